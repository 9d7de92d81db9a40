"""The tree part inside Mosaic GPU's prefix kernel against beside it (the Triton kernel's tree
part and merge), and against the Triton kernel alone, in one call: checks against the jnp
reference first, then the bench_kernels timing (chained calls, 8 dispatched back to back).

    python3 bench/mosaic_tree_ab.py [--shapes "B,N,L;..."]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax  # noqa: E402

from bench import bench_kernels as bk  # noqa: E402
from bench.kernel_ab import CHECKS, check, time_rows  # noqa: E402

VARIANTS = {"inside": dict(backend="mosaic"), "beside": dict(backend="mosaic", mosaic_tree=False),
            "triton": dict(backend="triton")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="8,64,1024;8,64,2048;1,16,8192;1,16,32768;1,64,8192;"
                                         "8,64,8192;64,64,8192")
    a = ap.parse_args()
    out = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
               checks=bk.RESULTS["check"], times=[])
    for args in CHECKS[:5]:   # the thirty-eighth set's checks
        check(*args)
    fns = {name: bk.kernel_fn(**cfg) for name, cfg in VARIANTS.items()}
    fns["inside again"] = bk.kernel_fn(backend="mosaic", block_n=64)  # same program, re-traced
    time_rows(a.shapes, fns, out, "mosaic_tree_ab.json")


if __name__ == "__main__":
    main()
