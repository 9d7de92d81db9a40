"""The Triton kernel's splits merged by their last program (`merge_last`, one launch) against
the combine pass (two launches), in one call: checks against the jnp reference first, a
repeat check (the merged output must be bit-identical over many launches, whichever program
arrives last), then the bench_kernels timing (chained calls, 8 dispatched back to back).

    python3 bench/merge_last_ab.py [--shapes "B,N,L;..."] [--repeats 200]
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
import numpy as np  # noqa: E402

from bench import bench_kernels as bk  # noqa: E402
from pallas_kernels import tree_attention as ta  # noqa: E402

VARIANTS = {"combine": dict(backend="triton", merge_last=False),
            "last": dict(backend="triton", merge_last=True)}


def inputs(b, n, t, hq, hkv, d):
    """Uneven prefixes: slot b holds t // 2 + 37 b (mod t) rows."""
    lens = jnp.arange(b, dtype=jnp.int32) * 37 % t + t // 2
    return bk.make_inputs(jax.random.key(b * 131 + n), b, n, t, 2, hq=hq, hkv=hkv, d=d,
                          seq_lens=lens)


def check(b, n, t, hq, hkv, d, splits, dtype=jnp.bfloat16):
    q, kc, vc, sl, kn, vn, mask = (x.astype(dtype) if x.dtype == jnp.bfloat16 else x
                                   for x in inputs(b, n, t, hq, hkv, d))
    scale = 1 / math.sqrt(d)
    ref = ta.tree_attention_reference(q, kc, vc, jnp.int32(1), sl, kn, vn, mask, sm_scale=scale)
    run = lambda: ta.tree_attention_pallas(  # noqa: E731
        q, kc, vc, jnp.int32(1), sl, kn, vn, mask, sm_scale=scale, num_splits=splits,
        interpret=bk.SMOKE, **VARIANTS["last"])
    tol = 1e-2 if dtype == jnp.bfloat16 else 1e-5
    bk.check_attention("tree_attention_merge_last", run, ref, tol,
                       dict(b=b, n=n, t=t, hq=hq, hkv=hkv, d=d, splits=splits,
                            dtype=jnp.dtype(dtype).name))


def repeat_check(b, n, t, repeats):
    """`repeats` launches of the same call: every output bit-identical to the first."""
    q, kc, vc, sl, kn, vn, mask = inputs(b, n, t, bk.HQ, bk.HKV, bk.D)
    f = jax.jit(lambda q: ta.tree_attention_pallas(
        q, kc, vc, jnp.int32(1), sl, kn, vn, mask, sm_scale=bk.SM_SCALE, interpret=bk.SMOKE,
        **VARIANTS["last"]))
    first = np.asarray(f(q))
    outs = [f(q) for _ in range(repeats)]
    differ = sum(int(not np.array_equal(np.asarray(o), first)) for o in outs)
    row = dict(op="merge_last_repeat", b=b, n=n, t=t, repeats=repeats, differing=differ,
               ok=differ == 0)
    bk.RESULTS["check"].append(row)
    print("check", row, flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="1,1,1024;1,1,8192;1,1,32768;8,1,8192;64,1,8192;"
                                         "1,4,8192;1,16,8192;8,16,8192")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (CPU)")
    a = ap.parse_args()
    checks = [(1, 1, 8192, 32, 8, 128, 32), (3, 1, 1024, 32, 8, 128, 5),
              (2, 7, 2048, 32, 8, 128, 4), (1, 16, 4096, 32, 8, 128, 16),
              (2, 1, 512, 9, 3, 64, 4), (2, 3, 1024, 32, 8, 128, 6, jnp.float32)]
    repeats = [(1, 1, 8192), (8, 1, 8192), (1, 4, 2048)]
    if a.smoke:
        bk.SMOKE, bk.HQ, bk.HKV = True, 8, 2
        checks = [(1, 1, 256, 8, 2, 64, 4), (2, 3, 128, 4, 2, 32, 3, jnp.float32)]
        repeats, a.repeats, a.shapes = [(1, 1, 256)], 2, "1,1,512"
    out = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
               checks=bk.RESULTS["check"], times=[])
    for args in checks:
        check(*args)
    for shape in repeats:
        repeat_check(*shape, a.repeats)
    for b, n, length in bk.parse_shapes(a.shapes):
        fns = {name: bk.kernel_fn(**cfg) for name, cfg in VARIANTS.items()}
        fns["combine again"] = bk.kernel_fn(backend="triton", merge_last=False, block_n=16)
        fns["default"] = bk.kernel_fn()   # what the dispatch picks (Mosaic for wide tiles)
        row = bk.bench_attention(b, n, length, fns, jax.random.key(7))
        row["splits"] = ta.default_config(b, n, bk.HQ, bk.HKV, bk.D, length)[2]
        print("time", {k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()
                       if k.endswith("_us") or k in ("b", "n", "L", "splits")}, flush=True)
        out["times"].append(row)
        with open(os.path.join(os.environ.get("OUT", "."), "merge_last_ab.json"), "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
