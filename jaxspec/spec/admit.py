"""Admission: prefill new requests into chosen slots of a live batch state, between cycles.

The engine keeps one static-shape batch state (B slots) alive for its whole life. New requests are
prefilled into free slots without touching the others: the admitted slots are gathered along the
batch axis into an A-slot sub-state (A = a slot-count bucket), one prompt chunk is run over it,
and the sub-state is scattered back. Padding rows of a bucket carry the slot index B, which the
gather clips and the scatter drops, so they change nothing.

Chunks: a prompt of P tokens is prefilled in chunks of at most `chunk` rows, each at rows
start..start+n_valid-1 over the rows the earlier chunks wrote. The draft catch-up of a chunk
pairs the target feature at t with the token at t+1, so each chunk also gets `next_tok`, the
first token of the next chunk, or -1 on a request's last chunk, where the root (the first
generated token, the target's argmax after the prompt) takes its place.

Batch axes: found per leaf, not assumed. `batch_axes(make_state, B)` evaluates the state's shapes
for B and B+1 slots (`jax.eval_shape`, no memory) and marks the one axis that differs: KV caches
are [L, B, Hkv, T, D] (axis 1), per-slot vectors and tables [B, ...] (axis 0); a leaf without a
batch axis (a shared rng key) is marked -1 and left to the caller. So fields added to SpecState
later (per-slot sampling arrays, token counts) are carried along without changes here: on
admission they take the values `init_state` gives a fresh slot.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxspec.config import ModelConfig
from jaxspec.kv import KVCache
from jaxspec.models import llama
from jaxspec.spec import draft as draft_lib
from jaxspec.spec.config import SpecConfig
from jaxspec.spec.cycle import init_state
from pallas_kernels.kv_compact import kv_compact


def batch_axes(make_state, slots: int):
    """Pytree (the state's structure) of each leaf's batch axis, -1 where it has none."""
    a = jax.eval_shape(lambda: make_state(slots))
    b = jax.eval_shape(lambda: make_state(slots + 1))

    def axis(x, y):
        diff = [i for i, (p, q) in enumerate(zip(x.shape, y.shape)) if p != q]
        if len(diff) > 1 or (diff and (x.shape[diff[0]], y.shape[diff[0]]) != (slots, slots + 1)):
            raise ValueError(f"cannot tell the batch axis of a state leaf: {x.shape} vs {y.shape}")
        return diff[0] if diff else -1

    return jax.tree_util.tree_map(axis, a, b)


def take_slots(state, axes, slot_idx):
    """The sub-state of slots slot_idx [A] (indices >= B are clipped: padding rows)."""
    return jax.tree_util.tree_map(
        lambda x, ax: x if ax < 0 else jnp.take(x, slot_idx, axis=ax, mode="clip"), state, axes)


def put_slots(state, axes, slot_idx, sub):
    """Writes sub-state rows into slots slot_idx [A]; rows with an index >= B are dropped.
    Leaves without a batch axis keep the state's value."""
    def put(x, ax, s):
        if ax < 0:
            return x
        where = (slice(None),) * ax + (slot_idx,)
        return x.at[where].set(s.astype(x.dtype), mode="drop")

    return jax.tree_util.tree_map(put, state, axes, sub)


def _chunk_forward(params, cfg: ModelConfig, cache: KVCache, tokens, start, n_valid):
    """Target forward over one chunk at rows start.. of each slot of an A-slot cache.

    Returns (cache with n_valid rows appended at start, hidden [A, C, H])."""
    a, c = tokens.shape
    rows = jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32)[None], (a, c))
    hidden, k_new, v_new, _ = llama.forward(params, cfg, tokens, start[:, None] + rows, cache.k,
                                            cache.v, start, llama.causal_mask(a, c, n_valid))
    k, v = kv_compact(cache.k, cache.v, k_new, v_new, start, rows, n_valid)
    return KVCache(k, v, start + n_valid), hidden


def _last_row(x, n_valid):
    """x [A, C, ...] -> row n_valid - 1 of each slot [A, ...]."""
    idx = jnp.maximum(n_valid - 1, 0).reshape((-1, 1) + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, idx, axis=1)[:, 0]


def spec_admit(params, draft_params, state, slot_idx, tokens, start, n_valid, next_tok, *,
               cfg: ModelConfig, spec: SpecConfig, axes):
    """One prefill chunk of target and draft for A requests in slots slot_idx.

    slot_idx [A] int32 (B = padding); tokens [A, C] (padded); start [A] rows already prefilled;
    n_valid [A] rows in this chunk; next_tok [A] the token after the chunk, -1 on the last chunk.
    Returns (state, first [A]): the root (first generated token) on a last chunk, else -1.
    """
    a, c = tokens.shape
    sub = take_slots(state, axes, slot_idx)
    target, hidden = _chunk_forward(params, cfg, sub.target, tokens, start, n_valid)
    feats = llama.final_norm(params, cfg, hidden)                            # EAGLE-1 features
    root = jnp.argmax(llama.project_logits(params, _last_row(feats, n_valid)),
                      axis=-1).astype(jnp.int32)
    is_last = next_tok < 0
    rows = jnp.arange(c, dtype=jnp.int32)[None]
    shifted = jnp.concatenate([tokens[:, 1:], jnp.zeros((a, 1), tokens.dtype)], axis=1)
    shifted = jnp.where(rows == (n_valid - 1)[:, None],
                        jnp.where(is_last, root, next_tok)[:, None], shifted)
    dk, dv, seed = draft_lib.catch_up(params, draft_params, cfg, spec, sub.draft_k, sub.draft_v,
                                      start, feats, shifted, n_valid)
    # Fields this function does not know take a fresh slot's values; the fresh caches are dead
    # code (replaced below) and never materialize.
    fresh = init_state(cfg, spec, a, state.target.max_len, sub.draft_k.dtype)
    new = fresh.replace(target=target, draft_k=dk, draft_v=dv,
                        root=jnp.where(is_last, root, sub.root), seed=seed)
    return put_slots(state, axes, slot_idx, new), jnp.where(is_last, root, -1)


@functools.lru_cache(maxsize=None)
def jit_spec_admit(cfg: ModelConfig, spec: SpecConfig, slots: int, max_len: int, dtype):
    """spec_admit(params, draft_params, state, slot_idx, tokens, start, n_valid, next_tok);
    the state is donated. One jitted function per state shape; buckets are its input shapes."""
    axes = batch_axes(lambda b: init_state(cfg, spec, b, max_len, dtype), slots)
    return jax.jit(functools.partial(spec_admit, cfg=cfg, spec=spec, axes=axes),
                   donate_argnums=(2,))
