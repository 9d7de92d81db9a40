"""Plain (non-speculative) decoding on device: multi-step decode and the plain backend's state.

Prompts are prefilled by the engine's admission programs (`engine.admission`); `plain_cycle` is
the plain backend's program, `decode_steps` the bare greedy loop the benchmarks time.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.config import ModelConfig, layout_of
from jaxspec.kv import KVCache, init_cache
from jaxspec.models import llama
from jaxspec.sampling import (MAX_LOGPROBS, Emitted, Features, SlotSampling, TokenCounts,
                              apply_penalties, cond, no_logprobs, sample, sample_slots,
                              split_slot_keys, token_logprobs)
from jaxspec.xla_options import jit
from pallas_kernels.kv_compact import kv_compact


def _append(cache: KVCache, k_new, v_new, count) -> KVCache:
    """Writes the first count[b] new rows of each slot at its end; lens += count."""
    b, n = k_new.shape[1], k_new.shape[3]
    src = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
    k, v = kv_compact(cache.k, cache.v, k_new, v_new, cache.lens, src, count)
    return KVCache(k, v, cache.lens + count)


def loop_params(params, cfg: ModelConfig, n_steps: int):
    """The params a multi-step decode loop should close over.

    With the unrolled layout, static slices of the stacked weights are read in place by a
    single step, but inside a loop body XLA copies each slice out on every iteration (measured
    at 2.4x the bytes floor for 32 steps of an 8B model on the H100, against 1.1x for one step
    per call). Slicing once, before the loop, makes the per-layer weights loop invariants:
    one copy per call instead of one per step."""
    if n_steps > 1 and layout_of(cfg).unroll_layers and not isinstance(params["layers"], (list, tuple)):
        return llama.unstack_layers(params)
    return params


def scan_steps(step, carry, xs, n_steps: int):
    """lax.scan(step, carry, xs, length=n_steps), without the loop when n_steps == 1.

    A one-iteration scan is still a while loop to XLA, which does not fuse or schedule across
    its boundary; on the H100 at the Llama-3-8B shape, batch 1, decode_steps with a one-step
    scan took 6.50 ms per step where the same step jitted without it took 5.66 ms."""
    if n_steps != 1:
        return jax.lax.scan(step, carry, xs, length=n_steps)
    x0 = None if xs is None else jax.tree_util.tree_map(lambda x: x[0], xs)
    carry, y = step(carry, x0)
    return carry, jax.tree_util.tree_map(lambda a: a[None], y)


@functools.partial(jit, static_argnums=(1, 6), donate_argnums=(2,))
def decode_steps(params, cfg: ModelConfig, cache: KVCache, tokens, sp: SlotSampling, key,
                 n_steps: int):
    """n_steps decode steps. tokens [B] sit at position cache.lens.

    Returns (cache, next tokens [B, n_steps], key).
    """
    b = tokens.shape[0]
    mask = jnp.ones((b, 1, 1), bool)
    params = loop_params(params, cfg, n_steps)

    def step(carry, _):
        cache, tok, key = carry
        key, sub = jax.random.split(key)
        hidden, k_new, v_new, _ = llama.forward(params, cfg, tok[:, None], cache.lens[:, None],
                                                cache.k, cache.v, cache.lens, mask)
        cache = _append(cache, k_new, v_new, jnp.ones((b,), jnp.int32))
        nxt = sample(llama.lm_head(params, cfg, hidden[:, 0]), sp, sub)
        return (cache, nxt, key), nxt

    (cache, _, key), out = scan_steps(step, (cache, tokens, key), None, n_steps)
    return cache, out.T, key


def _emit(logits, sp: SlotSampling, hist: TokenCounts, keys, forced, num_top: int, live=None):
    """logits [B, V] raw -> (Emitted [B], hist with the token counted, next keys).

    forced [B] (or None): emit these tokens instead of sampling, reporting their logprobs.
    live [B] bool (or None: all): only these slots count the token and advance their key."""
    pen = cond(sp.any_penalty(), lambda: apply_penalties(logits, sp, hist), lambda: logits)
    if live is None:
        live = jnp.ones(logits.shape[:1], bool)
    # A batch known to be greedy without penalties (LEAN) neither reads its keys nor its counts:
    # they stay as they are (see spec.cycle.cycle).
    lean = sp.features is not None and not sp.features.sampled
    if lean and forced is None:
        tok = sample_slots(pen, sp, None)
    else:
        new_keys, sub = split_slot_keys(keys, 2)
        tok = sample_slots(pen, sp, sub) if forced is None else forced.astype(jnp.int32)
        keys = jnp.where(live[:, None], new_keys, keys)
    lp, ids, tlp = token_logprobs(pen[:, None], sp, tok[:, None], num_top)
    if sp.features is None or sp.features.penalty:
        hist = hist.add(tok[:, None], live[:, None])
    return Emitted(tok, lp[:, 0], ids[:, 0], tlp[:, 0]), hist, keys


@functools.partial(jit, static_argnums=(1,), static_argnames=("num_top",))
def first_token(params, cfg: ModelConfig, hidden, sp: SlotSampling, hist: TokenCounts, keys,
                forced=None, num_top: int = MAX_LOGPROBS):
    """hidden [B, H] of the last prompt row -> (Emitted [B], hist, keys). hist holds the prompt
    (TokenCounts.from_prompts); keys [B, 2] per-slot rng keys."""
    return _emit(llama.lm_head(params, cfg, hidden), sp, hist, keys, forced, num_top)


def decode_scan(params, cfg: ModelConfig, cache: KVCache, tokens, sp: SlotSampling,
                hist: TokenCounts, keys, forced=None, active=None, *, n_steps: int,
                num_top: int = MAX_LOGPROBS, features: Optional[Features] = None):
    """The body of `sample_steps` (not jitted, to be traced inside other functions).

    active [B] bool (or None: all): idle slots write no KV rows, keep their input token, counts
    and key; their emitted tokens are meaningless. features (static, or None: device flags under
    lax.cond): what the batch uses, known on the host (`sampling.Features`)."""
    b = tokens.shape[0]
    sp = sp.with_features(features)
    mask = jnp.ones((b, 1, 1), bool)
    xs = None if forced is None else forced.T
    params = loop_params(params, cfg, n_steps)
    count = jnp.ones((b,), jnp.int32) if active is None else active.astype(jnp.int32)

    def step(carry, f):
        cache, tok, hist, keys = carry
        hidden, k_new, v_new, _ = llama.forward(params, cfg, tok[:, None], cache.lens[:, None],
                                                cache.k, cache.v, cache.lens, mask)
        cache = _append(cache, k_new, v_new, count)
        em, hist, keys = _emit(llama.lm_head(params, cfg, hidden[:, 0]), sp, hist, keys, f,
                               num_top, active)
        nxt = em.tokens if active is None else jnp.where(active, em.tokens, tok)
        return (cache, nxt, hist, keys), em

    (cache, _, hist, keys), out = scan_steps(step, (cache, tokens, hist, keys), xs, n_steps)
    out = jax.tree_util.tree_map(lambda x: jnp.moveaxis(x, 0, 1), out)
    return cache, hist, keys, out


@functools.partial(jit, static_argnums=(1,), static_argnames=("n_steps", "num_top"),
                   donate_argnums=(2, 5))
def sample_steps(params, cfg: ModelConfig, cache: KVCache, tokens, sp: SlotSampling,
                 hist: TokenCounts, keys, forced=None, *, n_steps: int,
                 num_top: int = MAX_LOGPROBS):
    """n_steps decode steps with penalties, per-slot keys and logprobs. tokens [B] sit at
    position cache.lens and are already counted in hist.

    forced [B, n_steps] (or None): teacher forcing, to score a given continuation.
    Returns (cache, hist, keys, Emitted [B, n_steps]).
    """
    return decode_scan(params, cfg, cache, tokens, sp, hist, keys, forced, n_steps=n_steps,
                       num_top=num_top)


@struct.dataclass
class PlainState:
    """The plain backend's batch state; its fields are the ones an admission writes
    (`engine.admission`), named as in `spec.cycle.SpecState`.

    target    KVCache [L, B, Hkv, T, D]
    root      [B] next input token (no KV yet, already counted)
    sampling  SlotSampling [B]; rng [B, 2] per-slot keys; history TokenCounts [B, V]
    """
    target: KVCache
    root: jax.Array
    sampling: SlotSampling
    rng: jax.Array
    history: TokenCounts


def init_plain_state(cfg: ModelConfig, slots: int, max_len: int, dtype) -> PlainState:
    return PlainState(init_cache(cfg, slots, max_len, dtype), jnp.zeros((slots,), jnp.int32),
                      SlotSampling.greedy(slots), jnp.zeros((slots, 2), jnp.uint32),
                      TokenCounts.zeros(slots, cfg.vocab_size))


def plain_cycle(params, draft_params, state: PlainState, active, *, cfg: ModelConfig,
                n_steps: int, features: Optional[Features] = None):
    """n_steps decode steps for the active slots (`decode_scan`: penalties, per-slot keys,
    logprobs); idle slots write no KV rows and change nothing. draft_params: unused (every
    backend program takes the same leading arguments).

    Returns (state, Emitted with tokens [B, n_steps] (-1 for idle slots))."""
    del draft_params
    cache, hist, keys, em = decode_scan(params, cfg, state.target, state.root, state.sampling,
                                        state.history, state.rng, active=active,
                                        n_steps=n_steps, features=features)
    root = jnp.where(active, em.tokens[:, -1], state.root)
    new = PlainState(cache, root, state.sampling, keys, hist)
    lp = (em.logprob, em.top_ids, em.top_logprobs)
    if features is not None and not features.logprobs:
        lp = no_logprobs(root.shape[0])      # the steps' zeros are then never written
    return new, Emitted(jnp.where(active[:, None], em.tokens, -1), *lp)
