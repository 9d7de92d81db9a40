"""KV cache: static-shape arrays for all layers plus per-slot lengths, updated in place."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.config import ConfigError, ModelConfig


@struct.dataclass
class KVCache:
    """k, v [L, B, Hkv, T, D]; lens [B] int32 = committed rows per slot."""
    k: jax.Array
    v: jax.Array
    lens: jax.Array

    @property
    def max_len(self) -> int:
        return self.k.shape[3]


def kv_bytes_per_token(cfg: ModelConfig, dtype) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize


def max_len_for_budget(cfg: ModelConfig, slots: int, budget_bytes: int, dtype,
                       multiple: int = 128) -> int:
    """Longest per-slot length (rounded down to `multiple`) whose cache fits the budget."""
    per_slot = budget_bytes // (slots * kv_bytes_per_token(cfg, dtype))
    t = (per_slot // multiple) * multiple
    if t <= 0:
        raise ConfigError(
            f"KV budget of {budget_bytes / 2**20:.1f} MiB cannot hold {multiple} tokens for "
            f"{slots} slots ({kv_bytes_per_token(cfg, dtype)} bytes per token)")
    return int(t)


def init_cache(cfg: ModelConfig, slots: int, max_len: int, dtype) -> KVCache:
    shape = (cfg.num_layers, slots, cfg.num_kv_heads, max_len, cfg.head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((slots,), jnp.int32))
