"""Prompt-chunk attention: the kernel visiting only the key blocks each row block reaches
(`tree_attention.new_key_bounds`) against all of them, on the shapes admissions run (SmolLM2's
9 query heads over 3 KV heads, head dim 64, empty prefix): packs of short prompts (block-
diagonal masks) and padded causal chunks. Checks each against the jnp reference first.

    python3 -m bench.bench_prefill_attention [--lengths 60,120,200,...]
"""
from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import device_name, timed, write_json
from pallas_kernels import tree_attention as ta


def pack_mask(lengths, n):
    """[N, N] block-diagonal causal mask of prompts laid end to end, padding after them."""
    seg = np.repeat(np.arange(len(lengths) + 1), list(lengths) + [n - sum(lengths)])
    pos = np.concatenate([np.arange(k) for k in lengths] + [np.arange(sum(lengths), n)])
    return (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])


def case(name, masks, hq=9, hkv=3, d=64, n_runs=30):
    b, n, _ = masks.shape
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (b, n, hq, d), jnp.bfloat16)
    kn = jax.random.normal(ks[1], (b, hkv, n, d), jnp.bfloat16)
    vn = jax.random.normal(ks[2], (b, hkv, n, d), jnp.bfloat16)
    cache = jnp.zeros((1, b, hkv, n, d), jnp.bfloat16)
    sl = jnp.zeros((b,), jnp.int32)
    mask = jnp.asarray(masks)
    scale = 1 / math.sqrt(d)
    ref = ta.tree_attention_reference(q, cache, cache, jnp.int32(0), sl, kn, vn, mask,
                                      sm_scale=scale)
    live = np.asarray(mask.any(-1))
    row = {"case": name, "b": b, "n": n}
    for bounded in (True, False):
        ta._BOUNDED_MIN_NEW = 128 if bounded else 1 << 30
        fn = jax.jit(lambda q: ta.tree_attention_pallas(q, cache, cache, jnp.int32(0), sl, kn,
                                                        vn, mask, sm_scale=scale))
        out = np.asarray(fn(q), np.float32)
        err = np.abs(out - np.asarray(ref, np.float32))[live].max()
        ms, _ = timed(lambda x: fn(x), q, n_runs, 5)
        row["bounded_us" if bounded else "all_us"] = ms * 1e3
        row["max_err_bounded" if bounded else "max_err_all"] = float(err)
    ta._BOUNDED_MIN_NEW = 128
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="60,120,200,90,45,300,150,30",
                    help="prompt lengths packed into the 1024-token row")
    args = ap.parse_args()
    lens = [int(x) for x in args.lengths.split(",")]
    rows = [case("pack 1024", pack_mask(lens, 1024)[None]),
            case("pack 512", pack_mask(lens[:4], 512)[None]),
            case("causal 16 x 256", np.broadcast_to(np.tril(np.ones((256, 256), bool)),
                                                    (16, 256, 256))),
            case("causal 4 x 512", np.broadcast_to(np.tril(np.ones((512, 512), bool)),
                                                   (4, 512, 512)))]
    write_json("bench_prefill_attention.json", dict(device=device_name(), rows=rows))
    print(device_name())
    print(f"{'case':18} {'bounded us':>10} {'all us':>8} {'ratio':>6} {'err b/all':>16}")
    for r in rows:
        print(f"{r['case']:18} {r['bounded_us']:>10.1f} {r['all_us']:>8.1f} "
              f"{r['all_us'] / r['bounded_us']:>5.2f}x "
              f"{r['max_err_bounded']:.3g}/{r['max_err_all']:.3g}")


if __name__ == "__main__":
    main()
