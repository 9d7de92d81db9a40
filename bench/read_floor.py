"""The floor under issue 4's batch-1 rows: how fast one kernel alone reads a layer's K and V.

Batch 1 over 8K reads 33.6 MB a call, so the goal of 70% of copy is about 11.5 us a call on the
H200. The tree kernel's main kernel alone takes about 11.7 us (thirty-ninth set). This script
asks what any kernel takes to read those bytes with no attention arithmetic, timed in the
harness's pattern (`reps` independent calls in one program, each on its own layer, so that L2
does not hold them), beside the tree kernel at N = 1 in the same run:

  * `stream_P_BK_W`: a Pallas (Triton) kernel with the main kernel's memory skeleton: P programs
    per (slot, KV head), each streaming its share of the rows of K and V in BK-row blocks and
    writing one partial sum ([B * Hkv, P, D] f32; nothing merges them);
  * `tma_P_BK_S` (Hopper): P CTAs per (slot, KV head) copy their share by Mosaic GPU's TMA in
    BK-row blocks into a ring of S shared-memory slots, the Mosaic prefix kernel's memory
    skeleton (its wgmmas read the ring in place);
  * `tree_n1_mosaic` (Hopper): the tree kernel at N = 1 on the Mosaic backend, which the
    backend rule leaves to Triton there (`tree_n1`);
  * `xla_sum`: XLA's reduction of K + V over the rows, fused into one kernel;
  * `touch_stream_P`, `touch_tma_P`: the launch floor, the stream and TMA kernels with P
    programs (CTAs) per (slot, KV head) that read only one small block of rows each: what a
    kernel costs in this harness with (almost) nothing to read;
  * `torch_sum`, `torch_copy`: torch's reduction of the layer to one number, and a copy of it
    (twice the bytes moved), the same calls captured in one CUDA graph.

    python3 bench/read_floor.py [--sizes "B,L;..."] [--heads "Hq,Hkv,D"] [--device-time]
                                [--only REGEX] [--release] [--copies] [--loop] [--smoke]

Bandwidths count the bytes read (K and V of the layer); % of copy is against torch's 1 GiB
copy (read + written) in the same run. Writes $OUT/read_floor.json.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import re

from bench import bench_kernels as bk

import jax  # noqa: E402  (after bench_kernels sets the allocator's share)
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402

from pallas_kernels import prefix_attention_mgpu as pm  # noqa: E402
from pallas_kernels._compat import CompilerParams, load, store  # noqa: E402

try:  # Mosaic GPU's Pallas API (Hopper); absent from some jaxlib builds
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover
    plgpu = None

SIZES = "1,8192;1,16384;1,32768;8,8192"
# (programs per slot and KV head, rows a block, warps); a program holding its whole share in
# one block issues all its loads at once, which Triton does not pipeline for loads that feed
# no dot.
STREAMS = ((4, 128, 4), (8, 128, 4), (16, 64, 4), (32, 64, 4), (32, 128, 4), (64, 64, 4), (64, 128, 4),
           (64, 128, 8), (128, 64, 4), (128, 32, 4), (256, 32, 4))


def _stream_kernel(layer_ref, k_ref, v_ref, o_ref, *, hkv, chunk, block, blocks):
    """Program (split, b * hkv + h): sum over the first `blocks` blocks of its `chunk` rows of
    K + V, in f32. -> o [D]."""
    split, bh = pl.program_id(0), pl.program_id(1)
    layer, b, h = layer_ref[0], bh // hkv, bh % hkv

    def body(i, acc):   # acc [block, D]: one add per element, no reduction inside the loop
        rows = pl.ds(split * chunk + i * block, block)
        k = load(k_ref.at[layer, b, h, rows, :])
        v = load(v_ref.at[layer, b, h, rows, :])
        return acc + k.astype(jnp.float32) + v.astype(jnp.float32)

    acc = lax.fori_loop(0, blocks, body,
                        jnp.zeros((block, k_ref.shape[-1]), jnp.float32))
    store(o_ref.at[bh, split, :], acc.sum(0))


def _chunk(t, splits, block):
    """Rows a split of t rows, refused unless the splits are equal and whole blocks."""
    chunk = t // splits
    if chunk * splits != t or chunk % block:
        raise ValueError(f"{t} rows do not cut into {splits} splits of whole {block}-row blocks")
    return chunk


@functools.partial(jax.jit, static_argnames=("splits", "block", "warps", "rows", "interpret"))
def stream_read(k_cache, v_cache, layer, *, splits, block, warps=4, rows=None,
                interpret=False):
    """Partial sums of K + V of cache layer `layer`: cache [L, B, Hkv, T, D] ->
    [B * Hkv, splits, D] f32, split s summing rows [s * T / splits, (s + 1) * T / splits)
    (rows: only the first `rows` of them, a multiple of block)."""
    _, b, hkv, t, d = k_cache.shape
    chunk = _chunk(t, splits, block)
    return pl.pallas_call(
        functools.partial(_stream_kernel, hkv=hkv, chunk=chunk, block=block,
                          blocks=(rows or chunk) // block),
        grid=(splits, b * hkv),
        out_shape=jax.ShapeDtypeStruct((b * hkv, splits, d), jnp.float32),
        compiler_params=CompilerParams(num_warps=warps, num_stages=3),
        interpret=interpret, name="stream_read",
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), k_cache, v_cache)

# (CTAs per slot and KV head, rows a copy, ring slots) of the TMA stream: from the Mosaic
# prefix kernel's own (16 splits of 128-row blocks, one CTA an SM) to 512 CTAs of small rings.
TMA_STREAMS = ((4, 128, 1), (8, 128, 3), (8, 64, 6), (16, 128, 3), (16, 128, 2), (16, 64, 4),
               (32, 128, 2), (32, 64, 2), (64, 64, 2), (64, 128, 1), (128, 64, 1))


def _tma_kernel(layer_ref, k_ref, v_ref, o_ref, scoped, *, chunk, block, steps, blocks):
    """CTA (split, b * hkv + h): TMA copies of the first `blocks` blocks of its `chunk` rows of
    K and V, `block` rows a copy,
    into a ring of `steps` shared-memory slots, each refilled once its copies have landed
    (nothing reads them: the Mosaic prefix kernel's wgmmas read the ring in place, so this is
    its memory skeleton). -> o [8, D]: the first rows of the last key block."""
    k_smem, v_smem, k_ready, v_ready = scoped
    split, bh = lax.axis_index("split"), lax.axis_index("bh")
    hkv = k_ref.shape[2]
    layer, b, h = layer_ref[0], lax.div(bh, hkv), lax.rem(bh, hkv)

    def fetch(i, slot):
        rows = pl.ds(split * chunk + i * block, block)
        plgpu.copy_gmem_to_smem(k_ref.at[layer, b, h, rows], k_smem.at[slot], k_ready.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[layer, b, h, rows], v_smem.at[slot], v_ready.at[slot])

    for i in range(min(steps, blocks)):
        fetch(i, i)

    @pl.loop(0, blocks)
    def _(i):
        slot = lax.rem(i, steps)
        plgpu.barrier_wait(k_ready.at[slot])
        plgpu.barrier_wait(v_ready.at[slot])
        pl.when(i + steps < blocks)(lambda: fetch(i + steps, slot))

    plgpu.copy_smem_to_gmem(k_smem.at[(blocks - 1) % steps, pl.ds(0, 8)], o_ref.at[bh, split])
    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("splits", "block", "steps", "rows", "interpret"))
def tma_read(k_cache, v_cache, layer, *, splits, block, steps, rows=None, interpret=False):
    """Cache layer `layer` ([L, B, Hkv, T, D]) read into shared memory by Mosaic GPU's TMA, each
    of B * Hkv * splits CTAs taking T / splits rows (rows: only the first `rows` of them, a
    multiple of block) -> [B * Hkv, splits, 8, D]: the first 8 rows of each CTA's last block
    of keys."""
    _, b, hkv, t, d = k_cache.shape
    chunk = _chunk(t, splits, block)
    ring = plgpu.SMEM((steps, block, d), k_cache.dtype)
    scratch = (ring, ring, plgpu.Barrier(num_barriers=steps), plgpu.Barrier(num_barriers=steps))
    body = functools.partial(_tma_kernel, chunk=chunk, block=block, steps=steps,
                             blocks=(rows or chunk) // block)
    call = plgpu.kernel(
        lambda *refs: pl.run_scoped(lambda *scoped: body(*refs, scoped), *scratch),
        out_type=jax.ShapeDtypeStruct((b * hkv, splits, 8, d), k_cache.dtype),
        grid=(splits, b * hkv), grid_names=("split", "bh"),
        **(dict(interpret=pm._interpret_params()) if interpret else {}))
    return call(jnp.reshape(layer, (1,)).astype(jnp.int32), k_cache, v_cache)


# The launch floor's programs per (slot, KV head), each reading one block of this many rows of
# K and V (2 KB each at head dim 128): from one to the streams' widest grids.
TOUCH, TOUCH_ROWS = (1, 16, 64), 8


def stream_reference(k_cache, v_cache, layer, splits, rows=None):
    """stream_read in jnp."""
    _, b, hkv, t, d = k_cache.shape
    kv = k_cache[layer].astype(jnp.float32) + v_cache[layer].astype(jnp.float32)
    return kv.reshape(b * hkv, splits, t // splits, d)[:, :, :rows].sum(2)


def _jax_fns(t, smoke):
    """{name: fn(q, kc, vc, layer, sl, kn, vn, mask)} in bench_kernels' calling convention,
    the streams that cut t rows into whole blocks."""
    fns = {"tree_n1": bk.kernel_fn()}
    for splits, block, warps in (s for s in STREAMS if t % (s[0] * s[1]) == 0):
        fns[f"stream_{splits}_{block}_{warps}"] = (
            lambda q, kc, vc, layer, *_, s=splits, bl=block, w=warps:
            stream_read(kc, vc, layer, splits=s, block=bl, warps=w, interpret=smoke))
    if pm.on_hopper():   # the Mosaic kernel too, which the backend rule leaves to Triton at N 1
        fns["tree_n1_mosaic"] = bk.kernel_fn(backend="mosaic")
    if smoke or pm.on_hopper():
        for splits, block, steps in (s for s in TMA_STREAMS if t % (s[0] * s[1]) == 0):
            fns[f"tma_{splits}_{block}_{steps}"] = (
                lambda q, kc, vc, layer, *_, s=splits, bl=block, st=steps:
                tma_read(kc, vc, layer, splits=s, block=bl, steps=st, interpret=smoke))
    for splits in (s for s in TOUCH if t % (s * TOUCH_ROWS) == 0):
        fns[f"touch_stream_{splits}"] = (
            lambda q, kc, vc, layer, *_, s=splits: stream_read(
                kc, vc, layer, splits=s, block=TOUCH_ROWS, rows=TOUCH_ROWS, interpret=smoke))
        if smoke or pm.on_hopper():
            fns[f"touch_tma_{splits}"] = (
                lambda q, kc, vc, layer, *_, s=splits: tma_read(
                    kc, vc, layer, splits=s, block=TOUCH_ROWS, steps=1, rows=TOUCH_ROWS,
                    interpret=smoke))
    fns["xla_sum"] = lambda q, kc, vc, layer, *_: (
        lax.dynamic_index_in_dim(kc, layer, 0, False).astype(jnp.float32)
        + lax.dynamic_index_in_dim(vc, layer, 0, False).astype(jnp.float32)).sum(2)
    return fns


def _torch_times(b, t, reps):
    """{name: us a call} for torch's reduction and copy of one layer, `reps` calls (each its
    own layer) captured in one CUDA graph, median of 20 replays."""
    import torch
    kv = torch.randn(reps, 2, b, bk.HKV, t, bk.D, device="cuda", dtype=torch.bfloat16)
    sums = torch.empty(reps, device="cuda", dtype=torch.float32)
    dst = torch.empty_like(kv[0])
    ops = {"torch_sum": lambda i: torch.sum(kv[i].view(-1), 0, dtype=torch.float32, out=sums[i]),
           "torch_copy": lambda i: dst.copy_(kv[i])}
    out = {}
    for name, op in ops.items():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):   # warm up off the capture stream, as torch asks
            for i in range(reps):
                op(i)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(reps):
                op(i)
        times = []
        for _ in range(23):
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / reps)
        out[name] = sorted(times[3:])[10]
        del graph
    return out   # the layers go with this frame; the caller empties torch's cache


def measure(b, t, smoke, device_time, only=".*", release=False, copies=False, loop=False):
    kv_bytes = 2 * b * bk.HKV * t * bk.D * 2
    reps = bk.calls_per_program(kv_bytes)
    row = dict(b=b, L=t, reps=reps, kv_bytes=kv_bytes)
    if not smoke:
        import torch
        row.update({k + "_us": v for k, v in _torch_times(b, t, reps).items()})
        torch.cuda.empty_cache()   # leave the device's memory to JAX
    args = bk.make_inputs(jax.random.key(b * 100003 + t), b, 1, t, reps)
    fns = {name: fn for name, fn in _jax_fns(t, smoke).items() if re.fullmatch(only, name)}
    plain = {name: bk.multi_call(fn, reps) for name, fn in fns.items()}
    calls = dict(plain)
    if release:   # each also with its outputs dropped execution by execution
        calls.update({name + "@release": bk.Release(f) for name, f in plain.items()})
    if loop:   # each also as one loop over the layers (bench_kernels.loop_call)
        calls.update({name + "@loop": bk.loop_call(fns[name], reps) for name in plain})
    if copies:   # each also as two loaded copies taken in turn
        calls.update({name + "@copies": bk.Alternate(f) for name, f in plain.items()})
    bk.time_calls(calls, args, reps, row, device_time)
    del args
    return row


def print_row(r, copy_bw):
    print(f"B {r['b']}, L {r['L']}: {r['kv_bytes'] / 1e6:.1f} MB a call, {r['reps']} calls")
    for k in sorted(k for k in r if k.endswith("_us") and not k.endswith(bk._DERIVED)):
        name, us = k[:-3], r[k]
        bw = r["kv_bytes"] / (us * 1e-6)
        pct = f"{100 * bw / copy_bw:5.0f}%" if copy_bw else "     "
        dev = r.get(name + "_dev_us")
        dev_s = f" kernel {dev:7.1f} us ({100 * r['kv_bytes'] / (dev * 1e-6) / copy_bw:3.0f}%)" if (
            dev and copy_bw) else ""
        host, update = r.get(name + "_host_us"), r.get(name + "_update_us")
        host_s = (f" host {host:5.1f} us" if host else "") + (
            f" (graph update {update:4.1f})" if update is not None else "")
        if name.startswith("touch"):   # the launch floor: no layer's bytes to count
            dev_s = f" kernel {dev:7.1f} us" if dev else ""
            print(f"  {name:<22} {us:8.1f} us {'':16}{host_s}{dev_s}")
        else:
            print(f"  {name:<22} {us:8.1f} us {bw / 1e12:5.2f} TB/s {pct}{host_s}{dev_s}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default=SIZES, help='"B,L;..."')
    bk.add_heads_argument(p)
    p.add_argument("--device-time", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny, interpret mode (CPU)")
    p.add_argument("--only", default=".*", help="a regex: the JAX functions it names")
    p.add_argument("--release", action="store_true",
                   help="each also timed with its outputs dropped execution by execution")
    p.add_argument("--loop", action="store_true",
                   help="each also timed as one loop over the layers, as a model runs them")
    p.add_argument("--copies", action="store_true",
                   help="each also timed as two loaded copies of its program taken in turn")
    a = p.parse_args()
    if a.device_time:
        bk.use_device_time()
    if a.heads:
        bk.set_heads(a.heads)
    sizes = [tuple(int(x) for x in s.split(",")) for s in a.sizes.split(";") if s]
    if a.smoke:
        bk.SMOKE, bk.HQ, bk.HKV, sizes = True, 8, 2, [(1, 512)]
    copy_bw = None if a.smoke else bk.torch_copy_bandwidth()
    rows = []
    for b, t in sizes:
        rows.append(measure(b, t, a.smoke, a.device_time, a.only, a.release, a.copies,
                            a.loop))
        print_row(rows[-1], copy_bw)
    os.makedirs(bk.OUT, exist_ok=True)
    with open(os.path.join(bk.OUT, "read_floor.json"), "w") as f:
        json.dump(dict(copy_TBs=copy_bw and copy_bw / 1e12, device=str(jax.devices()[0]),
                       heads=[bk.HQ, bk.HKV, bk.D], rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
