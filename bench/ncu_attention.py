"""One tree-attention call per shape, for a hardware profiler to read the Mosaic kernel's DRAM
bytes, L2 hit rate and tensor-pipe activity (Hq/Hkv 32/8, head dim 128, random bf16), or the
Triton kernel's (`--backend triton`; `--heads 9,3,64` for SmolLM2's):

    ncu --kernel-name regex:mosaic --metrics dram__bytes_read.sum,... \\
        python3 bench/ncu_attention.py --shapes "64,64,8192;64,16,8192" \\
        [--variants '[{}, {"mosaic_ring": [128, 3]}]'] [--heads "Hq,Hkv,D"]
        [--backend mosaic|triton|default]

Each shape runs twice under each tuning of `--variants` (the first compiles); the profiler
sees both launches, in that order.
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="64,64,8192")
    ap.add_argument("--variants", default="[{}]",
                    help="JSON list of tree_attention tunings, each run on every shape")
    bk.add_heads_argument(ap)
    ap.add_argument("--backend", default="mosaic", choices=("mosaic", "triton", "default"),
                    help="the prefix's kernel (default: the backend rule's choice)")
    args = ap.parse_args(argv)
    if args.heads:
        bk.set_heads(args.heads)
    backend = None if args.backend == "default" else args.backend
    for b, n, length in bk.parse_shapes(args.shapes):
        q, kc, vc, sl, kn, vn, mask = bk.make_inputs(jax.random.key(7), b, n, length, 1)
        for tuning in json.loads(args.variants):
            run = jax.jit(lambda *a, tuning=tuning: ta.tree_attention_pallas(
                *a, sm_scale=1 / math.sqrt(q.shape[-1]), backend=backend, **tuning))
            for _ in range(2):
                jax.block_until_ready(run(q, kc, vc, jnp.int32(0), sl, kn, vn, mask))
            print("ran", b, n, length, tuning, flush=True)


if __name__ == "__main__":
    main()
