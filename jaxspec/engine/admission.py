"""Admission: prefill new requests into chosen slots of a live batch state, between cycles.

One implementation serves the plain and the speculative backends. Their states share the
fields an admission writes (`target` KV cache, `root` next input token, `sampling`, `rng`,
`history`); a speculative state adds the draft cache and the draft seed, which the draft's
catch-up fills when a SpecConfig is given.

The engine keeps one static-shape batch state (B slots) alive for its whole life. The admitted
slots' per-slot leaves (sampling, keys, counts, lengths, draft seed) are gathered along the batch
axis into an A-slot sub-state (A = a slot-count bucket), one prompt chunk is run, and the
sub-state is scattered back. The KV caches are never gathered: the chunk's attention reads the
admitted slots' rows of the whole cache and its K/V rows are written there in place (the kernels'
`slots` argument); a gathered slot would be its whole cache. Padding rows carry the slot index B,
which the gathers clip and the writes drop.

Two forms (`FORMS`):
  "chunk"   tokens [A, C]: chunk k of each request at rows start..start+n_valid-1 over the rows
            earlier chunks wrote (a first chunk starts at 0).
  "packed"  tokens [R, W]: the first chunks of A requests laid end to end (`PackLayout`), each
            token attending to the earlier tokens of its own request; padding tokens belong to
            request A and padding requests (n_valid 0) to slot B.
The draft catch-up pairs the target feature at t with the token at t+1, so each chunk also gets
`next_tok`, the first token of the next chunk, or -1 on a request's last chunk, where the root
(the first generated token) takes its place.

Sampling: each admission carries the requests' parameters (`AdmitArgs`, flat per-row arrays, so
new parameters never recompile). A request resumed after a retract is prefilled over prompt +
output[:-1] with its last output token as the given root (nothing drawn), its output counted,
and (`advance_rows`, a separate program run only for such requests) its key advanced past the
draws it already made, so a retract changes neither penalties nor seeded outputs.

Variants: compiled once per `sampling.Features` variant; the host picks the one its admitted
requests need, so the program holds no conditional on device values (each would make the host
wait for the device).

Batch axes are found per leaf, not assumed: `batch_axes(make_state, B)` evaluates the state's
shapes for B and B+1 slots (`jax.eval_shape`, no memory) and marks the one axis that differs.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.kv import KVCache
from jaxspec.models import llama
from jaxspec.sampling import (FULL, MAX_LOGPROBS, VARIANTS, Emitted, Features, SlotSampling,
                              TokenCounts, apply_penalties, cond, sample_slots, split_slot_keys,
                              token_logprobs)
from jaxspec.xla_options import jit
from pallas_kernels.kv_compact import kv_compact

FORMS = ("chunk", "packed")


class AdmitArgs(NamedTuple):
    """Per admitted row (all [A, ...]; rows of one request are equal on all its chunks).

    root       int32: -1 draws the first token on the last chunk; >= 0 (a resumed request) is the
               root itself (its last output token), nothing is drawn and -1 is returned
    n_prompt   int32: prompt tokens; prefilled tokens past them are output and counted as such
    samp_f     [A, 6] fp32 and samp_i [A, 2] int32: `sampling.flat_params`
    key        [A, 2] uint32: the request's base key (seeded requests)
    serial     int32: -1 uses `key`; else the base key is fold_in(engine key, serial)
    """
    root: jax.Array
    n_prompt: jax.Array
    samp_f: jax.Array
    samp_i: jax.Array
    key: jax.Array
    serial: jax.Array

    @classmethod
    def host(cls, a: int, *, n_prompt=None, samp_f=None, samp_i=None, root=None, key=None,
             serial=None) -> "AdmitArgs":
        """numpy arrays for a bucket of a rows: greedy defaults for what is not given."""
        z = np.zeros(a, np.int32)
        f = np.tile(np.array([0, 1, 0, 1, 0, 0], np.float32), (a, 1))
        i = np.tile(np.array([0, -1], np.int32), (a, 1))
        pick = lambda x, d: d if x is None else x     # noqa: E731
        return cls(pick(root, z - 1), pick(n_prompt, z + np.iinfo(np.int32).max),
                   pick(samp_f, f), pick(samp_i, i), pick(key, np.zeros((a, 2), np.uint32)),
                   pick(serial, z.copy()))


class PackLayout(NamedTuple):
    """Where each request sits in a pack of R rows x W tokens (built on the host,
    `engine.prefill_plan.build_pack`).

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


# ------------------------------------------------------------------------------ slot gathers


def batch_axes(make_state, slots: int, what: str = "batch"):
    """Pytree (the state's structure) of each leaf's batch axis, -1 where it has none.
    (With make_state taking the cache length instead: each leaf's row axis.)"""
    a = jax.eval_shape(lambda: make_state(slots))
    b = jax.eval_shape(lambda: make_state(slots + 1))

    def axis(x, y):
        diff = [i for i, (p, q) in enumerate(zip(x.shape, y.shape)) if p != q]
        if len(diff) > 1 or (diff and (x.shape[diff[0]], y.shape[diff[0]]) != (slots, slots + 1)):
            raise ValueError(f"cannot tell the {what} axis of a state leaf: {x.shape} vs {y.shape}")
        return diff[0] if diff else -1

    return jax.tree_util.tree_map(axis, a, b)


def take_slots(state, axes, slot_idx, rows=None):
    """The sub-state of slots slot_idx [A] (indices >= B are clipped: padding rows).
    rows: the state's row axes; KV leaves (those with one) then stand in as empty arrays,
    since an admission reads and writes the caches in place."""
    def take(x, ax, rax=-1):
        if ax < 0:
            return x
        if rax >= 0:
            shape = list(x.shape)
            shape[ax], shape[rax] = slot_idx.shape[0], 0
            return jnp.zeros(shape, x.dtype)
        return jnp.take(x, slot_idx, axis=ax, mode="clip")

    extra = () if rows is None else (rows,)
    return jax.tree_util.tree_map(take, state, axes, *extra)


def put_slots(state, axes, slot_idx, sub, rows=None):
    """Writes sub-state rows into slots slot_idx [A]; rows with an index >= B are dropped.
    Leaves without a batch axis, and with rows the KV leaves, keep the state's value."""
    def put(x, ax, s, rax=-1):
        if ax < 0 or rax >= 0:
            return x
        where = [slice(None)] * x.ndim
        where[ax] = slot_idx
        return x.at[tuple(where)].set(s.astype(x.dtype), mode="drop")

    extra = () if rows is None else (rows,)
    return jax.tree_util.tree_map(put, state, axes, sub, *extra)


# ------------------------------------------------------------------------------ target forward


def chunk_forward(params, cfg: ModelConfig, cache: KVCache, tokens, start, n_valid, slots,
                  capture_layers=()):
    """Target forward over one chunk (tokens [A, C]) at rows start.. of slots `slots` [A] of the
    whole batch's cache (slot B: padding, nothing written).
    Returns (cache with n_valid rows written at start, hidden [A, C, H], captured or None)."""
    a, c = tokens.shape
    rows = jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32)[None], (a, c))
    hidden, k_new, v_new, captured = llama.forward(
        params, cfg.for_prefill(), tokens, start[:, None] + rows, cache.k, cache.v, start,
        llama.causal_mask(a, c, n_valid), capture_layers, slots=slots)
    k, v = kv_compact(cache.k, cache.v, k_new, v_new, start, rows, n_valid, slots)
    return cache.replace(k=k, v=v), hidden, captured


def scatter_rows(cache, new, slot_tok, pos):
    """cache [L, B, H, Tc, D] with new [L, R, H, W, D]'s token (r, w) written at
    (slot_tok[r, w], pos[r, w]); slot_tok B (padding, or a slot another device owns) drops."""
    l, r, h, w, d = new.shape
    vals = new.transpose(1, 3, 0, 2, 4).reshape(r * w, l, h, d).astype(cache.dtype)
    return cache.at[:, slot_tok.reshape(-1), :, pos.reshape(-1), :].set(vals, mode="drop")


def token_slots(slot_idx, lay: PackLayout, slots: int):
    """[R, W] the slot each token's K/V goes to; `slots` (dropped) for padding tokens."""
    return jnp.take(slot_idx, lay.seg, mode="fill", fill_value=slots)


def packed_forward(params, cfg: ModelConfig, cache: KVCache, tokens, lay: PackLayout, slot_tok,
                   capture_layers=()):
    """Target forward over a pack (tokens [R, W]); its K/V written into `cache` (the whole
    state's). Returns (cache, hidden [R * W, H] before the final norm, captured
    [len, 1, R * W, H] or None): the pack's tokens as one flat row."""
    r, w = tokens.shape
    shape = (cfg.num_layers, r, cfg.num_kv_heads, w, cfg.head_dim)
    # The pack attends to no cached prefix. The barriers keep XLA from constant-folding the
    # attention over the empty one, which costs seconds of compile time per program.
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


def last_row(x, n_valid):
    """x [A, C, ...] -> row n_valid - 1 of each slot [A, ...]."""
    idx = jnp.maximum(n_valid - 1, 0).reshape((-1, 1) + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, idx, axis=1)[:, 0]


# ------------------------------------------------------------------------------ token counts


def chunk_history(hist: TokenCounts, tokens, start, n_valid, n_prompt) -> TokenCounts:
    """The counts of A admitted rows after chunk tokens [A, C] at rows start..: prompt tokens set
    prompt_seen, later ones count as output; a first chunk (start 0) starts from empty counts."""
    a, c = tokens.shape
    v = hist.counts.shape[-1]
    pos = start[:, None] + jnp.arange(c, dtype=jnp.int32)[None]
    live = jnp.arange(c)[None] < n_valid[:, None]
    fresh = (start == 0)[:, None]
    seen = jnp.where(fresh, False, hist.prompt_seen)
    counts = jnp.where(fresh, 0, hist.counts)
    rows = jnp.arange(a)[:, None]
    in_prompt = pos < n_prompt[:, None]
    seen = seen.at[rows, jnp.where(live & in_prompt, tokens, v)].set(True, mode="drop")
    counts = counts.at[rows, jnp.where(live & ~in_prompt, tokens, v)].add(1, mode="drop")
    return TokenCounts(seen, counts)


def packed_history(hist: TokenCounts, tokens, lay: PackLayout, n_prompt) -> TokenCounts:
    """`chunk_history` of A requests' first chunks in a pack (from empty counts)."""
    v = hist.counts.shape[1]
    seg, pos, tok = lay.seg.reshape(-1), lay.pos.reshape(-1), tokens.reshape(-1)
    npr = jnp.take(n_prompt, seg, mode="fill", fill_value=0)
    seen = jnp.zeros_like(hist.prompt_seen).at[seg, jnp.where(pos < npr, tok, v)].set(
        True, mode="drop")
    counts = jnp.zeros_like(hist.counts).at[seg, jnp.where(pos >= npr, tok, v)].add(
        1, mode="drop")
    return TokenCounts(seen, counts)


# ------------------------------------------------------------------------------ first token


def admit_sampling(logits, hist: TokenCounts, adm: AdmitArgs, engine_key, is_last,
                   features: Features = FULL):
    """The first token of admitted rows, from logits [A, V] (raw) of their last prompt row.

    Draws (with the slot's parameters, counts and key) where the request is new, takes
    adm.root where it is resumed. The slot's key becomes its base key split once (the first
    draw). Returns (SlotSampling, Emitted [A] (tokens -1 unless a new request's last chunk),
    hist with the root counted on last chunks, keys [A, 2])."""
    sp = SlotSampling.from_flat(adm.samp_f, adm.samp_i)
    use = sp.with_features(features)
    folded = jax.vmap(jax.random.fold_in, (None, 0))(engine_key, jnp.maximum(adm.serial, 0))
    base = jnp.where((adm.serial >= 0)[:, None], folded, adm.key).astype(jnp.uint32)
    pen = cond(use.any_penalty(), lambda: apply_penalties(logits, sp, hist), lambda: logits)
    after, sub = split_slot_keys(base, 2)
    resumed = adm.root >= 0
    tok = jnp.where(resumed, adm.root, sample_slots(pen, use, sub))
    keys = jnp.where(is_last[:, None], after, base)
    hist = hist.add(tok[:, None], is_last[:, None])
    lp, ids, tlp = token_logprobs(pen[:, None], use, tok[:, None], MAX_LOGPROBS)
    first = jnp.where(is_last & ~resumed, tok, -1)
    return sp, Emitted(first, lp[:, 0], ids[:, 0], tlp[:, 0]), hist, keys


def advance_rows(keys, slot_idx, advance, key_splits: int):
    """keys [B, 2] with the rows slot_idx [A] (indices >= B: padding, dropped) moved on by
    advance [A] splits into `key_splits` (the backend's per-step or per-cycle split). A loop on
    a device value, so it runs only for resumed requests that sample."""
    rows = jnp.take(keys, slot_idx, axis=0, mode="clip")

    def step(i, k):
        return jnp.where((i < advance)[:, None], split_slot_keys(k, key_splits)[0], k)

    rows = jax.lax.fori_loop(0, jnp.max(advance), step, rows)
    return keys.at[slot_idx].set(rows, mode="drop")


# ------------------------------------------------------------------------------ the program


def next_tokens(tokens, lay: PackLayout, n_valid, after):
    """[R * W] each token's successor in its request (a pack): the flat pack shifted by one,
    with after [A] (the next chunk's first token, or the root) at each request's last token."""
    flat = tokens.reshape(-1)
    shifted = jnp.concatenate([flat[1:], jnp.zeros((1,), flat.dtype)])
    return shifted.at[jnp.where(n_valid > 0, lay.last, flat.shape[0])].set(
        after.astype(flat.dtype), mode="drop")


def shifted_chunk(tokens, n_valid, after):
    """[A, C] each token's successor in its chunk, with after [A] at the last valid one."""
    a, c = tokens.shape
    cols = jnp.arange(c, dtype=jnp.int32)[None]
    shifted = jnp.concatenate([tokens[:, 1:], jnp.zeros((a, 1), tokens.dtype)], axis=1)
    return jnp.where(cols == (n_valid - 1)[:, None], after[:, None], shifted)


def admit(params, draft_params, state, slot_idx, tokens, where, n_valid, next_tok,
          adm: AdmitArgs, engine_key, *, cfg: ModelConfig, spec, form: str, axes, rows,
          features: Features = FULL):
    """One prefill chunk for A requests into slots slot_idx [A] (B = padding).

    tokens: [A, C] ("chunk") or [R, W] ("packed"); where: start [A] rows already prefilled
    ("chunk") or the pack's PackLayout ("packed"); n_valid [A] tokens of each request in it;
    next_tok [A] the token after the chunk, -1 on the last chunk; adm: the requests' sampling;
    engine_key [2] uint32. spec: a SpecConfig (the draft catches up) or None (plain).
    Returns (state, Emitted [A]): the root and its logprobs on a new request's last chunk, else
    token -1."""
    from jaxspec.spec import context_vocab
    from jaxspec.spec import draft as draft_lib
    capture = draft_lib.capture_layers(draft_params) if spec is not None else ()
    sub = take_slots(state, axes, slot_idx, rows)          # per-slot leaves; no KV rows
    if form == "packed":
        slot_tok = token_slots(slot_idx, where, state.root.shape[0])
        target, hidden, captured = packed_forward(params, cfg, state.target, tokens, where,
                                                  slot_tok, capture)
        hist = packed_history(sub.history, tokens, where, adm.n_prompt)
        start, hidden_last = 0, hidden[where.last]
    else:
        target, hidden, captured = chunk_forward(params, cfg, state.target, tokens, where,
                                                 n_valid, slot_idx, capture)
        hist = chunk_history(sub.history, tokens, where, n_valid, adm.n_prompt)
        start, hidden_last = where, last_row(hidden, n_valid)
    is_last = next_tok < 0
    logits = llama.lm_head(params, cfg, hidden_last)
    sp, first, hist, keys = admit_sampling(logits, hist, adm, engine_key, is_last, features)
    root = jnp.where(adm.root >= 0, adm.root, first.tokens)
    new = sub.replace(target=sub.target.replace(lens=start + n_valid),
                      root=jnp.where(is_last, root, sub.root), sampling=sp, rng=keys,
                      history=hist)
    state = state.replace(target=target)
    if spec is not None:
        normed = llama.final_norm(params, cfg, hidden)
        after = jnp.where(is_last, root, next_tok)
        if form == "packed":
            feats = draft_lib.target_features(draft_params, normed[None], captured)
            dk, dv, seed = draft_lib.catch_up_packed(
                params, draft_params, cfg, spec, state.draft_k, state.draft_v, feats,
                next_tokens(tokens, where, n_valid, after), where, slot_tok)
        else:
            feats = draft_lib.target_features(draft_params, normed, captured)
            # a first chunk starts the request's context vocabulary afresh
            ctx = jnp.where((where == 0)[:, None], context_vocab.fresh(draft_params, len(n_valid)),
                            sub.seed.ctx)
            dk, dv, seed = draft_lib.catch_up(
                params, draft_params, cfg, spec, state.draft_k, state.draft_v, where, feats,
                shifted_chunk(tokens, n_valid, after), n_valid, slot_idx, ctx=ctx)
        new = new.replace(seed=seed)
        state = state.replace(draft_k=dk, draft_v=dv)
    return put_slots(state, axes, slot_idx, new, rows), first


def init_any_state(cfg: ModelConfig, spec, slots: int, max_len: int, dtype):
    """A state of either backend (spec None: plain) with the target's shapes: what the batch
    and row axes are read from (a head's own shapes change sizes, not which axis is which)."""
    if spec is None:
        from jaxspec.decode import init_plain_state
        return init_plain_state(cfg, slots, max_len, dtype)
    from jaxspec.spec.cycle import init_state
    return init_state(cfg, spec, slots, max_len, dtype)


@functools.lru_cache(maxsize=None)
def jit_admissions(cfg: ModelConfig, spec, slots: int, max_len: int, dtype):
    """({(features, form): admit program}, advance program, batch axes) of a backend's state
    (spec None: plain). The programs take (params, draft_params, state, ...) and donate the
    state; cached, so backends of the same shapes share executables."""
    make = functools.partial(init_any_state, cfg, spec, dtype=dtype)
    axes = batch_axes(lambda b: make(slots=b, max_len=max_len), slots)
    rows = batch_axes(lambda t: make(slots=slots, max_len=t), max_len, "row")
    programs = {(f, form): jit(functools.partial(admit, cfg=cfg, spec=spec, form=form,
                                                 axes=axes, rows=rows, features=f),
                               donate_argnums=(2,))
                for f in VARIANTS for form in FORMS}
    # rng splits per plain step (next key, draw) or per cycle (next key, draft, verify draws)
    splits = 2 if spec is None else 3
    advance = jit(lambda st, idx, n: st.replace(rng=advance_rows(st.rng, idx, n, splits)),
                  donate_argnums=(0,))
    return programs, advance, axes
