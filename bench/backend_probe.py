"""Triton lowering against Mosaic GPU on the tree-attention prefix (issue 4's backend choice).

The N = 64 rows of the kernel table are bound by arithmetic (256 query rows per KV head), so
the question is whether a Mosaic GPU kernel (wgmma + TMA, warp-specialised; jax's
FlashAttention-3 example `pallas.ops.gpu.attention_mgpu`) does more FLOP/s on these shapes than
our Triton kernel. The probe times both on the same work in the same run:

  * ours: `tree_attention_pallas` with N tree queries (R = N * G rows per KV head) over a full
    prefix of L keys, splits and combine included;
  * Mosaic GPU: the example's forward on q [B * S, R, Hkv, D] against k, v [B * S, L / S, Hkv, D],
    i.e. each KV head's R rows as one "head" of R queries, and a prefix cut into S splits folded
    into the batch (the work of a split-K pass, without the combine; the example has no split).

The example takes only R a multiple of 128 (two 64-row warpgroups), so N = 32 and 64 are
compared. fp16 for the example (its shared-memory scratch is fp16 in jax 0.10), bf16 for ours:
the same bytes and tensor-core rate. Output: $OUT/backend_probe.json and a table.

    export PYTHONPATH=$PWD; python3 bench/backend_probe.py
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_kernels as bk  # noqa: E402  (sets the memory fraction before jax starts)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels import tree_attention as ta  # noqa: E402

# (B, N, L, S): batch, tree size, prefix, splits folded into the example's batch.
SHAPES = [(1, 64, 8192, 16), (1, 64, 8192, 32), (8, 64, 8192, 4), (64, 64, 8192, 1),
          (1, 32, 8192, 16), (8, 32, 8192, 4), (64, 32, 8192, 1), (1, 64, 32768, 32),
          (8, 64, 32768, 4)]


def mosaic_fn(block_q, block_kv, steps):
    from jax.experimental.pallas.ops.gpu import attention_mgpu as am
    cfg = am.TuningConfig(block_q=block_q, block_kv=block_kv, max_concurrent_steps=steps)
    return jax.jit(lambda q, k, v: am.attention(q, k, v, cfg))


def check_mosaic():
    """The example against its own reference on a small shape: the timed kernel does the work."""
    from jax.experimental.pallas.ops.gpu import attention_mgpu as am
    ks = jax.random.split(jax.random.key(1), 3)
    q, k, v = (jax.random.normal(kk, shape, jnp.float16) for kk, shape in
               zip(ks, [(2, 256, bk.HKV, bk.D), (2, 1024, bk.HKV, bk.D), (2, 1024, bk.HKV, bk.D)]))
    out = mosaic_fn(64, 64, 2)(q, k, v)
    ref = am.attention_reference(q, k, v)
    print(f"mosaic example vs its reference: rel err {bk.rel_err(out, ref):.2e}")


def probe(b, n, length, splits, key, results):
    g = bk.HQ // bk.HKV
    rows, d = n * g, bk.D
    flops = 4 * b * bk.HQ * n * length * d
    kv_bytes = 2 * b * bk.HKV * length * d * 2
    row = dict(b=b, n=n, L=length, splits=splits, flops=flops, kv_bytes=kv_bytes, times={})
    args = bk.make_inputs(key, b, n, length, 1)
    q, kc, vc, sl, kn, vn, mask = args
    t, _ = bk.median_time(lambda *a: ta.tree_attention_pallas(*a, sm_scale=bk.SM_SCALE),
                          q, kc, vc, jnp.int32(0), sl, kn, vn, mask)
    row["times"]["triton"] = t
    del args, q, kc, vc, kn, vn
    f16 = jnp.float16
    ks = jax.random.split(key, 3)
    bs, ls = b * splits, length // splits
    qm = jax.random.normal(ks[0], (bs, rows, bk.HKV, d), f16)
    km = jax.random.normal(ks[1], (bs, ls, bk.HKV, d), f16)
    vm = jax.random.normal(ks[2], (bs, ls, bk.HKV, d), f16)
    for block_q, block_kv, steps in [(64, 64, 2), (64, 128, 2), (64, 64, 4), (64, 128, 4),
                                     (128, 64, 2), (128, 128, 2)]:
        name = f"mosaic q{block_q} kv{block_kv} s{steps}"
        if rows % (2 * block_q):
            continue
        try:
            t, _ = bk.median_time(mosaic_fn(block_q, block_kv, steps), qm, km, vm)
            row["times"][name] = t
        except Exception as e:  # noqa: BLE001  (a config the example refuses: record why)
            row["times"][name] = None
            row.setdefault("errors", {})[name] = f"{type(e).__name__}: {str(e)[:300]}"
            traceback.print_exc(limit=2)
    results.append(row)
    return row


def show(row, copy_bw):
    for name, t in row["times"].items():
        if t is None:
            print(f"B={row['b']:>2} N={row['n']:>2} L={row['L']:>5} S={row['splits']:>2} "
                  f"{name:<24} failed")
            continue
        tf = row["flops"] / t / 1e12
        pct = 100 * row["kv_bytes"] / t / copy_bw if copy_bw else float("nan")
        print(f"B={row['b']:>2} N={row['n']:>2} L={row['L']:>5} S={row['splits']:>2} "
              f"{name:<24} {t * 1e6:8.1f} us {tf:6.0f} TFLOP/s {pct:5.1f}% copy")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="", help='"B,N,L,S;..." instead of the default list')
    a = p.parse_args()
    shapes = ([tuple(int(x) for x in s.split(",")) for s in a.shapes.split(";") if s]
              if a.shapes else SHAPES)
    copy_bw = bk.torch_copy_bandwidth()
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, copy "
          f"{(copy_bw or 0) / 1e12:.2f} TB/s")
    check_mosaic()
    results, key = [], jax.random.key(7)
    out = os.environ.get("OUT", "/tmp/bench_out")
    os.makedirs(out, exist_ok=True)
    for b, n, length, splits in shapes:
        key, k = jax.random.split(key)
        row = probe(b, n, length, splits, k, results)
        show(row, copy_bw)
        with open(os.path.join(out, "backend_probe.json"), "w") as f:
            json.dump(dict(copy=copy_bw, jax=jax.__version__, rows=results), f, indent=1)
    print("\nsummary")
    for row in results:
        show(row, copy_bw)


if __name__ == "__main__":
    main()
