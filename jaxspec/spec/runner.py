"""Host loop for speculative generation: prefill a batch of prompts, dispatch cycles, collect.

Greedy and sampled requests share a batch (the per-slot parameters live in the device state). One
host read per cycle (the emitted tokens, accept lengths and logprobs); the cycle itself never
syncs. Slots past a stop or max_tokens are switched idle, which changes only an argument value, so
nothing recompiles after the first cycle.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ConfigError, ModelConfig
from jaxspec.sampling import (SamplingParams, SlotSampling, apply_stop_strings, logprob_dicts,
                              slot_keys)
from jaxspec.spec import draft as draft_lib
from jaxspec.spec.config import SpecConfig, check_vocab, resolve_spec
from jaxspec.spec.cycle import init_state, jit_cycle, jit_prefill


@dataclasses.dataclass
class SpecResult:
    token_ids: List[int]
    accept_lens: List[int]   # accepted drafted tokens per cycle (each cycle emits this + 1)
    finish_reason: str       # 'stop' (EOS / stop token included, or stop string) or 'length'
    logprobs: Optional[List[Dict[int, float]]] = None  # per token, when the request asked
    text: Optional[str] = None   # the text cut at a stop string (only when stop strings are checked)


def prompt_bucket(n: int, max_len: int, smallest: int = 16) -> int:
    """Padded prompt length: the next power of two (at least `smallest`), capped at max_len."""
    b = smallest
    while b < n:
        b *= 2
    return min(b, max_len)


class SpecRunner:
    def __init__(self, cfg: ModelConfig, params, draft_params, spec: Union[SpecConfig, str],
                 max_slots: int, max_len: int, seed: int = 0):
        self.cfg, self.params, self.draft_params = cfg, params, draft_params
        self.spec = resolve_spec(spec)
        check_vocab(self.spec, cfg.vocab_size)
        draft_lib.check_head(cfg, self.spec, draft_params)
        if max_slots < 1:
            raise ConfigError(f"max_slots={max_slots} must be >= 1")
        self.max_slots, self.max_len = max_slots, max_len
        self.dtype = params["embed"].dtype
        self._cycle = jit_cycle(cfg, self.spec)
        self._prefill = jit_prefill(cfg, self.spec, with_logprobs=True)
        self._state = None
        self.key = jax.random.PRNGKey(seed)

    def generate(self, prompts: Sequence[Sequence[int]],
                 sampling: Sequence[Union[SamplingParams, int]], eos_ids: Tuple[int, ...] = (),
                 detokenize: Optional[Callable[[List[int]], str]] = None) -> List[SpecResult]:
        """sampling: per prompt, SamplingParams (or an int: max_tokens, greedy).
        A request stops after an EOS in eos_ids (unless ignore_eos) or one of its
        stop_token_ids; its stop strings are checked when detokenize is given."""
        sps = check_requests(prompts, sampling, self.max_len, self.spec.num_steps + 1)
        results: List[SpecResult] = []
        for i in range(0, len(prompts), self.max_slots):
            results += self._run_group(prompts[i:i + self.max_slots],
                                       sps[i:i + self.max_slots], set(eos_ids), detokenize)
        return results

    def _run_group(self, prompts, sps, eos, detokenize) -> List[SpecResult]:
        b = self.max_slots
        p = prompt_bucket(max(len(x) for x in prompts), self.max_len)
        tokens = np.zeros((b, p), np.int32)
        lens = np.zeros((b,), np.int32)
        for j, x in enumerate(prompts):
            tokens[j, :len(x)] = x
            lens[j] = len(x)
        if self._state is None:
            self._state = init_state(self.cfg, self.spec, b, self.max_len, self.dtype,
                                     self.draft_params)
        self.key, sub = jax.random.split(self.key)
        self._state, first = self._prefill(self.params, self.draft_params, self._state,
                                           jnp.asarray(tokens), jnp.asarray(lens),
                                           SlotSampling.from_params(sps, b),
                                           slot_keys(sps, b, sub))
        n = len(prompts)
        reqs = [_Request(sp, eos, detokenize) for sp in sps]
        first = jax.device_get(first)
        for j in range(n):
            reqs[j].absorb([first.tokens[j]], [first.logprob[j]], [first.top_ids[j]],
                           [first.top_logprobs[j]])
        while True:
            active = np.array([j < n and reqs[j].reason is None for j in range(b)])
            if not active.any():
                break
            self._state, co = self._cycle(self.params, self.draft_params, self._state,
                                          jnp.asarray(active))
            co = jax.device_get(co)
            for j in np.flatnonzero(active):
                r, k = reqs[j], int(co.accept_len[j]) + 1
                r.accepts.append(k - 1)
                r.absorb(co.tokens[j, :k], co.logprob[j, :k], co.top_ids[j, :k],
                         co.top_logprobs[j, :k])
        return [r.result() for r in reqs]


def check_requests(prompts, sampling, max_len: int, slack: int) -> List[SamplingParams]:
    """Validates a batch of requests; returns their SamplingParams (an int means max_tokens,
    greedy). slack: cache rows needed past prompt + max_tokens (speculative rows)."""
    if len(prompts) != len(sampling):
        raise ConfigError(f"{len(prompts)} prompts but {len(sampling)} max_tokens / "
                          "sampling params")
    sps = [x if isinstance(x, SamplingParams) else _max_tokens_only(x) for x in sampling]
    for p, sp in zip(prompts, sps):
        if len(p) < 1:
            raise ConfigError("empty prompt")
        need = len(p) + sp.max_tokens + slack
        if need > max_len:
            raise ConfigError(
                f"prompt of {len(p)} tokens + max_tokens={sp.max_tokens} + {slack} speculative "
                f"rows needs {need} cache rows, max_len is {max_len}")
    return sps


def _max_tokens_only(m) -> SamplingParams:
    if not isinstance(m, (int, np.integer)) or m < 1:
        raise ConfigError(f"max_tokens={m} must be >= 1")
    return SamplingParams(max_tokens=int(m))


class _Request:
    """Host-side output of one request: tokens, logprobs, and when it finished."""

    def __init__(self, sp: SamplingParams, eos, detokenize):
        self.sp, self.detokenize = sp, detokenize if sp.stop else None
        self.stop_ids = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(eos))
        self.tokens: List[int] = []
        self.logprobs: List[dict] = []
        self.accepts: List[int] = []
        self.reason: Optional[str] = None
        self.text: Optional[str] = None

    def absorb(self, toks, lp, top_ids, top_lp):
        for i, t in enumerate(toks):
            if self.reason is not None:
                return
            self.tokens.append(int(t))
            if self.sp.logprobs is not None:
                self.logprobs += logprob_dicts([t], [lp[i]], [top_ids[i]], [top_lp[i]],
                                               self.sp.logprobs)
            if self.detokenize is not None:
                self.text, hit = apply_stop_strings(self.detokenize(self.tokens), self.sp.stop)
                if hit:
                    self.reason = "stop"
                    continue
            if int(t) in self.stop_ids:
                self.reason = "stop"
            elif len(self.tokens) >= self.sp.max_tokens:
                self.reason = "length"

    def result(self) -> SpecResult:
        return SpecResult(self.tokens, self.accepts, self.reason,
                          self.logprobs if self.sp.logprobs is not None else None, self.text)
