"""What the engine drives on the device: a batch state of B slots, admission into chosen slots,
and one cycle over all slots with an `active` mask.

Both backends have the same host-side shape, so the engine's scheduling (admission, stops, abort,
retract) does not know which one runs:
  init_state()                                   -> state
  admit(state, slot_idx, tokens, start, n_valid, next_tok)  -> (state, first [A])
  cycle(state, active [B] bool)                  -> (state, tokens [B, E] (-1 padded), accept [B])
  emit                                           E, the most tokens (and KV rows) a slot gains
                                                 per cycle
Every jitted function takes the (flattened once by jit) weights plus a few flat arrays; the state
is donated, so caches are updated in place.
"""
from __future__ import annotations

import functools
from typing import List

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.config import ModelConfig
from jaxspec.kv import KVCache, init_cache
from jaxspec.models import llama
from jaxspec.sampling import SamplingParams, SlotSampling, sample
from jaxspec.spec.admit import (_chunk_forward, _last_row, batch_axes, jit_spec_admit,
                                put_slots, take_slots)
from pallas_kernels.kv_compact import kv_compact


class SpecBackend:
    """EAGLE speculative decoding: one jitted cycle (draft -> verify -> accept -> compaction ->
    catch-up) per engine cycle; greedy only until the cycle carries sampling state."""

    def __init__(self, cfg: ModelConfig, params, draft_params, spec, slots: int, max_len: int):
        from jaxspec.spec.config import check_vocab, resolve_spec
        from jaxspec.spec.cycle import jit_cycle
        self.cfg, self.params, self.draft_params = cfg, params, draft_params
        self.spec = resolve_spec(spec)
        check_vocab(self.spec, cfg.vocab_size)
        self.slots, self.max_len = slots, max_len
        self.dtype = params["embed"].dtype
        self.emit = self.spec.max_emit
        self._cycle = jit_cycle(cfg, self.spec)
        self._admit = jit_spec_admit(cfg, self.spec, slots, max_len, self.dtype)

    def check(self, sp: SamplingParams):
        if sp.temperature > 0:
            raise ValueError("speculative decoding is greedy only in this version: use "
                             "temperature=0, or an LLM without spec= to sample")

    def set_sampling(self, slot: int, sp: SamplingParams):
        pass

    def init_state(self):
        from jaxspec.spec.cycle import init_state
        return init_state(self.cfg, self.spec, self.slots, self.max_len, self.dtype)

    def admit(self, state, slot_idx, tokens, start, n_valid, next_tok):
        return self._admit(self.params, self.draft_params, state, slot_idx, tokens, start,
                           n_valid, next_tok)

    def cycle(self, state, active):
        state, out = self._cycle(self.params, self.draft_params, state, active)
        return state, out.tokens, out.accept_len

    def jitted(self) -> List:
        return [self._cycle, self._admit]


# ----------------------------------------------------------------------------- plain decoding


@struct.dataclass
class PlainState:
    """cache KVCache [L, B, Hkv, T, D]; tokens [B] next input token (no KV yet); key rng."""
    cache: KVCache
    tokens: jax.Array
    key: jax.Array


def init_plain_state(cfg: ModelConfig, slots: int, max_len: int, dtype, seed: int = 0):
    return PlainState(init_cache(cfg, slots, max_len, dtype), jnp.zeros((slots,), jnp.int32),
                      jax.random.PRNGKey(seed))


def plain_admit(params, state: PlainState, sp: SlotSampling, slot_idx, tokens, start, n_valid,
                next_tok, *, cfg: ModelConfig, axes):
    """One prefill chunk for A requests in slots slot_idx (see spec_admit for the arguments);
    on a last chunk the first token is sampled with the slot's parameters."""
    sub = take_slots(state, axes, slot_idx)
    cache, hidden = _chunk_forward(params, cfg, sub.cache, tokens, start, n_valid)
    key, k1 = jax.random.split(state.key)
    sub_sp = jax.tree_util.tree_map(lambda x: jnp.take(x, slot_idx, axis=0, mode="clip"), sp)
    first = sample(llama.lm_head(params, cfg, _last_row(hidden, n_valid)), sub_sp, k1)
    is_last = next_tok < 0
    new = PlainState(cache, jnp.where(is_last, first, sub.tokens), sub.key)
    state = put_slots(state, axes, slot_idx, new)
    return state.replace(key=key), jnp.where(is_last, first, -1)


def plain_cycle(params, state: PlainState, sp: SlotSampling, active, *, cfg: ModelConfig,
                n_steps: int):
    """n_steps decode steps for the active slots; idle slots write no KV rows.

    Returns (state, tokens [B, n_steps] (-1 for idle slots))."""
    b = active.shape[0]
    count = active.astype(jnp.int32)
    mask = jnp.ones((b, 1, 1), bool)
    src = jnp.zeros((b, 1), jnp.int32)

    def step(carry, _):
        cache, tok, key = carry
        key, sub = jax.random.split(key)
        hidden, k_new, v_new, _ = llama.forward(params, cfg, tok[:, None], cache.lens[:, None],
                                                cache.k, cache.v, cache.lens, mask)
        k, v = kv_compact(cache.k, cache.v, k_new, v_new, cache.lens, src, count)
        nxt = sample(llama.lm_head(params, cfg, hidden[:, 0]), sp, sub)
        nxt = jnp.where(active, nxt, tok)
        return (KVCache(k, v, cache.lens + count), nxt, key), nxt

    (cache, tok, key), out = jax.lax.scan(step, (state.cache, state.tokens, state.key), None,
                                          length=n_steps)
    return PlainState(cache, tok, key), jnp.where(active[:, None], out.T, -1)


@functools.lru_cache(maxsize=None)
def _jit_plain(cfg: ModelConfig, slots: int, max_len: int, dtype, n_steps: int):
    axes = batch_axes(lambda b: init_plain_state(cfg, b, max_len, dtype), slots)
    admit = jax.jit(functools.partial(plain_admit, cfg=cfg, axes=axes), donate_argnums=(1,))
    cycle = jax.jit(functools.partial(plain_cycle, cfg=cfg, n_steps=n_steps), donate_argnums=(1,))
    return admit, cycle


class PlainBackend:
    """Plain decoding: n_steps decode steps per engine cycle (several per dispatch amortize the
    host's per-dispatch cost); sampling per slot."""

    def __init__(self, cfg: ModelConfig, params, slots: int, max_len: int, n_steps: int = 4,
                 seed: int = 0):
        self.cfg, self.params = cfg, params
        self.slots, self.max_len, self.seed = slots, max_len, seed
        self.dtype = params["embed"].dtype
        self.emit = n_steps
        self._admit, self._cycle = _jit_plain(cfg, slots, max_len, self.dtype, n_steps)
        self._sp = [SamplingParams()] * slots
        self._sp_dev = None

    def check(self, sp: SamplingParams):
        pass

    def set_sampling(self, slot: int, sp: SamplingParams):
        if self._sp[slot] != sp:
            self._sp[slot] = sp
            self._sp_dev = None

    def _sampling(self) -> SlotSampling:
        # Rebuilt only when a slot's parameters change; the arrays stay on the device otherwise.
        if self._sp_dev is None:
            self._sp_dev = SlotSampling.from_params(self._sp, self.slots)
        return self._sp_dev

    def init_state(self):
        return init_plain_state(self.cfg, self.slots, self.max_len, self.dtype, self.seed)

    def admit(self, state, slot_idx, tokens, start, n_valid, next_tok):
        return self._admit(self.params, state, self._sampling(), slot_idx, tokens, start,
                           n_valid, next_tok)

    def cycle(self, state, active):
        state, toks = self._cycle(self.params, state, self._sampling(), active)
        return state, toks, None

    def jitted(self) -> List:
        return [self._cycle, self._admit]
