"""Host loop for speculative generation: prefill a batch of prompts, dispatch cycles, collect.

Greedy only for now. One host read per cycle (the emitted tokens and accept lengths); the cycle
itself never syncs. Slots past EOS or max_tokens are switched idle, which changes only an argument
value, so nothing recompiles after the first cycle.
"""
from __future__ import annotations

import dataclasses
from typing import List, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ConfigError, ModelConfig
from jaxspec.spec.config import SpecConfig, check_vocab, resolve_spec
from jaxspec.spec.cycle import init_state, jit_cycle, jit_prefill


@dataclasses.dataclass
class SpecResult:
    token_ids: List[int]
    accept_lens: List[int]   # accepted drafted tokens per cycle (each cycle emits this + 1)
    finish_reason: str       # 'stop' (EOS, included in token_ids) or 'length'


def prompt_bucket(n: int, max_len: int, smallest: int = 16) -> int:
    """Padded prompt length: the next power of two (at least `smallest`), capped at max_len."""
    b = smallest
    while b < n:
        b *= 2
    return min(b, max_len)


class SpecRunner:
    def __init__(self, cfg: ModelConfig, params, draft_params, spec: Union[SpecConfig, str],
                 max_slots: int, max_len: int):
        self.cfg, self.params, self.draft_params = cfg, params, draft_params
        self.spec = resolve_spec(spec)
        check_vocab(self.spec, cfg.vocab_size)
        if max_slots < 1:
            raise ConfigError(f"max_slots={max_slots} must be >= 1")
        self.max_slots, self.max_len = max_slots, max_len
        self.dtype = params["embed"].dtype
        self._cycle = jit_cycle(cfg, self.spec)
        self._prefill = jit_prefill(cfg, self.spec)
        self._state = None

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int],
                 eos_ids: Tuple[int, ...] = ()) -> List[SpecResult]:
        if len(prompts) != len(max_tokens):
            raise ConfigError(f"{len(prompts)} prompts but {len(max_tokens)} max_tokens")
        for p, m in zip(prompts, max_tokens):
            if len(p) < 1:
                raise ConfigError("empty prompt")
            if m < 1:
                raise ConfigError(f"max_tokens={m} must be >= 1")
            need = len(p) + m + self.spec.num_steps + 1
            if need > self.max_len:
                raise ConfigError(
                    f"prompt of {len(p)} tokens + max_tokens={m} + {self.spec.num_steps + 1} "
                    f"speculative rows needs {need} cache rows, max_len is {self.max_len}")
        results: List[SpecResult] = []
        for i in range(0, len(prompts), self.max_slots):
            results += self._run_group(prompts[i:i + self.max_slots],
                                       max_tokens[i:i + self.max_slots], set(eos_ids))
        return results

    def _run_group(self, prompts, max_tokens, eos) -> List[SpecResult]:
        b = self.max_slots
        p = prompt_bucket(max(len(x) for x in prompts), self.max_len)
        tokens = np.zeros((b, p), np.int32)
        lens = np.zeros((b,), np.int32)
        for j, x in enumerate(prompts):
            tokens[j, :len(x)] = x
            lens[j] = len(x)
        if self._state is None:
            self._state = init_state(self.cfg, self.spec, b, self.max_len, self.dtype)
        self._state, root = self._prefill(self.params, self.draft_params, self._state,
                                          jnp.asarray(tokens), jnp.asarray(lens))
        n = len(prompts)
        out = [[int(t)] for t in np.asarray(root)[:n]]
        accepts: List[List[int]] = [[] for _ in range(n)]
        reasons = [None] * n
        for j in range(n):
            reasons[j] = _finished(out[j], max_tokens[j], eos)
        while True:
            active = np.array([j < n and reasons[j] is None for j in range(b)])
            if not active.any():
                break
            self._state, co = self._cycle(self.params, self.draft_params, self._state,
                                          jnp.asarray(active))
            toks, acc = jax.device_get((co.tokens, co.accept_len))
            for j in np.flatnonzero(active):
                accepts[j].append(int(acc[j]))
                for t in toks[j, :acc[j] + 1]:
                    out[j].append(int(t))
                    reasons[j] = _finished(out[j], max_tokens[j], eos)
                    if reasons[j] is not None:
                        break
        return [SpecResult(out[j], accepts[j], reasons[j]) for j in range(n)]


def _finished(tokens, max_tokens, eos):
    if tokens[-1] in eos:
        return "stop"
    if len(tokens) >= max_tokens:
        return "length"
    return None
