"""What the engine drives on the device: a batch state of B slots, admission into chosen slots,
and one cycle over all slots with an `active` mask.

Both backends have the same host-side shape, so the engine's scheduling (admission, stops, abort,
retract) does not know which one runs:
  init_state()                                   -> state
  admit(state, slot_idx, tokens, start, n_valid, next_tok[, adm], features=)
                                                 -> (state, Emitted [A]: first tokens (-1: none)
                                                    and their logprobs); features as the cycle's,
                                                    of the admitted requests
  advance_keys(state, slot_idx, advance)         -> state: resumed sampling requests' keys moved
                                                    past the draws their earlier run made
  cycle(state, active [B] bool, features, size=) -> (state, CycleTokens: tokens [B, E] (-1
                                                    padded), accept [B] or None, logprobs)
                                                 features: sampling.LEAN (every active slot
                                                 greedy, no penalty, no logprobs) or FULL; one
                                                 executable each, neither with a conditional
                                                 size: one of `sizes` (default the largest)
                                                 short: the program built for prefixes of at
                                                 most short_rows rows (`default_short_rows`)
  sizes                                          the call sizes the backend runs (spec: cycles
                                                 per call; plain: (n_steps,))
  short_rows                                     0, or the rows under which `short` cycles run
  call_size(n_active)                            the size to run with n_active active slots
  emit, min_emit                                 the most / fewest tokens an active slot gains
                                                 per call of the largest size (emit: KV rows)
  emits(size)                                    (emit, min_emit) of a call of that size
  key_advances(n_out, n_cycles)                  key splits past the first draw that a request
                                                 with n_out tokens from n_cycles cycles made
Sampling parameters, per-slot rng keys and token counts (penalties) live in the state; admission
writes them (`spec.admit.AdmitArgs`, flat arrays, so nothing recompiles per request). Every
jitted function takes the (flattened once by jit) weights plus a few flat arrays; the state is
donated, so caches are updated in place.

Ahead-of-time compilation: `admit(..., lower=True)` and `cycle(..., lower=True)` trace the call
they would make (under whatever context a wrapper sets, e.g. a mesh) and return (key, Lowered)
instead of running it; the engine compiles those concurrently and puts the executables in
`executables` (key -> jax.stages.Compiled, donation kept). A call whose key is there runs that
executable; any other goes through jit (compiling on its first use) and counts in `jit_calls`.
With cycle_copies > 1 the engine compiles that many copies of each cycle program (`spares`)
and calls take them in turn.
"""
from __future__ import annotations

import collections
import functools
import os
from typing import Dict, List, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxspec.config import ModelConfig
from jaxspec.decode import decode_scan
from jaxspec.kv import KVCache, init_cache
from jaxspec.models import llama
from jaxspec.sampling import FULL, VARIANTS, Features, SlotSampling, TokenCounts, no_logprobs
from jaxspec.spec.admit import (AdmitArgs, _chunk_forward, _last_row, admit_programs,
                                admit_sampling, advance_rows, batch_axes, chunk_history,
                                jit_spec_admit, put_slots, take_slots)
from jaxspec.spec.admit_packed import PackLayout, packed_forward, packed_history, token_slots
from jaxspec.xla_options import gemm_choice, jit


class CycleTokens(NamedTuple):
    """What one engine cycle emitted (device arrays until the host reads them)."""
    tokens: jax.Array                  # [B, E] int32, -1 padded
    accept: Optional[jax.Array]        # [B] accepted drafted tokens (speculative), else None
    logprob: jax.Array                 # [B, E] of each token (zeros unless a slot asked);
                                       # [B, 0] from the LEAN variant (`no_logprobs`)
    top_ids: jax.Array                 # [B, E, k]
    top_logprobs: jax.Array            # [B, E, k]


def _engine_key(seed: int):
    k = jax.random.PRNGKey(seed)
    return jax.random.key_data(k) if jnp.issubdtype(k.dtype, jax.dtypes.prng_key) else k


class MaskCache:
    """Host bool masks -> device arrays, kept by value (the `keep` most recent).

    A numpy argument is copied to the device inside the call, and on the GPU that copy waits for
    the work already queued: the call returned only when the previous cycle had ended
    (bench/bench_dispatch.py, bench/RESULTS.md), so the device idled while the host launched the
    next. A serving loop's active mask repeats in steady state, so each one crosses once.
    put: numpy -> device array(s) as the calls take them (default jax.device_put)."""

    def __init__(self, put=jax.device_put, keep: int = 64):
        self.put, self.keep = put, keep
        self._kept: "collections.OrderedDict[tuple, jax.Array]" = collections.OrderedDict()

    def __call__(self, mask: np.ndarray) -> jax.Array:
        mask = np.asarray(mask, bool)
        key = (mask.shape, mask.tobytes())
        got = self._kept.get(key)
        if got is None:
            got = self._kept[key] = self.put(mask.copy())
            if len(self._kept) > self.keep:
                self._kept.popitem(last=False)
        else:
            self._kept.move_to_end(key)
        return got


class _Dispatch:
    """Calls through the executables compiled ahead of time, else through jit."""

    def _init_dispatch(self, cycle_copies: Optional[int] = None):
        """cycle_copies: loaded copies of each cycle program, run in turn (`copies_of`); None:
        $JAXSPEC_CYCLE_COPIES, else 1. On the H100 (bench/RESULTS.md, fourteenth set) two
        copies cut the host's time per step at batch 1 (chain) from 0.90 to 0.76 ms and made
        batch 64 (chain:4, admissions between the cycles) slower, 28.0k against 24.9k tok/s,
        in one run each; the default stays 1."""
        if cycle_copies is None:
            cycle_copies = int(os.environ.get("JAXSPEC_CYCLE_COPIES", "1"))
        if cycle_copies < 1:
            raise ValueError(f"cycle_copies must be >= 1, got {cycle_copies}")
        self.executables: Dict[tuple, jax.stages.Compiled] = {}
        # More loaded copies of a program, run in turn with executables[key] (cycle_copies)
        self.spares: Dict[tuple, List[jax.stages.Compiled]] = {}
        self.cycle_copies = cycle_copies
        self._turn: collections.Counter = collections.Counter()
        self.jit_calls = 0      # calls that found no executable: after warm-up, a missed shape
        self.device_mask = MaskCache()   # the cycle's [B] active mask as a device array

    def copies_of(self, key: tuple) -> int:
        """Loaded copies warm-up compiles of the program `key`: cycle_copies for cycles, 1 for
        the rest. Why several: the host dispatches a cycle before the previous one has ended,
        so consecutive calls of one executable get different temporary and output buffers,
        and XLA then updates the executable's CUDA graph (every node that reads a moved
        buffer) before launching it. Two copies taken in turn each see the buffers of two calls
        before, which the allocator tends to hand back, so their graphs may run unchanged."""
        return self.cycle_copies if key[0] == "cycle" else 1

    def add_executable(self, key: tuple, compiled):
        """Files a compiled copy of `key`: a spare until the key has copies_of(key) copies;
        once it has, the next one starts them over (a second warm-up replaces the first's)."""
        spares = self.spares.get(key, [])
        if key in self.executables and 1 + len(spares) < self.copies_of(key):
            self.spares[key] = spares + [compiled]
        else:
            self.executables[key] = compiled
            self.spares.pop(key, None)

    def advance_keys(self, state, slot_idx, advance, *, lower=False):
        """Moves the keys of slots slot_idx [A] on by advance [A] splits (`admit.advance_rows`;
        padding rows carry slot index B)."""
        return self._call(("advance", len(slot_idx)), self._advance, (state, slot_idx, advance),
                          lower)

    def admit(self, state, slot_idx, tokens, start, n_valid, next_tok, adm=None, *,
              features: Features = FULL, first: bool = False, lower=False):
        """One prefill chunk (admit.spec_admit / plain_admit). first: every row starts at 0
        (the padded first-chunk form: its own bucket key, the general form's program)."""
        adm = AdmitArgs.host(len(slot_idx)) if adm is None else adm
        return self._call(_admit_key(slot_idx, tokens, features, first),
                          self._admits[features, first],
                          (*self.weights, state, slot_idx, tokens, start, n_valid, next_tok, adm,
                           self.key), lower)

    def admit_packed(self, state, slot_idx, tokens, lay, n_valid, next_tok, adm=None, *,
                     features: Features = FULL, lower=False):
        """The first chunks of A requests packed into tokens [R, W] with layout lay
        (admit_packed.build_pack, spec_admit_packed / plain_admit_packed): n_valid [A] each
        request's tokens; padding requests have slot B and n_valid 0."""
        adm = AdmitArgs.host(len(slot_idx)) if adm is None else adm
        return self._call(("admit_packed", len(slot_idx), tokens.size, features),
                          self._admits[features, "packed"],
                          (*self.weights, state, slot_idx, tokens, lay, n_valid, next_tok, adm,
                           self.key), lower)

    def admit_stacked(self, form, state, slot_idx, tokens, *args, features: Features = FULL,
                      lower=False):
        """Data parallel (`parallel.dp_engine`): the admission of `form` (True / False: a padded
        first / later chunk, as `admit`'s first; "packed": `admit_packed`) with its arguments
        stacked per device ([devices, ...]: each device's own rows, global slot indices)."""
        return self._call(("admit_stacked", form, slot_idx.shape[1], tokens[0].size, features),
                          self._admits[features, ("stacked", form)],
                          (*self.weights, state, slot_idx, tokens, *args, self.key), lower)

    def jitted(self) -> List:
        return [*self._cycles.values(), *self._admits.values(), self._advance]

    def _call(self, key: tuple, jitted, args, lower: bool):
        if lower:
            return key, jitted.lower(*args)
        fn = self.executables.get(key)
        if fn is None:
            self.jit_calls += 1
            fn = jitted
        elif self.spares.get(key):
            turn = self._turn[key] % (len(self.spares[key]) + 1)
            self._turn[key] += 1
            fn = self.spares[key][turn - 1] if turn else fn
        return fn(*args)


def _admit_key(slot_idx, tokens, features, first: bool) -> tuple:
    return ("admit", len(slot_idx), tokens.shape[1], features, first)


def default_cycles_per_call(slots: int) -> int:
    """Speculative cycles per call when none is asked for: on a GPU 4 for more than one slot and
    2 for one, else 1. Measured on the H100 with SmolLM2 and its head: batch 4, 16, 64 ran 1.34x,
    1.32x, 1.35x faster with 4 cycles per call than with 1 (bench/RESULTS.md, sixth set); batch
    1 at 4x8x32 (MT-bench, 80 prompts, 128 tokens, thirty-first set) ran 2.42-2.54x plain with
    2 cycles a call on three machines against 2.09-2.57x with 1: where the host is slow its ~1
    ms a call outlasts the one-slot cycle's device time (2 won by 5-16%), where it is fast 1
    won by 1.2-1.7% (a request's last call may run a wasted cycle). A CPU runs the cycles on
    the host itself: nothing to overlap."""
    if jax.default_backend() != "gpu":
        return 1
    return 4 if slots > 1 else 2


def default_admit_interval(slots: int, speculative: bool) -> int:
    """Device calls between admissions when none is asked for (`Engine(admit_interval=)`): on a
    GPU, 3 for a speculative engine of 64 or more slots, 2 from 32 slots, else 1. Measured with
    SmolLM2 and its head, chain:4 at batch 64, 384 requests of 128 tokens: on the H100 (bench/
    RESULTS.md, fourteenth and fifteenth sets) interval 2 ran 1.04x and 1.06x (MT-bench), 1.09x
    and 1.05x (held-out ShareGPT) the tokens/s of interval 1; on the H200 with packed first
    chunks (seventeenth set, MT-bench) interval 3 averaged 1.07x interval 2 over six timed passes
    each, and none of its passes had interval 2's occasional 25-30% slow one. There, requests
    finish in most calls and each admission is a dispatch whose host cost does not shrink with
    the requests it carries. Plain decoding gained nothing (0.97x to 1.02x): its 16-step calls
    admit rarely anyway."""
    if not speculative or jax.default_backend() != "gpu":
        return 1
    return 3 if slots >= 64 else 2 if slots >= 32 else 1


# The widest prefill chunk on a GPU when none is asked for (`default_prefill_chunk`).
GPU_PREFILL_CHUNK = 2048


def default_prefill_chunk() -> int:
    """The widest prefill chunk (`Engine(chunk=)`) when none is asked for: 2048 on a GPU, 512
    elsewhere. A prompt longer than the chunk is prefilled in later chunks, one call each at a
    slot count of 1, 4, 16 or 64, each row a whole chunk wide: groups of long prompts pad up to
    4x their rows there, while first chunks run packed (rows of 2 x chunk tokens). Measured on
    the H100 with SmolLM2 and its head, batch 64, 128 new tokens, 384 requests (bench/RESULTS.md,
    twenty-seventh set): on held-out ShareGPT (prompts of 773 tokens on average, 59% over 512)
    2048 ran plain 1.03x and 3x2x4:4 1.08-1.10x the tokens/s of 512 (1024: 0.97x both), and
    with `loop.PACK_MAX_TOKENS` plain gained 11% more; on MT-bench (prompts under 512) the two
    are equal by design. On the CPU a wider chunk only adds admission programs to compile."""
    return GPU_PREFILL_CHUNK if jax.default_backend() == "gpu" else 512


SHORT_ROWS = 512
SHORT_MIN_SLOTS = 64


def default_short_rows(slots: int, plain: bool = False, max_len: Optional[int] = None) -> int:
    """Rows per slot under which cycles run a second build of their program whose attention
    splits are sized for `ModelConfig.live_rows` = that many rows, not the cache's length (0:
    none). On the H100 with SmolLM2's heads at 64 slots in a 2,048-row cache (bench/RESULTS.md,
    twenty-second set) one split and no combine kernel took 2-2.4 us a layer less than the
    cache length's 4 splits for 100-400 live rows, but 3-4 us more for uneven slots of up to
    2,048 rows, hence the bound; chain:4 on MT-bench at 64 slots ran 0.5-3% faster with it.
    Plain decoding (plain=True) at 1 slot gets one too: its one-token attention over up to 512
    rows took 1.5-3 us a layer less in one split (twenty-fifth set, `tree_attention.
    default_config`). A speculative engine below SHORT_MIN_SLOTS has none: its verify's wide
    tiles at 1 slot ran slower in fewer splits. Only on the GPU: elsewhere the attention is the
    jnp reference, the same for both. None for a cache (max_len rows) no longer than the bound:
    the full build is sized for the cache, and the short one for more rows than it holds ran
    chain:4 and (6,10,60) 5% and 4% slower at 64 slots of 352-368 rows (H200, bench/RESULTS.md,
    forty-first set, `bench_parallel.py --dp-impl calls`; plain decoding equal)."""
    if jax.default_backend() != "gpu" or (max_len is not None and max_len <= SHORT_ROWS):
        return 0
    return SHORT_ROWS if slots >= SHORT_MIN_SLOTS or (plain and slots == 1) else 0


def _short_key(short: bool) -> tuple:
    return ("short",) if short else ()


# Slots from which a GPU engine drafts a 2-wide tree of the chain's size by default.
WIDE_CHAIN_MIN_SLOTS = 16


def default_spec(slots: int) -> str:
    """The tree shape when none is asked for, on a GPU: '4x8x32' for a single slot, the chain
    for 2-15 slots, '3x2x4' from WIDE_CHAIN_MIN_SLOTS; on a CPU the chain.
    Measured on the H100 with SmolLM2 and its head (bench/RESULTS.md, seventh set): at batch 1
    a cycle is latency-bound and a 40-token tree costs about what the chain does (2.02x over
    plain against 1.45x); from batch 4 on the verify's work grows with the tree and the chain
    led (4 cycles per call: 1.92x at batch 4 against 1.84x for 4x2x8 and 1.81x for 4x4x16). A
    CPU pays for every tree token. With the 16,384-token draft vocabulary, MT-bench, 128 new
    tokens (twenty-first set) fewer draft steps paid: 5x8x40 kept 6x8x40's tau and ran 5-11%
    faster; 4x8x32 (tau 3.25 against 3.46) ran 2.40-2.47x plain against 5x8x40's 2.26-2.35x
    in the same calls, and at 256 new tokens 2.75-2.87x against 2.65-2.70x (twenty-second
    set). '3x2x4' verifies the chain's 4 tokens, but picks the 3 best of 2 + 4 + 4 candidates
    by cumulative score (EAGLE-2's dynamic tree at the chain's size): tau 2.16-2.18 against
    2.09-2.10, for two draft rows a step and a top-2 (one reduction since the twenty-sixth
    set). MT-bench, 4 cycles a call, same runs: batch 16 1.35x plain against the chain's
    1.28x; batch 64 1.39-1.42x against 1.36-1.38x (twenty-sixth set)."""
    if jax.default_backend() != "gpu":
        return "chain"
    if slots == 1:
        return "4x8x32"
    return "3x2x4" if slots >= WIDE_CHAIN_MIN_SLOTS else "chain"


class SpecBackend(_Dispatch):
    """EAGLE speculative decoding: one jitted cycle (draft -> verify -> accept -> compaction ->
    catch-up) per engine cycle; greedy and sampled slots (lossless speculative sampling) mix.

    cycles_per_call: speculative cycles per device call (`spec.cycle.cycles`; the counterpart of
    PlainBackend's n_steps). Where the host's cost per call exceeds a cycle's device time (large
    batches of a small model) more cycles per call keep the device busy; a request that ends
    inside a call still runs to the call's end (its extra tokens are dropped), and newcomers wait
    up to a call for admission. The accept lengths come per cycle ([B, cycles_per_call]).
    With a single active slot of several a call runs one cycle (`call_size`): there the host
    keeps up with the device, and a longer call mostly wastes cycles past the request's end
    (measured: 4 cycles per call ran batch 1 at 0.89x the speed of 1, and batch 4 at 1.34x). A
    one-slot engine runs cycles_per_call as given."""

    def __init__(self, cfg: ModelConfig, params, draft_params, spec, slots: int, max_len: int,
                 seed: int = 0, cycles_per_call: int = 1, cycle_copies: Optional[int] = None,
                 short_rows: Optional[int] = None):
        from jaxspec.spec.config import check_vocab, resolve_spec
        from jaxspec.spec.draft import check_head
        from jaxspec.spec.cycle import jit_cycle
        self.cfg, self.params, self.draft_params = cfg, params, draft_params
        self.spec = resolve_spec(spec)
        check_vocab(self.spec, cfg.vocab_size)
        check_head(cfg, self.spec, draft_params)
        if cycles_per_call < 1:
            raise ValueError(f"cycles_per_call must be >= 1, got {cycles_per_call}")
        self.slots, self.max_len = slots, max_len
        self.dtype = params["embed"].dtype
        self.cycles_per_call = cycles_per_call
        self.sizes = tuple(sorted({1, cycles_per_call}))
        self.emit, self.min_emit = self.emits(cycles_per_call)
        self.key = _engine_key(seed)
        self.short_rows = (default_short_rows(slots, max_len=max_len) if short_rows is None
                           else short_rows)
        builds = [()] + ([("short",)] if self.short_rows else [])
        self._cycles = {(f, k) + s: jit_cycle(cfg.with_live_rows(self.short_rows) if s else cfg,
                                              self.spec, features=f, n_cycles=k, slots=slots)
                        for f in VARIANTS for k in self.sizes for s in builds}
        self._admits, self._advance = jit_spec_admit(cfg, self.spec, slots, max_len, self.dtype)
        self._init_dispatch(cycle_copies)

    def init_state(self):
        from jaxspec.spec.cycle import init_state
        return init_state(self.cfg, self.spec, self.slots, self.max_len, self.dtype,
                          self.draft_params)

    def key_advances(self, n_out: int, n_cycles: int) -> int:
        return n_cycles          # each cycle splits each active slot's key once

    def emits(self, size: int):
        return self.spec.max_emit * size, size   # an active slot emits >= 1 token per cycle

    def call_size(self, n_active: int) -> int:
        # A one-slot engine runs the size it was built for: cycles_per_call > 1 there is asked
        # for explicitly (the default gives one slot 1).
        return 1 if n_active <= 1 < self.slots else self.cycles_per_call

    @property
    def weights(self) -> tuple:
        """What every jitted call takes first: (target params, draft params)."""
        return self.params, self.draft_params

    def cycle(self, state, active, features: Features = FULL, *, size=None, short=False,
              lower=False):
        size = size or self.cycles_per_call
        got = self._call(("cycle", features, size) + _short_key(short),
                         self._cycles[(features, size) + _short_key(short)],
                         (*self.weights, state, active), lower)
        if lower:
            return got
        state, out = got
        return state, CycleTokens(out.tokens, out.accept_len, out.logprob, out.top_ids,
                                  out.top_logprobs)


# ----------------------------------------------------------------------------- plain decoding


@struct.dataclass
class PlainState:
    """cache KVCache [L, B, Hkv, T, D]; tokens [B] next input token (no KV yet, already counted);
    sampling SlotSampling [B]; keys [B, 2] per-slot rng keys; history TokenCounts [B, V]."""
    cache: KVCache
    tokens: jax.Array
    sampling: SlotSampling
    keys: jax.Array
    history: TokenCounts


def init_plain_state(cfg: ModelConfig, slots: int, max_len: int, dtype):
    return PlainState(init_cache(cfg, slots, max_len, dtype), jnp.zeros((slots,), jnp.int32),
                      SlotSampling.greedy(slots), jnp.zeros((slots, 2), jnp.uint32),
                      TokenCounts.zeros(slots, cfg.vocab_size))


def plain_admit(params, state: PlainState, slot_idx, tokens, start, n_valid, next_tok,
                adm: AdmitArgs, engine_key, *, cfg: ModelConfig, axes, rows,
                features: Features = FULL):
    """One prefill chunk for A requests in slots slot_idx (see spec_admit for the arguments);
    on a new request's last chunk the first token is drawn with the slot's parameters."""
    sub = take_slots(state, axes, slot_idx, rows)     # per-slot leaves; no KV rows
    (k, v), hidden = _chunk_forward(params, cfg, state.cache, tokens, start, n_valid, slot_idx)
    is_last = next_tok < 0
    hist = chunk_history(sub.history, tokens, start, n_valid, adm.n_prompt)
    logits = llama.lm_head(params, cfg, _last_row(hidden, n_valid))
    sp, first, hist, keys = admit_sampling(logits, hist, adm, engine_key, is_last, features)
    root = jnp.where(adm.root >= 0, adm.root, first.tokens)
    new = PlainState(sub.cache.replace(lens=start + n_valid), jnp.where(is_last, root, sub.tokens),
                     sp, keys, hist)
    return put_slots(state.replace(cache=state.cache.replace(k=k, v=v)), axes, slot_idx, new,
                     rows), first


def plain_admit_packed(params, state: PlainState, slot_idx, tokens, lay: PackLayout, n_valid,
                       next_tok, adm: AdmitArgs, engine_key, *, cfg: ModelConfig, axes, rows,
                       features: Features = FULL):
    """The first chunks of A requests packed (see `admit_packed.spec_admit_packed` for the
    arguments); on a new request's last chunk the first token is drawn."""
    slot_tok = token_slots(slot_idx, lay, state.tokens.shape[0])
    sub = take_slots(state, axes, slot_idx, rows)      # per-slot leaves; no KV rows
    cache, hidden, _ = packed_forward(params, cfg, state.cache, tokens, lay, slot_tok)
    is_last = next_tok < 0
    hist = packed_history(sub.history, tokens, lay, adm.n_prompt)
    logits = llama.lm_head(params, cfg, hidden[lay.last])
    sp, first, hist, keys = admit_sampling(logits, hist, adm, engine_key, is_last, features)
    root = jnp.where(adm.root >= 0, adm.root, first.tokens)
    new = PlainState(sub.cache.replace(lens=n_valid), jnp.where(is_last, root, sub.tokens), sp,
                     keys, hist)
    return put_slots(state.replace(cache=cache), axes, slot_idx, new, rows), first


def plain_cycle(params, state: PlainState, active, *, cfg: ModelConfig, n_steps: int,
                features: Optional[Features] = None):
    """n_steps decode steps for the active slots (decode.sample_steps' body: penalties, per-slot
    keys, logprobs); idle slots write no KV rows and change nothing.

    Returns (state, CycleTokens with tokens [B, n_steps] (-1 for idle slots))."""
    cache, hist, keys, em = decode_scan(params, cfg, state.cache, state.tokens, state.sampling,
                                        state.history, state.keys, active=active,
                                        n_steps=n_steps, features=features)
    tokens = jnp.where(active, em.tokens[:, -1], state.tokens)
    new = PlainState(cache, tokens, state.sampling, keys, hist)
    lp = (em.logprob, em.top_ids, em.top_logprobs)
    if features is not None and not features.logprobs:
        lp = no_logprobs(tokens.shape[0])      # the steps' zeros are then never written
    return new, CycleTokens(jnp.where(active[:, None], em.tokens, -1), None, *lp)


def _jit_plain(cfg: ModelConfig, slots: int, max_len: int, dtype, n_steps: int):
    """(admission programs, {features: decode program}, key advance) of a plain engine."""
    gemm = gemm_choice()
    admits, advance = _jit_plain_admits(cfg, slots, max_len, dtype, gemm)
    return admits, _jit_plain_cycles(cfg, slots, n_steps, gemm), advance


@functools.lru_cache(maxsize=None)
def _jit_plain_cycles(cfg, slots, n_steps, _gemm):
    """{features: n_steps decode steps}; cfg.live_rows sizes the attention (short builds)."""
    return {f: jit(functools.partial(plain_cycle, cfg=cfg, n_steps=n_steps, features=f),
                   rows=slots, donate_argnums=(1,)) for f in VARIANTS}


@functools.lru_cache(maxsize=None)
def _jit_plain_admits(cfg, slots, max_len, dtype, _gemm):
    axes = batch_axes(lambda b: init_plain_state(cfg, b, max_len, dtype), slots)
    rows = batch_axes(lambda t: init_plain_state(cfg, slots, t, dtype), max_len, "row")
    admits = admit_programs(functools.partial(plain_admit, cfg=cfg, axes=axes),
                            functools.partial(plain_admit_packed, cfg=cfg, axes=axes), rows,
                            donate=1)
    # Each decode step splits a slot's key into 2 (next key, the draw).
    advance = jit(lambda st, idx, n: st.replace(keys=advance_rows(st.keys, idx, n, 2)),
                  donate_argnums=(0,))
    return admits, advance


class PlainBackend(_Dispatch):
    """Plain decoding: n_steps decode steps per engine cycle (several per dispatch amortize the
    host's per-dispatch cost); sampling, penalties and logprobs per slot."""

    def __init__(self, cfg: ModelConfig, params, slots: int, max_len: int, n_steps: int = 4,
                 seed: int = 0, cycle_copies: Optional[int] = None,
                 short_rows: Optional[int] = None):
        self.cfg, self.params = cfg, params
        self.slots, self.max_len, self.seed = slots, max_len, seed
        self.dtype = params["embed"].dtype
        self.emit = self.min_emit = n_steps
        self.sizes = (n_steps,)
        self.key = _engine_key(seed)
        self._admits, self._cycles, self._advance = _jit_plain(cfg, slots, max_len, self.dtype,
                                                               n_steps)
        self.short_rows = (default_short_rows(slots, plain=True, max_len=max_len)
                           if short_rows is None else short_rows)
        if self.short_rows:   # the decode programs again, sized for short prefixes
            short = _jit_plain_cycles(cfg.with_live_rows(self.short_rows), slots, n_steps,
                                      gemm_choice())
            self._cycles = {**self._cycles, **{(f, "short"): j for f, j in short.items()}}
        self._init_dispatch(cycle_copies)

    def init_state(self):
        return init_plain_state(self.cfg, self.slots, self.max_len, self.dtype)

    def key_advances(self, n_out: int, n_cycles: int) -> int:
        return n_out - 1         # one split per decode step after the first token

    def emits(self, size: int):
        return size, size

    def call_size(self, n_active: int) -> int:
        return self.emit

    @property
    def weights(self) -> tuple:
        """What every jitted call takes first: (target params,)."""
        return (self.params,)

    def cycle(self, state, active, features: Features = FULL, *, size=None, short=False,
              lower=False):
        return self._call(("cycle", features, self.emit) + _short_key(short),
                          self._cycles[(features, "short") if short else features],
                          (*self.weights, state, active), lower)
