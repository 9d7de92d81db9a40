"""Sampling parameters (host side, validated) and the on-device sampler.

Per-request parameters travel to the device as per-slot arrays, so a batch that mixes greedy and
sampled requests, or changes parameters between calls, never recompiles.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """What to generate. temperature 0 is greedy; top_k 0 (or -1) and top_p 1 disable those."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int = 16
    seed: Optional[int] = None
    stop_token_ids: Tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not (isinstance(self.max_tokens, (int, np.integer)) and self.max_tokens > 0):
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not (np.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_k, (int, np.integer)) and self.top_k >= -1):
            raise ValueError(f"top_k must be an integer >= -1 (0 or -1 disable it), got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SlotSampling:
    """Per-slot device arrays: temperature [B] f32, top_k [B] i32 (0 = off), top_p, min_p [B]."""
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], slots: int) -> "SlotSampling":
        pad = [SamplingParams()] * (slots - len(params))
        ps = list(params) + pad
        return cls(
            temperature=jnp.asarray([p.temperature for p in ps], jnp.float32),
            top_k=jnp.asarray([max(p.top_k, 0) for p in ps], jnp.int32),
            top_p=jnp.asarray([p.top_p for p in ps], jnp.float32),
            min_p=jnp.asarray([p.min_p for p in ps], jnp.float32),
        )


def processed_logprobs(logits, sp: SlotSampling):
    """logits [B, V] fp32 -> log-probabilities after temperature, top-k, top-p, min-p.

    Rows with temperature 0 are returned as plain log-softmax (callers take the argmax).
    """
    t = jnp.where(sp.temperature > 0, sp.temperature, 1.0)[:, None]
    lp = jax.nn.log_softmax(logits / t, axis=-1)
    srt = jnp.sort(lp, axis=-1)[:, ::-1]                                  # descending
    v = lp.shape[-1]
    k = jnp.where(sp.top_k > 0, jnp.minimum(sp.top_k, v), v)
    kth = jnp.take_along_axis(srt, (k - 1)[:, None], axis=-1)              # [B, 1]
    # top-p: keep the smallest prefix whose mass reaches top_p (the token crossing it included).
    cum = jnp.cumsum(jnp.exp(srt), axis=-1)
    n_p = jnp.sum(cum - jnp.exp(srt) < sp.top_p[:, None], axis=-1)
    pth = jnp.take_along_axis(srt, (jnp.maximum(n_p, 1) - 1)[:, None], axis=-1)
    mth = srt[:, :1] + jnp.log(jnp.maximum(sp.min_p, 1e-38))[:, None]
    keep = (lp >= kth) & (lp >= pth) & (lp >= mth)
    lp = jnp.where(keep, lp, -jnp.inf)
    return jax.nn.log_softmax(lp, axis=-1)


def sample(logits, sp: SlotSampling, key):
    """logits [B, V] fp32 -> tokens [B] int32; greedy where temperature == 0.

    The sort behind top-k/top-p runs only when some slot samples (lax.cond on device).
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sampled(_):
        lp = processed_logprobs(logits, sp)
        draw = jax.random.categorical(key, lp, axis=-1).astype(jnp.int32)
        return jnp.where(sp.temperature > 0, draw, greedy)

    return jax.lax.cond(jnp.any(sp.temperature > 0), sampled, lambda _: greedy, None)
