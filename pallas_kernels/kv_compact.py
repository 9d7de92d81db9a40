"""KV compaction: write chosen rows of a forward pass's new K/V into each slot's cache rows.

Semantics (`kv_compact_reference`): for every layer l, slot b and d < count[b],
  cache[l, b, :, seq_lens[b] + d] = new[l, b, :, src_idx[b, d]]
and nothing else changes (rows past T are dropped, never wrapped). With src_idx = 0..N-1 this is
the plain KV append of prefill/decode; after a tree verify, src_idx is the accepted path.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _compact_one(cache, new, seq_lens, src_idx, count):
    # cache [L, B, Hkv, T, D]; new [L, B, Hkv, N, D]; src_idx [B, M]; count [B]
    t = cache.shape[3]
    m = src_idx.shape[1]
    rows = jnp.take_along_axis(new, src_idx[None, :, None, :, None], axis=3)  # [L,B,Hkv,M,D]
    d = jnp.arange(m)[None, :]
    dst = jnp.where(d < count[:, None], seq_lens[:, None] + d, t)             # t = dropped
    bidx = jnp.broadcast_to(jnp.arange(cache.shape[1])[:, None], dst.shape)
    vals = jnp.transpose(rows, (1, 3, 0, 2, 4))                               # [B,M,L,Hkv,D]
    return cache.at[:, bidx, :, dst].set(vals.astype(cache.dtype), mode="drop")


@jax.jit
def kv_compact_reference(
    k_cache,   # [L, B, Hkv, T, D]
    v_cache,   # [L, B, Hkv, T, D]
    k_new,     # [L, B, Hkv, N, D]
    v_new,     # [L, B, Hkv, N, D]
    seq_lens,  # [B] int32: first destination row per slot
    src_idx,   # [B, M] int32: rows of new to keep, in order
    count,     # [B] int32: how many of src_idx are live
):
    return (_compact_one(k_cache, k_new, seq_lens, src_idx, count),
            _compact_one(v_cache, v_new, seq_lens, src_idx, count))


def kv_compact(k_cache, v_cache, k_new, v_new, seq_lens, src_idx, count):
    """Dispatch: the Pallas kernel on GPU, the reference elsewhere."""
    return kv_compact_reference(k_cache, v_cache, k_new, v_new, seq_lens, src_idx, count)
