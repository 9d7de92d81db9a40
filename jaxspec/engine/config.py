"""The engine's configuration: one frozen dataclass, every option documented once.

`LLM(model, draft, spec, **everyday)` takes the options most runs change as keywords and the
rest as `LLM(..., engine=EngineConfig(...))`; `jaxspec-bench` fills the same object. None means
"the tuned default" (`jaxspec.defaults`), resolved by `resolved()` once the engine's size and
kind are known.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from jaxspec import defaults
from jaxspec.config import ConfigError

PACK_ROWS = ("pow2", "fine")


def _int(name: str, value, low: int, none_ok: bool = True):
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{name} must be an int >= {low}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How the engine schedules, prefills and calls the device.

    max_batch         slots decoded together (per replica under data parallelism)
    max_model_len     tokens per slot, prompt + output (None: the default, capped by the model)
    kv_budget         KV rows in all the running requests may hold (None: every slot full);
                      past it the newest requests are retracted and resumed later
    prefill_chunk     the widest prefill chunk; longer prompts take one device call a chunk
    min_chunk         the narrowest chunk and pack
    slot_growth       ratio of successive admission slot counts (4: 1, 4, 16, 64)
    width_growth      ratio of successive chunk widths (4: 16, 64, 256, ..)
    packing           first chunks of an admission's newcomers laid end to end in one row
                      (False: padded to a slot count and the longest prompt's width)
    pack_tokens       the widest pack row (None: 2 x prefill_chunk)
    pack_max_tokens   the most tokens one packed admission computes
    pack_rows         row counts a pack is padded to: 'pow2' (2, 4, 8, ..) or 'fine' (2, 3, 4,
                      6, 8, 12, ..: at most 1.5x its rows, one more program per doubling)
    admit_interval    device calls between admissions while requests run (1: at once)
    cycles_per_call   speculative cycles per device call
    decode_steps      plain decode steps per device call
    short_rows        rows under which calls run builds with fewer attention splits (0: none)
    cycle_copies      loaded copies of each cycle program, run in turn (None: the variable
                      JAXSPEC_CYCLE_COPIES, else 1)
    layer_layout      'scan' or 'unrolled' (the target's layers in a loop or unrolled)
    compile_workers   threads compiling the warm-up programs
    submit_slice      `LLM.generate` encodes and submits prompts this many at a time while the
                      device runs the ones before
    seed              the engine's rng seed (requests without their own seed)
    """
    max_batch: int = defaults.MAX_BATCH
    max_model_len: Optional[int] = None
    kv_budget: Optional[int] = None
    prefill_chunk: Optional[int] = None
    min_chunk: int = defaults.MIN_CHUNK
    slot_growth: int = defaults.SLOT_GROWTH
    width_growth: int = defaults.WIDTH_GROWTH
    packing: bool = True
    pack_tokens: Optional[int] = None
    pack_max_tokens: Optional[int] = None
    pack_rows: str = "pow2"
    admit_interval: Optional[int] = None
    cycles_per_call: Optional[int] = None
    decode_steps: int = defaults.DECODE_STEPS
    short_rows: Optional[int] = None
    cycle_copies: Optional[int] = None
    layer_layout: Optional[str] = None
    compile_workers: Optional[int] = None
    submit_slice: Optional[int] = None
    seed: int = 0

    def __post_init__(self):
        _int("max_batch", self.max_batch, 1, none_ok=False)
        _int("max_model_len", self.max_model_len, 16)
        _int("kv_budget", self.kv_budget, 1)
        _int("min_chunk", self.min_chunk, 1, none_ok=False)
        _int("prefill_chunk", self.prefill_chunk, max(16, self.min_chunk))
        _int("slot_growth", self.slot_growth, 2, none_ok=False)
        _int("width_growth", self.width_growth, 2, none_ok=False)
        _int("pack_tokens", self.pack_tokens, 1)
        _int("pack_max_tokens", self.pack_max_tokens, 1)
        _int("admit_interval", self.admit_interval, 1)
        _int("cycles_per_call", self.cycles_per_call, 1)
        _int("decode_steps", self.decode_steps, 1, none_ok=False)
        _int("short_rows", self.short_rows, 0)
        _int("cycle_copies", self.cycle_copies, 1)
        _int("compile_workers", self.compile_workers, 1)
        _int("submit_slice", self.submit_slice, 1)
        _int("seed", self.seed, 0, none_ok=False)
        if not isinstance(self.packing, bool):
            raise ConfigError(f"packing must be a bool, got {self.packing!r}")
        if self.pack_rows not in PACK_ROWS:
            raise ConfigError(f"pack_rows must be one of {PACK_ROWS}, got {self.pack_rows!r}")
        if self.layer_layout not in (None, "scan", "unrolled"):
            raise ConfigError(f"layer_layout must be 'scan' or 'unrolled', got "
                              f"{self.layer_layout!r}")
        chunk = self.prefill_chunk
        if chunk is not None and self.pack_tokens is not None and self.pack_tokens < chunk:
            raise ConfigError(f"pack_tokens ({self.pack_tokens}) must be >= prefill_chunk "
                              f"({chunk})")
        if (self.pack_tokens is not None and self.pack_max_tokens is not None
                and self.pack_max_tokens < self.pack_tokens):
            raise ConfigError(f"pack_max_tokens ({self.pack_max_tokens}) must be >= "
                              f"pack_tokens ({self.pack_tokens})")

    def replace(self, **changes) -> "EngineConfig":
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ConfigError(f"unknown engine option(s): {', '.join(sorted(unknown))}; see "
                              "jaxspec.EngineConfig")
        return dataclasses.replace(self, **changes)

    def resolved(self, *, slots: int, speculative: bool, model_limit: int) -> "EngineConfig":
        """Every None replaced by its default for an engine of `slots` slots in all. A
        max_model_len past model_limit (the model's context length, or the KV rows the
        backend holds) is capped to it, with a warning: the caller asked for more."""
        import warnings

        max_len = min(self.max_model_len or defaults.MAX_MODEL_LEN, model_limit)
        if self.max_model_len is not None and self.max_model_len > model_limit:
            warnings.warn(f"max_model_len={self.max_model_len} is past this model's limit of "
                          f"{model_limit} tokens (its context length, or the KV rows of the "
                          f"backend): using max_model_len={model_limit}", stacklevel=4)
        chunk = min(self.prefill_chunk or defaults.prefill_chunk(), max_len)
        pack = self.pack_tokens or 2 * chunk
        out = dataclasses.replace(
            self, max_model_len=max_len, prefill_chunk=chunk, pack_tokens=pack,
            pack_max_tokens=self.pack_max_tokens or max(defaults.PACK_MAX_TOKENS, pack),
            admit_interval=self.admit_interval or defaults.admit_interval(slots, speculative),
            cycles_per_call=self.cycles_per_call or defaults.cycles_per_call(self.max_batch),
            layer_layout=self.layer_layout or defaults.layer_layout(),
            compile_workers=self.compile_workers or defaults.compile_workers(),
            submit_slice=self.submit_slice or max(64, self.max_batch))
        if out.min_chunk > chunk:
            raise ConfigError(f"min_chunk ({out.min_chunk}) must be <= prefill_chunk ({chunk})")
        return out
