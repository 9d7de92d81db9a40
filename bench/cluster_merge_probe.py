"""Probe of `pallas_kernels/cluster_merge.merge` alone, outside the attention kernel: a
cluster of S CTAs per row, each holding a made-up partial (acc = (s + 1) (1 + c / D + r /
64), m = s / 2, l = 2 + s), merged and checked against numpy on a Hopper GPU ("WRONG" past
1e-2 relative). With --lower-only it only lowers the kernel for the GPU (Mosaic GPU's layout
inference and dialect lowering run then in the Warpgroup semantics, on a CPU too) and reports
the time that took. With --time it takes each step's share of the merge's kernel time on the
GPU, with batch 1's 8 clusters (one a KV head): the CTAs write their columns unmerged
(`store`), after the merge's cluster syncs (`syncs`), after the same syncs by the hardware's
cluster barrier (`hw_syncs`), and the whole merge (`merge`).

    python3 bench/cluster_merge_probe.py [--splits 2,4,8] [--lower-only | --time]
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time
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
MODES = ("store", "syncs", "hw_syncs", "merge")


def _hw_sync():
    """The hardware's cluster barrier (barrier.cluster arrive.release / wait.acquire) from
    every thread: what `cluster_merge._cluster_sync` does with an mbarrier and two fences."""
    from jax._src.lib.mlir.dialects import nvvm

    @plgpu.inline_mgpu()
    def sync(ctx):
        del ctx
        nvvm.cluster_arrive(aligned=True)
        nvvm.cluster_wait(aligned=True)
    sync()


def _unmerged(acc, scratch, o_ref, barriers, *, s, splits, bh, sync):
    """This CTA's own columns of acc written as they are, after the merge's syncs (`sync`
    "mbarrier" or "hw") or none: the merge's writes without its reads of the peers."""
    parts, out_smem = scratch
    cols = D // splits
    for i in range(cluster_merge.BARRIERS if sync else 0):
        if sync == "mbarrier":
            cluster_merge._cluster_sync(barriers.at[i])
        else:
            _hw_sync()
    for j in range(len(parts)):   # a static slice of acc a split, as the merge takes
        @pl.when(s == j)
        def _():
            out_smem[...] = acc[:, j * cols:(j + 1) * cols].astype(out_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, o_ref.at[bh, :, pl.ds(s * cols, cols)])
    plgpu.wait_smem_to_gmem(0)


def _kernel(o_ref, scoped, *, splits, mode="merge"):
    scratch, ml, barriers = scoped
    s, bh = lax.axis_index("split"), lax.axis_index("bh")
    f = s.astype(jnp.float32)
    row = plgpu.Layout.WGMMA.reduce(1)
    wgmma = plgpu.Layout.WGMMA
    # (s + 1) * (1 + c / D + r / 64): each column and row its own value, so that a column
    # block written to the wrong place shows
    cols = plgpu.broadcasted_iota(jnp.float32, (ROWS, D), 1, layout=wgmma)
    rows = plgpu.broadcasted_iota(jnp.float32, (ROWS, D), 0, layout=wgmma)
    acc = (cols / D + rows / ROWS + 1.0) * (f + 1)
    m = plgpu.layout_cast(jnp.full((ROWS,), 0.5, jnp.float32) * f, row)
    l_ = plgpu.layout_cast(jnp.full((ROWS,), 2.0, jnp.float32) + f, row)
    if mode != "merge":
        sync = {"store": None, "syncs": "mbarrier", "hw_syncs": "hw"}[mode]
        return _unmerged(acc, scratch, o_ref, barriers, s=s, splits=splits, bh=bh, sync=sync)
    cluster_merge.merge((acc, m, l_), ml, scratch, o_ref, barriers, split=s, num_splits=splits,
                        bh=bh)


def _call(splits, mode="merge", bh=BH, params=None):
    """The probe kernel for `bh` clusters of `splits` CTAs."""
    smem = (cluster_merge.scratch(ROWS, D, splits, jnp.bfloat16),
            (plgpu.SMEM((ROWS,), jnp.float32),) * 2,
            plgpu.ClusterBarrier(collective_axes=("split",), num_barriers=cluster_merge.BARRIERS))
    body = functools.partial(_kernel, splits=splits, mode=mode)
    return plgpu.kernel(lambda o_ref: pl.run_scoped(lambda *sc: body(o_ref, sc), *smem),
                        out_type=jax.ShapeDtypeStruct((bh, ROWS, D), jnp.bfloat16),
                        grid=(bh,), grid_names=("bh",), cluster=(splits,),
                        cluster_names=("split",), **(params or {}))


def run(splits, lower_only=False):
    """The probe kernel's output [BH, 64, D] as floats (or, lower_only, its lowered text)."""
    params = {}
    if lower_only:   # the semantics whose inference and dialect lowering jax 0.10 runs too
        params = dict(compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
    call = _call(splits, params=params)
    if lower_only:
        return jax.jit(call).trace().lower(lowering_platforms=("cuda",)).as_text()
    return np.asarray(jax.jit(call)().astype(jnp.float32))


def expected(splits):
    """[64, D]: the merge of the made-up partials, in float64."""
    f = np.arange(splits, dtype=np.float64)
    w = np.exp2(f / 2 - f.max() / 2)
    ratio = ((f + 1) * w).sum() / ((2 + f) * w).sum()
    return ratio * (1 + np.arange(D)[None, :] / D + np.arange(ROWS)[:, None] / ROWS)


def time_modes(splits, heads=8):
    """Kernel time (us, median of 3 traces of 8 executions) of each of MODES with `heads`
    clusters of `splits` CTAs; a mode that fails to compile or run gets its error."""
    from bench.bench_kernels import median_kernel_us
    row = {"splits": splits}
    for mode in MODES:
        try:
            f = jax.jit(_call(splits, mode, bh=heads))
            row[f"{mode}_us"] = round(median_kernel_us(f), 2)
        except Exception as e:  # noqa: BLE001  (each mode's failure is the finding)
            row[f"{mode}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    print("time", row, flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--splits", default="2,4,8")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--lower-only", action="store_true")
    mode.add_argument("--time", action="store_true")
    a = ap.parse_args()
    if a.time:
        from bench.bench_kernels import use_device_time
        use_device_time()
        for splits in (int(x) for x in a.splits.split(",")):
            time_modes(splits)
        return
    for splits in (int(x) for x in a.splits.split(",")):
        start = time.perf_counter()
        try:
            out = run(splits, a.lower_only)
            took = f"{time.perf_counter() - start:.1f} s"
            if a.lower_only:
                print(f"splits {splits}: lowered in {took}", flush=True)
            else:
                want = expected(splits)
                err = float((np.abs(out - want) / want).max())
                verdict = "ok" if err < 1e-2 else "WRONG"
                print(f"splits {splits}: {verdict}, max rel err {err:.3g} (bf16 rounds at "
                      f"3.9e-3; compiled and ran in {took})", flush=True)
        except Exception as e:  # noqa: BLE001  (each count's failure is the finding)
            traceback.print_exc(limit=3)
            print(f"splits {splits}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)


if __name__ == "__main__":
    main()
