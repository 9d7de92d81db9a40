"""The context vocabulary: tokens of a request's own text that its restricted draft may propose.

A head cut to the K most frequent tokens (`draft_vocab`) can never draft a token outside them,
and the tokens it misses are mostly the topic's own words: on MT-bench (SmolLM2's greedy answers
to the 80 first turns) 3.6% of the answer tokens lie outside the shipped 16,384, and 72% of
those already occurred in the prompt or earlier in the answer (41% in the prompt alone). So each
slot keeps the last E distinct such tokens of its context (prompt and output), and the draft
scores them beside the K: E more lm_head columns, gathered per slot, a few hundred KB a draft
forward at E = 256 where the K columns are 19 MB. The verify is unchanged, so the output is
still exactly the target's; only what the draft can propose grows. Measured on the H200
(bench/RESULTS.md, thirty-third set), E = 256 gives back most of the cut's acceptance (tree
tau 4.321 -> 4.600 against 4.654 uncut) but adds ~25 small kernels to a batch-1 cycle (68 us,
6%), more than its tau returns there, so `LLM` leaves it off unless asked.

Layout: ctx [B, E] int32 target ids, -1 for an empty entry, right-aligned (oldest first, the
newest last). A head with a context vocabulary carries `draft_in_vocab` [V] bool (the K ids)
and `draft_context` [E] int32 (an empty row, -1s: its shape is E); `draft_vocab.restrict` adds
both. A head without them has E = 0 and an unused ctx [B, 1] of -1: never a zero-size array,
whose sharding jax drops (a data-parallel engine then finds its state sharded otherwise than
its programs were compiled for).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

# Sequences up to this long are deduplicated by pairwise comparisons (the cycle's few emitted
# tokens), longer ones (prompt chunks) by a sort.
PAIRWISE_MAX = 32


def size(draft_params) -> int:
    """E of a head (0: no context vocabulary)."""
    if not isinstance(draft_params, dict) or "draft_context" not in draft_params:
        return 0
    return int(draft_params["draft_context"].shape[0])


def empty(batch: int, e: int):
    """An empty context: [batch, max(E, 1)] of -1 (see the module notes)."""
    return jnp.full((batch, max(e, 1)), -1, jnp.int32)


def fresh(draft_params, batch: int):
    """An empty context for `batch` slots of this head (`empty`)."""
    return empty(batch, size(draft_params))


def _first_occurrences(tokens, new):
    """[B, R] bool: position i is new and no earlier new position holds the same token."""
    b, r = tokens.shape
    if r <= PAIRWISE_MAX:
        earlier = jnp.tril(jnp.ones((r, r), bool), k=-1)[None]             # [1, i, j]: j < i
        same = (tokens[:, :, None] == tokens[:, None, :]) & new[:, None, :] & earlier
        return new & ~jnp.any(same, axis=-1)
    key = jnp.where(new, tokens, jnp.iinfo(jnp.int32).max)
    order = jnp.argsort(key, axis=1, stable=True)              # equal tokens: earliest first
    st = jnp.take_along_axis(key, order, axis=1)
    first = jnp.concatenate([jnp.ones((b, 1), bool), st[:, 1:] != st[:, :-1]], axis=1)
    back = jnp.zeros((b, r), bool).at[jnp.arange(b)[:, None], order].set(first)
    return new & back


def update(ctx, tokens, live, in_vocab):
    """ctx [B, E] after the context tokens [B, R] where live [B, R] (bool): the live tokens
    outside the draft vocabulary (in_vocab [V] bool) that ctx does not hold yet are appended in
    order of first appearance; past E entries the oldest give way."""
    b, e = ctx.shape
    if e == 0:
        return ctx
    v = in_vocab.shape[0]
    tokens = tokens.astype(jnp.int32)
    valid = live & (tokens >= 0) & (tokens < v)
    new = valid & ~in_vocab[jnp.clip(tokens, 0, v - 1)]
    new = new & ~jnp.any(tokens[:, :, None] == ctx[:, None, :], axis=-1)
    new = _first_occurrences(tokens, new)
    both = jnp.concatenate([ctx, jnp.where(new, tokens, -1)], axis=1)    # [B, E + R]
    keep = both >= 0
    after = jnp.cumsum(keep[:, ::-1], axis=1)[:, ::-1]      # kept entries at or after each one
    dest = jnp.where(keep, e - after, e)                     # the newest kept entry -> E - 1
    dest = jnp.where(dest >= 0, dest, e)                     # older than the last E: dropped
    out = jnp.full((b, e), -1, jnp.int32)
    return out.at[jnp.arange(b)[:, None], dest].set(both, mode="drop")


def logits(params, hidden, ctx):
    """Draft hidden [B, ..., H] -> fp32 logits [B, ..., E] of each slot's context ids through
    the target's lm_head (-inf at empty entries)."""
    b, e = ctx.shape
    ids = jnp.maximum(ctx, 0)
    if "lm_head" in params:
        w = jnp.take(params["lm_head"], ids, axis=1).transpose(1, 2, 0)          # [B, E, H]
    else:
        w = jnp.take(params["embed"], ids, axis=0)                                # tied
    flat = hidden.reshape(b, -1, hidden.shape[-1])
    x = jnp.einsum("brh,beh->bre", flat, w.astype(hidden.dtype),
                   preferred_element_type=jnp.float32).reshape(hidden.shape[:-1] + (e,))
    valid = (ctx >= 0).reshape((b,) + (1,) * (hidden.ndim - 2) + (e,))
    return jnp.where(valid, x, -jnp.inf)


def ids_like(ctx, shape):
    """ctx [B, E] broadcast to [B, ..., E] (the leading axes of `shape`, then E)."""
    b, e = ctx.shape
    return jnp.broadcast_to(ctx.reshape((b,) + (1,) * (len(shape) - 2) + (e,)),
                            tuple(shape[:-1]) + (e,))
