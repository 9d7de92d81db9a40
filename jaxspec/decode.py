"""Plain (non-speculative) decoding: chunked prefill and multi-step decode, all on device.

The host dispatches `decode_steps` chunks back to back and reads a chunk's tokens only after the
next chunk is already queued, so the GPU never waits on the host (JAX dispatch is asynchronous).
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Dict, List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.kv import KVCache
from jaxspec.models import llama
from jaxspec.sampling import (MAX_LOGPROBS, Emitted, Features, SamplingParams, SlotSampling,
                              TokenCounts, apply_penalties, cond, logprob_dicts, sample,
                              sample_slots, slot_keys, split_slot_keys, token_logprobs)
from jaxspec.xla_options import jit
from pallas_kernels.kv_compact import kv_compact


def _append(cache: KVCache, k_new, v_new, count) -> KVCache:
    """Writes the first count[b] new rows of each slot at its end; lens += count."""
    b, n = k_new.shape[1], k_new.shape[3]
    src = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
    k, v = kv_compact(cache.k, cache.v, k_new, v_new, cache.lens, src, count)
    return KVCache(k, v, cache.lens + count)


@functools.partial(jit, static_argnums=(1,), donate_argnums=(2,))
def prefill_chunk(params, cfg: ModelConfig, cache: KVCache, tokens, n_valid):
    """tokens [B, C] (padded), n_valid [B] -> (cache, hidden of each slot's last valid row [B, H]).

    Extends each slot's cache by n_valid[b] rows (0 leaves a slot untouched).
    """
    b, c = tokens.shape
    positions = cache.lens[:, None] + jnp.arange(c, dtype=jnp.int32)[None, :]
    mask = llama.causal_mask(b, c, n_valid)
    hidden, k_new, v_new, _ = llama.forward(params, cfg.for_prefill(), tokens, positions,
                                            cache.k, cache.v, cache.lens, mask)
    last = jnp.take_along_axis(hidden, jnp.maximum(n_valid - 1, 0)[:, None, None], axis=1)[:, 0]
    return _append(cache, k_new, v_new, n_valid), last


@functools.partial(jit, static_argnums=(1,))
def sample_from_hidden(params, cfg: ModelConfig, hidden, sp: SlotSampling, key):
    """hidden [B, H] (before the final norm) -> next tokens [B]."""
    return sample(llama.lm_head(params, cfg, hidden), sp, key)


def loop_params(params, cfg: ModelConfig, n_steps: int):
    """The params a multi-step decode loop should close over.

    With the unrolled layout, static slices of the stacked weights are read in place by a
    single step, but inside a loop body XLA copies each slice out on every iteration (measured
    at 2.4x the bytes floor for 32 steps of an 8B model on the H100, against 1.1x for one step
    per call). Slicing once, before the loop, makes the per-layer weights loop invariants:
    one copy per call instead of one per step."""
    if n_steps > 1 and cfg.unroll_layers and not isinstance(params["layers"], (list, tuple)):
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


def prefill_bucket(n: int, chunk: int) -> int:
    """Padded prefill width: the next power of two >= n (at least 16), capped at chunk."""
    return min(chunk, max(16, 1 << (max(n, 1) - 1).bit_length()))


@dataclasses.dataclass
class Generation:
    token_ids: List[int]
    finish_reason: str       # "stop" (EOS / stop token, included) or "length"
    ttft_s: float
    latency_s: float
    logprobs: Optional[List[Dict[int, float]]] = None   # per token, when the request asked


def finish(tokens: Sequence[int], max_tokens: int, stop_ids) -> tuple[list, str | None]:
    """Cuts a token stream at the first stop token (kept) or at max_tokens."""
    for i, t in enumerate(tokens[:max_tokens]):
        if t in stop_ids:
            return list(tokens[:i + 1]), "stop"
    if len(tokens) >= max_tokens:
        return list(tokens[:max_tokens]), "length"
    return list(tokens), None


class PlainRunner:
    """Batched plain decoding over a fixed set of slots."""

    def __init__(self, cfg: ModelConfig, params, cache: KVCache, *, prefill_chunk_size=512,
                 decode_chunk=16, seed=0):
        self.cfg, self.params, self.cache = cfg, params, cache
        self.prefill_chunk_size, self.decode_chunk = prefill_chunk_size, decode_chunk
        self.key = jax.random.PRNGKey(seed)

    @property
    def slots(self) -> int:
        return self.cache.lens.shape[0]

    def prefill(self, prompts: Sequence[Sequence[int]]):
        """Resets the cache and prefills prompts into slots 0..len-1; returns last hidden [B, H]."""
        b, c = self.slots, self.prefill_chunk_size
        self.cache = dataclasses.replace(self.cache, lens=jnp.zeros((b,), jnp.int32))
        lens = np.zeros(b, np.int64)
        lens[:len(prompts)] = [len(p) for p in prompts]
        width = prefill_bucket(int(lens.max()), c)
        last = None
        for start in range(0, int(lens.max()), width):
            toks = np.zeros((b, width), np.int32)
            for i, p in enumerate(prompts):
                seg = p[start:start + width]
                toks[i, :len(seg)] = seg
            n_valid = np.clip(lens - start, 0, width).astype(np.int32)
            self.cache, h = prefill_chunk(self.params, self.cfg, self.cache, jnp.asarray(toks),
                                          jnp.asarray(n_valid))
            last = h if last is None else jnp.where(jnp.asarray(n_valid > 0)[:, None], h, last)
        return last

    def generate(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams],
                 stop_ids: Sequence[set]) -> List[Generation]:
        t0 = time.perf_counter()
        b = self.slots
        sp = SlotSampling.from_params(params, b)
        self.key, sub = jax.random.split(self.key)
        keys = slot_keys(params, b, sub)
        hist = TokenCounts.from_prompts(*_padded(prompts, b), self.cfg.vocab_size)
        last = self.prefill(prompts)
        em, hist, keys = first_token(self.params, self.cfg, last, sp, hist, keys)
        tok = em.tokens
        first = jax.device_get(jax.tree_util.tree_map(lambda x: x[:, None], em))
        ttft = time.perf_counter() - t0
        streams = [[] for _ in prompts]
        lps: List[list] = [[] for _ in prompts]
        results: List[Generation | None] = [None] * len(prompts)
        pending = []

        def absorb(out: Emitted):
            for i, s in enumerate(streams):
                if results[i] is None:
                    s.extend(out.tokens[i].tolist())
                    if params[i].logprobs is not None:
                        lps[i] += logprob_dicts(out.tokens[i], out.logprob[i], out.top_ids[i],
                                                out.top_logprobs[i], params[i].logprobs)
            self._settle(streams, lps, results, params, stop_ids, ttft,
                         time.perf_counter() - t0)

        absorb(first)
        while any(r is None for r in results):
            self.cache, hist, keys, out = sample_steps(self.params, self.cfg, self.cache, tok, sp,
                                                       hist, keys, n_steps=self.decode_chunk)
            tok = out.tokens[:, -1]
            pending.append(out)
            if len(pending) > 1:   # read the previous chunk while this one runs
                absorb(jax.device_get(pending.pop(0)))
        return results

    @staticmethod
    def _settle(streams, lps, results, params, stop_ids, ttft, elapsed):
        for i, s in enumerate(streams):
            if results[i] is None:
                toks, reason = finish(s, params[i].max_tokens, stop_ids[i])
                if reason:
                    lp = lps[i][:len(toks)] if params[i].logprobs is not None else None
                    results[i] = Generation(toks, reason, ttft, elapsed, lp)


def _padded(prompts: Sequence[Sequence[int]], slots: int):
    """-> (tokens [slots, P] int32 zero-padded, lens [slots] int32) as device arrays."""
    p = max(len(x) for x in prompts)
    toks = np.zeros((slots, p), np.int32)
    lens = np.zeros((slots,), np.int32)
    for i, x in enumerate(prompts):
        toks[i, :len(x)] = x
        lens[i] = len(x)
    return jnp.asarray(toks), jnp.asarray(lens)
