"""Admission: prefill new requests into chosen slots of a live batch state, between cycles.

The engine keeps one static-shape batch state (B slots) alive for its whole life. New requests are
prefilled into free slots without touching the others: the admitted slots' per-slot leaves
(sampling, keys, counts, lengths, draft seed) are gathered along the batch axis into an A-slot
sub-state (A = a slot-count bucket), one prompt chunk is run, and the sub-state is scattered back.
The KV caches are never gathered: the chunk's attention reads the admitted slots' rows of the
whole cache and its K/V rows are written there in place (the kernels' `slots` argument). Padding
rows of a bucket carry the slot index B, which the gathers clip and the writes drop, so they
change nothing.

Chunks: a prompt of P tokens is prefilled in chunks of at most `chunk` rows, each at rows
start..start+n_valid-1 over the rows the earlier chunks wrote. The draft catch-up of a chunk
pairs the target feature at t with the token at t+1, so each chunk also gets `next_tok`, the
first token of the next chunk, or -1 on a request's last chunk, where the root (the first
generated token, the target's argmax after the prompt) takes its place.

Sampling: each admission also carries the request's parameters (`AdmitArgs`, flat per-row
arrays, so new parameters never recompile): every chunk writes the slot's SlotSampling rows, rng
key and token counts (prompt tokens seen, output tokens counted), the first chunk starting from
empty counts. A request resumed after a retract is prefilled over prompt + output[:-1] with its
last output token as the given root (nothing drawn), its output counted, and (`advance_keys`,
a separate call made only for such requests) its key advanced past the draws it already made,
so a retract changes neither penalties nor seeded outputs.

Variants: like the cycle, admission is compiled once per `sampling.Features` variant and the
host picks the one its admitted requests need, so the program holds no conditional and no loop
on device values. On the GPU each of those makes the host read a flag back and wait for the
device: an admission with them held the host for about 6 ms at batch 64 on the H100
(bench/profile_engine.py), several chain cycles' worth.

Batch axes: found per leaf, not assumed. `batch_axes(make_state, B)` evaluates the state's shapes
for B and B+1 slots (`jax.eval_shape`, no memory) and marks the one axis that differs: KV caches
are [L, B, Hkv, T, D] (axis 1), per-slot vectors and tables [B, ...] (axis 0); a leaf without a
batch axis (a shared rng key) is marked -1 and left to the caller.
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
from jaxspec.spec import context_vocab
from jaxspec.spec import draft as draft_lib
from jaxspec.spec.config import SpecConfig
from jaxspec.sampling import (FULL, MAX_LOGPROBS, VARIANTS, Emitted, Features, SlotSampling,
                              TokenCounts, apply_penalties, cond, sample_slots, split_slot_keys,
                              token_logprobs)
from jaxspec.spec.cycle import init_state
from jaxspec.xla_options import jit
from pallas_kernels.kv_compact import kv_compact


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
        pick = lambda x, d: d if x is None else x
        return cls(pick(root, z - 1), pick(n_prompt, z + np.iinfo(np.int32).max),
                   pick(samp_f, f), pick(samp_i, i), pick(key, np.zeros((a, 2), np.uint32)),
                   pick(serial, z.copy()))


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


def admit_sampling(logits, hist: TokenCounts, adm: AdmitArgs, engine_key, is_last,
                   features: Features = FULL):
    """The first token of admitted rows, from logits [A, V] (raw) of their last prompt row.

    Draws (with the slot's parameters, counts and key, as the batch prefill does) where the
    request is new, takes adm.root where it is resumed. features: what the admitted requests
    use (LEAN leaves sampling, penalties and logprobs out). The slot's key becomes its base key
    split once (the first draw); a resumed request's further advance is `advance_keys`'.
    Returns (SlotSampling, Emitted [A] (tokens -1 unless a new request's last chunk), hist with
    the root counted on last chunks, keys [A, 2]).
    """
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
    advance [A] splits into `key_splits` (the backend's per-step or per-cycle split): where a
    resumed request's earlier run left its key. A loop on a device value, so it runs only for
    resumed requests that sample (greedy ones never read their key)."""
    rows = jnp.take(keys, slot_idx, axis=0, mode="clip")

    def step(i, k):
        return jnp.where((i < advance)[:, None], split_slot_keys(k, key_splits)[0], k)

    rows = jax.lax.fori_loop(0, jnp.max(advance), step, rows)
    return keys.at[slot_idx].set(rows, mode="drop")


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

    rows: the state's row axes (-1 for leaves without one). The KV leaves (those with a row
    axis) are then not gathered: they stand in as empty arrays (0 rows), since an admission
    reads and writes the caches in place (`_chunk_forward`). A gathered slot is its whole cache
    (47 MB per slot for SmolLM2 at 2,048 rows).
    """
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
    Leaves without a batch axis keep the state's value; with rows (see take_slots) so do the
    KV leaves."""
    def put(x, ax, s, rax=-1):
        if ax < 0 or rax >= 0:
            return x
        where = [slice(None)] * x.ndim
        where[ax] = slot_idx
        return x.at[tuple(where)].set(s.astype(x.dtype), mode="drop")

    extra = () if rows is None else (rows,)
    return jax.tree_util.tree_map(put, state, axes, sub, *extra)


def _chunk_forward(params, cfg: ModelConfig, cache: KVCache, tokens, start, n_valid, slots):
    """Target forward over one chunk at rows start.. of slots `slots` [A] of the whole batch's
    cache (slots B: padding rows, nothing written). Reads and writes those slots' rows in place:
    gathering them would copy whole slot caches (47 MB a slot for SmolLM2 at 2,048 rows) in and
    out for every chunk.

    Returns (cache k, v with n_valid rows written at start, hidden [A, C, H])."""
    return _chunk_forward_captured(params, cfg, cache, tokens, start, n_valid, slots)[:2]


def _chunk_forward_captured(params, cfg: ModelConfig, cache: KVCache, tokens, start, n_valid,
                            slots, capture_layers=()):
    """_chunk_forward, plus the outputs of `capture_layers` [len, A, C, H] (None if none)."""
    a, c = tokens.shape
    rows = jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32)[None], (a, c))
    hidden, k_new, v_new, captured = llama.forward(
        params, cfg.for_prefill(), tokens, start[:, None] + rows, cache.k, cache.v, start,
        llama.causal_mask(a, c, n_valid), capture_layers, slots=slots)
    k, v = kv_compact(cache.k, cache.v, k_new, v_new, start, rows, n_valid, slots)
    return (k, v), hidden, captured


def _last_row(x, n_valid):
    """x [A, C, ...] -> row n_valid - 1 of each slot [A, ...]."""
    idx = jnp.maximum(n_valid - 1, 0).reshape((-1, 1) + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, idx, axis=1)[:, 0]


def spec_admit(params, draft_params, state, slot_idx, tokens, start, n_valid, next_tok,
               adm: AdmitArgs, engine_key, *, cfg: ModelConfig, spec: SpecConfig, axes, rows,
               features: Features = FULL):
    """One prefill chunk of target and draft for A requests in slots slot_idx.

    slot_idx [A] int32 (B = padding); tokens [A, C] (padded); start [A] rows already prefilled;
    n_valid [A] rows in this chunk; next_tok [A] the token after the chunk, -1 on the last chunk;
    adm: the requests' sampling (AdmitArgs); engine_key [2] uint32. rows: the state's row axes:
    the KV caches are read and written in place at the slots (`_chunk_forward`), only the
    per-slot leaves are gathered and scattered.
    Returns (state, Emitted [A]): the root (first generated token) and its logprobs on a new
    request's last chunk, else token -1.
    """
    a, c = tokens.shape
    sub = take_slots(state, axes, slot_idx, rows)          # per-slot leaves; no KV rows
    (tk, tv), hidden, captured = _chunk_forward_captured(
        params, cfg, state.target, tokens, start, n_valid, slot_idx,
        draft_lib.capture_layers(draft_params))
    normed = llama.final_norm(params, cfg, hidden)
    feats = draft_lib.target_features(draft_params, normed, captured)
    is_last = next_tok < 0
    hist = chunk_history(sub.history, tokens, start, n_valid, adm.n_prompt)
    logits = llama.project_logits(params, _last_row(normed, n_valid))
    sp, first, hist, keys = admit_sampling(logits, hist, adm, engine_key, is_last, features)
    root = jnp.where(adm.root >= 0, adm.root, first.tokens)
    cols = jnp.arange(c, dtype=jnp.int32)[None]
    shifted = jnp.concatenate([tokens[:, 1:], jnp.zeros((a, 1), tokens.dtype)], axis=1)
    shifted = jnp.where(cols == (n_valid - 1)[:, None],
                        jnp.where(is_last, root, next_tok)[:, None], shifted)
    # a first chunk starts the request's context vocabulary afresh
    ctx = jnp.where((start == 0)[:, None], context_vocab.fresh(draft_params, a), sub.seed.ctx)
    dk, dv, seed = draft_lib.catch_up(params, draft_params, cfg, spec, state.draft_k,
                                      state.draft_v, start, feats, shifted, n_valid, slot_idx,
                                      ctx=ctx)
    new = sub.replace(target=sub.target.replace(lens=start + n_valid),
                      root=jnp.where(is_last, root, sub.root), seed=seed, sampling=sp, rng=keys,
                      history=hist)
    state = state.replace(target=state.target.replace(k=tk, v=tv), draft_k=dk, draft_v=dv)
    return put_slots(state, axes, slot_idx, new, rows), first


def admit_programs(admit_fn, packed_fn, rows, donate: int) -> dict:
    """{(features, form): jitted program} per `sampling.VARIANTS`, form True for padded first
    chunks, False for the general form, "packed" for packed first chunks (`admit_packed`);
    argument `donate` (the state) is donated. admit_fn / packed_fn: spec_admit /
    spec_admit_packed or the plain ones, static arguments bound. The padded first chunk and the
    general form are one program (a first chunk starts at row 0 of the same in-place forward);
    both keys stay so the engine's bucket keys do not change."""
    general = {f: jit(functools.partial(admit_fn, features=f, rows=rows), donate_argnums=(donate,))
               for f in VARIANTS}
    out = {(f, first): general[f] for f in VARIANTS for first in (False, True)}
    out.update({(f, "packed"): jit(functools.partial(packed_fn, features=f, rows=rows),
                                   donate_argnums=(donate,)) for f in VARIANTS})
    return out


@functools.lru_cache(maxsize=None)
def jit_spec_admit(cfg: ModelConfig, spec: SpecConfig, slots: int, max_len: int, dtype):
    """{(features, form): spec_admit(params, draft_params, state, slot_idx, tokens, start,
    n_valid, next_tok, adm, engine_key)} per `sampling.VARIANTS`, under the keys of the
    padded first-chunk form and the general one (one program, `admit_programs`), and the packed
    one (`spec_admit_packed`, without start), and advance(state, slot_idx, advance); the state
    is donated. Buckets are the input shapes."""
    axes = batch_axes(lambda b: init_state(cfg, spec, b, max_len, dtype), slots)
    rows = batch_axes(lambda t: init_state(cfg, spec, slots, t, dtype), max_len, "row")
    from jaxspec.spec.admit_packed import spec_admit_packed
    admits = admit_programs(functools.partial(spec_admit, cfg=cfg, spec=spec, axes=axes),
                            functools.partial(spec_admit_packed, cfg=cfg, spec=spec, axes=axes),
                            rows, donate=2)
    # The cycle splits each slot's key into 3 (next key, draft draws, verify draws).
    advance = jit(lambda st, idx, n: st.replace(rng=advance_rows(st.rng, idx, n, 3)),
                  donate_argnums=(0,))
    return admits, advance
