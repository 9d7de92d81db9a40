"""Static configuration: frozen, hashable dataclasses usable as static jit arguments."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Tuple

from jaxspec import envs

SUPPORTED_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


class ConfigError(ValueError):
    """A model or run configuration is invalid or unsupported."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. kind in {"llama3", "linear"}."""
    kind: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    sliding_window: Optional[int] = None  # Mistral; checked against the context length
    bos_token_id: Optional[int] = None
    eos_token_ids: Tuple[int, ...] = ()
    def with_layout(self, **changes) -> "RunConfig":
        """This architecture as one program runs it: `Layout` fields changed from this
        config's layout (the default layout for a plain ModelConfig)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(ModelConfig)}
        return RunConfig(**fields, layout=dataclasses.replace(layout_of(self), **changes))

    def with_live_rows(self, rows: int) -> "RunConfig":
        """This config for programs run only while every slot holds at most `rows` rows."""
        return self.with_layout(live_rows=rows)

    def for_prefill(self, unroll: Optional[int] = None, packed: bool = False) -> "RunConfig":
        """The layout prompt chunks run with: always the scan. A serving engine compiles one
        prefill per (slot count, chunk width) bucket, dozens in all; the scan compiles one layer
        body per bucket where the unrolled loop compiles all L (with their attention kernels),
        which makes warm-up take minutes. A chunk does far more arithmetic per weight byte than
        a decode step, so the scan's weight copies cost it little.

        unroll: layers per scan iteration (default: JAXSPEC_PREFILL_UNROLL, else 1).
        packed: the chunks are packs of prompts (`Layout.packed_chunks`)."""
        if unroll is None:
            unroll = envs.JAXSPEC_PREFILL_UNROLL
        if unroll < 1:
            raise ConfigError(f"prefill unroll must be >= 1, got {unroll}")
        return self.with_layout(unroll_layers=False, scan_unroll=unroll, causal_chunks=True,
                                packed_chunks=packed)

    def __post_init__(self):
        if self.arch not in SUPPORTED_ARCHS:
            raise ConfigError(
                f"unsupported architecture {self.arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for RoPE")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def param_count(self) -> int:
        h, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * f + 2 * h
        head = 0 if self.tie_word_embeddings else h * v
        return v * h + head + h + self.num_layers * per_layer

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> "ModelConfig":
        """From a parsed HF `config.json`."""
        archs = d.get("architectures") or [d.get("model_type", "?")]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHS:
            raise ConfigError(
                f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
        try:
            n_heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            # transformers >= 5 writes `rope_parameters` (theta included) instead of rope_scaling.
            rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
            eos = d.get("eos_token_id")
            eos = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
            return cls(
                arch=arch,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=int(d["num_hidden_layers"]),
                num_heads=n_heads,
                num_kv_heads=int(d.get("num_key_value_heads") or n_heads),
                head_dim=int(d.get("head_dim") or hidden // n_heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=float(d.get("rope_theta") or rope.get("rope_theta") or 10000.0),
                rope_scaling=_rope_scaling_from_hf(rope),
                max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=bool(d.get("attention_bias", arch == "Qwen2ForCausalLM")),
                sliding_window=(d.get("sliding_window") if d.get("use_sliding_window", arch == "MistralForCausalLM")
                                else None),
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=tuple(int(e) for e in eos),
            )
        except KeyError as e:
            raise ConfigError(f"config.json lacks required field {e.args[0]!r}") from None


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one compiled program runs a model: execution, not architecture.

    unroll_layers  the layers as an unrolled loop over static slices of the stacked weights
                   (a GPU reads them in place) instead of a lax.scan (whose dynamic slices XLA
                   copies out every step); the scan compiles much faster, which the CPU wants
    scan_unroll    with the scan: layers per iteration (each iteration a loop runs outside
                   the CUDA graph is a launch the host makes)
    causal_chunks  no token sees a later new token (prompt chunks and packs), so attention row
                   blocks stop at their last query's key block (`for_prefill`)
    packed_chunks  the chunks are prompts end to end: each row block starts at the key block
                   its first token first sees (`for_prefill(packed=True)`)
    live_rows      no slot's live prefix exceeds this many rows while the program runs (0: up
                   to the cache's length): the attention cuts the prefix into fewer splits;
                   results do not depend on it (the kernel reads each slot's length)
    """
    unroll_layers: bool = False
    scan_unroll: int = 1
    causal_chunks: bool = False
    packed_chunks: bool = False
    live_rows: int = 0

    def __post_init__(self):
        if self.live_rows < 0:
            raise ConfigError(f"live_rows must be >= 0, got {self.live_rows}")
        if self.scan_unroll < 1:
            raise ConfigError(f"scan_unroll must be >= 1, got {self.scan_unroll}")


@dataclasses.dataclass(frozen=True)
class RunConfig(ModelConfig):
    """A ModelConfig as one program runs it: the architecture and its `Layout`
    (`ModelConfig.with_layout`, `for_prefill`, `with_live_rows`)."""
    layout: Layout = Layout()


def layout_of(cfg: ModelConfig) -> Layout:
    """The layout a config runs with (the default one for a plain ModelConfig)."""
    return cfg.layout if isinstance(cfg, RunConfig) else _DEFAULT_LAYOUT


_DEFAULT_LAYOUT = Layout()


def _rope_scaling_from_hf(rs: Optional[Mapping[str, Any]]) -> Optional[RopeScaling]:
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return None
    if kind == "llama3":
        return RopeScaling("llama3", float(rs["factor"]), float(rs.get("low_freq_factor", 1.0)),
                           float(rs.get("high_freq_factor", 4.0)),
                           int(rs.get("original_max_position_embeddings", 8192)))
    if kind == "linear":
        return RopeScaling("linear", float(rs["factor"]))
    raise ConfigError(f"unsupported rope_scaling type {kind!r} (supported: llama3, linear)")


# GGUF `general.architecture` -> the HF class whose semantics the tensors follow. Mistral files use
# "llama". Others (e.g. "gemma", "phi3") need a different forward and are refused.
GGUF_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def model_config_from_gguf(meta: Mapping[str, Any], *, vocab_size: int, tie_word_embeddings: bool,
                           rope_scaling: Optional[RopeScaling] = None) -> ModelConfig:
    """From GGUF metadata (key -> plain value). The vocabulary size and tying come from the tensors
    and the token list, which the caller has; llama3 RoPE scaling is stored as a tensor
    (`rope_freqs.weight`), so the caller infers it too."""
    g = meta.get("general.architecture")
    if g not in GGUF_ARCHS:
        raise ConfigError(
            f"unsupported GGUF architecture {g!r}; supported: {', '.join(GGUF_ARCHS)}")

    def key(name, default=KeyError):
        v = meta.get(f"{g}.{name}")
        if v is None:
            if default is KeyError:
                raise ConfigError(f"GGUF metadata lacks required key {g}.{name!s}")
            return default
        return v

    hidden, n_heads = int(key("embedding_length")), int(key("attention.head_count"))
    if rope_scaling is None and key("rope.scaling.type", None) == "linear":
        rope_scaling = RopeScaling("linear", float(key("rope.scaling.factor")))
    elif rope_scaling is None and key("rope.scaling.type", None) not in (None, "none"):
        raise ConfigError(f"unsupported GGUF rope scaling type {key('rope.scaling.type')!r}")
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
           if meta.get(k) is not None]
    return ModelConfig(
        arch=GGUF_ARCHS[g],
        vocab_size=int(vocab_size),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=n_heads,
        num_kv_heads=int(key("attention.head_count_kv", n_heads)),
        head_dim=int(key("attention.key_length", hidden // n_heads)),
        rms_norm_eps=_from_f32(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=_from_f32(key("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(key("context_length", 4096)),
        tie_word_embeddings=bool(tie_word_embeddings),
        attention_bias=g == "qwen2",
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos)),
    )


def _from_f32(v) -> float:
    """GGUF stores floats as f32: 1e-5 reads back as 9.9999997e-06. The shortest decimal that
    rounds to the same f32 is the value the model was configured with."""
    import numpy as np

    return float(str(np.float32(v)))
