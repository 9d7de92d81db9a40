"""The Mosaic prefix kernel's split partials merged inside one thread-block cluster (Hopper).

With `prefix_partials_mgpu(cluster_merge=True)` the S split CTAs of one (slot, KV head) run as
one cluster (S in 2, 4, 8; 8 is the portable cluster size). When their loops are done:

  1. each CTA leaves its rows' running max m_s and sum l_s (base 2) in its shared memory;
  2. every CTA reads all S of them through distributed shared memory, takes each row's common
     max M and total L = sum_s l_s 2^(m_s - M), and rescales its own accumulator to
     o_s 2^(m_s - M) / L, so that the output is the plain sum of the S rescaled tiles;
  3. each CTA sums its own 64 / S rows of those tiles across the cluster and writes them.

This is the combine pass's merge without its launch, and without the partials' round trip
through global memory. At batch 1 over 8K a TMA read of a layer by 8 CTAs a KV head takes what
16 take (9.6 us, bench/RESULTS.md, fiftieth set), so a cluster can hold a head's splits.

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

SIZES = (2, 4, 8)   # splits a cluster holds: they cut a 64-row tile into whole 8-row slices
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


def merge(carry, o_smem, ml_smem, out_smem, out_ref, barriers, *, split, num_splits, bh,
          axis="split"):
    """Write the normalised output rows of this cluster's (slot, KV head) to out_ref [BH, R, D].

    carry: this CTA's (acc [64, D] f32, m, l [64]) in the WGMMA layouts; o_smem [64, D] f32 and
    ml_smem [2, 1, 64] f32 its shared memory (untiled o_smem: peers read slices of its rows);
    out_smem [64 / S, D] the output's staging tile; barriers: `BARRIERS` cluster barriers."""
    acc, m_i, l_i = carry
    ml_smem.at[0, 0][...] = m_i
    ml_smem.at[1, 0][...] = l_i
    _cluster_sync(barriers.at[0])
    row = plgpu.Layout.WGMMA.reduce(1)
    peers = [plgpu.cluster_ref(ml_smem, {axis: j}) for j in range(num_splits)]
    ms = [plgpu.load(p.at[0, 0], (), layout=row) for p in peers]
    ls = [plgpu.load(p.at[1, 0], (), layout=row) for p in peers]
    top = functools.reduce(jnp.maximum, ms)
    total = functools.reduce(operator.add, [l * jnp.exp2(m - top) for m, l in zip(ms, ls)])
    # Every row has a live key somewhere (its own tree token), so total > 0.
    scale = jnp.exp2(m_i - top) / total
    o_smem[...] = acc * lax.broadcast_in_dim(scale, acc.shape, [0])
    _cluster_sync(barriers.at[1])
    rows = o_smem.shape[0] // num_splits
    mine = pl.ds(split * rows, rows)
    tiles = [plgpu.cluster_ref(o_smem, {axis: j}).at[mine][...] for j in range(num_splits)]
    out_smem[...] = functools.reduce(operator.add, tiles).astype(out_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, out_ref.at[bh, mine])
    _cluster_sync(barriers.at[2])   # no CTA leaves while a peer still reads its tile
    plgpu.wait_smem_to_gmem(0)
