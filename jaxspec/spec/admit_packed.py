"""Packed first chunks: an admission's newcomers laid end to end in one row of tokens.

The padded first chunk (`admit.spec_admit` with kv_rows) runs A slots x W tokens, W the bucket of
the longest prompt and A the slot bucket of the count: for groups of chat prompts that is 3-8x
their tokens (bench/RESULTS.md, sixteenth set), and at batch 64 the admissions are the largest
part of a step after the cycles. Here the first chunks of A requests fill one row of T tokens
(T a bucket of their sum), or, for more tokens than a row takes, R rows of the widest pack (the
host fills them first-fit); each token attends only to the earlier tokens of its own request (a
block-diagonal causal mask per row), and each token's K/V goes straight to its slot's row. Only
first chunks are packed (every request starts at row 0); later chunks of long prompts keep the
padded general form. Attention within a row costs its width squared: rows stay at most
`Engine.pack_tokens` wide (2 x the chunk by default).

Padding tokens belong to request A and padding requests (n_valid 0) to slot B: every write drops
them.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.kv import KVCache
from jaxspec.models import llama
from jaxspec.sampling import FULL, Features, TokenCounts
from jaxspec.spec import draft as draft_lib
from jaxspec.spec.admit import AdmitArgs, admit_sampling, put_slots, take_slots
from jaxspec.spec.config import SpecConfig


class PackLayout(NamedTuple):
    """Where each request sits in a pack of R rows x W tokens (built on the host, `build_pack`).

    seg   [R, W] int32: the request (0..A-1) of each token; A for padding
    pos   [R, W] int32: the token's row within its request (RoPE position and cache row);
          padding tokens count their column
    last  [A] int32: flat index (row * W + column) of each request's last token (0: padding)
    """
    seg: jax.Array
    pos: jax.Array
    last: jax.Array

    @property
    def mask(self):
        """[R, W, W]: token i sees token j of its own request at or before its row (padding
        tokens see the padding before them in their row, so no row of the mask is empty)."""
        return (self.seg[:, :, None] == self.seg[:, None, :]) & \
            (self.pos[:, None, :] <= self.pos[:, :, None])


def build_pack(chunks: Sequence[Sequence[int]], row_of: Sequence[int], rows: int, width: int,
               a: int):
    """numpy (tokens [R, W], PackLayout) of chunks (request j's tokens, in row row_of[j], after
    the requests before it in that row) for a pack of `a` requests; requests len(chunks)..a-1
    are padding."""
    tokens = np.zeros((rows, width), np.int32)
    seg = np.full((rows, width), a, np.int32)
    pos = np.tile(np.arange(width, dtype=np.int32), (rows, 1))
    last = np.zeros(a, np.int32)
    cursor = [0] * rows
    for j, (ids, r) in enumerate(zip(chunks, row_of)):
        c, n = cursor[r], len(ids)
        if c + n > width:
            raise ValueError(f"row {r} of a {width}-token pack cannot take {n} more tokens")
        tokens[r, c:c + n], seg[r, c:c + n], pos[r, c:c + n] = ids, j, np.arange(n)
        last[j] = r * width + c + n - 1
        cursor[r] = c + n
    return tokens, PackLayout(seg, pos, last)


def scatter_rows(cache, new, slot_tok, pos):
    """cache [L, B, H, Tc, D] with new [L, R, H, W, D]'s token (r, w) written at
    (slot_tok[r, w], pos[r, w]); slot_tok B (padding, or a slot another device owns) is
    dropped."""
    l, r, h, w, d = new.shape
    vals = new.transpose(1, 3, 0, 2, 4).reshape(r * w, l, h, d).astype(cache.dtype)
    return cache.at[:, slot_tok.reshape(-1), :, pos.reshape(-1), :].set(vals, mode="drop")


def token_slots(slot_idx, lay: PackLayout, slots: int):
    """[R, W] the slot each token's K/V goes to; `slots` (dropped) for padding tokens."""
    return jnp.take(slot_idx, lay.seg, mode="fill", fill_value=slots)


def packed_history(hist: TokenCounts, tokens, lay: PackLayout, n_prompt) -> TokenCounts:
    """The counts of A requests after their first chunks (`admit.chunk_history` for a pack):
    from empty, prompt tokens set prompt_seen, later ones (a resumed request's output) count."""
    v = hist.counts.shape[1]
    seg, pos, tok = lay.seg.reshape(-1), lay.pos.reshape(-1), tokens.reshape(-1)
    npr = jnp.take(n_prompt, seg, mode="fill", fill_value=0)
    seen = jnp.zeros_like(hist.prompt_seen).at[seg, jnp.where(pos < npr, tok, v)].set(
        True, mode="drop")
    counts = jnp.zeros_like(hist.counts).at[seg, jnp.where(pos >= npr, tok, v)].add(
        1, mode="drop")
    return TokenCounts(seen, counts)


def packed_forward(params, cfg: ModelConfig, cache: KVCache, tokens, lay: PackLayout, slot_tok,
                   capture_layers=()):
    """Target forward over a pack (tokens [R, W]); its K/V written into `cache` (the whole
    state's). Returns (cache, hidden [R * W, H] before the final norm, captured
    [len, 1, R * W, H] or None): the pack's tokens as one flat row."""
    r, w = tokens.shape
    shape = (cfg.num_layers, r, cfg.num_kv_heads, w, cfg.head_dim)
    # nothing of it is read (length 0). The barriers keep XLA from constant-folding the
    # attention over it: its softmax max over a known-masked prefix took XLA's evaluator
    # seconds per admission program at compile time.
    empty, none = jax.lax.optimization_barrier((jnp.zeros(shape, cache.k.dtype),
                                                jnp.zeros((r,), jnp.int32)))
    hidden, k_new, v_new, captured = llama.forward(
        params, cfg.for_prefill(packed=True), tokens, lay.pos, empty, empty, none, lay.mask,
        capture_layers)
    cache = KVCache(scatter_rows(cache.k, k_new, slot_tok, lay.pos),
                    scatter_rows(cache.v, v_new, slot_tok, lay.pos), cache.lens)
    if captured is not None:
        captured = captured.reshape(captured.shape[0], 1, r * w, -1)
    return cache, hidden.reshape(r * w, -1), captured


def next_tokens(tokens, lay: PackLayout, n_valid, after):
    """[R * W] each token's successor in its request, for the draft's rows (f_t pairs x_{t+1}):
    the flat pack shifted by one, with after [A] (the next chunk's first token, or the root) at
    each request's last token (a request never spans rows)."""
    flat = tokens.reshape(-1)
    shifted = jnp.concatenate([flat[1:], jnp.zeros((1,), flat.dtype)])
    return shifted.at[jnp.where(n_valid > 0, lay.last, flat.shape[0])].set(
        after.astype(flat.dtype), mode="drop")


def spec_admit_packed(params, draft_params, state, slot_idx, tokens, lay: PackLayout, n_valid,
                      next_tok, adm: AdmitArgs, engine_key, *, cfg: ModelConfig,
                      spec: SpecConfig, axes, rows, features: Features = FULL):
    """The first chunks of A requests, packed, into slots slot_idx (`spec_admit`'s counterpart).

    slot_idx [A] int32 (B = padding); tokens [R, W] the pack, lay its layout (`build_pack`);
    n_valid [A] each request's tokens in it (0 for padding requests); next_tok [A] the token
    after the chunk, -1 on a request's last chunk; adm, engine_key: as `spec_admit`. rows: the
    state's row axes. Returns (state, Emitted [A]) as `spec_admit` does.
    """
    slot_tok = token_slots(slot_idx, lay, state.root.shape[0])
    sub = take_slots(state, axes, slot_idx, rows)   # per-slot leaves; no KV rows
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
    new = sub.replace(target=sub.target.replace(lens=n_valid),
                      root=jnp.where(is_last, root, sub.root), seed=seed, sampling=sp, rng=keys,
                      history=hist)
    state = state.replace(target=target, draft_k=dk, draft_v=dv)
    return put_slots(state, axes, slot_idx, new, rows), first
