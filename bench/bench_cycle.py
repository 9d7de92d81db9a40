"""Cost of one speculative cycle at Llama-3-8B shape (random bf16 weights, batch 1 or --batch B,
~1K prefix each row).

For each (steps, topk, tokens): cycle time (median over repeats of back-to-back dispatches,
blocked at the end), its ratio to a plain decode step measured in the same run, and the bytes
floor (target weights + steps x (draft layer + lm_head)) / copy bandwidth, the bandwidth taken from
a large device-to-device copy in the same run. Then the draft steps and the catch-up alone, with
and without the topk == 1 argmax path and the catch-up's dead-row skip.

    python bench/bench_cycle.py            # GPU, Llama-3-8B shape
    python bench/bench_cycle.py --batch 64 --shapes "3,2,4"   # the same at batch 64
    python bench/bench_cycle.py --tiny     # any backend, tiny shape: checks the script runs
JSON goes to $OUT/bench_cycle.json when OUT is set.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (LLAMA3_8B, add_kernel_default, apply_kernel_defaults,  # noqa: E402
                          copy_bandwidth, timed)
from jaxspec.config import ModelConfig  # noqa: E402
from jaxspec.kv import KVCache  # noqa: E402
from jaxspec.models import llama  # noqa: E402
from jaxspec.sampling import FULL, LEAN  # noqa: E402
from jaxspec.spec import SpecConfig, init_state, jit_cycle  # noqa: E402
from jaxspec.spec import topk as topk_lib  # noqa: E402
from jaxspec.spec import draft as draft_lib  # noqa: E402
from jaxspec.xla_options import gemm_backend, jit  # noqa: E402
from pallas_kernels.kv_compact import kv_compact  # noqa: E402

TINY = ModelConfig(arch="LlamaForCausalLM", vocab_size=4096, hidden_size=256,
                   intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64)
SHAPES = [(1, 1, 2), (3, 1, 4), (5, 8, 32), (6, 10, 60)]


def random_params(cfg: ModelConfig, key, dtype, scale=0.02):
    """llama.py's layout, each leaf drawn straight in `dtype` (no fp32 copy of an 8B model)."""
    h, f, l, v = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.vocab_size
    qkv = cfg.q_size + 2 * cfg.kv_size
    shapes = {"embed": (v, h), "final_norm": (h,), "lm_head": (h, v),
              "layers": {"attn_norm": (l, h), "wqkv": (l, h, qkv), "wo": (l, cfg.q_size, h),
                         "mlp_norm": (l, h), "w_gate_up": (l, h, 2 * f), "w_down": (l, f, h)}}
    leaves, tree = jax.tree_util.tree_flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(key, len(leaves))
    out = []
    for k, shp in zip(keys, leaves):
        gen = jax.jit(lambda k, shp=shp: (scale * jax.random.normal(k, shp, jnp.float32)).astype(dtype))
        out.append(gen(k))
    p = jax.tree_util.tree_unflatten(tree, out)
    p["final_norm"] = jnp.ones_like(p["final_norm"])
    p["layers"]["attn_norm"] = jnp.ones_like(p["layers"]["attn_norm"])
    p["layers"]["mlp_norm"] = jnp.ones_like(p["layers"]["mlp_norm"])
    return p


def random_head(cfg: ModelConfig, key, dtype):
    one = dataclasses.replace(cfg, num_layers=1, vocab_size=8)
    lay = random_params(one, key, dtype)["layers"]
    k1, k2 = jax.random.split(jax.random.fold_in(key, 1))
    h = cfg.hidden_size
    return {"fc": (0.02 * jax.random.normal(k1, (2 * h, h))).astype(dtype),
            "fc_bias": (0.02 * jax.random.normal(k2, (h,))).astype(dtype), "layers": lay}


def nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))


def plain_decode_ms(cfg, params, prefix, max_len, n, repeats, batch=1):
    dt = params["embed"].dtype
    shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)

    # Weights are arguments, never closed over: a closure would bake them in as constants.
    @functools.partial(jit, rows=batch, donate_argnums=1)
    def step_fn(p, c):
        k, v, lens, tok = c
        h, kn, vn, _ = llama.forward(p, cfg, tok[:, None], lens[:, None], k, v, lens,
                                     jnp.ones((batch, 1, 1), bool))
        k, v = kv_compact(k, v, kn, vn, lens, jnp.zeros((batch, 1), jnp.int32),
                          jnp.ones((batch,), jnp.int32))
        nxt = jnp.argmax(llama.lm_head(p, cfg, h[:, 0]), -1).astype(jnp.int32)
        return k, v, lens + 1, nxt

    step = functools.partial(step_fn, params)

    reset = jax.jit(lambda c: (c[0], c[1], jnp.full((batch,), prefix, jnp.int32), c[3]),
                    donate_argnums=0)
    carry = (jnp.zeros(shape, dt), jnp.zeros(shape, dt), jnp.full((batch,), prefix, jnp.int32),
             jnp.zeros((batch,), jnp.int32))
    ms, _ = timed(step, carry, n, repeats, reset)
    return ms


def spec_state(cfg, spec, prefix, max_len, dtype, key, batch=1):
    st = init_state(cfg, spec, batch, max_len, dtype)
    k1, k2 = jax.random.split(key)
    seed = draft_lib.DraftSeed(
        jax.random.randint(k1, (batch, spec.topk), 0, cfg.vocab_size, jnp.int32),
        jnp.broadcast_to(-jnp.arange(spec.topk, dtype=jnp.float32), (batch, spec.topk)),
        (jax.random.normal(k2, (batch, cfg.hidden_size))).astype(dtype), st.seed.ctx)
    return st.replace(target=KVCache(st.target.k, st.target.v,
                                     jnp.full((batch,), prefix, jnp.int32)), seed=seed)


# The cycle's compiled variants: what the engine runs for greedy batches (LEAN) and for batches
# that sample, penalize or want logprobs (FULL), both without a conditional; `cond` tests device
# flags under lax.cond instead (a host round trip per conditional on the GPU).
VARIANTS = {"lean": LEAN, "full": FULL, "cond": None}


TOP_K_IMPLS = {
    "two_stage": lambda x, k: topk_lib.top_k(x, k),
    "chunk_max_sort": lambda x, k: topk_lib.top_k_by_chunk_max(x, k, small="sort"),
    "chunk_max_top_k": lambda x, k: topk_lib.top_k_by_chunk_max(x, k, small="top_k"),
}


@contextlib.contextmanager
def vocab_top_k_impl(name: str):
    """The draft's wide vocab top-k as TOP_K_IMPLS[name] (the chunked two-stage top-k used
    before top_k_by_chunk_max, or chunk maxima with sorts), for a same-run comparison; jit
    caches are cleared on entry and exit so the cycle is retraced."""
    from unittest import mock
    impl = TOP_K_IMPLS[name]
    wide = lambda x, k: (impl(x, k) if topk_lib.use_two_stage(x.shape[-1], k)  # noqa: E731
                         else jax.lax.top_k(x, k))
    jit_cycle.cache_clear()
    jax.clear_caches()
    with mock.patch.object(topk_lib, "vocab_top_k", wide):
        yield
    jit_cycle.cache_clear()
    jax.clear_caches()


def prefix_reset(prefix, batch=1):
    """A jitted, donating SpecState -> SpecState that sets the target's lens back to prefix,
    so back-to-back cycles all run over the same committed prefix."""
    return jax.jit(lambda s: s.replace(target=KVCache(s.target.k, s.target.v,
                                                      jnp.full((batch,), prefix, jnp.int32))),
                   donate_argnums=0)


def cycle_ms(cfg, params, head, spec, prefix, max_len, n, repeats, variant="lean", batch=1):
    cyc = jit_cycle(cfg, spec, features=VARIANTS[variant], slots=batch)
    active = jnp.ones((batch,), bool)
    st = spec_state(cfg, spec, prefix, max_len, params["embed"].dtype, jax.random.PRNGKey(3),
                    batch)
    ms, _ = timed(lambda s: cyc(params, head, s, active)[0], st, n, repeats,
                  prefix_reset(prefix, batch))
    return ms


def draft_steps_ms(cfg, params, head, spec, prefix, max_len, n, repeats, batch=1):
    st = spec_state(cfg, spec, prefix, max_len, params["embed"].dtype, jax.random.PRNGKey(4),
                    batch)
    f = jit(functools.partial(draft_lib.draft_tree, cfg=cfg, spec=spec), rows=batch)
    # The draft cache is read only; chaining the root token keeps dispatches dependent.
    step = lambda seed: seed._replace(tokens=f(params, head, draft_k=st.draft_k,  # noqa: E731
                                               draft_v=st.draft_v, lens=st.target.lens,
                                               seed=seed).tokens[:, :spec.topk])
    ms, _ = timed(step, st.seed, n, repeats)
    return ms


def catch_up_ms(cfg, params, head, spec, prefix, max_len, n, repeats, batch=1):
    st = spec_state(cfg, spec, prefix, max_len, params["embed"].dtype, jax.random.PRNGKey(5),
                    batch)
    r = spec.num_steps + 1
    feats = jnp.ones((batch, r, cfg.hidden_size), params["embed"].dtype)
    toks = jnp.zeros((batch, r), jnp.int32)
    # a full accept: every row live, all but one dead after KV
    n_live = jnp.full((batch,), r, jnp.int32)
    base = st.target.lens

    @functools.partial(jit, rows=batch, donate_argnums=2)
    def step_fn(p, hd, c):
        dk, dv, _ = c
        return draft_lib.catch_up(p, hd, cfg, spec, dk, dv, base, feats, toks, n_live)

    step = functools.partial(step_fn, params, head)
    ms, _ = timed(step, (st.draft_k, st.draft_v, st.seed), n, repeats)
    return ms


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shape (CPU check)")
    ap.add_argument("--prefix", type=int, default=None, help="committed tokens (default 1024)")
    ap.add_argument("--batch", type=int, default=1, help="slots, each over the same prefix")
    ap.add_argument("--cycles", type=int, default=None, help="dispatches per repeat")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--shapes", default=None, help="e.g. 1,1,2;3,1,4")
    ap.add_argument("--variants", default="lean",
                    help="comma list of cycle variants timed per shape: lean (the engine's "
                         "greedy program, the row's cycle_ms), full, cond (lax.cond on device "
                         "flags)")
    ap.add_argument("--top-k-impls", default="",
                    help="comma list of TOP_K_IMPLS (two_stage, chunk_max_sort, "
                         "chunk_max_top_k): also time each tree (topk > 1) cycle with that "
                         "vocab top-k")
    ap.add_argument("--gemm", default="auto",
                    help="comma list of GEMM backends (xla_options.GEMM_BACKENDS); the first "
                         "gives the row's figures, the others are timed beside it: plain decode "
                         "and each cycle variant")
    ap.add_argument("--no-ablation", action="store_true",
                    help="skip the argmax / dead-row ablations")
    add_kernel_default(ap)
    a = ap.parse_args(argv)
    settings = apply_kernel_defaults(a)
    cfg = TINY if a.tiny else LLAMA3_8B
    # GPU: the unrolled layer loop (lax.scan copies each layer's weights out every step).
    cfg = cfg.with_layout(unroll_layers=jax.default_backend() == "gpu")
    dtype = jnp.float32 if a.tiny and jax.default_backend() == "cpu" else jnp.bfloat16
    prefix = a.prefix or (128 if a.tiny else 1024)
    n = a.cycles or (5 if a.tiny else 30)
    repeats = a.repeats or (3 if a.tiny else 7)
    shapes = ([tuple(int(x) for x in s.split(",")) for s in a.shapes.split(";")]
              if a.shapes else SHAPES)
    max_len = prefix + 128

    key = jax.random.PRNGKey(0)
    params = random_params(cfg, key, dtype)
    head = random_head(cfg, jax.random.fold_in(key, 1), dtype)
    target_read = nbytes(params) - nbytes(params["embed"])   # a step gathers rows, not the table
    lm_head_b = nbytes(params["lm_head"])
    draft_layer_b = nbytes(head)
    bw = copy_bandwidth((64 << 20) if a.tiny else (2 << 30), 10 if a.tiny else 20, repeats)
    res = {"device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
           "jax": jax.__version__, "model": "tiny" if a.tiny else "llama3-8b-shape",
           "dtype": jnp.dtype(dtype).name, "batch": a.batch, "prefix": prefix,
           "copy_bw_GBps": bw / 1e9, "target_read_bytes": target_read,
           "target_all_bytes": nbytes(params), "draft_layer_bytes": draft_layer_b,
           "lm_head_bytes": lm_head_b, "kernel_defaults": settings, "cycles": []}
    print(f"# {res['device']} {res['model']} {res['dtype']} batch {a.batch} prefix {prefix}; copy "
          f"{bw / 1e9:.0f} GB/s; target {target_read / 1e9:.2f} GB, draft layer "
          f"{draft_layer_b / 1e9:.3f} GB, lm_head {lm_head_b / 1e9:.3f} GB", flush=True)

    gemms = a.gemm.split(",")
    with gemm_backend(gemms[0]):
        decode = plain_decode_ms(cfg, params, prefix, max_len, n, repeats, batch=a.batch)
    res["decode_ms"], res["gemm"] = decode, gemms[0]
    for g in gemms[1:]:
        with gemm_backend(g):
            res[f"decode_{g}_ms"] = plain_decode_ms(cfg, params, prefix, max_len, n, repeats,
                                                    batch=a.batch)
        print(f"# plain decode with {g} GEMMs {res[f'decode_{g}_ms']:.3f} ms", flush=True)
    res["decode_floor_ms"] = target_read / bw * 1e3
    print(f"# plain decode {decode:.3f} ms (floor {res['decode_floor_ms']:.3f})", flush=True)

    for s, k, t in shapes:
        spec = SpecConfig(s, k, t)
        row = {"shape": [s, k, t]}
        variants = a.variants.split(",")
        for v in variants:
            with gemm_backend(gemms[0]):
                row[f"cycle_{v}_ms"] = cycle_ms(cfg, params, head, spec, prefix, max_len, n,
                                                repeats, v, batch=a.batch)
            for g in gemms[1:]:
                with gemm_backend(g):
                    row[f"cycle_{v}_{g}_ms"] = cycle_ms(cfg, params, head, spec, prefix,
                                                        max_len, n, repeats, v, batch=a.batch)
            for impl in (a.top_k_impls.split(",") if a.top_k_impls and k > 1 else []):
                with vocab_top_k_impl(impl):
                    row[f"cycle_{v}_{impl}_ms"] = cycle_ms(cfg, params, head, spec, prefix,
                                                           max_len, n, repeats, v, batch=a.batch)
        row["cycle_ms"] = row[f"cycle_{variants[0]}_ms"]
        row["variant"] = variants[0]
        row["floor_ms"] = (target_read + s * (draft_layer_b + lm_head_b)) / bw * 1e3
        row["cycle_over_decode"] = row["cycle_ms"] / decode
        row["floor_over_decode"] = row["floor_ms"] / decode
        # The ratio, and the same with the floor read at the decode step's own rate: a
        # device whose weight reads outrun its copy figure (the H200: decode 0.95x its floor)
        # would otherwise flatter every cycle.
        row["cycle_over_floor"] = row["cycle_ms"] / row["floor_ms"]
        row["cycle_over_decode_rate_floor"] = (row["cycle_over_floor"]
                                               / (decode / res["decode_floor_ms"]))
        if not a.no_ablation:
            off_skip = dataclasses.replace(spec, skip_dead_rows=False)
            row["catch_up_ms"] = catch_up_ms(cfg, params, head, spec, prefix, max_len, n,
                                             repeats, batch=a.batch)
            row["catch_up_no_skip_ms"] = catch_up_ms(cfg, params, head, off_skip, prefix,
                                                     max_len, n, repeats, batch=a.batch)
            row["cycle_no_skip_ms"] = cycle_ms(cfg, params, head, off_skip, prefix, max_len, n,
                                               repeats, batch=a.batch)
            if s > 1:
                row["draft_steps_ms"] = draft_steps_ms(cfg, params, head, spec, prefix, max_len,
                                                       n, repeats, batch=a.batch)
            if k == 1:
                soft = dataclasses.replace(spec, argmax_topk1=False)
                row["catch_up_softmax_ms"] = catch_up_ms(cfg, params, head, soft, prefix,
                                                         max_len, n, repeats, batch=a.batch)
                if s > 1:
                    row["draft_steps_softmax_ms"] = draft_steps_ms(
                        cfg, params, head, soft, prefix, max_len, n, repeats, batch=a.batch)
                both = dataclasses.replace(spec, argmax_topk1=False, skip_dead_rows=False)
                row["cycle_no_opt_ms"] = cycle_ms(cfg, params, head, both, prefix, max_len, n,
                                                  repeats, batch=a.batch)
        res["cycles"].append(row)
        print("# " + json.dumps(row), flush=True)

    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        Path(os.environ["OUT"], f"bench_cycle{'' if a.batch == 1 else f'_b{a.batch}'}.json").write_text(json.dumps(res, indent=1))

    def f(row, key):
        return f"{row[key]:8.3f}" if key in row else "       -"

    for g in gemms[1:]:
        print(f"(decode with {g} GEMMs {res[f'decode_{g}_ms']:.3f} ms)")
    print(f"\ndecode ({gemms[0]} GEMMs) {decode:.3f} ms  floor {res['decode_floor_ms']:.3f} ms  copy "
          f"{bw / 1e9:.0f} GB/s  ({res['device']}, {res['model']}, batch {a.batch}, prefix {prefix})")
    print(" S  K   N |  cycle ms  x decode |  floor ms  x decode | x floor (at decode's rate) | "
          "draft ms (softmax) | catch-up ms (no skip) (softmax) | cycle no-skip | cycle no-opt")
    for row in res["cycles"]:
        s, k, t = row["shape"]
        others = [v for v in list(VARIANTS) + [f"{x}_{i}" for x in VARIANTS
                                               for i in list(TOP_K_IMPLS) + gemms[1:]]
                  if f"cycle_{v}_ms" in row and v != row["variant"]]
        if others:
            print(f"   ({row['variant']} cycle; " + ", ".join(
                f"{v} {row[f'cycle_{v}_ms']:.3f} ms" for v in others) + ")")
        print(f"{s:2d} {k:2d} {t:3d} | {row['cycle_ms']:9.3f} {row['cycle_over_decode']:8.2f} | "
              f"{row['floor_ms']:9.3f} {row['floor_over_decode']:8.2f} | "
              f"{row['cycle_over_floor']:7.3f} ({row['cycle_over_decode_rate_floor']:.3f})"
              f"{'':12s} | {f(row, 'draft_steps_ms')} {f(row, 'draft_steps_softmax_ms')} | "
              f"{f(row, 'catch_up_ms')} {f(row, 'catch_up_no_skip_ms')} "
              f"{f(row, 'catch_up_softmax_ms')} | {f(row, 'cycle_no_skip_ms')} | "
              f"{f(row, 'cycle_no_opt_ms')}")
    return res


if __name__ == "__main__":
    main()
