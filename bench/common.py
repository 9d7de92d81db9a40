"""Shared benchmark helpers: model shapes, copy bandwidth, timing."""
from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp

from jaxspec.config import ModelConfig

LLAMA3_8B = ModelConfig(arch="LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
                        intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                        head_dim=128, rope_theta=500000.0, max_position_embeddings=8192)
SMOLLM2_135M = ModelConfig(arch="LlamaForCausalLM", vocab_size=49152, hidden_size=576,
                           intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                           head_dim=64, rope_theta=100000.0, max_position_embeddings=8192,
                           tie_word_embeddings=True)
SHAPES = {"llama3-8b": LLAMA3_8B, "smollm2-135m": SMOLLM2_135M}


def copy_bandwidth(nbytes: int = 2 << 30, reps: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    f = jax.jit(lambda a: a + jnp.bfloat16(1))
    f(x).block_until_ready()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return 2 * nbytes / ts[len(ts) // 2]


def param_bytes(params) -> int:
    return sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(params))


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def write_json(name: str, obj) -> None:
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, name), "w") as f:
            json.dump(obj, f, indent=1)


def device_name() -> str:
    d = jax.devices()[0]
    return f"{d.platform}:{getattr(d, 'device_kind', '?')}"
