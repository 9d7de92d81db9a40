"""Does a Mosaic GPU kernel that starts with `griddepcontrol.wait` get a programmatic dependent
launch after the tree kernel, and what does that take off a call?

The combine's launch after the main kernel costs batch 1 over 8K about 1.7 us of the 13.2 a
call (bench/RESULTS.md, sixty-fourth set). jaxlib launches Pallas Triton kernels without
launch attributes, so they cannot start early; newer Mosaic GPU runtimes launch a kernel
with `programmaticStreamSerializationAllowed` when its module uses the grid-dependency
instructions. This probe times, at batch 1, N 1 (and 16) over 8K, `reps` chained layers of
the tree kernel each followed by a small Mosaic GPU kernel (the attention's output doubled:
TMA in, one multiply, TMA out), with and without `griddepcontrol.wait` at its start. It
follows the Triton combine, which cannot let it launch early, so at most its launch overlaps
the combine's end; outputs of both are checked equal.

First (`pairs`), the launch alone: two Mosaic GPU kernels a pair, the first (`doubled_chunks`,
a CTA a 64 KB chunk, or `--loops` of them in turn) letting its dependents launch as its CTAs
start, the second (one CTA on the first's chunk 0) waiting. A dependent launches once every
CTA of the first kernel has triggered, and only if the host is ahead of the device: so a
first kernel of one wave and about 300 us (`--chunks 8192 --loops 64`). A second kernel that
starts early makes the pair's kernel time (summed) exceed its first-to-last span.

On the H200 (bench/RESULTS.md, sixty-sixth set) it started early only with XLA's command
buffers off (`XLA_FLAGS=--xla_gpu_enable_command_buffer=`); inside them, never.

    python3 bench/pdl_probe.py [--reps 32] [--chunks 512] [--loops 1]
                               [--shapes "1,1,8192;1,16,8192"]
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

from bench import bench_kernels as bk  # noqa: E402
from jaxspec.benchmark import trace  # noqa: E402
from pallas_kernels import prefix_attention_mgpu as pm  # noqa: E402


def doubled_chunks(x, trigger: bool = False, wait: bool = False, interpret: bool = False,
                   ctas: int | None = None, loops: int = 1):
    """x [C, R, D] (R <= 256, R * D a multiple of 128) -> 2 * x[:ctas * loops], a Mosaic GPU
    CTA doubling chunks c, c + ctas, ... (`loops` of them; all C chunks by default), reading x
    whole so that no slicing kernel comes between this kernel and the one that made x.
    `trigger`: each CTA first lets the kernels that wait on this one launch
    (`griddepcontrol.launch_dependents`; a dependent launches once every CTA has done so or
    ended, so only a grid of one wave lets it launch at the kernel's start); `wait`: each CTA
    first waits for the kernels this one depends on (`griddepcontrol.wait`, so no read of x
    before they are done). The interpreter has no rule for either."""
    params = dict(interpret=pm._interpret_params()) if interpret else {}
    ctas = x.shape[0] // loops if ctas is None else ctas

    def body(x_ref, o_ref, smem, bar):
        if trigger:
            plgpu.griddepcontrol_launch_dependents()
        if wait:
            plgpu.griddepcontrol_wait()

        def one(i, carry):
            c = jax.lax.axis_index("c") + i * ctas
            plgpu.copy_gmem_to_smem(x_ref.at[c], smem, bar)
            plgpu.barrier_wait(bar)
            smem[...] = smem[...] * 2
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(smem, o_ref.at[c])
            plgpu.wait_smem_to_gmem(0)     # smem is read again by the next chunk's copy
            return carry
        jax.lax.fori_loop(0, loops, one, 0)

    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((ctas * loops,) + x.shape[1:], x.dtype),
        scratch_types=(plgpu.SMEM(x.shape[1:], x.dtype), plgpu.Barrier()),
        grid=(ctas,), grid_names=("c",), **params)(x)


def doubled(x, wait: bool, interpret: bool = False):
    """x [R, D] -> 2 * x by one CTA (`doubled_chunks` of one chunk)."""
    return doubled_chunks(x[None], wait=wait, interpret=interpret)[0]


def _tma_rows(size, cols=128):
    """Rows of a [rows, cols] view of `size` elements with at most 256 rows (a TMA box)."""
    rows = size // cols
    while rows > 256:
        rows, cols = rows // 2, cols * 2
    return rows


def chain(reps, tail):
    """`reps` layers: the tree kernel on layer i, then `tail` (None, "plain", "wait")."""
    attn = bk.kernel_fn()

    def f(q, kc, vc, sl, kn, vn, mask):
        outs = []
        for i in range(reps):
            o = attn(q, kc, vc, jnp.int32(i), sl, kn, vn, mask)
            o = o.reshape(_tma_rows(o.size), -1)
            outs.append(o if tail is None else doubled(o, tail == "wait"))
        return outs
    return jax.jit(f)


def pair_chain(reps, trigger, wait, loops=1):
    """`reps` pairs: `doubled_chunks` over chunk array i (its CTAs triggering or not, each
    doubling `loops` chunks), then one CTA doubling the first chunk of its output (waiting or
    not), nothing between the two. Each pair's result is 4 x[i][0]."""
    def f(xs):
        return [doubled_chunks(doubled_chunks(xs[i], trigger, loops=loops), wait=wait,
                               ctas=1)[0] for i in range(reps)]
    return jax.jit(f)


def pairs(reps, chunks=512, loops=1):
    """The launch itself, between two Mosaic GPU kernels: with a dependent launch and the first
    kernel's early trigger, the second's CTAs start while the first still runs, so the pair's
    summed kernel time grows past its first-to-last span by what the second waits; the
    results must not change."""
    xs = jax.random.normal(jax.random.PRNGKey(1), (reps, chunks, 256, 128), jnp.bfloat16)
    want = [np.asarray(xs[i, 0].astype(jnp.float32)) * 4 for i in range(reps)]
    for trigger, wait in ((False, False), (False, True), (True, True), (False, False)):
        got = timed_variant(f"pairs trigger={trigger} wait={wait}", "a pair",
                            pair_chain(reps, trigger, wait, loops), (xs,), reps)
        if got is not None:
            print(f"  results right: {all(np.array_equal(g, w) for g, w in zip(got, want))}")


def timed_variant(label, unit, f, args, reps, execs=8):
    """Runs f(*args), prints its summed kernel and first-to-last us and each kernel's us per
    `unit` (of `reps` in a call) from a trace of `execs` calls, and returns its outputs as f32
    arrays; None, said, where the runtime refuses it (a primitive it lacks)."""
    try:
        outs = f(*args)
        jax.block_until_ready([f(*args) for _ in range(3)])
        with tempfile.TemporaryDirectory() as d:
            with jax.profiler.trace(d):
                jax.block_until_ready([f(*args) for _ in range(execs)])
            events = trace.load_trace(d)
    except Exception as e:
        print(f"{label}: {type(e).__name__}: {str(e)[:300]}")
        return None
    summed, span, _ = bk.trace_times(events, execs * reps)
    outs = [np.asarray(x.astype(jnp.float32)) for x in outs]
    if summed is None:
        print(f"{label}: no GPU kernels in the trace")
        return outs
    per = collections.defaultdict(float)
    for name, _, dur in trace.gpu_spans(events):
        per[name] += dur / (execs * reps)
    per = {k: round(v, 2) for k, v in sorted(per.items())}
    print(f"{label}: {unit} {summed * 1e6:.2f} us of kernels summed, {span * 1e6:.2f} us "
          f"first-to-last; kernels {per}")
    return outs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=32)
    ap.add_argument("--shapes", default="1,1,8192;1,16,8192")
    ap.add_argument("--chunks", type=int, default=512,
                    help="64 KB chunks the first kernel of `pairs` reads (512: about 20 us)")
    ap.add_argument("--loops", type=int, default=1,
                    help="chunks a CTA of that kernel doubles in turn (chunks / loops CTAs)")
    args = ap.parse_args()
    print("jax", jax.__version__, jax.devices()[0].device_kind)
    pairs(args.reps, args.chunks, args.loops)
    for b, n, length in bk.parse_shapes(args.shapes):
        call = bk.make_inputs(jax.random.PRNGKey(0), b, n, length, args.reps)
        outs = {}
        for tail in (None, "plain", "wait", "plain", "wait"):
            got = timed_variant(f"{b},{n},{length} tail={tail}", "a layer",
                                chain(args.reps, tail), call, args.reps)
            if got is not None:
                outs[tail] = got
        if "plain" in outs and "wait" in outs:
            same = all(np.array_equal(a, c) for a, c in zip(outs["plain"], outs["wait"]))
            print(f"{b},{n},{length}: outputs with and without the wait equal: {same}")


if __name__ == "__main__":
    main()
