"""Speculation settings: a frozen, hashable SpecConfig (a static jit argument) and named presets."""
from __future__ import annotations

import dataclasses
from typing import Optional, Union

from jaxspec.config import ConfigError


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """EAGLE tree shape.

    num_steps         S: tree depth = draft forwards per cycle (S - 1 draft steps + the catch-up)
    topk              K: children expanded per frontier node, and frontier width
    num_draft_tokens  N: tree nodes verified per cycle, root included
    argmax_topk1      with K == 1, draft by argmax and never form a full-vocab softmax
    skip_dead_rows    in the catch-up, run attention output / MLP / lm_head only for the last
                      live row of each slot (the other rows only write draft KV)
    The last two exist so the benchmark can measure what each saves; leave them on.
    """
    num_steps: int
    topk: int
    num_draft_tokens: int
    argmax_topk1: bool = True
    skip_dead_rows: bool = True

    def __post_init__(self):
        for name in ("num_steps", "topk", "num_draft_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ConfigError(f"SpecConfig.{name} must be an int, got {v!r}")
        if self.num_steps < 1:
            raise ConfigError(f"num_steps={self.num_steps} must be >= 1")
        if self.topk < 1:
            raise ConfigError(f"topk={self.topk} must be >= 1")
        if self.num_draft_tokens < 2:
            raise ConfigError(
                f"num_draft_tokens={self.num_draft_tokens} must be >= 2 (the root plus at least "
                "one drafted token)")
        if self.num_draft_tokens - 1 > self.num_candidates:
            raise ConfigError(
                f"num_draft_tokens={self.num_draft_tokens} needs {self.num_draft_tokens - 1} "
                f"candidates besides the root, but num_steps={self.num_steps}, topk={self.topk} "
                f"draft only topk + (num_steps - 1) * topk**2 = {self.num_candidates}")

    @property
    def num_candidates(self) -> int:
        """Drafted tokens per cycle: K from the catch-up, K*K from each later draft step."""
        return self.topk + (self.num_steps - 1) * self.topk * self.topk

    @property
    def max_emit(self) -> int:
        """Tokens a slot can emit per cycle (accepted + bonus): the stride of the output rows."""
        return self.num_steps + 1

    @property
    def uses_argmax(self) -> bool:
        return self.topk == 1 and self.argmax_topk1


PRESETS = {
    # SGLang's "Naive EAGLE": one drafted token; verify and draft catch-up in one function.
    "naive": SpecConfig(num_steps=1, topk=1, num_draft_tokens=2),
    "chain": SpecConfig(num_steps=3, topk=1, num_draft_tokens=4),
    # The EAGLE reference default tree.
    "tree": SpecConfig(num_steps=6, topk=10, num_draft_tokens=60),
}


def resolve_spec(spec: Union[SpecConfig, str]) -> SpecConfig:
    """A SpecConfig, a preset name, or 'STEPSxTOPKxTOKENS' (e.g. '6x8x40', the jaxspec-bench
    spelling) -> SpecConfig."""
    if isinstance(spec, SpecConfig):
        return spec
    if isinstance(spec, str):
        if spec in PRESETS:
            return PRESETS[spec]
        try:
            s, t, n = (int(p) for p in spec.lower().split("x"))
        except ValueError:
            raise ConfigError(f"unknown speculation preset {spec!r}; presets: "
                              f"{', '.join(PRESETS)}, or STEPSxTOPKxTOKENS such as 3x1x4") from None
        return SpecConfig(num_steps=s, topk=t, num_draft_tokens=n)
    raise ConfigError(f"spec must be a SpecConfig or a preset name, got {type(spec).__name__}")


def check_vocab(spec: SpecConfig, vocab_size: int) -> None:
    if spec.topk > vocab_size:
        raise ConfigError(f"topk={spec.topk} exceeds the vocabulary size {vocab_size}")


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """How the draft head scores tokens (EAGLE-1 heads; an EAGLE-3 head has its own vocabulary).

    draft_vocab          draft only the K most frequent tokens of a ranking (FR-Spec): the
                         draft's lm_head reads K columns instead of V; the output is unchanged,
                         tokens outside the K are never drafted. 0: the whole vocabulary.
                         None: the shipped head's default (`defaults.DRAFT_VOCAB`), else all.
    draft_vocab_ranking  the ranking file (`spec.draft_vocab.save_ranking`); None: the one
                         shipped beside the default head
    draft_context_vocab  of a cut vocabulary's K, the last E are each request's own recent
                         tokens outside the other K - E (`spec.context_vocab`). None:
                         `defaults.context_vocab(max_batch)` with a cut vocabulary
    """
    draft_vocab: Optional[int] = None
    draft_vocab_ranking: Optional[str] = None
    draft_context_vocab: Optional[int] = None

    def __post_init__(self):
        for name, zero in (("draft_vocab", "the whole vocabulary"), ("draft_context_vocab",
                                                                     "none")):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 0):
                raise ConfigError(f"{name} must be an int >= 0 (0: {zero}), got {value!r}")
