"""Plain decode speed against its bytes floor (issue: Foundation).

For each shape and batch: ms per decode step with the layers scanned (stacked weights) and
unrolled (per-layer weights), at 1 and `--steps` decode steps per dispatch, beside the floor
(weight bytes + live KV bytes) / copy bandwidth measured in the same run.
`--program engine` (default) times the engine's greedy program (`decode.plain_cycle` with
`sampling.LEAN`: no conditional, no sampling code); `decode_steps` the older entry, whose
sampling runs under a lax.cond on device flags (a host round trip per call on the GPU).
Usage: python bench/bench_decode.py [--tiny] [--program engine,decode_steps]
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import time

import jax
import jax.numpy as jnp

from bench.common import SHAPES, copy_bandwidth, device_name, param_bytes, write_json
from jaxspec.config import ModelConfig
from jaxspec.decode import decode_steps, init_plain_state, plain_cycle
from jaxspec.kv import KVCache, kv_bytes_per_token
from jaxspec.models import llama
from jaxspec.sampling import LEAN, SamplingParams, SlotSampling
from jaxspec.xla_options import gemm_backend, jit


def use_reference_kernels():
    """Routes the model's attention and KV writes to the pure-jnp references."""
    import jaxspec.decode
    from pallas_kernels import kv_compact, tree_attention
    llama.tree_attention = tree_attention.tree_attention_reference
    jaxspec.decode.kv_compact = kv_compact.kv_compact_reference


def random_cache(cfg, batch, ctx, max_len, dtype, key):
    shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    k = jax.random.normal(key, shape, dtype)
    return KVCache(k, k * 0.5, jnp.full((batch,), ctx, jnp.int32))


def _cache_len(ctx, steps_per_call, calls):
    """Rows for ctx committed tokens plus every step of the warm-up and timed calls."""
    return -(-(ctx + steps_per_call * (calls + 2)) // 128) * 128


def _seconds_per_step(call, carry, calls, steps_per_call):
    """call(carry) -> (carry, tokens): two warm calls (compile), then `calls` back to back,
    blocked at the end; seconds per decode step."""
    for _ in range(2):  # compile + warm
        carry, tok = call(carry)
    tok.block_until_ready()
    t0 = time.perf_counter()
    for _ in range(calls):
        carry, tok = call(carry)
    tok.block_until_ready()
    return (time.perf_counter() - t0) / (calls * steps_per_call)


def time_engine_program(params, cfg, batch, ctx, steps_per_call, calls, dtype):
    """The plain engine's greedy program (plain_cycle, LEAN), back to back, state donated."""
    max_len = _cache_len(ctx, steps_per_call, calls)
    state = init_plain_state(cfg, batch, 16, dtype).replace(
        target=random_cache(cfg, batch, ctx, max_len, dtype, jax.random.PRNGKey(1)))
    fn = jit(functools.partial(plain_cycle, cfg=cfg, n_steps=steps_per_call,
                               features=LEAN), rows=batch, donate_argnums=(2,))
    active = jnp.ones((batch,), bool)

    def call(state):
        state, out = fn(params, None, state, active)
        return state, out.tokens
    return _seconds_per_step(call, state, calls, steps_per_call)


def time_decode(params, cfg, batch, ctx, steps_per_call, calls, dtype):
    max_len = _cache_len(ctx, steps_per_call, calls)
    cache = random_cache(cfg, batch, ctx, max_len, dtype, jax.random.PRNGKey(1))
    sp = SlotSampling.from_params([SamplingParams()] * batch, batch)

    def call(carry):
        cache, tok, key = carry
        cache, out, key = decode_steps(params, cfg, cache, tok, sp, key, steps_per_call)
        return (cache, out[:, -1], key), out[:, -1]
    carry = (cache, jnp.ones((batch,), jnp.int32), jax.random.PRNGKey(0))
    return _seconds_per_step(call, carry, calls, steps_per_call)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run on a tiny shape")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--only", default="", help="comma list of case names")
    ap.add_argument("--attn", choices=("auto", "reference"), default="auto",
                    help="reference: force the pure-jnp attention and KV write (no Pallas)")
    ap.add_argument("--layouts", default="static,scan,leaves",
                    help="static: stacked weights, unrolled loop (the GPU default); scan: "
                         "lax.scan over stacked weights; leaves: one leaf per layer weight")
    ap.add_argument("--program", default="engine",
                    help="comma list: engine (plain_cycle, LEAN), decode_steps")
    ap.add_argument("--batches", default="",
                    help="comma list of batch sizes replacing each shape's default ones")
    ap.add_argument("--gemm", default="auto",
                    help="comma list of GEMM backends the engine program is compiled with "
                         "(xla_options.GEMM_BACKENDS: auto = the engine's rule)")
    args = ap.parse_args()
    if args.attn == "reference":
        use_reference_kernels()
    dtype = jnp.float32 if args.tiny else jnp.bfloat16
    bw = copy_bandwidth(64 << 20 if args.tiny else 2 << 30)
    cases = [("smollm2-135m", 1, 512), ("llama3-8b", 1, 512), ("llama3-8b", 64, 512)]
    if args.tiny:
        tiny = ModelConfig(arch="LlamaForCausalLM", vocab_size=512, hidden_size=64,
                           intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                           head_dim=16)
        SHAPES["tiny"] = tiny
        cases = [("tiny", 1, 64), ("tiny", 4, 64)]
    if args.batches:
        shapes = dict.fromkeys(c[0] for c in cases)
        cases = [(sh, int(b), 64 if args.tiny else 512) for sh in shapes
                 for b in args.batches.split(",")]
    rows = []
    for shape, batch, ctx in cases:
        if args.only and shape not in args.only.split(","):
            continue
        cfg = SHAPES[shape]
        stacked = llama.init_random_params(cfg, jax.random.PRNGKey(0), dtype=dtype)
        wbytes = param_bytes(stacked)
        kv = batch * ctx * kv_bytes_per_token(cfg, dtype)
        floor = (wbytes + kv) / bw
        for layout in args.layouts.split(","):
            params = llama.unstack_layers(stacked) if layout == "leaves" else stacked
            lcfg = cfg.with_layout(unroll_layers=layout == "static")
            for prog in args.program.split(","):
                timer = time_engine_program if prog == "engine" else time_decode
                # decode_steps is compiled at import, with the default options only
                for gemm in args.gemm.split(",") if prog == "engine" else ["default"]:
                    for spc in sorted({1, args.steps}):
                        with gemm_backend(gemm) if gemm != "default" else contextlib.nullcontext():
                            dt = timer(params, lcfg, batch, ctx, spc, max(4, 256 // spc), dtype)
                        rows.append(dict(attn=args.attn, shape=shape, batch=batch, ctx=ctx,
                                         layout=layout, program=prog, gemm=gemm,
                                         steps_per_call=spc, ms_per_step=dt * 1e3,
                                         floor_ms=floor * 1e3, ratio_to_floor=dt / floor))
                        print(rows[-1], flush=True)
            del params
        del stacked
    write_json("bench_decode.json", dict(device=device_name(), copy_bw=bw, rows=rows))
    print(f"\ndevice {device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s")
    print(f"{'shape':14s} {'B':>3s} {'ctx':>5s} {'layout':9s} {'program':12s} {'gemm':8s} "
          f"{'steps/call':>10s} {'ms/step':>8s} {'floor':>7s} {'x floor':>7s}")
    for r in rows:
        print(f"{r['shape']:14s} {r['batch']:3d} {r['ctx']:5d} {r['layout']:9s} {r['program']:12s} "
              f"{r['gemm']:8s} "
              f"{r['steps_per_call']:10d} {r['ms_per_step']:8.3f} {r['floor_ms']:7.3f} "
              f"{r['ratio_to_floor']:7.3f}")


if __name__ == "__main__":
    main()
