"""What the engine drives on the device: a batch state of B slots, admission into chosen slots,
and one call of cycles over all slots with an `active` mask.

Both backends have the same host-side shape, so the engine's scheduling does not know which
one runs:
  init_state()                                    -> state
  admit(state, form, parts, features)             -> (state, Emitted [A]: first tokens (-1:
                                                     none) and their logprobs); parts: one
                                                     argument tuple per replica
                                                     (`engine.admission.admit`)
  advance_keys(state, slot_idx, advance)          -> state: resumed sampling requests' keys
                                                     moved past their earlier draws
  cycle(state, active [B], features, size, short) -> (state, CycleTokens)
  sizes, call_size(n_active), emits(size)         call sizes and the tokens a slot gains
  short_rows                                      0, or the rows under which `short` builds run
  key_advances(n_out, n_cycles)                   splits a resumed request's key moves on
  host(x)                                         an output read as numpy, [B, ...]
Every program takes (params, draft_params, state, ...) and donates the state. A backend is
built over a placement (`parallel.placement`: one device, tensor or data parallel), which
places its weights and state and gives the per-device form of its programs.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from jaxspec import defaults, envs
from jaxspec.config import ModelConfig
from jaxspec.decode import init_plain_state, plain_cycle
from jaxspec.engine.admission import jit_admissions
from jaxspec.engine.compile import Programs
from jaxspec.parallel.placement import OneDevice
from jaxspec.sampling import FULL, VARIANTS, Features
from jaxspec.xla_options import gemm_choice, jit


class CycleTokens(NamedTuple):
    """What one call emitted (device arrays until the host reads them)."""
    tokens: jax.Array                  # [B, E] int32, -1 padded
    accept: Optional[jax.Array]        # [B] or [B, cycles] accepted drafted tokens, else None
    logprob: jax.Array                 # [B, E] (zeros unless a slot asked; [B, 0] when LEAN)
    top_ids: jax.Array                 # [B, E, k]
    top_logprobs: jax.Array            # [B, E, k]


def _engine_key(seed: int):
    k = jax.random.PRNGKey(seed)
    return jax.random.key_data(k) if jnp.issubdtype(k.dtype, jax.dtypes.prng_key) else k


class _Backend:
    """What both backends share: placement, weights, admissions, the compiled executables."""

    def _setup(self, cfg: ModelConfig, params, draft_params, spec, slots: int, max_len: int,
               seed: int, placement, cycle_copies: Optional[int], cycles: dict):
        self.cfg, self.spec, self.slots, self.max_len = cfg, spec, slots, max_len
        self.placement = placement or OneDevice()
        self.replicas = self.placement.replicas
        self.dtype = params["embed"].dtype
        self._draft_shapes = draft_params     # unplaced: sizes the draft cache (`_make_state`)
        admits, advance, self._axes = jit_admissions(cfg, spec, slots, max_len, self.dtype)
        self.params, self.draft_params = self.placement.weights(params, draft_params)
        self.key = self.placement.replicated(_engine_key(seed))
        self.programs = Programs(envs.JAXSPEC_CYCLE_COPIES if cycle_copies is None
                                 else cycle_copies)
        # The placement's per-device forms need the state's split, so the state comes first.
        self._jitted = dict(cycles=cycles, admits=admits, advance=advance)
        self._built = None

    def _build(self):
        if self._built is None:
            pl, j = self.placement, self._jitted
            self._built = ({k: pl.program(f, "cycle") for k, f in j["cycles"].items()},
                           {k: pl.program(f, "admit") for k, f in j["admits"].items()},
                           pl.program(j["advance"], "advance"))
        return self._built

    def init_state(self):
        state = self.placement.state(self._make_state, self.slots, self._axes)
        self._build()
        return state

    @property
    def jit_calls(self) -> int:
        return self.programs.jit_calls

    @property
    def weights(self) -> tuple:
        return self.params, self.draft_params

    def host(self, x):
        return self.placement.host(x)

    def admit(self, state, form: str, parts, *, features: Features = FULL, lower=False):
        """One admission of `form` ("chunk" or "packed"); parts[r]: replica r's (slot_idx,
        tokens, where, n_valid, next_tok, AdmitArgs) (`engine.admission.admit`)."""
        args = self.placement.stack(parts)
        slot_idx, tokens = args[0], args[1]
        key = ("admit", form, slot_idx.shape[-1], tokens[0].size if self.replicas > 1
               else tokens.size, features)
        return self.programs.call(key, self._build()[1][features, form],
                                  (*self.weights, state, *args, self.key), lower)

    def advance_keys(self, state, slot_idx, advance, *, lower=False):
        """Moves the keys of slots slot_idx [A] on by advance [A] splits (padding: slot B)."""
        return self.programs.call(("advance", len(slot_idx)), self._build()[2],
                                  (state, slot_idx, advance), lower)

    def cycle(self, state, active, features: Features = FULL, *, size=None, short=False,
              lower=False):
        size = size or self.sizes[-1]
        key = (features, size) + (("short",) if short else ())
        got = self.programs.call(("cycle",) + key, self._build()[0][key],
                                 (*self.weights, state, active), lower)
        if lower:
            return got
        state, out = got
        return state, self._tokens(out)


class SpecBackend(_Backend):
    """EAGLE speculative decoding: one jitted call of `cycles_per_call` cycles (draft -> verify
    -> accept -> compaction -> catch-up) per engine step; greedy and sampled slots mix.
    With a single active slot of several a call runs one cycle (`call_size`): a longer call
    would mostly waste cycles past the request's end. The accept lengths come per cycle."""

    def __init__(self, cfg: ModelConfig, params, draft_params, spec, slots: int, max_len: int,
                 *, seed: int = 0, cycles_per_call: int = 1, short_rows: Optional[int] = None,
                 placement=None, cycle_copies: Optional[int] = None):
        from jaxspec.spec.config import check_vocab, resolve_spec
        from jaxspec.spec.cycle import jit_cycle
        from jaxspec.spec.draft import check_head
        spec = resolve_spec(spec)
        check_vocab(spec, cfg.vocab_size)
        check_head(cfg, spec, draft_params)
        if cycles_per_call < 1:
            raise ValueError(f"cycles_per_call must be >= 1, got {cycles_per_call}")
        self.cycles_per_call = cycles_per_call
        self.sizes = tuple(sorted({1, cycles_per_call}))
        self.short_rows = (defaults.short_rows(slots, max_len=max_len) if short_rows is None
                           else short_rows)
        builds = [()] + ([("short",)] if self.short_rows else [])
        cycles = {(f, k) + s: jit_cycle(cfg.with_live_rows(self.short_rows) if s else cfg, spec,
                                        features=f, n_cycles=k, slots=slots)
                  for f in VARIANTS for k in self.sizes for s in builds}
        self._setup(cfg, params, draft_params, spec, slots, max_len, seed, placement,
                    cycle_copies, cycles)
        self.emit, self.min_emit = self.emits(cycles_per_call)

    def _make_state(self, slots: int):
        from jaxspec.spec.cycle import init_state
        return init_state(self.cfg, self.spec, slots, self.max_len, self.dtype,
                          self._draft_shapes)

    def _tokens(self, out) -> CycleTokens:
        return CycleTokens(out.tokens, out.accept_len, out.logprob, out.top_ids,
                           out.top_logprobs)

    def key_advances(self, n_out: int, n_cycles: int) -> int:
        return n_cycles          # each cycle splits each active slot's key once

    def emits(self, size: int):
        return self.spec.max_emit * size, size   # an active slot emits >= 1 token per cycle

    def call_size(self, n_active: int) -> int:
        # A one-slot engine runs the size it was built for (asked for explicitly).
        return 1 if n_active <= 1 < self.slots else self.cycles_per_call


@functools.lru_cache(maxsize=None)
def _jit_plain_cycles(cfg, slots, n_steps, _gemm):
    """{features: n_steps decode steps}; the layout's live_rows sizes the attention (short
    builds)."""
    return {f: jit(functools.partial(plain_cycle, cfg=cfg, n_steps=n_steps, features=f),
                   rows=slots, donate_argnums=(2,)) for f in VARIANTS}


class PlainBackend(_Backend):
    """Plain decoding: n_steps decode steps per engine step (several per dispatch amortize the
    host's per-dispatch cost); sampling, penalties and logprobs per slot."""

    def __init__(self, cfg: ModelConfig, params, slots: int, max_len: int, *, n_steps: int = 4,
                 seed: int = 0, short_rows: Optional[int] = None, placement=None,
                 cycle_copies: Optional[int] = None):
        if n_steps < 1:
            raise ValueError(f"decode steps per call must be >= 1, got {n_steps}")
        self.emit = self.min_emit = n_steps
        self.sizes = (n_steps,)
        self.short_rows = (defaults.short_rows(slots, plain=True, max_len=max_len)
                           if short_rows is None else short_rows)
        cycles = {(f, n_steps): j for f, j in
                  _jit_plain_cycles(cfg, slots, n_steps, gemm_choice()).items()}
        if self.short_rows:   # the decode programs again, sized for short prefixes
            short = _jit_plain_cycles(cfg.with_live_rows(self.short_rows), slots, n_steps,
                                      gemm_choice())
            cycles.update({(f, n_steps, "short"): j for f, j in short.items()})
        self._setup(cfg, params, None, None, slots, max_len, seed, placement, cycle_copies,
                    cycles)

    def _make_state(self, slots: int):
        return init_plain_state(self.cfg, slots, self.max_len, self.dtype)

    def _tokens(self, em) -> CycleTokens:
        return CycleTokens(em.tokens, None, em.logprob, em.top_ids, em.top_logprobs)

    def key_advances(self, n_out: int, n_cycles: int) -> int:
        return n_out - 1         # one split per decode step after the first token

    def emits(self, size: int):
        return size, size

    def call_size(self, n_active: int) -> int:
        return self.emit
