"""Drafting: the catch-up (draft step 0) and draft steps 1..S-1 that grow the candidate tree.

Positions (EAGLE's convention): draft row t pairs the target feature of position t with the token
of position t+1 and runs at RoPE position t. With the root (last emitted token) at position L,
the catch-up's last row is (f_{L-1}, root) at L-1 and seeds the depth-1 candidates; draft step i
feeds the depth-i frontier at position L + i - 1 and yields the depth-(i+1) candidates.

Candidates are kept in static arrays in generation order (depth 1: K, then K*K per step), with
`parent` = index of the parent candidate (-1 for the root's children) and cumulative
log-probability scores. With topk == 1 (and argmax_topk1) every pick is an argmax and no
full-vocab softmax is formed: a chain's ranking never needs the scores.

Heads: EAGLE-1 (`jaxspec.models.eagle`, draft params a dict) or EAGLE-3 (`jaxspec.models.eagle3`,
an `Eagle3Head`); both modules have the same functions, picked by the draft params' type (a static
property of the pytree, so nothing is decided at run time). What differs is confined to three
places: the target features the head reads (`capture_layers`, `target_features`), the lm_head
(the target's, or the draft vocabulary's with its map to target ids: `_children`), and the shapes
of the draft layer (`layer_config`).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.models import eagle, eagle3
from jaxspec.spec import context_vocab
from jaxspec.spec import topk as topk_lib
from jaxspec.spec.config import SpecConfig
from pallas_kernels.kv_compact import kv_compact


class Candidates(NamedTuple):
    tokens: jax.Array  # [B, C] int32
    scores: jax.Array  # [B, C] fp32 cumulative log-probability (zeros on the argmax path)
    parent: jax.Array  # [B, C] int32 parent candidate, -1 for the root's children


class DraftSeed(NamedTuple):
    """What the catch-up hands to the next cycle's drafting."""
    tokens: jax.Array  # [B, K] the root's top-k children
    logp: jax.Array    # [B, K] their log-probabilities (zeros on the argmax path)
    hidden: jax.Array  # [B, H] draft hidden of the root's row: the children's input feature
    ctx: jax.Array     # [B, E] the slot's context vocabulary (`context_vocab`; [B, 1] unused
                       # without one)


def top_children(logits, spec: SpecConfig):
    """logits [..., V] -> (tokens [..., K], log-probabilities [..., K])."""
    if spec.uses_argmax:
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)[..., None]
        return tok, jnp.zeros(tok.shape, jnp.float32)
    # two-stage on a wide vocab on GPU: XLA's TopK runs one block per row, K rows leave SMs idle
    vals, tok = topk_lib.vocab_top_k(logits, spec.topk)
    # top-k first, then one logsumexp: the K log-probs without a [.., V] log-softmax array.
    logp = vals - _logsumexp_from_max(logits, vals[..., :1])
    return tok.astype(jnp.int32), logp.astype(jnp.float32)


def _logsumexp_from_max(x, top):
    """jax.nn.logsumexp(x, -1, keepdims=True), its row max read from `top` [..., 1] (the top-1
    value the top-k just found) instead of a reduction pass of its own over the vocabulary.
    The same operations as jax.nn.logsumexp, so the same bits wherever top is the row's max
    (no NaN in the row)."""
    top = jax.lax.stop_gradient(jnp.where(jnp.isfinite(top), top, jnp.zeros_like(top)))
    return jnp.log(jnp.sum(jnp.exp(x - top), axis=-1, keepdims=True)) + top


def head_module(draft_params):
    """The module whose functions run this head: eagle3 for an Eagle3Head, else eagle."""
    return eagle3 if eagle3.is_eagle3(draft_params) else eagle


def layer_config(cfg: ModelConfig, draft_params) -> ModelConfig:
    """The config of the draft's decoder layer (EAGLE-1: the target's; EAGLE-3: its own)."""
    return draft_params.config.layer_config(cfg) if eagle3.is_eagle3(draft_params) else cfg


def capture_layers(draft_params):
    """Target layers whose outputs the head reads (EAGLE-3's three), () for EAGLE-1."""
    return draft_params.config.aux_layers if eagle3.is_eagle3(draft_params) else ()


def target_features(draft_params, normed, captured):
    """The head's input features of target rows: EAGLE-1 the post-final-norm hidden `normed`
    [B, N, H]; EAGLE-3 the captured layers [3, B, N, H] concatenated [B, N, 3H]."""
    return eagle3.target_features(captured) if eagle3.is_eagle3(draft_params) else normed


def check_head(cfg: ModelConfig, spec: SpecConfig, draft_params) -> None:
    """Raises ConfigError if a head does not fit the target or the tree shape."""
    from jaxspec.config import ConfigError
    if not eagle3.is_eagle3(draft_params):
        k = draft_params["draft_ids"].shape[0] if "draft_ids" in draft_params else None
        if k is not None and spec.topk > k:
            raise ConfigError(f"topk={spec.topk} exceeds the head's draft vocabulary of {k}")
        return
    hc = draft_params.config
    if hc.vocab_size != cfg.vocab_size:
        raise ConfigError(f"the EAGLE-3 head maps to a vocabulary of {hc.vocab_size} tokens, the "
                          f"target has {cfg.vocab_size}")
    if spec.topk > hc.draft_vocab_size:
        raise ConfigError(f"topk={spec.topk} exceeds the head's draft vocabulary size "
                          f"{hc.draft_vocab_size}")
    bad = [i for i in hc.aux_layers if not 0 <= i < cfg.num_layers]
    if bad or len(hc.aux_layers) != 3:
        raise ConfigError(f"the EAGLE-3 head reads target layers {list(hc.aux_layers)}; it needs "
                          f"three in [0, {cfg.num_layers})")


def _children(params, draft_params, hidden, spec: SpecConfig, ctx=None, ctx_rows=None):
    """Draft hidden [B, ..., H] -> top-k children (target ids [B, ..., K], log-probs [B, ..., K]).
    EAGLE-3, or an EAGLE-1 head with a smaller draft vocabulary (`draft_vocab`): top-k over the
    draft vocabulary, then mapped to target ids; with a context vocabulary ctx [B, E]
    (`context_vocab`), the row's last E entries are the slot's context ids (their lm_head rows
    ctx_rows [B, E, H]: gathered here when None)."""
    if eagle3.is_eagle3(draft_params):
        tok, logp = top_children(eagle3.logits(draft_params, hidden), spec)
        return eagle3.to_target(draft_params, tok), logp
    if "draft_ids" not in draft_params:
        return top_children(eagle.logits(params, hidden), spec)
    # a smaller draft vocabulary (`draft_vocab.restrict`)
    logits = jnp.dot(hidden, draft_params["draft_lm_head"].astype(hidden.dtype),
                     preferred_element_type=jnp.float32)
    ids = draft_params["draft_ids"]
    if ctx is None or context_vocab.size(draft_params) == 0:
        tok, logp = top_children(logits, spec)
        return ids[tok], logp
    if ctx_rows is None:
        ctx_rows = context_vocab.rows(params, ctx, hidden.dtype)
    tok, logp = top_children(context_vocab.place(logits, hidden, ctx_rows, ctx), spec)
    return context_vocab.to_target(tok, ids, ctx).astype(jnp.int32), logp


def _context(draft_params, ctx, tokens, live):
    """The context after the catch-up's tokens [B, R] where live [B, R]; ctx None: a fresh
    one."""
    b = tokens.shape[0]
    if ctx is None:
        ctx = context_vocab.fresh(draft_params, b)
    if context_vocab.size(draft_params) == 0:
        return ctx
    return context_vocab.update(ctx, tokens, live, draft_params["draft_in_vocab"])


def _last_live(x, n_live):
    """x [B, R, ...] -> row n_live - 1 of each slot [B, 1, ...]."""
    idx = jnp.maximum(n_live - 1, 0).reshape((-1, 1) + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, idx, axis=1)


def catch_up(params, draft_params, cfg: ModelConfig, spec: SpecConfig, draft_k, draft_v, base,
             features, tokens, n_live, slots=None, ctx=None):
    """Draft rows (features[:, r], tokens[:, r]) at positions base + r for r < n_live.

    draft_k/v [1, B, Hkv, T, D]: the committed draft cache, base [B] rows long (or [1, Bc, ...]
    with slots [B] naming the cache slot of each row).
    features [B, R, F] target features (`target_features`: F = H for EAGLE-1, 3H for EAGLE-3);
    tokens [B, R]; n_live [B] live rows (0 = slot idle).
    ctx [B, E]: the rows' context vocabulary before these tokens (None: a fresh one).
    Writes the draft KV of all live rows at base..base+n_live-1 and returns
    (draft_k, draft_v, DraftSeed from the last live row, its context updated with the tokens).
    """
    head = head_module(draft_params)
    b, r = tokens.shape
    positions = base[:, None] + jnp.arange(r, dtype=jnp.int32)[None]
    rows = jnp.broadcast_to(jnp.arange(r, dtype=jnp.int32)[None], (b, r))
    if spec.skip_dead_rows:
        x = head.fuse_input(params, draft_params, tokens, features)
        q, k, v = head.qkv(cfg, draft_params, x, positions)
        draft_k, draft_v = kv_compact(draft_k, draft_v, k[None], v[None], base, rows, n_live,
                                      slots)
        # Only the last live row goes on: its query sees the rows just written (through the cache,
        # lengths base + n_live - 1) and itself (as the one new key).
        q1 = _last_live(q, n_live)                                          # [B, 1, Hq, D]
        k1 = _last_live(k.transpose(0, 2, 1, 3), n_live).transpose(0, 2, 1, 3)  # [B, Hkv, 1, D]
        v1 = _last_live(v.transpose(0, 2, 1, 3), n_live).transpose(0, 2, 1, 3)
        lens = base + jnp.maximum(n_live - 1, 0)
        o = head.attend(cfg, q1, draft_k, draft_v, lens, k1, v1, jnp.ones((b, 1, 1), bool),
                        slots)
        x1 = jax.tree_util.tree_map(lambda a: _last_live(a, n_live), x)  # EAGLE-3: a pair
        hidden = head.finish_layer(cfg, draft_params, x1, o)[:, 0]
    else:
        mask = jnp.tril(jnp.ones((r, r), bool))[None] & (rows < n_live[:, None])[:, None, :]
        hid, k, v = head.forward(params, draft_params, cfg, tokens, features, positions, draft_k,
                                 draft_v, base, mask, slots)
        draft_k, draft_v = kv_compact(draft_k, draft_v, k, v, base, rows, n_live, slots)
        hidden = _last_live(hid, n_live)[:, 0]
    ctx = _context(draft_params, ctx, tokens, rows < n_live[:, None])
    tok, logp = _children(params, draft_params, hidden, spec, ctx)
    return draft_k, draft_v, DraftSeed(tok, logp, hidden, ctx)


def catch_up_packed(params, draft_params, cfg: ModelConfig, spec: SpecConfig, draft_k, draft_v,
                    features, tokens, lay, slot_tok):
    """`catch_up` over a pack of first chunks (`admit_packed`, R rows x W tokens, flat here):
    draft row t is (features[0, t], tokens[t]) at position lay.pos; its K/V goes to (slot_tok,
    lay.pos) of draft_k/v [1, B, Hkv, Tc, D] (slot_tok B: dropped), and each request's seed
    comes from its last row, which attends to its request's rows (all at or before it: a first
    chunk). features [1, R * W, F], tokens [R * W]. Returns (draft_k, draft_v, DraftSeed [A])."""
    from jaxspec.engine.admission import scatter_rows
    head = head_module(draft_params)
    r, w = lay.pos.shape
    x = head.fuse_input(params, draft_params, tokens[None], features)
    # q [1, R * W, Hq, D]; k, v [1, Hkv, R * W, D]
    q, k, v = head.qkv(cfg, draft_params, x, lay.pos.reshape(1, -1))
    split = lambda z: z[0].reshape(z.shape[1], r, w, z.shape[-1])   # noqa: E731  [Hkv, R, W, D]
    draft_k = scatter_rows(draft_k, split(k).transpose(1, 0, 2, 3)[None], slot_tok, lay.pos)
    draft_v = scatter_rows(draft_v, split(v).transpose(1, 0, 2, 3)[None], slot_tok, lay.pos)
    a = lay.last.shape[0]
    row = lay.last // w                                          # each request's pack row
    own = lay.seg[row] == jnp.arange(a, dtype=lay.seg.dtype)[:, None]               # [A, W]
    rows_of = lambda z: split(z)[:, row].transpose(1, 0, 2, 3)   # noqa: E731  [A, Hkv, W, D]
    o = _attend_rows(q[0, lay.last], rows_of(k), rows_of(v), own)                   # [A, Hq, D]
    x1 = jax.tree_util.tree_map(lambda z: z[0, lay.last][:, None], x)   # EAGLE-3: a pair
    hidden = head.finish_layer(cfg, draft_params, x1, o[:, None])[:, 0]
    # each request's context: its tokens in its pack row (a first chunk: the whole prompt so far)
    ctx = _context(draft_params, None, tokens.reshape(r, w)[row], own)
    tok, logp = _children(params, draft_params, hidden, spec, ctx)
    return draft_k, draft_v, DraftSeed(tok, logp, hidden, ctx)


def _attend_rows(q, k, v, visible):
    """q [A, Hq, D] over its own keys k, v [A, Hkv, W, D] where visible [A, W]; fp32 softmax
    -> [A, Hq, D]. A few rows: too small a job for the attention kernel's grid."""
    a, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(a, hkv, hq // hkv, d).astype(jnp.float32) * d ** -0.5
    s = jnp.einsum("ahgd,ahtd->ahgt", qg, k.astype(jnp.float32))
    s = jnp.where(visible[:, None, None, :], s, -1e30)     # finite: a padding row sees nothing
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("ahgt,ahtd->ahgd", p, v.astype(jnp.float32))
    return o.reshape(a, hq, d).astype(q.dtype)


def _pad_rows(x, n):
    """x [B, R, ...] -> [B, n + R, ...]: n zero rows first."""
    return jnp.pad(x, [(0, 0), (n, 0)] + [(0, 0)] * (x.ndim - 2))


def draft_tree(params, draft_params, cfg: ModelConfig, spec: SpecConfig, draft_k, draft_v, lens,
               seed: DraftSeed) -> Candidates:
    """Draft steps 1..S-1 from the catch-up's seed; returns all K + (S-1)K^2 candidates.

    lens [B] = L: the committed draft rows (the root's row is the last of them). The tree rows of
    this cycle's earlier steps live in a small buffer passed to attention as the new keys, under a
    mask of self + ancestors; nothing is written to the draft cache.
    """
    head = head_module(draft_params)
    s, kk = spec.num_steps, spec.topk
    b, h = seed.hidden.shape
    tok, score = seed.tokens, seed.logp                                     # [B, K]
    feat = jnp.broadcast_to(seed.hidden[:, None], (b, kk, h))
    cand_tok, cand_score = [tok], [score]
    cand_parent = [jnp.full((b, kk), -1, jnp.int32)]
    front = jnp.broadcast_to(jnp.arange(kk, dtype=jnp.int32)[None], (b, kk))  # candidate ids
    m = (s - 1) * kk
    ks, vs = [], []                              # the buffer rows' K/V, [B, Hkv, K, D] per step
    anc = jnp.zeros((b, kk, m), bool)            # buffer rows that are ancestors of the frontier
    ctx_rows = None                              # the context's lm_head rows, once for all steps
    if context_vocab.size(draft_params) and "draft_ids" in draft_params:
        ctx_rows = context_vocab.rows(params, seed.ctx, seed.hidden.dtype)
    for i in range(1, s):
        lo, hi = (i - 1) * kk, i * kk
        x = head.fuse_input(params, draft_params, tok, feat)
        pos = jnp.broadcast_to(lens[:, None] + (i - 1), (b, kk)).astype(jnp.int32)
        q, k, v = head.qkv(cfg, draft_params, x, pos)
        ks.append(k)
        vs.append(v)
        self_rows = np.zeros((kk, m), bool)
        self_rows[np.arange(kk), lo + np.arange(kk)] = True
        anc = anc | self_rows[None]
        # tree_attention takes a square [n, n] mask: the queries sit at their buffer rows 0..hi-1,
        # earlier rows get zero queries whose outputs are dropped (at most (S-2)K wasted rows).
        # (Padding, not zeros().at[].set: jax 0.11's Shardy partitioner crashes on an update
        # that covers its whole operand inside a shard_map, as step 1's does.)
        q_sq = _pad_rows(q, lo)
        mask = _pad_rows(anc[:, :, :hi], lo)
        o = head.attend(cfg, q_sq, draft_k, draft_v, lens, jnp.concatenate(ks, axis=2),
                        jnp.concatenate(vs, axis=2), mask)[:, lo:hi]
        hid = head.finish_layer(cfg, draft_params, x, o)                    # [B, K, H]
        ctok, clogp = _children(params, draft_params, hid, spec, seed.ctx,     # [B, K, K]
                                 ctx_rows)
        cum = score[:, :, None] + clogp
        base = kk + (i - 1) * kk * kk
        cand_tok.append(ctok.reshape(b, kk * kk))
        cand_score.append(cum.reshape(b, kk * kk))
        cand_parent.append(jnp.repeat(front, kk, axis=1))
        if i == s - 1:
            break
        if kk == 1:
            sel = jnp.zeros((b, 1), jnp.int32)
        else:
            _, sel = topk_lib.small_top_k(cum.reshape(b, kk * kk), kk)      # [B, K]
        par = sel // kk
        tok = jnp.take_along_axis(ctok.reshape(b, kk * kk), sel, axis=1)
        score = jnp.take_along_axis(cum.reshape(b, kk * kk), sel, axis=1)
        feat = jnp.take_along_axis(hid, par[..., None], axis=1)
        anc = jnp.take_along_axis(anc, par[..., None], axis=1)
        front = base + sel
    return Candidates(jnp.concatenate(cand_tok, 1), jnp.concatenate(cand_score, 1),
                      jnp.concatenate(cand_parent, 1))
