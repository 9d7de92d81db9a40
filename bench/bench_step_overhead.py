"""Where a decode step's time goes beyond its weight read: one harness, several step forms.

At the Llama-3-8B shape on the H100, `bench_decode` (through `decode_steps`) measured 7.05 ms
per batch-1 step where `bench_cycle`'s bare step took 5.71 ms, and `decode_steps` with 32 steps
per call took 15.2 ms per step. This times, in one process and against one copy-bandwidth
figure, each ingredient separately:

  bare          forward + lm_head + argmax + KV write, one jitted step (bench_cycle's form)
  bare+cond     the same, token chosen through sampling's lax.cond (any slot sampled?)
  decode_steps  jaxspec.decode.decode_steps with n steps per call (n = 1, 16)
  cycle         the speculative cycle (3, 1, 4), general vs greedy_only variant

    python -m bench.bench_step_overhead [--tiny] [--prefix 512] [--n 20] [--repeats 5]
"""
from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from bench.bench_cycle import TINY, random_head, random_params, spec_state
from bench.common import LLAMA3_8B, copy_bandwidth, device_name, timed, write_json
from jaxspec.decode import decode_steps
from jaxspec.kv import KVCache
from jaxspec.models import llama
from jaxspec.sampling import SamplingParams, SlotSampling, sample
from jaxspec.spec import SpecConfig, jit_cycle
from jaxspec.xla_options import jit
from pallas_kernels.kv_compact import kv_compact


def bare_step(cfg, with_cond: bool):
    """One decode step over a batch-1 cache carried as (k, v, lens, tok, key)."""
    sp = SlotSampling.from_params([SamplingParams()], 1)

    @functools.partial(jit, rows=1, donate_argnums=1)
    def step(p, c):
        k, v, lens, tok, key = c
        h, kn, vn, _ = llama.forward(p, cfg, tok[:, None], lens[:, None], k, v, lens,
                                     jnp.ones((1, 1, 1), bool))
        k, v = kv_compact(k, v, kn, vn, lens, jnp.zeros((1, 1), jnp.int32),
                          jnp.ones((1,), jnp.int32))
        logits = llama.lm_head(p, cfg, h[:, 0])
        if with_cond:
            key, sub = jax.random.split(key)
            nxt = sample(logits, sp, sub)
        else:
            nxt = jnp.argmax(logits, -1).astype(jnp.int32)
        return k, v, lens + 1, nxt, key

    return step


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shape (CPU check)")
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--n", type=int, default=None, help="dispatches per repeat")
    ap.add_argument("--repeats", type=int, default=None)
    a = ap.parse_args(argv)
    gpu = jax.default_backend() == "gpu"
    cfg = (TINY if a.tiny else LLAMA3_8B).with_layout(unroll_layers=gpu)
    dtype = jnp.bfloat16 if gpu else jnp.float32
    n, repeats = a.n or (5 if a.tiny else 20), a.repeats or (3 if a.tiny else 5)
    max_len = a.prefix + 16 * (n + 2) * (repeats + 2) + 128
    params = random_params(cfg, jax.random.PRNGKey(0), dtype)
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params))
    floor_ms = (weights - params["embed"].size * params["embed"].dtype.itemsize) / \
        copy_bandwidth((64 << 20) if a.tiny else (2 << 30)) * 1e3
    shape = (cfg.num_layers, 1, cfg.num_kv_heads, max_len, cfg.head_dim)
    reset_lens = jnp.full((1,), a.prefix, jnp.int32)
    rows = {}

    for name, with_cond in (("bare", False), ("bare+cond", True)):
        step = functools.partial(bare_step(cfg, with_cond), params)
        carry = (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), reset_lens,
                 jnp.zeros((1,), jnp.int32), jax.random.PRNGKey(1))
        reset = jax.jit(lambda c: (c[0], c[1], reset_lens) + tuple(c[3:]), donate_argnums=0)
        rows[name], _ = timed(step, carry, n, repeats, reset)

    sp = SlotSampling.from_params([SamplingParams()], 1)
    for steps in (1, 16):
        def call(c, steps=steps):
            cache, tok, key = c
            cache, out, key = decode_steps(params, cfg, cache, tok, sp, key, steps)
            return cache, out[:, -1], key
        carry = (KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), reset_lens),
                 jnp.zeros((1,), jnp.int32), jax.random.PRNGKey(2))
        reset = jax.jit(lambda c: (KVCache(c[0].k, c[0].v, reset_lens), c[1], c[2]),
                        donate_argnums=0)
        ms, _ = timed(call, carry, max(2, n // steps), repeats, reset)
        rows[f"decode_steps x{steps}"] = ms / steps

    spec = SpecConfig(3, 1, 4)
    head = random_head(cfg, jax.random.PRNGKey(4), dtype)
    active = jnp.ones((1,), bool)
    for greedy_only in (False, True):
        cyc = jit_cycle(cfg, spec, greedy_only)
        st = spec_state(cfg, spec, a.prefix, max_len, dtype, jax.random.PRNGKey(3))
        reset = jax.jit(lambda s: s.replace(target=KVCache(s.target.k, s.target.v, reset_lens)),
                        donate_argnums=0)
        rows[f"cycle (3,1,4){' greedy_only' if greedy_only else ''}"], _ = timed(
            lambda s, cyc=cyc: cyc(params, head, s, active)[0], st, n, repeats, reset)

    print(f"\n{device_name()}  {'tiny' if a.tiny else 'llama3-8b'} batch 1 prefix {a.prefix}; "
          f"weights floor {floor_ms:.3f} ms")
    for k, v in rows.items():
        print(f"{k:28s} {v:8.3f} ms  {v / floor_ms:5.2f}x floor")
    write_json("bench_step_overhead.json", dict(device=device_name(), floor_ms=floor_ms,
                                                prefix=a.prefix, ms=rows))


if __name__ == "__main__":
    main()
