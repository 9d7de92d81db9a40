"""A/B of tree-attention tuning variants in one call: each variant checked against the jnp
reference first (uneven prefixes, 1-4 splits, packed and separate inputs, SmolLM2's heads),
then all timed with the bench_kernels harness (chained calls, 8 dispatched back to back).

    python3 bench/kernel_ab.py --variants '{"ring3": {"mosaic_ring": [128, 3]}}' \\
        [--base '{"backend": "mosaic"}'] [--shapes "B,N,L;..."] [--no-checks] [--device-time]
        [--heads "Hq,Hkv,D"] [--repeats K]
Every variant is `base` updated with its own settings; "default" (base alone) is always
timed, twice. JSON lists become tuples (`mosaic_ring`). --device-time adds each one's kernel
time from a profiler trace. --repeats K runs each check K times and fails it unless all K
outputs are the same bit for bit (kernels whose CTAs exchange results must not race). Checks
take their own split counts, so a variant's num_splits applies to the timed rows only.
Writes $OUT/kernel_ab.json.
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

CHECKS = [(8, 64, 1024, 32, 8, 128, 1, False), (3, 16, 1024, 32, 8, 128, 3, True),
          (2, 60, 2048, 32, 8, 128, 2, True), (3, 30, 1024, 9, 3, 64, 1, True),
          (1, 7, 512, 32, 8, 128, 4, False), (2, 64, 4096, 32, 8, 128, 3, False),
          # 2, 4 and 8 splits of one warpgroup's rows, one slot's splits mostly empty
          (1, 1, 8192, 32, 8, 128, 8, False), (2, 16, 2048, 32, 8, 128, 4, True),
          (1, 4, 1024, 32, 8, 128, 2, False), (2, 1, 512, 32, 8, 128, 8, False)]
SHAPES = ("64,64,8192;8,64,8192;1,64,8192;8,64,2048;1,16,8192;8,16,8192;64,16,8192;"
          "1,16,32768")


def check(b, n, t, hq, hkv, d, splits, packed, extra=None, repeats=1):
    """`bench_kernels.check_attention` on uneven prefixes, at a given split count (and the
    tuning in `extra`); with repeats > 1 the call runs that many times and must give the same
    output bit for bit each time."""
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

    def run_all():
        outs = [run() for _ in range(repeats)]
        differ = [i for i, o in enumerate(outs) if not bool(jnp.array_equal(o, outs[0]))]
        if differ:
            raise AssertionError(f"runs {differ} of {repeats} differ from the first")
        return outs[0]
    bk.check_attention("tree_attention_mosaic_packed" if packed else "tree_attention_mosaic",
                       run_all, ref, 1e-2, dict(b=b, n=n, t=t, hq=hq, hkv=hkv, d=d,
                                                splits=splits, **(extra or {})))


def time_rows(shapes, fns, out, filename):
    """Time `fns` (name -> bench_kernels kernel fn) on each "B,N,L" shape; rows into out["times"],
    saved to $OUT/filename after each."""
    for b, n, length in bk.parse_shapes(shapes):
        row = bk.bench_attention(b, n, length, fns, jax.random.key(7))
        print("time", {k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()
                       if k.endswith("_us") or k in ("b", "n", "L")}, flush=True)
        out["times"].append(row)
        with open(os.path.join(os.environ.get("OUT", "."), filename), "w") as f:
            json.dump(out, f, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", required=True, help='{"name": {tuning...}, ...}')
    ap.add_argument("--base", default='{"backend": "mosaic"}')
    ap.add_argument("--shapes", default=SHAPES, help='"" for the checks alone')
    ap.add_argument("--no-checks", action="store_true", help="time only (checked before)")
    ap.add_argument("--device-time", action="store_true",
                    help="also each one's kernel time from a profiler trace")
    bk.add_heads_argument(ap)
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of each check, all to agree bit for bit")
    a = ap.parse_args()
    if a.device_time:
        bk.use_device_time()
    if a.heads:
        bk.set_heads(a.heads)
    hashable = lambda cfg: {k: tuple(v) if isinstance(v, list) else v  # noqa: E731
                            for k, v in cfg.items()}   # (static arguments)
    base = hashable(json.loads(a.base))
    variants = {name: hashable({**base, **cfg}) for name, cfg in json.loads(a.variants).items()}
    out = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
               heads=[bk.HQ, bk.HKV, bk.D], base=base,
               variants=variants, checks=bk.RESULTS["check"], times=[])
    for name, cfg in ({} if a.no_checks else variants).items():
        for args in CHECKS:
            check(*args, extra={k: v for k, v in cfg.items()
                                if k not in ("backend", "num_splits")}, repeats=a.repeats)
    fns = {"default": bk.kernel_fn(**base)}
    fns.update({name: bk.kernel_fn(**cfg) for name, cfg in variants.items()})
    fns["default again"] = bk.kernel_fn(**base, block_n=64)   # same program, re-traced
    time_rows(a.shapes, fns, out, "kernel_ab.json")


if __name__ == "__main__":
    main()
