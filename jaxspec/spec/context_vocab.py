"""The context vocabulary: tokens of a request's own text that its restricted draft may propose.

A head cut to the K most frequent tokens (`draft_vocab`) can never draft a token outside them,
and the tokens it misses are mostly the topic's own words, most of which already occurred in
the prompt or earlier in the answer. So the last E of a slot's K drafted tokens are its own:
the last E distinct tokens of its context (prompt and output) outside the K - E fixed ones. A
fresh slot starts with the ranking's tokens K - E .. K - 1 there (the "fillers", rarest
oldest), so before its text brings rarer words it drafts exactly the K of the ranking. The
verify is unchanged, so the output is still exactly the target's; only what the draft can
propose changes.

Cost: the draft's logits stay one [.., K] row per draft forward, so its top-k is the same as
without a context. The slot's E lm_head rows are gathered once per catch-up and once per draft
tree (`rows`), scored by a small batched product and written over the row's last E entries
(`place`); the picks then map back through the slot's ids (`to_target`): a few percent of a
batch-1 cycle, for more accepted tokens a cycle. Scoring the E beside the K and merging the two
selections instead costs about twice as much.

Layout: ctx [B, E] int32 target ids, right-aligned (oldest first, the newest last), -1 for an
empty entry (scored -inf; only a state built without the head's fillers has them). A head with
a context vocabulary carries `draft_in_vocab` [V] bool (the K - E fixed ids) and
`draft_context` [E] int32 (the fillers); `draft_vocab.restrict` adds both. A head without them
has E = 0 and an unused ctx [B, 1] of -1: never a zero-size array, whose sharding jax drops (a
data-parallel engine then finds its state sharded otherwise than its programs were compiled
for).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

# Sequences up to this long are deduplicated and compacted by pairwise comparisons (the cycle's
# few emitted tokens), longer ones (prompt chunks) by a sort and a scatter.
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
    """A new request's context for `batch` slots: the head's fillers ([B, 1] of -1 without a
    context vocabulary)."""
    if size(draft_params) == 0:
        return empty(batch, 0)
    fill = draft_params["draft_context"].astype(jnp.int32)
    return jnp.broadcast_to(fill[None], (batch, fill.shape[0]))


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


def _compact(tokens, new):
    """[B, R]: the new tokens in order at the front, -1 after them."""
    b, r = tokens.shape
    place = jnp.cumsum(new, axis=1, dtype=jnp.int32) - 1
    if r <= PAIRWISE_MAX:
        hit = new[:, None, :] & (place[:, None, :] == jnp.arange(r, dtype=jnp.int32)[None, :, None])
        return jnp.where(jnp.any(hit, -1), jnp.sum(jnp.where(hit, tokens[:, None, :], 0), -1), -1)
    dest = jnp.where(new, place, r)
    return jnp.full((b, r), -1, jnp.int32).at[jnp.arange(b)[:, None], dest].set(tokens,
                                                                                mode="drop")


def update(ctx, tokens, live, in_vocab):
    """ctx [B, E] after the context tokens [B, R] where live [B, R] (bool): the live tokens
    outside the fixed vocabulary (in_vocab [V] bool) that ctx does not hold yet are appended in
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
    # ctx is right-aligned, so the n new tokens after it end at E + n: the last E are the E
    # entries from n on (the oldest, or empty entries, drop first).
    both = jnp.concatenate([ctx, _compact(tokens, new)], axis=1)          # [B, E + R]
    n = jnp.sum(new, axis=1, dtype=jnp.int32)
    return jnp.take_along_axis(both, n[:, None] + jnp.arange(e, dtype=jnp.int32)[None], axis=1)


def rows(params, ctx, dtype):
    """The lm_head rows of each slot's context ids: [B, E, H] in dtype."""
    ids = jnp.maximum(ctx, 0)
    if "lm_head" in params:
        return jnp.take(params["lm_head"], ids, axis=1).transpose(1, 2, 0).astype(dtype)
    return jnp.take(params["embed"], ids, axis=0).astype(dtype)                 # tied


def place(logits, hidden, w, ctx):
    """The draft vocabulary's fp32 logits [B, ..., K] with their last E entries replaced by the
    context's (hidden [B, ..., H] through its rows w [B, E, H]; -inf at empty entries)."""
    b, e = ctx.shape
    flat = hidden.reshape(b, -1, hidden.shape[-1])
    x = jnp.einsum("brh,beh->bre", flat, w, preferred_element_type=jnp.float32)
    x = jnp.where((ctx >= 0)[:, None, :], x, -jnp.inf).reshape(hidden.shape[:-1] + (e,))
    return jax.lax.dynamic_update_slice_in_dim(logits, x.astype(logits.dtype),
                                               logits.shape[-1] - e, axis=-1)


def to_target(tok, fixed_ids, ctx):
    """Picks tok [B, ..., k] into the [.., K] row of `place` -> target ids: the first K - E
    through fixed_ids [K] (its last E entries unused), the last E through the slot's ctx."""
    b, e = ctx.shape
    kf = fixed_ids.shape[0] - e
    cids = jnp.broadcast_to(ctx.reshape((b,) + (1,) * (tok.ndim - 2) + (e,)),
                            tok.shape[:-1] + (e,))
    from_ctx = jnp.take_along_axis(cids, jnp.clip(tok - kf, 0, e - 1), axis=-1)
    return jnp.where(tok < kf, fixed_ids[jnp.minimum(tok, kf - 1)], from_ctx)
