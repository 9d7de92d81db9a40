"""The Mosaic prefix kernel's split partials merged inside one thread-block cluster (Hopper).

With `prefix_partials_mgpu(cluster_merge=True)` the S split CTAs of one (slot, KV head) run as
one cluster (S in 2, 4, 8; 8 is the portable cluster size). When their loops are done:

  1. each CTA leaves its rows' running max m_s and sum l_s (base 2) in its shared memory;
  2. every CTA reads all S of them through distributed shared memory, takes each row's common
     max M and total L = sum_s l_s 2^(m_s - M), and rescales its own accumulator to
     o_s 2^(m_s - M) / L, so that the output is the plain sum of the S rescaled tiles;
  3. each CTA sums its own D / S columns of those tiles across the cluster and writes them.

Everything stays in the WGMMA register layout and in tiled, swizzled shared memory, with
every layout given. Mosaic GPU's layout inference gave up on a first form that moved the
tile's rows into a strided layout: the search ran out of its budget, with 10x the budget too
(`bench/cluster_merge_probe.py`). A peer's view of a ref (`plgpu.cluster_ref`) lowers only for a
whole ref, not for a slice of one. So each CTA leaves its tile as S refs of D / S columns, and
picks the ref of its own columns by a branch a split.

This is the combine pass's merge without its launch, and without the partials' round trip
through global memory. At batch 1 over 8K a TMA read of a layer by 8 CTAs a KV head takes what
16 take (9.6 us, bench/RESULTS.md, fiftieth set), so a cluster can hold a head's splits.

Measured on the device (fifty-first set), it is right and slower: 3.4-4.0 us more than the
same splits with the combine at batch 1. The merge alone takes 5.8 us at 8 splits, 3.4 of
them reading the peers' tiles, and a clustered launch costs 0.7 us more than a plain one. The
attention kernel therefore leaves it off (`tree_attention._MOSAIC_CLUSTER_MERGE`).

A cluster barrier orders the steps. Its arrive signals every CTA's barrier from one thread a
CTA, so the warpgroup first meets at its own barrier, and a cluster-scope fence on each side
makes the shared-memory writes before it visible to the peers' reads after it.
"""
from __future__ import annotations

import functools
import operator

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

try:  # Mosaic GPU's Pallas API (Hopper); absent from some jaxlib builds
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import llvm
except ImportError:  # pragma: no cover
    plgpu = None

SIZES = (2, 4, 8)   # splits a cluster holds (8: the portable cluster size); D / S columns each
MIN_COLS = 16       # columns a CTA writes, at least: a 32-byte swizzle of its bf16 rows
BARRIERS = 3        # cluster barriers a merge passes: m and l out, tiles out, tiles read


def _fence(sync_first: bool):
    """fence.acq_rel.cluster from every thread of the warpgroup (after meeting at the
    warpgroup's barrier when sync_first: the thread that arrives for the CTA then orders the
    others' writes too)."""
    @plgpu.inline_mgpu()
    def fence(ctx):
        del ctx
        if sync_first:
            mgpu_utils.warpgroup_barrier()
        llvm.inline_asm(ir.Type.parse("!llvm.void"), [], "fence.acq_rel.cluster;", "",
                        has_side_effects=True)
    fence()


def _cluster_sync(barrier):
    """Past this point once every CTA of the cluster has reached it; the shared-memory writes
    of each before it are visible to the reads of all after it."""
    _fence(sync_first=True)
    plgpu.barrier_arrive(barrier)
    plgpu.barrier_wait(barrier)
    _fence(sync_first=False)


def _tiles(cols, dtype):
    """Shared-memory transforms for [64, cols] tiles in the WGMMA layout: 8-row tiles, swizzled
    by the row's bytes up to 128."""
    minor = min(cols, 128 // jnp.dtype(dtype).itemsize)
    return (plgpu.TilingTransform((8, minor)),
            plgpu.SwizzleTransform(minor * jnp.dtype(dtype).itemsize))


def scratch(rows, head_dim, num_splits, dtype):
    """The merge's shared memory: the rescaled tile [rows, D] f32 as `num_splits` refs of
    D / S columns, and the output's staging tile [rows, D / S] in `dtype`."""
    cols = head_dim // num_splits
    return (tuple(plgpu.SMEM((rows, cols), jnp.float32, transforms=_tiles(cols, jnp.float32))
                  for _ in range(num_splits)),
            plgpu.SMEM((rows, cols), dtype, transforms=_tiles(cols, dtype)))


def merge(carry, ml_smem, scratch_refs, out_ref, barriers, *, split, num_splits, bh,
          axis="split"):
    """Write the normalised output of this cluster's (slot, KV head) to out_ref [BH, R, D],
    D / S columns from each CTA.

    carry: this CTA's (acc [R, D] f32, m, l [R]) in the WGMMA layouts (R = 64); ml_smem: two
    [R] f32 refs; scratch_refs: `scratch`'s refs; barriers: `BARRIERS` cluster barriers."""
    acc, m_i, l_i = carry
    m_smem, l_smem = ml_smem
    parts, out_smem = scratch_refs
    cols = out_smem.shape[1]
    row, wgmma = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA
    m_smem[...] = m_i
    l_smem[...] = l_i
    _cluster_sync(barriers.at[0])
    ms, ls = ([plgpu.load(plgpu.cluster_ref(ref, {axis: j}), (), layout=row)
               for j in range(num_splits)] for ref in (m_smem, l_smem))
    top = functools.reduce(jnp.maximum, ms)
    total = functools.reduce(operator.add, [l * jnp.exp2(m - top) for m, l in zip(ms, ls)])
    # Every row has a live key somewhere (its own tree token), so total > 0.
    scale = jnp.exp2(m_i - top) / total
    scaled = acc * lax.broadcast_in_dim(scale, acc.shape, [0])
    for s, part in enumerate(parts):
        part[...] = scaled[:, s * cols:(s + 1) * cols]
    _cluster_sync(barriers.at[1])
    for s, part in enumerate(parts):
        @pl.when(split == s)
        def _():
            tiles = [plgpu.load(plgpu.cluster_ref(part, {axis: j}), (), layout=wgmma)
                     for j in range(num_splits)]
            out_smem[...] = functools.reduce(operator.add, tiles).astype(out_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, out_ref.at[bh, :, pl.ds(split * cols, cols)])
    _cluster_sync(barriers.at[2])   # no CTA leaves while a peer still reads its tiles
    plgpu.wait_smem_to_gmem(0)
