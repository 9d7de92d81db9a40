"""Sampling parameters (host side, validated) and the on-device sampler.

Per-request parameters travel to the device as per-slot arrays (`SlotSampling`), and each slot
has its own rng key, so a batch that mixes greedy and sampled requests, or changes parameters
between calls, never recompiles, and a seeded request draws the same stream in any batch.

The processed distribution of the next token, in vLLM's order:
  1. penalties on the raw logits (`apply_penalties`), from per-slot token counts on the device;
  2. temperature;
  3. top-k, top-p, min-p (`processed_logprobs`).
Temperature 0 is greedy: the argmax of the penalized logits.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

# Top alternatives a request may ask for per token (vLLM's default max_logprobs).
MAX_LOGPROBS = 20


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def _is_sequence(x) -> bool:
    """A collection of items (a list, tuple, set, array), not a string or a mapping."""
    return (not isinstance(x, (str, bytes, dict)) and hasattr(x, "__iter__")
            and hasattr(x, "__len__"))


def _type_name(x) -> str:
    return type(x).__name__


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """What to generate.

    temperature         0 is greedy (argmax of the penalized logits)
    top_k               keep the k most likely tokens; 0 or -1 disable it
    top_p               keep the smallest set of tokens whose mass reaches top_p; 1 disables it
    min_p               drop tokens less likely than min_p times the most likely one; 0 disables it
    repetition_penalty  > 0, 1 disables it. Tokens seen in the prompt or the output so far: a
                        positive logit is divided by it, a negative one multiplied (HF and vLLM)
    frequency_penalty   in [-2, 2]: subtracts count * frequency_penalty from the logit of each
                        token, count = its occurrences in the output so far (not the prompt; vLLM)
    presence_penalty    in [-2, 2]: subtracts presence_penalty from each token that occurs in the
                        output so far (not the prompt; vLLM)
    max_tokens          tokens to generate at most
    seed                per-request rng seed; None draws from the engine's key
    stop_token_ids      generation stops after emitting one of these (kept in the output)
    stop                strings: the text is cut before the first occurrence (not included)
    ignore_eos          keep going past the model's EOS tokens
    logprobs            None: no logprobs; n >= 0: the log-probability of every emitted token and
                        of the n most likely alternatives, from the processed distribution
    skip_special_tokens leave special tokens (EOS, end of turn) out of the text and the stream's
                        text (HF and vLLM); token_ids keep them either way

    A value of the wrong type (a string for a number, a bool for an integer) is a TypeError, a
    value out of range a ValueError; both name the field and what it takes.
    """
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    max_tokens: int = 16
    seed: Optional[int] = None
    stop_token_ids: Tuple[int, ...] = ()
    stop: Tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    skip_special_tokens: bool = True

    def __post_init__(self):
        self._check_types()
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        ids = tuple(self.stop_token_ids)
        if not all(_is_int(t) and t >= 0 for t in ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))
        if not (_is_int(self.max_tokens) and self.max_tokens > 0):
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not (_finite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (_is_int(self.top_k) and self.top_k >= -1):
            raise ValueError(f"top_k must be an integer >= -1 (0 or -1 disable it), got {self.top_k!r}")
        if not (_finite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (_finite(self.min_p) and 0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not (_finite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 disables it), "
                             f"got {self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not (_finite(v) and -2.0 <= v <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be None or an integer in [0, 2**63), got {self.seed!r}")
        if self.logprobs is not None and not (_is_int(self.logprobs)
                                              and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], "
                             f"got {self.logprobs!r}")

    def _check_types(self):
        """TypeError for a field of the wrong kind, before any comparison could raise one that
        names no field."""
        numbers = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                   "presence_penalty")
        for name in numbers:
            v = getattr(self, name)
            if not _is_number(v):
                raise TypeError(f"{name} must be a number, got {v!r} ({_type_name(v)})")
        for name, none_ok in (("top_k", False), ("max_tokens", False), ("seed", True),
                              ("logprobs", True)):
            v = getattr(self, name)
            # a float is a number out of the integers' range (ValueError below), not a type error
            if not (_is_number(v) or (none_ok and v is None)):
                raise TypeError(f"{name} must be an integer{' or None' if none_ok else ''}, "
                                f"got {v!r} ({_type_name(v)})")
        for name in ("ignore_eos", "skip_special_tokens"):
            v = getattr(self, name)
            if not isinstance(v, (bool, np.bool_)):
                raise TypeError(f"{name} must be True or False, got {v!r} ({_type_name(v)})")
            object.__setattr__(self, name, bool(v))
        if not (isinstance(self.stop, str) or _is_sequence(self.stop)):
            raise TypeError(f"stop must be a string or a list of strings, got {self.stop!r} "
                            f"({_type_name(self.stop)})")
        if not _is_sequence(self.stop_token_ids):
            raise TypeError(f"stop_token_ids must be a list of token ids, got "
                            f"{self.stop_token_ids!r} ({_type_name(self.stop_token_ids)})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _finite(x) -> bool:
    try:
        return bool(np.isfinite(float(x)))
    except (TypeError, ValueError):
        return False


class Features(NamedTuple):
    """What some slot of a batch may use, known on the host: the engine picks a compiled
    variant per cycle instead of testing device flags with lax.cond, so the program has no
    conditional (on the GPU a conditional makes the host read its flag back and wait for the
    device, and splits the CUDA graph). False leaves the feature's code out; True runs it for
    every slot (exact for slots without it: their rows pass through unchanged)."""
    sampled: bool        # temperature > 0 (and the filters behind it)
    penalty: bool        # repetition / frequency / presence
    logprobs: bool

    @classmethod
    def of(cls, params: Sequence["SamplingParams"]) -> "Features":
        """The two variants the engine compiles: LEAN when every request is greedy with no
        penalty and no logprobs (None; 0 asks for the emitted token's own), else FULL."""
        lean = all(p.temperature == 0 and p.repetition_penalty == 1 and p.frequency_penalty == 0
                   and p.presence_penalty == 0 and p.logprobs is None for p in params)
        return LEAN if lean else FULL


LEAN = Features(sampled=False, penalty=False, logprobs=False)
FULL = Features(sampled=True, penalty=True, logprobs=True)
VARIANTS = (LEAN, FULL)     # what the engine's backends compile


def cond(pred, true_fn, false_fn, *operands):
    """lax.cond, or the branch itself when pred is a Python bool (decided at trace time)."""
    if isinstance(pred, bool):
        return (true_fn if pred else false_fn)(*operands)
    return jax.lax.cond(pred, true_fn, false_fn, *operands)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SlotSampling:
    """Per-slot device arrays, all [B]: temperature (0 = greedy), top_k (0 = off), top_p, min_p,
    the three penalties, and logprobs (alternatives wanted per token; -1 = no logprobs)."""
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    repetition_penalty: jax.Array
    frequency_penalty: jax.Array
    presence_penalty: jax.Array
    logprobs: jax.Array
    # Static (part of the tree structure, not an array): when set, the any_* tests below are
    # Python bools decided on the host (see Features), so `cond` needs no device flag.
    features: Optional[Features] = dataclasses.field(default=None, metadata=dict(static=True))

    def with_features(self, features: Optional[Features]) -> "SlotSampling":
        return dataclasses.replace(self, features=features)

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], slots: int) -> "SlotSampling":
        """Slots past len(params) get greedy defaults."""
        ps = list(params) + [SamplingParams()] * (slots - len(params))
        f32 = lambda xs: jnp.asarray(np.asarray(xs, np.float32))
        i32 = lambda xs: jnp.asarray(np.asarray(xs, np.int32))
        return cls(
            temperature=f32([p.temperature for p in ps]),
            top_k=i32([max(p.top_k, 0) for p in ps]),
            top_p=f32([p.top_p for p in ps]),
            min_p=f32([p.min_p for p in ps]),
            repetition_penalty=f32([p.repetition_penalty for p in ps]),
            frequency_penalty=f32([p.frequency_penalty for p in ps]),
            presence_penalty=f32([p.presence_penalty for p in ps]),
            logprobs=i32([-1 if p.logprobs is None else p.logprobs for p in ps]),
        )

    @classmethod
    def from_flat(cls, f, i) -> "SlotSampling":
        """f [B, 6] fp32, i [B, 2] int32 (as `flat_params` lays them out) -> SlotSampling."""
        return cls(temperature=f[:, 0], top_k=i[:, 0], top_p=f[:, 1], min_p=f[:, 2],
                   repetition_penalty=f[:, 3], frequency_penalty=f[:, 4],
                   presence_penalty=f[:, 5], logprobs=i[:, 1])

    @classmethod
    def greedy(cls, slots: int) -> "SlotSampling":
        return cls.from_params([], slots)

    def any_sampled(self):
        if self.features is not None:
            return self.features.sampled
        return jnp.any(self.temperature > 0)

    def any_filter(self):
        """Some slot truncates its distribution (top-k, top-p or min-p): the sort is needed."""
        if self.features is not None:
            return self.features.sampled or self.features.logprobs
        return jnp.any((self.top_k > 0) | (self.top_p < 1) | (self.min_p > 0))

    def any_penalty(self):
        if self.features is not None:
            return self.features.penalty
        return jnp.any((self.repetition_penalty != 1) | (self.frequency_penalty != 0)
                       | (self.presence_penalty != 0))

    def any_logprobs(self):
        if self.features is not None:
            return self.features.logprobs
        return jnp.any(self.logprobs >= 0)


def flat_params(sp: SamplingParams) -> Tuple[List[float], List[int]]:
    """Host side: one request's parameters as the rows `SlotSampling.from_flat` reads
    ([6] floats, [2] ints), so they travel to the device as plain array arguments."""
    return ([sp.temperature, sp.top_p, sp.min_p, sp.repetition_penalty, sp.frequency_penalty,
             sp.presence_penalty],
            [max(sp.top_k, 0), -1 if sp.logprobs is None else sp.logprobs])


def seed_key(seed: int) -> np.ndarray:
    """[2] uint32 raw key of a seeded request (as `slot_keys` gives it)."""
    k = jax.random.PRNGKey(seed)
    return np.asarray(jax.random.key_data(k) if jnp.issubdtype(k.dtype, jax.dtypes.prng_key)
                      else k, np.uint32)


def slot_keys(params: Sequence[SamplingParams], slots: int, key) -> jax.Array:
    """[B, 2] uint32 per-slot rng keys: PRNGKey(seed) for seeded requests, else key folded with
    the slot index (so unseeded slots of one call draw different streams)."""
    out = np.zeros((slots, 2), np.uint32)
    for i in range(slots):
        s = params[i].seed if i < len(params) else None
        k = jax.random.PRNGKey(s) if s is not None else jax.random.fold_in(key, i)
        out[i] = np.asarray(jax.random.key_data(k) if jnp.issubdtype(k.dtype, jax.dtypes.prng_key)
                            else k)
    return jnp.asarray(out)


def split_slot_keys(keys, num: int):
    """keys [B, 2] -> num arrays of [B, 2] (the first is the slot's next key)."""
    parts = jax.vmap(lambda k: jax.random.split(k, num))(keys)               # [B, num, 2]
    return [parts[:, i] for i in range(num)]


# ---------------------------------------------------------------- token counts and penalties


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TokenCounts:
    """Per-slot token history for the penalties, on the device.

    prompt_seen [B, V] bool: the token occurs in the prompt (repetition penalty only)
    counts      [B, V] int32: occurrences in the output so far (all three penalties)
    """
    prompt_seen: jax.Array
    counts: jax.Array

    @classmethod
    def zeros(cls, slots: int, vocab: int) -> "TokenCounts":
        return cls(jnp.zeros((slots, vocab), bool), jnp.zeros((slots, vocab), jnp.int32))

    @classmethod
    def from_prompts(cls, tokens, lens, vocab: int) -> "TokenCounts":
        """tokens [B, P] padded, lens [B] -> prompt_seen of the first lens[b] tokens, no output."""
        b, p = tokens.shape
        live = jnp.arange(p)[None] < lens[:, None]
        idx = jnp.where(live, tokens, vocab)                                  # vocab: dropped
        seen = jnp.zeros((b, vocab), bool).at[jnp.arange(b)[:, None], idx].set(True, mode="drop")
        return cls(seen, jnp.zeros((b, vocab), jnp.int32))

    def add(self, tokens, live) -> "TokenCounts":
        """Counts tokens [B, R] where live [B, R] as output."""
        b, v = self.counts.shape
        idx = jnp.where(live, tokens, v)
        counts = self.counts.at[jnp.arange(b)[:, None], idx].add(1, mode="drop")
        return TokenCounts(self.prompt_seen, counts)


def _col(x, ndim: int):
    """Per-slot [B] array -> [B, 1, ...] broadcasting against an ndim-dim [B, ..., V] array."""
    return x.reshape((-1,) + (1,) * (ndim - 1))


def _penalize(logits, count, prompt_seen, pen):
    """The penalties at given counts; pen = (repetition, frequency, presence), all arrays
    broadcasting together."""
    rep, freq, pres = pen
    seen = prompt_seen | (count > 0)
    x = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    return x - count.astype(x.dtype) * freq - (count > 0).astype(x.dtype) * pres


def apply_penalties(logits, sp: SlotSampling, hist: TokenCounts):
    """logits [B, V] fp32 -> penalized logits [B, V]."""
    pen = tuple(_col(a, 2) for a in (sp.repetition_penalty, sp.frequency_penalty,
                                      sp.presence_penalty))
    return _penalize(logits, hist.counts, hist.prompt_seen, pen)


def apply_tree_penalties(logits, sp: SlotSampling, hist: TokenCounts, path_tokens, path_live):
    """logits [B, N, V] of N tree rows -> penalized [B, N, V], exactly as if each row's counts
    held the slot's counts plus the tokens on its path (path_tokens [B, N, P] where path_live).

    No [B, N, V] counts: the base penalty broadcasts over the rows, then each row's at most P
    path entries are recomputed with their corrected counts and scattered in.
    """
    b, n, v = logits.shape
    pen3 = tuple(_col(a, 3) for a in (sp.repetition_penalty, sp.frequency_penalty,
                                      sp.presence_penalty))
    out = _penalize(logits, hist.counts[:, None], hist.prompt_seen[:, None], pen3)
    tok = jnp.where(path_live, path_tokens, 0)
    same = (tok[..., :, None] == tok[..., None, :]) & path_live[..., None, :]   # [B, N, P, P]
    extra = jnp.sum(same, axis=-1).astype(jnp.int32)                         # [B, N, P]
    bi = jnp.arange(b)[:, None, None]
    count = hist.counts[bi, tok] + extra
    raw = jnp.take_along_axis(logits, tok, axis=-1)
    val = _penalize(raw, count, hist.prompt_seen[bi, tok], pen3)
    # Repeated path tokens get the same value at every occurrence, so the scatter is well defined.
    idx = jnp.where(path_live, tok, v)
    return out.at[bi, jnp.arange(n)[None, :, None], idx].set(val, mode="drop")


# ---------------------------------------------------------------- the processed distribution


def processed_logprobs(logits, sp: SlotSampling):
    """logits [B, ..., V] fp32 (penalized) -> log-probabilities after temperature, top-k, top-p,
    min-p; sp holds [B] arrays.

    Rows with temperature 0 are returned as the plain log-softmax of the logits (their token is
    the argmax; the filters do not change it), which is what greedy requests report as logprobs.
    """
    nd = logits.ndim
    t = _col(jnp.where(sp.temperature > 0, sp.temperature, 1.0), nd)
    lp = jax.nn.log_softmax(logits / t, axis=-1)
    # The filters sort every row ([B, N, V] in a tree verify); without any filter in the batch
    # they would keep every token, so the sort is skipped.
    return cond(sp.any_filter(), lambda: _filtered(lp, sp), lambda: lp)


def _filtered(lp, sp: SlotSampling):
    """lp [B, ..., V] temperature-scaled log-probabilities -> after top-k, top-p, min-p."""
    nd = lp.ndim
    greedy = _col(sp.temperature <= 0, nd)
    srt = jnp.flip(jnp.sort(lp, axis=-1), axis=-1)                          # descending
    v = lp.shape[-1]
    k = _col(jnp.where(sp.top_k > 0, jnp.minimum(sp.top_k, v), v), nd)
    kth = jnp.take_along_axis(srt, jnp.broadcast_to(k - 1, lp.shape[:-1] + (1,)), axis=-1)
    # top-p: keep the smallest prefix whose mass reaches top_p (the token crossing it included).
    ps = jnp.exp(srt)
    n_p = jnp.sum(jnp.cumsum(ps, axis=-1) - ps < _col(sp.top_p, nd), axis=-1, keepdims=True)
    pth = jnp.take_along_axis(srt, jnp.maximum(n_p, 1) - 1, axis=-1)
    # top_p = 1 keeps everything: the fp32 cumsum can reach 1 before the tail and would drop it.
    pth = jnp.where(_col(sp.top_p, nd) >= 1, -jnp.inf, pth)
    mth = srt[..., :1] + jnp.log(jnp.maximum(_col(sp.min_p, nd), 1e-38))
    keep = greedy | ((lp >= kth) & (lp >= pth) & (lp >= mth))
    return jax.nn.log_softmax(jnp.where(keep, lp, -jnp.inf), axis=-1)


def sample(logits, sp: SlotSampling, key):
    """logits [B, V] fp32 -> tokens [B] int32 with one key for the batch; greedy where
    temperature == 0. The sort behind top-k/top-p runs only when some slot samples."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sampled(_):
        lp = processed_logprobs(logits, sp)
        draw = jax.random.categorical(key, lp, axis=-1).astype(jnp.int32)
        return jnp.where(sp.temperature > 0, draw, greedy)

    return cond(sp.any_sampled(), sampled, lambda _: greedy, None)


def sample_slots(logits, sp: SlotSampling, keys):
    """logits [B, V] fp32 (penalized), keys [B, 2] -> tokens [B] int32, each slot drawing with
    its own key; greedy where temperature == 0."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sampled(_):
        lp = processed_logprobs(logits, sp)
        draw = jax.vmap(jax.random.categorical)(keys, lp).astype(jnp.int32)
        return jnp.where(sp.temperature > 0, draw, greedy)

    return cond(sp.any_sampled(), sampled, lambda _: greedy, None)


# ---------------------------------------------------------------- logprobs


class Emitted(NamedTuple):
    """Emitted tokens and their logprobs (zeros when no slot asked for logprobs). Leading dims
    [B], [B, n_steps] or [B, S+1]."""
    tokens: jax.Array        # int32
    logprob: jax.Array       # fp32, from the processed distribution
    top_ids: jax.Array       # [..., k] int32, k = min(MAX_LOGPROBS, V)
    top_logprobs: jax.Array  # [..., k] fp32


def token_logprobs(logits, sp: SlotSampling, tokens, num_top: int):
    """logits [B, R, V] (penalized) of the rows that emitted tokens [B, R] ->
    (logprob [B, R], top_ids [B, R, k], top_logprobs [B, R, k]), k = min(num_top, V), from the
    processed distribution. Computed only when some slot asked for logprobs (zeros otherwise)."""
    b, r, v = logits.shape
    k = min(num_top, v)

    def compute(_):
        lp = processed_logprobs(logits, sp)
        tok = jnp.take_along_axis(lp, jnp.clip(tokens, 0, v - 1)[..., None], axis=-1)[..., 0]
        top_lp, top_ids = jax.lax.top_k(lp, k) if k else (jnp.zeros((b, r, 0)),
                                                          jnp.zeros((b, r, 0), jnp.int32))
        return tok, top_ids.astype(jnp.int32), top_lp

    def skip(_):
        return (jnp.zeros((b, r), jnp.float32), jnp.zeros((b, r, k), jnp.int32),
                jnp.zeros((b, r, k), jnp.float32))

    return cond(sp.any_logprobs(), compute, skip, None)


def no_logprobs(b: int):
    """(logprob [B, 0], top_ids [B, 0, 0], top_logprobs [B, 0, 0]): what a program variant that
    computes no logprobs (LEAN) returns in their place. Zeros of the full shape would still be
    written every call (and, over several cycles a call, gathered): empty arrays cost nothing,
    and the host reads them only for requests that asked for logprobs, which never run LEAN."""
    return (jnp.zeros((b, 0), jnp.float32), jnp.zeros((b, 0, 0), jnp.int32),
            jnp.zeros((b, 0, 0), jnp.float32))


def logprob_dicts(tokens, logprob, top_ids, top_logprobs, n: int) -> List[Dict[int, float]]:
    """Host side: per emitted token, {token: logprob} plus its n best alternatives (vLLM's
    layout: the sampled token is always present, alternatives may include it)."""
    out = []
    for t, lp, ids, tlp in zip(tokens, logprob, top_ids, top_logprobs):
        d = {int(i): float(x) for i, x in zip(ids[:n], tlp[:n])}
        d[int(t)] = float(lp)
        out.append(d)
    return out


# ---------------------------------------------------------------- stop strings (host)


def apply_stop_strings(text: str, stops: Sequence[str]) -> Tuple[str, bool]:
    """Cuts text before the earliest occurrence of any stop string (the stop string is not
    included, as vLLM). Returns (text, whether a stop string occurred)."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)
