"""GPU benchmark of the Pallas kernels (issue 4): tree attention and KV compaction.

One run does, in order: a device-to-device copy (the bandwidth yardstick), correctness of the
compiled kernels against the jnp references on fresh random inputs, a small sweep of block
configurations on a few shapes, the main table (kernel vs the XLA reference, same run), and the
compaction timings. Results go to $OUT/kernels.json (rewritten after every row, so a run cut
short still leaves what it measured); a compact table is printed last.

The configurations of a row are timed with their samples interleaved (`median_times`), and
each gets its host dispatch time a call next to the wall time; `--device-time` adds the GPU's
kernel time from a profiler trace. Calls of 10-20 us sit near the host's dispatch time, so
their wall time can be the host's (bench/RESULTS.md, forty-fourth set).

    export PYTHONPATH=$PWD; python3 bench/bench_kernels.py [--quick] [--no-sweep]
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.88")

HQ, HKV, D = 32, 8, 128
SM_SCALE = 1.0 / math.sqrt(D)
OUT = os.environ.get("OUT", "/tmp/bench_out")
RESULTS: dict = {"copy": {}, "check": [], "sweep": [], "attention": [], "compact": []}
# --smoke: tiny shapes, kernels in interpret mode, to check this script on a CPU.
SMOKE = False
# median_times: samples of the configurations interleaved (else each one's back to back).
INTERLEAVE = True
# bench_attention: also each configuration's device time from a profiler trace (`device_times`).
DEVICE_TIME = False


def save():
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "kernels.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)


def torch_copy_bandwidth():
    """Device-to-device copy through PyTorch, timed with CUDA events; bytes read + written."""
    try:
        import torch
    except ImportError:
        return None
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    times.sort()
    bw = 2 * n / times[len(times) // 2]
    del src, dst
    torch.cuda.empty_cache()
    return bw


# ---- everything below uses JAX -------------------------------------------------------------

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pallas_kernels import backend_rule  # noqa: E402
from pallas_kernels import kv_compact as kvc  # noqa: E402
from pallas_kernels import tree_attention as ta  # noqa: E402


def median_time(f, *args, iters=10, warmup=2, burst=8):
    """Median seconds per call over `iters` samples, each `burst` calls dispatched back to back
    and synced once. A sync after every call added the host's round trip (~0.6 ms on the H200,
    as much as the work of a whole executable at batch 1) to each sample; dispatched ahead, as
    the model's layers and cycles run, the time is the device's plus any gap between launches."""
    timed = median_times({"f": f}, args, iters=iters, warmup=warmup, burst=burst)
    if "f" not in timed:
        raise RuntimeError("the timed function failed (printed above)")
    return timed["f"][:2]


def median_times(fns, args, iters=10, warmup=2, burst=8):
    """`median_time` for several functions of the same arguments, their samples interleaved:
    round i times one burst of each, starting one further along each round. Timed one after
    another, calls of 10-20 us drifted up to 30% between configurations within one call (the
    host's dispatch, near their wall time, and the GPU's clocks move over seconds), which a
    comparison took as a difference. -> {name: (median s, (max - min) / median, median host
    dispatch s)}, all a call; a function that fails to compile or run is left out, with its
    error printed."""
    burst = 1 if SMOKE else burst    # interpret mode: only checks that the script runs
    live = {}
    for name, f in fns.items():
        try:
            for _ in range(warmup):
                jax.block_until_ready(f(*args))
            live[name] = f
        except Exception as e:
            print(f"FAILED {name}: {type(e).__name__}: {str(e)[:300]}")
    names = list(live)
    ts = {name: [] for name in names}
    host = {name: [] for name in names}
    rounds = ([names[i % len(names):] + names[:i % len(names)] for i in range(iters)]
              if INTERLEAVE and names else [[name] for name in names for _ in range(iters)])
    for order in rounds:
        for name in order:
            f = live[name]
            t0 = time.perf_counter()
            if getattr(f, "hold_outputs", True):   # the burst's outputs all alive at once
                outs = [f(*args) for _ in range(burst)]
            else:   # each execution's outputs dropped before the next is dispatched, so
                for _ in range(burst):   # that it can take their buffers (`Release`)
                    outs = None
                    outs = f(*args)
            host[name].append((time.perf_counter() - t0) / burst)
            jax.block_until_ready(outs)
            ts[name].append((time.perf_counter() - t0) / burst)
            del outs
    return {name: (*_median_spread(v), sorted(host[name])[len(v) // 2]) for name, v in ts.items()}


class Release:
    """f, timed by `median_times` with each execution's outputs dropped before the next one is
    dispatched, as a model's program drops a layer's: the outputs can then take the same
    buffers every time. A burst that holds all its outputs gives each execution new output
    addresses, which XLA's CUDA graphs must be updated for (bench/RESULTS.md, forty-fifth
    set)."""
    hold_outputs = False

    def __init__(self, f):
        self.f = f

    def __call__(self, *args):
        return self.f(*args)


class Alternate:
    """f's program compiled `copies` times and called in turn, as the engine runs its cycles
    (`jaxspec.engine.backends.SpecBackend.copies_of`): each loaded copy sees the buffers of
    `copies` executions before, which the allocator tends to hand back, so its CUDA graph may
    run without the update a moved buffer forces."""

    def __init__(self, f, copies=2):
        self.f, self.copies, self.compiled, self.turn = f, copies, None, 0

    def __call__(self, *args):
        if self.compiled is None:
            lowered = self.f.lower(*args)
            self.compiled = [lowered.compile() for _ in range(self.copies)]
        self.turn = (self.turn + 1) % self.copies
        return self.compiled[self.turn](*args)


def add_heads_argument(parser):
    """`--heads`, the timed rows' heads (`set_heads`), shared by the kernel benchmarks."""
    parser.add_argument("--heads", default="",
                        help='"Hq,Hkv,D" in place of 32,8,128 (SmolLM2: "9,3,64")')


def set_heads(spec: str):
    """The timed rows' heads, "Hq,Hkv,D" (default 32,8,128; SmolLM2's "9,3,64")."""
    global HQ, HKV, D, SM_SCALE
    try:
        hq, hkv, d = (int(x) for x in spec.split(","))
    except ValueError:
        raise ValueError(f"--heads {spec!r}: expected Hq,Hkv,D") from None
    if min(hq, hkv, d) < 1 or hq % hkv:
        raise ValueError(f"--heads {spec!r}: Hq must be a positive multiple of Hkv")
    HQ, HKV, D = hq, hkv, d
    SM_SCALE = 1.0 / math.sqrt(D)
    RESULTS["heads"] = [HQ, HKV, D]


def use_device_time():
    """Rows also get each function's kernel time (`device_times`): XLA told to keep its CUDA
    graphs while profiling, which must happen before the backend starts."""
    global DEVICE_TIME
    from jaxspec.benchmark.trace import keep_graphs_while_profiling
    keep_graphs_while_profiling()
    DEVICE_TIME = True


def device_times(f, args, execs=8, warm=8):
    """(kernel-busy s, first-to-last-kernel s, CUDA-graph update s) per execution of f(*args),
    from a profiler trace of `execs` back-to-back executions (CUDA graphs kept on,
    `keep_graphs_while_profiling`), right after `warm` untraced ones. Unlike the wall time,
    the first two do not count the host's dispatch: where the host is slower than the device
    (small calls, a slow host), the wall time is the host's. The third is host time: XLA
    re-records a graph whose buffers moved since its last launch (bench/RESULTS.md,
    forty-fifth set). Why a burst each: on arithmetic-bound rows the GPU's clock falls under
    sustained load, and two executions traced after an idle pause ran up to 14% faster than
    the same program traced straight after the timing loop (forty-sixth set)."""
    import tempfile

    from jaxspec.benchmark import trace
    if SMOKE:   # interpret mode: only checks that the script runs
        warm, execs = 1, 2
    jax.block_until_ready([f(*args) for _ in range(warm)])
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            jax.block_until_ready([f(*args) for _ in range(execs)])
        return trace_times(trace.load_trace(d), execs)


def median_kernel_us(f, args=(), traces=3):
    """The median over `traces` calls of `device_times` of f(*args)'s kernel-busy time, in us
    (the probes' figure: one trace can catch the clock mid-change)."""
    return sorted(device_times(f, args)[0] for _ in range(traces))[traces // 2] * 1e6


def trace_times(events, execs):
    """`device_times` from a trace's events: GPU kernels and copies (on the GPUs' processes)
    and the host's `command_buffer::update` spans, per execution, in s; (None, None, None)
    without GPU events."""
    from jaxspec.benchmark.trace import gpu_pids, gpu_spans
    ev = gpu_spans(events)
    if not ev:
        return None, None, None
    busy = sum(dur for _, _, dur in ev) / execs * 1e-6
    span = (max(t + dur for _, t, dur in ev) - min(t for _, t, _ in ev)) / execs * 1e-6
    gpu = gpu_pids(events)
    update = sum(e.get("dur", 0) for e in events if e.get("ph") == "X"
                 and e.get("pid") not in gpu and e.get("name") == "command_buffer::update")
    return busy, span, update / execs * 1e-6


def _median_spread(ts):
    ts = sorted(ts)
    mid = ts[len(ts) // 2]
    return mid, (ts[-1] - ts[0]) / mid


def jax_copy_bandwidth():
    x = jax.random.normal(jax.random.key(0), (1 << (20 if SMOKE else 29),), jnp.bfloat16)
    f = jax.jit(lambda x: x * 2)
    t, _ = median_time(f, x, iters=20)
    return 2 * x.nbytes / t


def make_inputs(key, b, n, t, num_layers, dtype=jnp.bfloat16, hq=None, hkv=None, d=None,
                seq_lens=None):
    hq, hkv, d = hq or HQ, hkv or HKV, d or D   # the globals as --heads left them
    ks = jax.random.split(key, 8)
    q = jax.random.normal(ks[0], (b, n, hq, d), dtype)
    kc = jax.random.normal(ks[1], (num_layers, b, hkv, t, d), dtype)
    vc = jax.random.normal(ks[2], (num_layers, b, hkv, t, d), dtype)
    kn = jax.random.normal(ks[3], (b, hkv, n, d), dtype)
    vn = jax.random.normal(ks[4], (b, hkv, n, d), dtype)
    # A tree: each node sees itself and a random subset of earlier nodes.
    mask = jax.random.bernoulli(ks[5], 0.5, (b, n, n)) & jnp.tril(jnp.ones((n, n), bool))
    mask = mask | jnp.eye(n, dtype=bool)
    if seq_lens is None:
        seq_lens = jnp.full((b,), t, jnp.int32)
    return q, kc, vc, seq_lens, kn, vn, mask


def loop_call(fn, reps):
    """`multi_call` as a model runs its layers: one loop of `reps` trips in the program, trip i
    calling fn on layer i (the layer an operand the kernel reads on the device), the last
    trip's output returned. No call gets a buffer of its own (so no CUDA-graph updates), but
    jax 0.11.2's XLA on the H200 drove the loop from the host a trip at a time: 11.6 us a
    trip for a kernel of 1.4 (bench/RESULTS.md, forty-sixth set)."""
    def f(q, kc, vc, sl, kn, vn, mask):
        args = lambda i: (q, kc, vc, i, sl, kn, vn, mask)  # noqa: E731
        shapes = jax.eval_shape(fn, *args(jnp.int32(0)))
        init = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        return jax.lax.fori_loop(0, reps, lambda i, _: fn(*args(i)), init)
    return jax.jit(f)


def rel_err(out, ref):
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def multi_call(fn, reps):
    """One executable holding `reps` independent calls, one per layer (amortises dispatch)."""
    def f(q, kc, vc, sl, kn, vn, mask):
        return [fn(q, kc, vc, jnp.int32(i), sl, kn, vn, mask) for i in range(reps)]
    return jax.jit(f)


def check_attention(op, run, ref, tol, shape):
    """One check row: `run()`'s output against the reference, recorded and printed; an error
    is recorded as a failed row (the rest of the run is still worth having)."""
    try:
        out = run()
        err = rel_err(out, ref)
        finite = bool(jnp.isfinite(out.astype(jnp.float32)).all())
    except Exception:
        traceback.print_exc()
        err, finite = float("nan"), False
    row = dict(op=op, **shape, rel_err=err, ok=bool(finite and err < tol))
    RESULTS["check"].append(row)
    print("check", row, flush=True)


def checks(only: str = ""):
    """Compiled kernels vs the references on fresh random inputs (GPU). only: "B,N,Hq,Hkv,D,T;..."
    keeps just those attention cases (and the compaction checks)."""
    key = jax.random.key(1)
    cases = [  # b, n, hq, hkv, d, t, dtype
        (3, 1, 32, 8, 128, 1024, jnp.bfloat16),
        (3, 7, 32, 8, 128, 777, jnp.bfloat16),
        (2, 16, 8, 8, 64, 513, jnp.bfloat16),
        (2, 64, 32, 4, 128, 2048, jnp.bfloat16),
        (2, 16, 16, 2, 64, 300, jnp.float32),
        (1, 300, 32, 8, 128, 1500, jnp.bfloat16),
        (4, 5, 8, 1, 128, 4096, jnp.float32),
        (3, 16, 32, 8, 128, 1024, jnp.bfloat16),
        (3, 30, 9, 3, 64, 1024, jnp.bfloat16),   # SmolLM2's heads, 90 rows padded to 128
        (8, 64, 32, 8, 128, 512, jnp.bfloat16),   # under 1K rows: Triton, Mosaic beside it
        (16, 32, 9, 3, 64, 2048, jnp.bfloat16),   # SmolLM2's heads on Mosaic (batch 16, 2K)
        (2, 48, 32, 8, 128, 2048, jnp.bfloat16),   # 3 one-warpgroup row tiles, 4 splits
        (1, 16, 32, 8, 128, 2048, jnp.bfloat16),   # Mosaic, 8 splits of 2 blocks, combine
        (2, 32, 32, 8, 128, 1024, jnp.bfloat16),   # Mosaic, 4 splits of 2 blocks, combine
    ]
    if SMOKE:
        cases = [(2, 7, 8, 2, 64, 100, jnp.bfloat16), (2, 3, 4, 4, 64, 50, jnp.float32)]
    if only:   # the listed cases; one not listed above runs in bf16
        keep = [tuple(int(x) for x in c.split(",")) for c in only.split(";") if c]
        listed = {c[:6]: c for c in cases}
        cases = [listed.get(k, (*k, jnp.bfloat16)) for k in keep]
    for b, n, hq, hkv, d, t, dtype in cases:
        key, k1, k2 = jax.random.split(key, 3)
        sl = jax.random.randint(k2, (b,), 0, t + 1).at[0].set(t).at[-1].set(0)
        args = make_inputs(k1, b, n, t, 3, dtype, hq, hkv, d, sl)
        q, kc, vc, sl, kn, vn, mask = args
        scale = 1 / math.sqrt(d)
        # XLA's default f32 dot on GPU is TF32 (~3e-4): the reference runs at full precision.
        with jax.default_matmul_precision("highest"):
            ref = ta.tree_attention_reference(q, kc, vc, jnp.int32(2), sl, kn, vn, mask,
                                              sm_scale=scale)
        tol = 1e-4 if dtype == jnp.float32 else 2e-2
        shape = dict(b=b, n=n, hq=hq, hkv=hkv, d=d, t=t, dtype=jnp.dtype(dtype).name)
        # The packed entry: q, k_new, v_new read out of one [B, N, Hq + 2 Hkv, D] array.
        qkv = jnp.concatenate([q, kn.transpose(0, 2, 1, 3), vn.transpose(0, 2, 1, 3)], axis=2)
        entries = {
            "tree_attention": lambda **kw: ta.tree_attention_pallas(
                q, kc, vc, jnp.int32(2), sl, kn, vn, mask, sm_scale=scale, **kw),
            "tree_attention_packed": lambda **kw: ta.tree_attention_packed_pallas(
                qkv, kc, vc, jnp.int32(2), sl, mask, num_heads=hq, sm_scale=scale, **kw)}
        for op, entry in entries.items():
            check_attention(op, lambda: entry(interpret=SMOKE), ref, tol, shape)
        if n * hq // hkv < 64 or t % 128 or dtype == jnp.float32 or SMOKE:
            continue
        for op, entry in entries.items():   # the prefix by Mosaic GPU (Hopper only)
            check_attention(op.replace("attention", "attention_mosaic", 1),
                            lambda: entry(backend="mosaic"), ref, tol, shape)

    for (nl, b, hkv, t, d, n, m) in [(3, 4, 8, 64, 128, 16, 8), (2, 3, 2, 40, 64, 64, 64)]:
        key, *ks = jax.random.split(key, 7)
        kc = jnp.full((nl, b, hkv, t, d), jnp.nan, jnp.bfloat16)
        vc = jnp.full((nl, b, hkv, t, d), 7.0, jnp.bfloat16)
        kn = jax.random.normal(ks[0], (nl, b, hkv, n, d), jnp.bfloat16)
        vn = jax.random.normal(ks[1], (nl, b, hkv, n, d), jnp.bfloat16)
        sl = jax.random.randint(ks[2], (b,), 0, t).at[0].set(t - 3)
        src = jax.random.randint(ks[3], (b, m), 0, n)
        cnt = jax.random.randint(ks[4], (b,), 0, m + 1).at[1].set(0).at[0].set(m)
        ref = kvc.kv_compact_reference(kc, vc, kn, vn, sl, src, cnt)
        try:
            out = kvc.kv_compact_pallas(jnp.copy(kc), jnp.copy(vc), kn, vn, sl, src, cnt,
                                        interpret=SMOKE)
            same = all(bool((np.asarray(o).view(np.uint16) == np.asarray(r).view(np.uint16)).all())
                       for o, r in zip(out, ref))
        except Exception:
            traceback.print_exc()
            same = False
        row = dict(op="kv_compact", nl=nl, b=b, t=t, n=n, m=m, bit_exact=same, ok=same)
        RESULTS["check"].append(row)
        print("check", row, flush=True)
    save()


# Seconds the GPU idles before each function's traced burst (`time_calls`).
DEVICE_PAUSE_S = 1.0


def calls_per_program(kv_bytes):
    """Calls in one timed executable: enough to amortise dispatch (~1.5 ms of work at 2 TB/s),
    each on its own layer (identical calls would be merged by XLA's CSE, and rotating layers
    keeps the working set out of the 50 MB L2); 2 in the smoke run."""
    return 2 if SMOKE else int(min(48, max(2, math.ceil(1.5e-3 / (kv_bytes / 2.0e12)))))


def time_calls(calls, args, reps, row, device_time):
    """Times `calls` ({name: executable of `reps` calls}) interleaved on args and fills row
    with each one's `_us`, `_spread` and `_host_us` a call, and with `device_time` its
    `_dev_us`, `_span_us` and `_update_us` (`device_times`). -> the names timed (a function
    that failed is left out, its error printed)."""
    timed = median_times(calls, args)
    for name, (t, spread, host) in timed.items():
        row[name + "_us"] = t / reps * 1e6
        row[name + "_spread"] = spread
        row[name + "_host_us"] = host / reps * 1e6   # dispatch; near the wall time: host-bound
        if device_time:
            # An idle pause first: straight after the interleaved timing loop the clock is
            # down, and the first name traced ran 13% slow on arithmetic-bound rows (B 64,
            # N 64, 8K: 1071 against 948 us for the same program traced last; fifty-second set)
            time.sleep(0 if SMOKE else DEVICE_PAUSE_S)
            times = device_times(calls[name], args)   # the executable just timed
            for suffix, x in zip(("_dev_us", "_span_us", "_update_us"), times):
                row[name + suffix] = x and x / reps * 1e6
    return set(timed)


def bench_attention(b, n, length, fns, key):
    per_layer = 2 * b * HKV * length * D * 2
    kv_bytes = per_layer + 2 * b * HKV * n * D * 2
    reps = calls_per_program(kv_bytes)
    num_layers = int(max(reps, min(32, math.ceil(256e6 / per_layer))))
    args = make_inputs(key, b, n, length, num_layers)
    row = dict(b=b, n=n, L=length, layers=num_layers, reps=reps, kv_bytes=kv_bytes)
    calls = {name: multi_call(fn, reps) for name, fn in fns.items() if fn}
    timed = time_calls(calls, args, reps, row, DEVICE_TIME)
    for name in fns:
        if name not in timed:   # not run, or failed (printed)
            row[name + "_us"] = None
        else:
            row[name + "_TBs"] = kv_bytes / (row[name + "_us"] * 1e-6) / 1e12
    del args
    return row


def kernel_fn(**cfg):
    def fn(q, kc, vc, layer, sl, kn, vn, mask):
        return ta.tree_attention_pallas(q, kc, vc, layer, sl, kn, vn, mask, sm_scale=SM_SCALE,
                                        interpret=SMOKE, **cfg)
    return fn


def ref_fn(q, kc, vc, layer, sl, kn, vn, mask):
    return ta.tree_attention_reference(q, kc, vc, layer, sl, kn, vn, mask, sm_scale=SM_SCALE)


def xla_bf16_fn(q, kc, vc, layer, sl, kn, vn, mask):
    """A plain XLA version kept in bf16 (fp32 accumulation): a fairer XLA baseline."""
    b, n, hq, d = q.shape
    hkv, t = kc.shape[2], kc.shape[3]
    k = jax.lax.dynamic_index_in_dim(kc, layer, 0, keepdims=False)
    v = jax.lax.dynamic_index_in_dim(vc, layer, 0, keepdims=False)
    qg = q.reshape(b, n, hkv, hq // hkv, d)
    f32 = jnp.float32
    s = jnp.concatenate([
        jnp.einsum("bnhgd,bhtd->bhgnt", qg, k, preferred_element_type=f32),
        jnp.einsum("bnhgd,bhmd->bhgnm", qg, kn, preferred_element_type=f32)], -1) * SM_SCALE
    live = jnp.concatenate([jnp.broadcast_to(jnp.arange(t)[None, None, :] < sl[:, None, None],
                                             (b, n, t)), mask], -1)
    p = jax.nn.softmax(jnp.where(live[:, None, None], s, ta.MASK_VALUE), -1).astype(q.dtype)
    o = (jnp.einsum("bhgnt,bhtd->bnhgd", p[..., :t], v, preferred_element_type=f32)
         + jnp.einsum("bhgnm,bhmd->bnhgd", p[..., t:], vn, preferred_element_type=f32))
    return o.reshape(b, n, hq, d).astype(q.dtype)


def ref_fits(b, n, length):
    # The reference upcasts the layer's K and V to f32 and keeps [B, Hq, N, T] f32 scores.
    need = 2 * b * HKV * length * D * 4 + 3 * b * HQ * n * length * 4
    return need < 24e9


# The split grid: (B, N, L) -> num_splits tried (the default's is added). Short prefixes at
# batch 1 are what the 8B decode step and cycle run (L ~ 1K), long ones the issue's table.
SPLIT_GRID = {(1, 1, 1024): (4, 8, 16, 32), (1, 1, 8192): (16, 32, 64, 128),
              (1, 1, 32768): (33, 66, 132), (8, 1, 8192): (8, 16, 32, 64),
              (64, 1, 1024): (1, 2, 4), (1, 16, 8192): (8, 16, 32, 64),
              (8, 16, 8192): (4, 8, 16), (1, 64, 1024): (2, 4, 8, 16),
              (64, 16, 1024): (1, 2), (1, 16, 32768): (16, 33, 66, 132)}


def parse_shapes(spec: str):
    """"B,N,L;B,N,L" -> [(B, N, L), ...]"""
    return [tuple(int(x) for x in p.split(",")) for p in spec.split(";") if p]


# The backend grid: the tree's wide tiles (N * G >= 64), where Mosaic GPU's prefix kernel runs.
BACKEND_GRID = [(1, 16, 8192), (8, 16, 8192), (64, 16, 8192), (1, 64, 8192), (8, 64, 8192),
                (64, 64, 8192), (1, 16, 32768), (8, 16, 32768), (1, 64, 32768),
                (8, 64, 32768)]


def sweep(quick, grid: str = "blocks", only: str = ""):
    """`blocks`: block sizes, warps and stages around the default on four shapes; `splits`:
    num_splits x block_k (64, 128) x warps (4, 2) on SPLIT_GRID's shapes; `backends`: Triton
    against Mosaic GPU's prefix kernel at its default split count, half and twice it, on
    BACKEND_GRID (`mosaic_splits`: also at 2 splits either side of the default; `mosaic_ring`:
    Mosaic's key block and ring slots, at the block's default splits); `merge`: the
    Mosaic path's Triton merge (row tile, warps, stages) at the default split count, on
    BACKEND_GRID. only: "B,N,L;..." keeps just those shapes."""
    shapes = [(1, 1, 8192), (8, 16, 8192), (64, 1, 8192), (8, 64, 8192)]
    configs = [dict(), dict(block_k=32), dict(block_k=128), dict(num_stages=2),
               dict(num_stages=4), dict(num_warps=8), dict(num_warps=2)]
    if grid == "splits":
        shapes = list(SPLIT_GRID)
    if grid in ("backends", "mosaic_splits", "mosaic_ring", "merge"):
        shapes = BACKEND_GRID
    if only:
        shapes = parse_shapes(only)
    if quick:
        shapes, configs = shapes[:1], configs[:2]
    if SMOKE:
        shapes = [(1, 1, 512)]
    key = jax.random.key(3)
    for b, n, length in shapes:
        key, k = jax.random.split(key)
        base = ta.default_config(b, n, HQ, HKV, D, length)
        if grid in ("backends", "mosaic_splits"):
            sp = backend_rule.mosaic_splits(b, HKV, n * HQ // HKV, length)
            near = range(sp - 2, sp + 3) if grid == "mosaic_splits" else ()
            cfgs = [dict(backend="triton")] + [
                dict(backend="mosaic", num_splits=x)
                for x in sorted({max(1, sp // 2), sp, 2 * sp, *near}) if x >= 1]
        elif grid == "mosaic_ring":
            cfgs = [dict(backend="triton")] + [
                dict(backend="mosaic", mosaic_ring=ring)
                for ring in ((128, 2), (64, 2), (64, 3), (64, 4), (64, 5))]
        elif grid == "merge":
            cfgs = [dict(backend="triton"), dict(backend="mosaic")] + [
                dict(backend="mosaic", block_r=r, num_warps=w, num_stages=st)
                for r, w, st in ((64, 4, 3), (64, 8, 3), (128, 4, 3), (128, 8, 1), (32, 4, 3))
                if (r, w) != (base[0], base[3]) or st != base[4]]
        elif grid == "splits":
            splits = sorted(set(SPLIT_GRID.get((b, n, length), (2, 4))) | {base[2]})
            cfgs = [dict(num_splits=sp, block_k=bk, num_warps=w) for sp in splits
                    for bk in (64, 128) for w in ((4, 2) if b == n == 1 else (base[3],))
                    if sp * bk * (1 if SMOKE else 2) <= length]
        else:
            cfgs = configs + [dict(num_splits=max(1, base[2] // 2)),
                              dict(num_splits=base[2] * 2)]
            if n > 1:
                cfgs += [dict(block_r=32), dict(block_r=128, num_warps=8)]
        fns = {json.dumps(c): kernel_fn(**c) for c in cfgs}
        fns["{}"] = kernel_fn()
        fns["again"] = kernel_fn()  # the default a second time: the run-to-run spread
        row = bench_attention(b, n, length, fns, k)
        row["default"] = base
        row["grid"] = grid
        RESULTS["sweep"].append(row)
        print_sweep_row(row)
        save()


def table(quick, shapes="", kernel_only=False):
    key = jax.random.key(4)
    bs, lens, ns = (1, 8, 64), (8192, 32768, 1024), (1, 16, 64)
    if quick:
        bs, lens, ns = (1, 8), (8192,), (1, 16)
    if SMOKE:
        bs, lens, ns = (1, 2), (512,), (1, 16)
    grid = [(b, n, length) for length in lens for b in bs for n in ns]
    if shapes:
        grid = parse_shapes(shapes)
    for b, n, length in grid:
        key, k = jax.random.split(key)
        with_ref = not kernel_only and ref_fits(b, n, length)
        fns = {"kernel": kernel_fn(), "xla_ref": ref_fn if with_ref else None}
        if n * HQ // HKV >= 64:   # wide tiles: Triton's prefix beside the default's (Mosaic GPU)
            fns["triton"] = kernel_fn(backend="triton")
        if not kernel_only and length == (512 if SMOKE else 8192) and n <= 16:
            fns["xla_bf16"] = xla_bf16_fn
        row = bench_attention(b, n, length, fns, k)
        if row.get("kernel_us") and row.get("xla_ref_us"):
            row["speedup_vs_ref"] = row["xla_ref_us"] / row["kernel_us"]
        RESULTS["attention"].append(row)
        print("attn", {k: (round(v, 3) if isinstance(v, float) else v)
                       for k, v in row.items()}, flush=True)
        save()


def bench_compact():
    key = jax.random.key(5)
    nl = 32
    cases = [(1, 1, 1), (64, 1, 1), (1, 64, 8), (64, 64, 8), (8, 512, 512)]
    if SMOKE:
        nl, cases = 2, [(2, 16, 4)]
    for b, n, m in cases:
        t = 4096 if b <= 8 and not SMOKE else 1024
        key, *ks = jax.random.split(key, 6)
        kc = jax.random.normal(ks[0], (nl, b, HKV, t, D), jnp.bfloat16)
        vc = jax.random.normal(ks[1], (nl, b, HKV, t, D), jnp.bfloat16)
        kn = jax.random.normal(ks[2], (nl, b, HKV, n, D), jnp.bfloat16)
        vn = jax.random.normal(ks[3], (nl, b, HKV, n, D), jnp.bfloat16)
        src = jax.random.randint(ks[4], (b, m), 0, n)
        cnt = jnp.full((b,), m, jnp.int32)
        reps = 2 if SMOKE else 16
        row = dict(nl=nl, b=b, n=n, m=m, t=t, moved_bytes=2 * 2 * nl * b * HKV * m * D * 2)
        kernel = functools.partial(kvc.kv_compact_pallas, interpret=SMOKE)
        for name, fn in (("kernel", kernel), ("xla_ref", kvc.kv_compact_reference)):
            def chain(kc, vc, kn, vn, src, cnt, fn=fn):
                for i in range(reps):   # every call's rows inside the cache (rows past T
                    # are dropped, which would make the moved bytes a fiction)
                    sl = jnp.full((b,), 100 + (i * m) % max(t - m - 100, 1), jnp.int32)
                    kc, vc = fn(kc, vc, kn, vn, sl, src, cnt)
                return kc, vc
            f = jax.jit(chain, donate_argnums=(0, 1))
            try:
                for _ in range(2):
                    kc, vc = f(kc, vc, kn, vn, src, cnt)
                jax.block_until_ready(kc)
                ts = []
                for _ in range(10):   # 8 chained executables a sample, synced once
                    t0 = time.perf_counter()
                    for _ in range(8):
                        kc, vc = f(kc, vc, kn, vn, src, cnt)
                    jax.block_until_ready(kc)
                    ts.append((time.perf_counter() - t0) / 8)
                ts.sort()
                row[name + "_us"] = ts[len(ts) // 2] / reps * 1e6
                row[name + "_TBs"] = row["moved_bytes"] / row[name + "_us"] / 1e6
            except Exception as e:
                print(f"FAILED compact {name}: {type(e).__name__}: {str(e)[:300]}")
                row[name + "_us"] = None
        RESULTS["compact"].append(row)
        print("compact", row, flush=True)
        del kc, vc
        save()


_DERIVED = ("_host_us", "_dev_us", "_span_us", "_update_us")


def print_sweep_row(r):
    """The row's configurations fastest first: wall us, with [host dispatch / kernel-busy us]
    where measured."""
    times = sorted((v, k[:-3]) for k, v in r.items()
                   if k.endswith("_us") and not k.endswith(_DERIVED) and v)

    def fmt(v, k):
        extra = [f"{r[k + s]:.1f}" for s in ("_host_us", "_dev_us") if r.get(k + s)]
        return f"{k} {v:.1f}" + (f" [{'/'.join(extra)}]" if extra else "")
    print(f"sweep B={r['b']} N={r['n']} L={r['L']}: default {r['default']} "
          f"{r.get('{}_us') or float('nan'):.1f} us (again {r.get('again_us') or float('nan'):.1f});"
          " best " + ", ".join(fmt(v, k) for v, k in
                            (times if r.get("grid") == "backends" else times[:3])), flush=True)


def print_tables():
    copy_bw = RESULTS["copy"].get("torch_TBs") or RESULTS["copy"].get("jax_TBs")
    print(f"\ndevice: {RESULTS['device']}  jax {jax.__version__}  copy (read+write): "
          + ", ".join(f"{k}={v:.2f}" for k, v in RESULTS["copy"].items() if v))
    print("checks:", "all ok" if all(r["ok"] for r in RESULTS["check"]) else
          [r for r in RESULTS["check"] if not r["ok"]])
    nan = float("nan")
    print(f"{'B':>3} {'N':>3} {'L':>6} | {'kern us':>8} {'TB/s':>5} {'%copy':>5} | "
          f"{'host us':>7} {'dev us':>7} {'%copy':>5} | "
          f"{'ref us':>8} {'TB/s':>5} {'x ref':>5} | {'bf16 us':>8} | {'triton':>8}")
    for r in RESULTS["attention"]:
        k, x, xb = r.get("kernel_us"), r.get("xla_ref_us"), r.get("xla_bf16_us")
        kt, dev = r.get("kernel_TBs"), r.get("kernel_dev_us")
        # host: the dispatch a call (near the wall time: host-bound); dev: the GPU's kernel
        # time a call (--device-time), and the bytes it reads a second as % of copy
        dev_pct = 100 * r["kv_bytes"] / (dev * 1e-6) / 1e12 / copy_bw if dev else nan
        print(f"{r['b']:>3} {r['n']:>3} {r['L']:>6} | "
              f"{k or nan:>8.1f} {kt or nan:>5.2f} {100 * (kt or nan) / copy_bw:>5.0f} | "
              f"{r.get('kernel_host_us') or nan:>7.1f} {dev or nan:>7.1f} {dev_pct:>5.0f} | "
              f"{x or nan:>8.1f} {r.get('xla_ref_TBs') or nan:>5.2f} "
              f"{(x / k) if (x and k) else nan:>5.2f} | {xb or nan:>8.1f} | "
              f"{r.get('triton_us') or nan:>8.1f}")
    for r in RESULTS["sweep"]:
        print_sweep_row(r)
    print(f"{'L':>3} {'B':>3} {'N':>4} {'M':>4} | {'kern us':>8} {'TB/s':>5} {'ref us':>8} "
          f"{'TB/s':>5}  (moved bytes: read + written)")
    for r in RESULTS["compact"]:
        print(f"{r['nl']:>3} {r['b']:>3} {r['n']:>4} {r['m']:>4} | "
              + " ".join(f"{r.get(k + '_us') or nan:>8.1f} {r.get(k + '_TBs') or nan:>5.2f}"
                         for k in ("kernel", "xla_ref")))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--skip", default="", help="comma list of: check,sweep,table,compact")
    p.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (CPU)")
    p.add_argument("--sweep-grid",
                   choices=("blocks", "splits", "backends", "mosaic_splits", "mosaic_ring",
                            "merge"),
                   default="blocks")
    p.add_argument("--sweep-shapes", default="", help='only these "B,N,L;..." in the sweep')
    p.add_argument("--table-shapes", default="", help='only these "B,N,L;..." in the table')
    p.add_argument("--check-cases", default="",
                   help='only these "B,N,Hq,Hkv,D,T;..." attention checks (bf16 if not listed)')
    p.add_argument("--kernel-only", action="store_true",
                   help="table: time the kernel alone (A/B runs of two trees)")
    p.add_argument("--sequential", action="store_true",
                   help="time each configuration's samples back to back, not interleaved")
    p.add_argument("--device-time", action="store_true",
                   help="also each configuration's kernel time from a profiler trace")
    add_heads_argument(p)
    a = p.parse_args()
    global SMOKE, HQ, HKV, INTERLEAVE
    INTERLEAVE = not a.sequential
    if a.device_time:
        use_device_time()
    RESULTS["interleaved"] = INTERLEAVE
    if a.heads:
        set_heads(a.heads)
    if a.smoke:
        SMOKE, HQ, HKV = True, 8, 2
    skip = set(a.skip.split(","))
    t0 = time.time()
    if not SMOKE:
        RESULTS["copy"]["torch_TBs"] = (torch_copy_bandwidth() or 0) / 1e12 or None
    RESULTS["device"] = str(jax.devices()[0].device_kind)
    RESULTS["jax"] = jax.__version__
    RESULTS["copy"]["jax_TBs"] = jax_copy_bandwidth() / 1e12
    print("copy", RESULTS["copy"], RESULTS["device"], flush=True)
    for name, f in (("check", lambda: checks(a.check_cases)),
                    ("table", lambda: table(a.quick, a.table_shapes, a.kernel_only)),
                    ("sweep", lambda: sweep(a.quick, a.sweep_grid, a.sweep_shapes)),
                    ("compact", bench_compact)):
        if name in skip or (name == "sweep" and a.no_sweep):
            continue
        s = time.time()
        try:
            f()
        except Exception:
            traceback.print_exc()
        print(f"== {name} took {time.time() - s:.0f} s (total {time.time() - t0:.0f} s)",
              flush=True)
    save()
    print_tables()


if __name__ == "__main__":
    main()
