"""Packed first chunks: an admission's newcomers laid end to end in one row of tokens.

The padded first chunk (`admit.spec_admit` with kv_rows) runs A slots x W tokens, W the bucket of
the longest prompt and A the slot bucket of the count: for groups of chat prompts that is 3-8x
their tokens (bench/RESULTS.md, sixteenth set), and at batch 64 the admissions are the largest
part of a step after the cycles. Here the first chunks of A requests fill one row of T tokens
(T a bucket of their sum), each token attends only to the earlier tokens of its own request (a
block-diagonal causal mask), and each token's K/V goes straight to its slot's row. Only first
chunks are packed (every request starts at row 0); later chunks of long prompts keep the padded
general form.

Layout of a pack: request a holds tokens first[a] .. first[a] + n_valid[a] - 1 with first the
exclusive cumulative sum of n_valid (requests in order; padding requests, n_valid 0, at the end);
tokens past the sum are padding and belong to request A, which every write drops.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxspec.config import ModelConfig
from jaxspec.kv import KVCache
from jaxspec.models import llama
from jaxspec.sampling import FULL, Features, TokenCounts
from jaxspec.spec import draft as draft_lib
from jaxspec.spec.admit import AdmitArgs, admit_sampling, put_slots, take_slots
from jaxspec.spec.config import SpecConfig


class PackLayout(NamedTuple):
    seg: jax.Array    # [T] int32 request of each token; A for padding
    pos: jax.Array    # [T] int32 row within its request (its RoPE position and cache row)
    last: jax.Array   # [A] int32 index of each request's last token (0 for padding requests)

    @property
    def mask(self):
        """[T, T]: token i sees token j of its own request at or before its row (padding tokens
        see the padding before them, so no row is empty)."""
        return (self.seg[:, None] == self.seg[None, :]) & (self.pos[None, :] <= self.pos[:, None])


def pack_layout(n_valid, t: int) -> PackLayout:
    """n_valid [A] tokens per request (> 0, then zeros) -> the layout of a T-token pack."""
    ends = jnp.cumsum(n_valid)
    idx = jnp.arange(t, dtype=jnp.int32)
    # compare_all, not the default binary search: that is a loop on device values, and on the
    # GPU a loop's trip makes the host wait (an A x T compare is nothing beside the forward)
    seg = jnp.searchsorted(ends, idx, side="right", method="compare_all").astype(jnp.int32)
    start = jnp.take(ends - n_valid, seg, mode="fill", fill_value=0)
    pos = jnp.where(seg < n_valid.shape[0], idx - start, idx - ends[-1]).astype(jnp.int32)
    return PackLayout(seg, pos, jnp.maximum(ends - 1, 0).astype(jnp.int32))


def scatter_rows(cache, new, slot_tok, pos):
    """cache [L, B, H, Tc, D] with new [L, 1, H, T, D]'s token t written at (slot_tok[t],
    pos[t]); slot_tok B (padding, or a slot another device owns) is dropped."""
    vals = new[:, 0].transpose(2, 0, 1, 3).astype(cache.dtype)            # [T, L, H, D]
    return cache.at[:, slot_tok, :, pos, :].set(vals, mode="drop")


def token_slots(slot_idx, lay: PackLayout, slots: int):
    """[T] the slot each token's K/V goes to; `slots` (dropped) for padding tokens."""
    return jnp.take(slot_idx, lay.seg, mode="fill", fill_value=slots)


def packed_history(hist: TokenCounts, tokens, lay: PackLayout, n_prompt) -> TokenCounts:
    """The counts of A requests after their first chunks (`admit.chunk_history` for a pack):
    from empty, prompt tokens set prompt_seen, later ones (a resumed request's output) count."""
    a, v = hist.counts.shape
    npr = jnp.take(n_prompt, lay.seg, mode="fill", fill_value=0)
    seen = jnp.zeros_like(hist.prompt_seen).at[lay.seg, jnp.where(lay.pos < npr, tokens, v)].set(
        True, mode="drop")
    counts = jnp.zeros_like(hist.counts).at[lay.seg, jnp.where(lay.pos >= npr, tokens, v)].add(
        1, mode="drop")
    return TokenCounts(seen, counts)


def packed_forward(params, cfg: ModelConfig, cache: KVCache, tokens, lay: PackLayout, slot_tok,
                   capture_layers=()):
    """Target forward over a pack; its K/V written into `cache` (the whole state's).

    Returns (cache, hidden [T, H] before the final norm, captured [len, 1, T, H] or None)."""
    t = tokens.shape[0]
    shape = (cfg.num_layers, 1, cfg.num_kv_heads, t, cfg.head_dim)
    # nothing of it is read (length 0); the barrier as in admit.take_slots
    empty = jax.lax.optimization_barrier(jnp.zeros(shape, cache.k.dtype))
    hidden, k_new, v_new, captured = llama.forward(
        params, cfg.for_prefill(), tokens[None], lay.pos[None], empty, empty,
        jnp.zeros((1,), jnp.int32), lay.mask[None], capture_layers)
    cache = KVCache(scatter_rows(cache.k, k_new, slot_tok, lay.pos),
                    scatter_rows(cache.v, v_new, slot_tok, lay.pos), cache.lens)
    return cache, hidden[0], captured


def next_tokens(tokens, lay: PackLayout, n_valid, after):
    """[T] each token's successor in its request, for the draft's rows (f_t pairs x_{t+1}): the
    pack shifted by one, with after [A] (the next chunk's first token, or the root) at each
    request's last token."""
    t = tokens.shape[0]
    shifted = jnp.concatenate([tokens[1:], jnp.zeros((1,), tokens.dtype)])
    return shifted.at[jnp.where(n_valid > 0, lay.last, t)].set(after.astype(tokens.dtype),
                                                               mode="drop")


def spec_admit_packed(params, draft_params, state, slot_idx, tokens, n_valid, next_tok,
                      adm: AdmitArgs, engine_key, *, cfg: ModelConfig, spec: SpecConfig, axes,
                      rows, features: Features = FULL):
    """The first chunks of A requests, packed, into slots slot_idx (`spec_admit`'s counterpart).

    slot_idx [A] int32 (B = padding); tokens [T] the pack; n_valid [A] each request's tokens in
    it (0 for padding requests, which come last); next_tok [A] the token after the chunk, -1 on
    a request's last chunk; adm, engine_key: as `spec_admit`. rows: the state's row axes.
    Returns (state, Emitted [A]) as `spec_admit` does.
    """
    slots = state.root.shape[0]
    lay = pack_layout(n_valid, tokens.shape[0])
    slot_tok = token_slots(slot_idx, lay, slots)
    sub = take_slots(state, axes, slot_idx, (rows, 0))   # per-slot leaves; no KV rows
    target, hidden, captured = packed_forward(params, cfg, state.target, tokens, lay, slot_tok,
                                              draft_lib.capture_layers(draft_params))
    normed = llama.final_norm(params, cfg, hidden)
    feats = draft_lib.target_features(draft_params, normed[None], captured)
    is_last = next_tok < 0
    hist = packed_history(sub.history, tokens, lay, adm.n_prompt)
    logits = llama.project_logits(params, normed[lay.last])
    sp, first, hist, keys = admit_sampling(logits, hist, adm, engine_key, is_last, features)
    root = jnp.where(adm.root >= 0, adm.root, first.tokens)
    succ = next_tokens(tokens, lay, n_valid, jnp.where(is_last, root, next_tok))
    dk, dv, seed = draft_lib.catch_up_packed(params, draft_params, cfg, spec, state.draft_k,
                                             state.draft_v, feats, succ, lay, slot_tok)
    new = sub.replace(target=sub.target.replace(lens=n_valid), root=jnp.where(is_last, root, sub.root),
                      seed=seed, sampling=sp, rng=keys, history=hist)
    state = state.replace(target=target, draft_k=dk, draft_v=dv)
    return put_slots(state, axes, slot_idx, new, rows), first
