"""Prompt-chunk attention on the shapes admissions run (SmolLM2's 9 query heads over 3 KV heads,
head dim 64, q/k/v packed as the model's projection writes them): the kernel's settings side by
side, device time per call with 30 chained calls per program (one per layer, as a forward runs
them), each checked against the jnp reference first.

Cases: packs of first chunks (block-diagonal causal masks, empty prefix) and later chunks
(causal over the chunk, after a cached prefix). Variants: `causal` (each row block stops at its
last query's key block), row-block sizes.

    python3 -m bench.bench_prefill_attention [--variants default,causal,causal+r64] [--tiny]
Writes $OUT/bench_prefill_attention.json.
"""
from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import device_name, timed, write_json
from pallas_kernels import tree_attention as ta

HQ, HKV, D, LAYERS = 9, 3, 64, 30
VARIANTS = {"default": {}, "causal": {"causal": True},
            "causal+r64": {"causal": True, "block_r": 64},
            "causal+r32": {"causal": True, "block_r": 32},
            "causal+n32": {"causal": True, "block_n": 32},
            "causal+n128": {"causal": True, "block_n": 128},
            "causal+start": {"causal": True, "skip_before": True},
            "causal+start+r64": {"causal": True, "skip_before": True, "block_r": 64}}


def pack_mask(lengths, n):
    """[N, N] block-diagonal causal mask of prompts laid end to end, padding after them."""
    seg = np.repeat(np.arange(len(lengths) + 1), list(lengths) + [n - sum(lengths)])
    pos = np.concatenate([np.arange(k) for k in lengths] + [np.arange(sum(lengths), n)])
    return (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])


def cases(tiny: bool):
    """(name, masks [R, W, W], prefix rows already cached per row)."""
    mt = [60, 120, 200, 90, 45, 300, 150, 30]           # ~MT-bench prompts in the template
    if tiny:
        return [("pack 1x128", pack_mask([50, 40, 30], 128)[None], 0),
                ("chunk 2x64 after 64", np.broadcast_to(np.tril(np.ones((64, 64), bool)),
                                                        (2, 64, 64)), 64)]
    sg = [np.stack([pack_mask([700, 300], 1024), pack_mask([1000], 1024)])[i % 2]
          for i in range(32)]
    tril = np.tril(np.ones((512, 512), bool))
    return [("pack 1x1024 (8 prompts)", pack_mask(mt, 1024)[None], 0),
            ("pack 4x1024", np.stack(sg[:4]), 0),
            ("pack 32x1024", np.stack(sg), 0),
            ("chunk 16x512 after 512", np.broadcast_to(tril, (16, 512, 512)), 512),
            ("chunk 4x512 after 1024", np.broadcast_to(tril, (4, 512, 512)), 1024)]


def run_case(name, masks, prefix, variants, dtype, interpret):
    r, w, _ = masks.shape
    t = prefix + w
    ks = jax.random.split(jax.random.key(0), 3)
    qkv = jax.random.normal(ks[0], (r, w, HQ + 2 * HKV, D), dtype)
    kc = jax.random.normal(ks[1], (LAYERS, r, HKV, t, D), dtype)
    vc = jax.random.normal(ks[2], (LAYERS, r, HKV, t, D), dtype)
    sl = jnp.full((r,), prefix, jnp.int32)
    mask = jnp.asarray(masks)
    scale = 1 / math.sqrt(D)
    q, kn, vn = ta.split_packed(qkv, HQ, HKV)
    ref = ta.tree_attention_reference(q, kc, vc, jnp.int32(0), sl, kn, vn, mask, sm_scale=scale)
    live = np.asarray(mask.any(-1))
    row = {"case": name, "rows": r, "width": w, "prefix": prefix}
    for label in variants:
        tune = dict(VARIANTS[label], interpret=interpret)

        @jax.jit
        def layers(qkv, kc=kc, vc=vc, sl=sl, mask=mask, tune=tune):
            outs = [ta.tree_attention_packed_pallas(qkv, kc, vc, jnp.int32(i), sl, mask,
                                                    num_heads=HQ, sm_scale=scale, **tune)
                    for i in range(LAYERS)]
            return qkv + sum(o.astype(jnp.float32).sum() for o in outs).astype(qkv.dtype) * 0

        one = ta.tree_attention_packed_pallas(qkv, kc, vc, jnp.int32(0), sl, mask, num_heads=HQ,
                                              sm_scale=scale, **tune)
        err = float(np.abs(np.asarray(one, np.float32) - np.asarray(ref, np.float32))[live].max())
        ms, _ = timed(layers, qkv, 1 if interpret else 10, 1 if interpret else 5)
        row[label] = {"us_per_call": ms * 1e3 / LAYERS, "max_err": err}
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--tiny", action="store_true", help="small shapes, interpret mode (CPU)")
    a = ap.parse_args(argv)
    variants = a.variants.split(",")
    gpu = jax.default_backend() == "gpu"
    dtype = jnp.bfloat16 if gpu else jnp.float32
    rows = [run_case(*c, variants, dtype, not gpu) for c in cases(a.tiny)]
    write_json("bench_prefill_attention", dict(device=device_name(), rows=rows))
    print(device_name(), "(us per call, 30 chained calls per program; max error vs reference)")
    print(f"{'case':26}" + "".join(f"{v:>16}" for v in variants))
    for r in rows:
        print(f"{r['case']:26}" + "".join(
            f"{r[v]['us_per_call']:>9.1f} ({r[v]['max_err']:.0e})" for v in variants))
    return rows


if __name__ == "__main__":
    main()
