"""Tree attention on SmolLM2's shapes with short live prefixes in a long cache (issues 4, 8).

The engine's caches are `max_model_len` rows (2,048 by default) while MT-bench slots hold 100-400
live rows. The kernel's split count is static and comes from the cache's length, so a short
prefix is cut into 1-block splits and merged by a second kernel. This times one program of
L attention calls (one per layer, each feeding the next's queries, as in a decode step) for
the kernel's settings named by --variants, at several live lengths (equal, or spread from
live / 8 to 2 x live), next to the XLA reference in the same run; err is the largest
difference from the reference.

    python3 -m bench.bench_short_prefix [--batches 1,64] [--news 1,4,32] [--lens 128,256,512,1024]
        [--spread 0,1] [--variants default,s1,s2,s4] [--shape llama3-8b --layers 2 --cache 8192]
Writes $OUT/short_prefix.json.
"""
from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import SHAPES, timed, write_json
from pallas_kernels import tree_attention as ta


_KEYS = {"s": "num_splits", "r": "block_r", "w": "num_warps", "k": "block_k",
         "p": "num_stages"}


def _tuning(variant):
    """Kernel keywords of a variant: "default" (the kernel's own), or "+"-joined settings: "sN"
    (N splits), "rN" (N-row tiles), "wN" (N warps), "kN" (N-key blocks), "pN" (N pipeline
    stages); e.g. "s2+r64"."""
    if variant == "default":
        return {}
    return {_KEYS[part[0]]: int(part[1:]) for part in variant.split("+")}


def _program(c, tuning, layers, reference=False):
    """jit(q, kc, vc, lens, kn, vn, mask) -> q after `layers` attention calls."""
    d = c.head_dim

    def run(q, kc, vc, lens, kn, vn, mask):
        for layer in range(layers):
            if reference:
                q = ta.tree_attention_reference(q, kc, vc, layer, lens, kn, vn, mask,
                                                sm_scale=d ** -0.5)
            else:
                q = ta.tree_attention_pallas(q, kc, vc, jnp.int32(layer), lens, kn, vn, mask,
                                             sm_scale=d ** -0.5, **tuning)
        return q

    return jax.jit(run)


def _inputs(c, layers, b, n, t, live, spread, key):
    """Random inputs; every slot at `live` rows, or with `spread` lengths from live / 8 to
    2 x live (capped at the cache) in a fixed shuffled order."""
    ks = jax.random.split(key, 5)
    bf = jnp.bfloat16
    cache = (layers, b, c.num_kv_heads, t, c.head_dim)
    q = jax.random.normal(ks[0], (b, n, c.num_heads, c.head_dim), bf)
    kc = jax.random.normal(ks[1], cache, bf)
    vc = jax.random.normal(ks[2], cache, bf)
    kn = jax.random.normal(ks[3], (b, c.num_kv_heads, n, c.head_dim), bf)
    vn = jax.random.normal(ks[4], (b, c.num_kv_heads, n, c.head_dim), bf)
    lens = np.full((b,), live)
    if spread:
        lens = np.random.default_rng(0).permutation(np.linspace(max(1, live // 8), 2 * live, b))
    lens = jnp.asarray(np.minimum(lens.round(), t), jnp.int32)
    mask = jnp.tril(jnp.ones((n, n), bool))[None].repeat(b, 0)
    return q, kc, vc, lens, kn, vn, mask


def _time_variant(c, variant, layers, x, ref, iters):
    """(us a layer over `layers` chained calls, largest difference from the reference)."""
    tune = _tuning(variant)
    got = _program(c, tune, 1)(*x)
    err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - ref.astype(jnp.float32))))
    prog = _program(c, tune, layers)
    step = functools.partial(lambda p, xs, q: p(q, *xs[1:]), prog, x)
    ms, _ = timed(step, x[0], iters, 5)
    return round(ms * 1e3 / layers, 2), err


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--news", default="1,4,32")
    ap.add_argument("--lens", default="128,256,512,1024")
    ap.add_argument("--variants", default="default,s1,s2,s4",
                    help="default (the kernel's own), or settings joined by +: sN (N splits), "
                         "rN (row tile), wN (warps), kN (key block), pN (pipeline stages)")
    ap.add_argument("--cache", type=int, default=2048, help="cache rows (max_model_len)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=0, help="0: the model's")
    ap.add_argument("--spread", default="0", help="0,1: equal lengths and/or spread ones")
    args = ap.parse_args()
    ints = lambda s: [int(x) for x in s.split(",") if x]
    rows = []
    c = SHAPES[args.shape]
    layers = args.layers or c.num_layers
    for b in ints(args.batches):
        for n in ints(args.news):
            default = ta.default_config(b, n, c.num_heads, c.num_kv_heads, c.head_dim,
                                        args.cache)[2]
            for live, spread in [(v, s) for v in ints(args.lens) for s in ints(args.spread)]:
                x = _inputs(c, layers, b, n, args.cache, live, spread, jax.random.key(live))
                ref = _program(c, {}, 1, reference=True)(*x)
                line = {"shape": args.shape, "batch": b, "new": n, "live": live,
                        "spread": bool(spread), "default_splits": default}
                for v in args.variants.split(","):
                    try:
                        line[f"us_{v}"], line[f"err_{v}"] = _time_variant(c, v, layers, x, ref,
                                                                         args.iters)
                    except Exception as e:    # a setting the GPU cannot run (shared memory)
                        line[f"us_{v}"], line[f"err_{v}"] = None, f"{type(e).__name__}"
                ms, _ = timed(functools.partial(lambda p, xs, q: p(q, *xs[1:]),
                                                _program(c, {}, layers, reference=True), x),
                              x[0], args.iters, 5)
                line["us_xla"] = round(ms * 1e3 / layers, 2)
                rows.append(line)
                print(line, flush=True)
                write_json("short_prefix.json",
                           {"device": jax.devices()[0].device_kind, "rows": rows})


if __name__ == "__main__":
    main()
