"""The tree part inside Mosaic GPU's prefix kernel against beside it (the Triton kernel's tree
part and merge), and against the Triton kernel alone, in one call: checks against the jnp
reference first, then the bench_kernels timing (chained calls, 8 dispatched back to back).

    python3 bench/mosaic_tree_ab.py [--shapes "B,N,L;..."]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench import bench_kernels as bk  # noqa: E402
from pallas_kernels import tree_attention as ta  # noqa: E402

VARIANTS = {"inside": dict(backend="mosaic"), "beside": dict(backend="mosaic", mosaic_tree=False),
            "triton": dict(backend="triton")}


def check(b, n, t, hq, hkv, d, splits, packed, extra=None):
    """`bench_kernels.check_attention` on uneven prefixes, at a given split count (and the
    tuning in `extra`)."""
    key = jax.random.key(b * 131 + n)
    q, kc, vc, sl, kn, vn, mask = bk.make_inputs(key, b, n, t, 2, hq=hq, hkv=hkv, d=d,
                                                 seq_lens=jnp.arange(b, dtype=jnp.int32) * 37
                                                 % t + t // 2)
    scale = 1 / math.sqrt(d)
    ref = ta.tree_attention_reference(q, kc, vc, jnp.int32(1), sl, kn, vn, mask, sm_scale=scale)
    kw = dict(sm_scale=scale, backend="mosaic", num_splits=splits, **(extra or {}))
    if packed:
        qkv = jnp.concatenate([q, kn.transpose(0, 2, 1, 3), vn.transpose(0, 2, 1, 3)], 2)
        run = lambda: ta.tree_attention_packed_pallas(  # noqa: E731
            qkv, kc, vc, jnp.int32(1), sl, mask, num_heads=hq, **kw)
    else:
        run = lambda: ta.tree_attention_pallas(  # noqa: E731
            q, kc, vc, jnp.int32(1), sl, kn, vn, mask, **kw)
    bk.check_attention("tree_attention_mosaic_packed" if packed else "tree_attention_mosaic",
                       run, ref, 1e-2, dict(b=b, n=n, t=t, hq=hq, hkv=hkv, d=d, splits=splits,
                                            **(extra or {})))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="8,64,1024;8,64,2048;1,16,8192;1,16,32768;1,64,8192;"
                                         "8,64,8192;64,64,8192")
    a = ap.parse_args()
    out = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
               checks=bk.RESULTS["check"], times=[])
    for args in [(8, 64, 1024, 32, 8, 128, 1, False), (3, 16, 1024, 32, 8, 128, 3, True),
                 (2, 60, 2048, 32, 8, 128, 2, True), (3, 30, 1024, 9, 3, 64, 1, True),
                 (1, 7, 512, 32, 8, 128, 4, False)]:
        check(*args)
    for b, n, length in bk.parse_shapes(a.shapes):
        fns = {name: bk.kernel_fn(**cfg) for name, cfg in VARIANTS.items()}
        fns["inside again"] = bk.kernel_fn(backend="mosaic", block_n=64)  # same program, re-traced
        row = bk.bench_attention(b, n, length, fns, jax.random.key(7))
        print("time", {k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()
                       if k.endswith("_us") or k in ("b", "n", "L")}, flush=True)
        out["times"].append(row)
        with open(os.path.join(os.environ.get("OUT", "."), "mosaic_tree_ab.json"), "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
