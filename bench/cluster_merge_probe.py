"""Device probe of `pallas_kernels/cluster_merge.merge` alone, outside the attention kernel: a
cluster of S CTAs per row, each holding a made-up partial (acc = s + 1, m = s / 2, l = 2 + s in
its rows), merged and checked against numpy; with the merge's scratch as its own shared memory
and as a union with a tiled ring like the attention kernel's. Prints each form's error or what
failed to compile. Hopper only.

    python3 bench/cluster_merge_probe.py [--splits 2,4,8] [--pieces]

--pieces compiles parts of the merge alone instead (2 splits), to find which one Mosaic GPU's
layout inference (jax 0.11) gives up on:
  * `copy`: the local copy of the tile's row slices into their own refs (a WGMMA-layout store,
    then strided loads of the same ref);
  * `branch`: the remote loads of those refs under a branch a split, the output copied after;
  * `branch_copy`: the same with the output's copy inside each branch;
  * `scale`, `scale_copy`: the exchange of m, then the rescaled tile stored (and copied);
  * `ml`: the exchange of m and l, their total and the division, as the merge does them.
On an H200 (fiftieth set) copy, branch, scale and scale_copy compiled and ran; the whole merge
did not.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

from pallas_kernels import cluster_merge  # noqa: E402

ROWS, D, BH = 64, 128, 2


def _kernel(o_ref, scoped, *, splits, union):
    scratch, ml, barriers = scoped
    if union:
        _, scratch = scratch
    s, bh = lax.axis_index("split"), lax.axis_index("bh")
    f = s.astype(jnp.float32)
    row = plgpu.Layout.WGMMA.reduce(1)
    acc = plgpu.layout_cast(jnp.full((ROWS, D), 1.0, jnp.float32) * (f + 1), plgpu.Layout.WGMMA)
    m = plgpu.layout_cast(jnp.full((ROWS,), 0.5, jnp.float32) * f, row)
    l_ = plgpu.layout_cast(jnp.full((ROWS,), 2.0, jnp.float32) + f, row)
    cluster_merge.merge((acc, m, l_), ml, scratch, o_ref, barriers, split=s, num_splits=splits,
                        bh=bh)


def _piece(o_ref, scoped, *, which):
    """One part of `cluster_merge.merge`, for --pieces (the module docstring names them)."""
    (o_smem, parts, out_smem), (m_smem, l_smem), barriers = scoped
    s, bh = lax.axis_index("split"), lax.axis_index("bh")
    rows = out_smem.shape[0]
    strided = plgpu.Layout.WG_STRIDED(out_smem.shape, vec_size=4)
    if which == "ml":
        f = s.astype(jnp.float32)
        row = plgpu.Layout.WGMMA.reduce(1)
        acc = plgpu.layout_cast(jnp.full((ROWS, D), 1.0, jnp.float32) * (f + 1),
                                plgpu.Layout.WGMMA)
        m_i = plgpu.layout_cast(jnp.full((ROWS,), 0.5, jnp.float32) * f, row)
        m_smem[...] = m_i
        l_smem[...] = plgpu.layout_cast(jnp.full((ROWS,), 2.0, jnp.float32) + f, row)
        cluster_merge._cluster_sync(barriers.at[0])
        ms, ls = ([plgpu.load(plgpu.cluster_ref(ref, {"split": j}), (), layout=row)
                   for j in range(len(parts))] for ref in (m_smem, l_smem))
        top = jnp.maximum(ms[0], ms[1])
        total = ls[0] * jnp.exp2(ms[0] - top) + ls[1] * jnp.exp2(ms[1] - top)
        scale = jnp.exp2(m_i - top) / total
        o_smem[...] = acc * lax.broadcast_in_dim(scale, acc.shape, [0])
        out_smem[...] = plgpu.load(o_smem.at[pl.ds(0, rows)], (), layout=strided).astype(
            out_smem.dtype)
        cluster_merge._cluster_sync(barriers.at[1])
    elif which in ("scale", "scale_copy"):   # step 2 of the merge, then a strided load
        f = s.astype(jnp.float32)
        row = plgpu.Layout.WGMMA.reduce(1)
        acc = plgpu.layout_cast(jnp.full((ROWS, D), 1.0, jnp.float32) * (f + 1),
                                plgpu.Layout.WGMMA)
        m_smem[...] = plgpu.layout_cast(jnp.full((ROWS,), 0.5, jnp.float32) * f, row)
        cluster_merge._cluster_sync(barriers.at[0])
        ms = [plgpu.load(plgpu.cluster_ref(m_smem, {"split": j}), (), layout=row)
              for j in range(len(parts))]
        scale = jnp.exp2(ms[0] - jnp.maximum(ms[0], ms[1]))
        o_smem[...] = acc * lax.broadcast_in_dim(scale, acc.shape, [0])
        src = o_smem.at[pl.ds(0, rows)]
        if which == "scale_copy":
            for i, part in enumerate(parts):
                part[...] = plgpu.load(o_smem.at[pl.ds(i * rows, rows)], (), layout=strided)
            src = parts[0]
        out_smem[...] = plgpu.load(src, (), layout=strided).astype(out_smem.dtype)
        cluster_merge._cluster_sync(barriers.at[1])
    elif which == "copy":
        f = s.astype(jnp.float32)
        o_smem[...] = plgpu.layout_cast(jnp.full((ROWS, D), 1.0, jnp.float32) * f,
                                        plgpu.Layout.WGMMA)
        for i, part in enumerate(parts):
            part[...] = plgpu.load(o_smem.at[pl.ds(i * rows, rows)], (), layout=strided)
        out_smem[...] = plgpu.load(parts[0], (), layout=strided).astype(out_smem.dtype)
    else:
        for i, part in enumerate(parts):
            part[...] = plgpu.layout_cast(jnp.full((rows, D), 1.0, jnp.float32), strided)
        cluster_merge._cluster_sync(barriers.at[0])
        for i, part in enumerate(parts):
            @pl.when(s == i)
            def _():
                tiles = [plgpu.load(plgpu.cluster_ref(part, {"split": j}), (), layout=strided)
                         for j in range(len(parts))]
                out_smem[...] = (tiles[0] + tiles[1]).astype(out_smem.dtype)
                if which == "branch_copy":
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(out_smem, o_ref.at[bh, pl.ds(i * rows, rows)])
        cluster_merge._cluster_sync(barriers.at[1])
    if which != "branch_copy":
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, o_ref.at[bh, pl.ds(0, rows)])
    plgpu.wait_smem_to_gmem(0)


def run(splits, union, piece=None):
    tiles = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    scratch = cluster_merge.scratch(ROWS, D, splits, jnp.bfloat16)
    if union:
        ring = plgpu.SMEM((2, 128, D), jnp.bfloat16, transforms=tiles)
        scratch = plgpu.RefUnion((ring, ring), scratch)
    smem = (scratch, (plgpu.SMEM((ROWS,), jnp.float32),) * 2,
            plgpu.ClusterBarrier(collective_axes=("split",), num_barriers=cluster_merge.BARRIERS))
    body = (functools.partial(_piece, which=piece) if piece else
            functools.partial(_kernel, splits=splits, union=union))
    call = plgpu.kernel(lambda o_ref: pl.run_scoped(lambda *sc: body(o_ref, sc), *smem),
                        out_type=jax.ShapeDtypeStruct((BH, ROWS, D), jnp.bfloat16),
                        grid=(BH,), grid_names=("bh",), cluster=(splits,),
                        cluster_names=("split",))
    return np.asarray(jax.jit(call)().astype(jnp.float32))


def expected(splits):
    f = np.arange(splits, dtype=np.float64)
    w = np.exp2(f / 2 - f.max() / 2)
    return float(((f + 1) * w).sum() / ((2 + f) * w).sum())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--splits", default="2,4,8")
    ap.add_argument("--pieces", action="store_true")
    a = ap.parse_args()
    pieces = ("ml", "branch", "branch_copy", "copy", "scale", "scale_copy")
    for piece in pieces if a.pieces else ():
        try:
            run(2, False, piece)
            print(f"piece {piece}: compiled and ran", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"piece {piece}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
    if a.pieces:
        return
    for splits in (int(x) for x in a.splits.split(",")):
        for union in (False, True):
            try:
                out = run(splits, union)
                err = float(np.abs(out - expected(splits)).max())
                print(f"splits {splits} union {union}: max err {err:.3g} "
                      f"(want {expected(splits):.4f})", flush=True)
            except Exception as e:  # noqa: BLE001  (each form's failure is the finding)
                traceback.print_exc(limit=3)
                print(f"splits {splits} union {union}: FAILED {type(e).__name__}: "
                      f"{str(e)[:300]}", flush=True)


if __name__ == "__main__":
    main()
