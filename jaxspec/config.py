"""Static configuration: frozen, hashable dataclasses usable as static jit arguments."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Tuple

from jaxspec import envs

SUPPORTED_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                   "Qwen3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")
# Multimodal checkpoints whose language model runs as the text-only architecture (its
# `text_config`; the loader leaves the other towers out).
TEXT_OF_MULTIMODAL = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
# HF `hidden_act` / `hidden_activation` names -> the MLP gate's activation.
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh",
               "gelu_tanh": "gelu_tanh"}


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
    # Sliding-window attention: a query at position p sees keys at positions > p - window
    # (HF's convention), on the layers `sliding_layers` marks (None: every layer). The cache
    # holds every row of every layer; the window is a mask, not a ring buffer.
    sliding_window: Optional[int] = None
    sliding_layers: Optional[Tuple[bool, ...]] = None
    bos_token_id: Optional[int] = None
    eos_token_ids: Tuple[int, ...] = ()
    # Family features (Qwen3, Gemma 2/3); the defaults are Llama's.
    qk_norm: bool = False             # RMSNorm over head_dim on q and k, before RoPE
    norm_weight_offset: float = 0.0   # norms scale by (offset + weight): Gemma's 1 + w
    sandwich_norms: bool = False      # norms after attention and after the MLP (Gemma)
    embed_scale: float = 1.0          # embeddings times this, in their dtype (Gemma: sqrt(H))
    hidden_act: str = "silu"          # MLP gate activation: "silu" or "gelu_tanh"
    query_pre_attn_scalar: Optional[float] = None  # scores scaled by this ** -0.5 (else D)
    rope_local_theta: Optional[float] = None  # RoPE base of sliding layers, unscaled (Gemma 3)
    attn_logit_softcap: Optional[float] = None   # scores -> cap * tanh(scores / cap)
    final_logit_softcap: Optional[float] = None  # logits -> cap * tanh(logits / cap)

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
        if self.hidden_act not in ACTIVATIONS.values():
            raise ConfigError(f"hidden_act must be one of {sorted(set(ACTIVATIONS.values()))}, "
                              f"got {self.hidden_act!r}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ConfigError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")
        if self.sliding_layers is not None and len(self.sliding_layers) != self.num_layers:
            raise ConfigError(f"sliding_layers has {len(self.sliding_layers)} entries for "
                              f"{self.num_layers} layers")
        for name in ("attn_logit_softcap", "final_logit_softcap", "query_pre_attn_scalar"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive or None, got {getattr(self, name)}")

    @property
    def window_layers(self) -> Tuple[bool, ...]:
        """Per layer: whether it attends through the sliding window."""
        if self.sliding_window is None:
            return (False,) * self.num_layers
        return self.sliding_layers or (True,) * self.num_layers

    @property
    def attn_scale(self) -> float:
        """The factor on q.k: query_pre_attn_scalar ** -0.5 (Gemma), else head_dim ** -0.5."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def param_count(self) -> int:
        h, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * f + 2 * h
        per_layer += 2 * self.head_dim * self.qk_norm + 2 * h * self.sandwich_norms
        head = 0 if self.tie_word_embeddings else h * v
        return v * h + head + h + self.num_layers * per_layer

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> "ModelConfig":
        """From a parsed HF `config.json`."""
        archs = d.get("architectures") or [d.get("model_type", "?")]
        arch = archs[0]
        if arch in TEXT_OF_MULTIMODAL:
            d, arch = _text_config(d, arch), TEXT_OF_MULTIMODAL[arch]
        if arch not in SUPPORTED_ARCHS:
            raise ConfigError(
                f"unsupported architecture {arch!r}; supported: "
                f"{', '.join(SUPPORTED_ARCHS + tuple(TEXT_OF_MULTIMODAL))}")
        try:
            n_heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            eos = d.get("eos_token_id")
            eos = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
            global_rope, _ = _hf_rope_parameters(d)
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
                rope_theta=float(d.get("rope_theta") or global_rope.get("rope_theta")
                                 or (1e6 if arch == "Gemma3ForCausalLM" else 10000.0)),
                rope_scaling=_rope_scaling_from_hf(global_rope),
                max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings",
                                               arch.startswith("Gemma"))),
                attention_bias=bool(d.get("attention_bias", arch == "Qwen2ForCausalLM")),
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=tuple(int(e) for e in eos),
                **_hf_window(arch, d), **_hf_family(arch, d),
            )
        except KeyError as e:
            raise ConfigError(f"config.json lacks required field {e.args[0]!r}") from None


def _text_config(d: Mapping[str, Any], arch: str) -> dict:
    """A multimodal config's `text_config` with transformers' defaults filled in (released
    Gemma 3 configs give only what differs from them), the token ids and tying of the whole
    model where it states them."""
    import transformers

    if not isinstance(d.get("text_config"), Mapping):
        raise ConfigError(f"{arch} config.json lacks its text_config")
    cls = {"Gemma3ForConditionalGeneration": transformers.Gemma3TextConfig}[arch]
    out = cls.from_dict(dict(d["text_config"])).to_dict()
    for key in ("eos_token_id", "bos_token_id", "tie_word_embeddings"):
        if d.get(key) is not None:
            out[key] = d[key]
    return out


def _hf_rope_parameters(d: Mapping[str, Any]):
    """(global, local) RoPE parameter dicts of an HF config: transformers >= 5 writes
    `rope_parameters` (theta included), per layer type where they differ (Gemma 3); older
    configs `rope_scaling` and, for Gemma 3, `rope_local_base_freq`. local is None where the
    config names no RoPE of its own for sliding layers."""
    rp = d.get("rope_parameters")
    if isinstance(rp, Mapping) and ("full_attention" in rp or "sliding_attention" in rp):
        return dict(rp.get("full_attention") or {}), dict(rp.get("sliding_attention") or {})
    glob = dict(rp or d.get("rope_scaling") or {})
    local = ({"rope_theta": d["rope_local_base_freq"]}
             if d.get("rope_local_base_freq") is not None else None)
    return glob, local


# Layer types of HF's `layer_types` this forward runs.
_LAYER_TYPES = {"full_attention": False, "sliding_attention": True}


def _hf_window(arch: str, d: Mapping[str, Any]) -> dict:
    """sliding_window and sliding_layers from an HF config: its `layer_types` where it has them,
    else each family's rule (Mistral: every layer; Qwen2/3 with use_sliding_window: layers from
    max_window_layers on; Gemma 2: every other layer from the first; Gemma 3: all but every
    sliding_window_pattern-th)."""
    window = d.get("sliding_window")
    n = int(d["num_hidden_layers"])
    types = d.get("layer_types")
    if types is not None:
        bad = sorted(set(types) - set(_LAYER_TYPES))
        if bad:
            raise ConfigError(f"unsupported layer type(s) {bad} in layer_types (supported: "
                              f"{', '.join(_LAYER_TYPES)})")
        if len(types) != n:
            raise ConfigError(f"layer_types has {len(types)} entries for {n} layers")
        layers = tuple(_LAYER_TYPES[t] for t in types)
    elif arch == "MistralForCausalLM":
        layers = (True,) * n
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        first = int(d.get("max_window_layers", 28))
        layers = tuple(bool(d.get("use_sliding_window")) and i >= first for i in range(n))
    elif arch == "Gemma2ForCausalLM":
        layers = tuple(i % 2 == 0 for i in range(n))
    elif arch == "Gemma3ForCausalLM":
        period = int(d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6)
        layers = tuple((i + 1) % period != 0 for i in range(n))
    else:
        layers = (False,) * n
    if window is None or not any(layers):
        return {"sliding_window": None, "sliding_layers": None}
    return {"sliding_window": int(window), "sliding_layers": None if all(layers) else layers}


def _hf_family(arch: str, d: Mapping[str, Any]) -> dict:
    """The family features of `ModelConfig` an HF config implies."""
    if arch == "Qwen3ForCausalLM":
        return {"qk_norm": True, "hidden_act": _activation(d.get("hidden_act", "silu"))}
    if not arch.startswith("Gemma"):
        return {"hidden_act": _activation(d.get("hidden_act", "silu"))}
    if d.get("use_bidirectional_attention"):
        raise ConfigError("use_bidirectional_attention=true (an embedding model) is not "
                          "supported: the target must be causal")
    gemma3 = arch == "Gemma3ForCausalLM"
    if gemma3 and d.get("attn_logit_softcapping") is not None:
        # transformers' Gemma 3 ignores it and llama.cpp's converter refuses it.
        raise ConfigError("attn_logit_softcapping is set in a Gemma 3 config, which its "
                          "reference implementation does not apply; set it to null")
    _, local = _hf_rope_parameters(d)
    if local and local.get("rope_type", "default") != "default":
        raise ConfigError(f"unsupported RoPE type {local['rope_type']!r} on sliding layers")
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    return {
        "qk_norm": gemma3, "norm_weight_offset": 1.0, "sandwich_norms": True,
        "embed_scale": float(d["hidden_size"]) ** 0.5, "hidden_act": _activation(act),
        "query_pre_attn_scalar": float(d.get("query_pre_attn_scalar", 256)),
        "rope_local_theta": (float((local or {}).get("rope_theta") or 10000.0) if gemma3
                             else None),
        "attn_logit_softcap": None if gemma3 else _positive(d.get("attn_logit_softcapping")),
        "final_logit_softcap": _positive(d.get("final_logit_softcapping")),
    }


def _activation(name) -> str:
    if name not in ACTIVATIONS:
        raise ConfigError(f"unsupported MLP activation {name!r} (supported: "
                          f"{', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


def _positive(v) -> Optional[float]:
    """A soft-cap from a config: None or 0 (off) -> None."""
    return float(v) if v else None


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
GGUF_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
              "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
              "gemma3": "Gemma3ForCausalLM"}
# Gemma 2/3 27B: llama.cpp (after gemma_pytorch) scales queries by (hidden / heads) ** -0.5 at
# these layer counts, by head_dim ** -0.5 otherwise; GGUF stores no query_pre_attn_scalar.
_GGUF_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def model_config_from_gguf(meta: Mapping[str, Any], *, vocab_size: int, tie_word_embeddings: bool,
                           rope_scaling: Optional[RopeScaling] = None) -> ModelConfig:
    """From GGUF metadata (key -> plain value). The vocabulary size and tying come from the tensors
    and the token list, which the caller has; llama3 RoPE scaling is stored as a tensor
    (`rope_freqs.weight`), so the caller infers it too. What the format leaves out, llama.cpp's
    loader fixes per architecture, and so does this (`_gguf_family`)."""
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
        rope_theta=_from_f32(key("rope.freq_base", 1e6 if g == "gemma3" else 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(key("context_length", 4096)),
        tie_word_embeddings=bool(tie_word_embeddings),
        attention_bias=g == "qwen2",
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos)),
        **_gguf_family(g, key, hidden, n_heads),
    )


def _gguf_family(g: str, key, hidden: int, n_heads: int) -> dict:
    """Family features of a GGUF architecture, as llama.cpp's loader sets them (llama-model.cpp):
    Gemma 2 slides every other layer (window 4096 unless stored) and soft-caps (50 on scores,
    30 on logits unless stored); Gemma 3 slides five layers of six where a window is stored,
    with RoPE base 10000 there (unless stored). A stored sliding_window_pattern (a period, or a
    flag per layer) takes the place of the layer rule."""
    if g == "qwen3":
        return {"qk_norm": True}
    if g not in ("gemma2", "gemma3"):
        return {}
    n = int(key("block_count"))
    head_dim = int(key("attention.key_length", hidden // n_heads))
    window = int(key("attention.sliding_window", 4096 if g == "gemma2" else 0))
    pattern = key("attention.sliding_window_pattern", 2 if g == "gemma2" else 6)
    if isinstance(pattern, (list, tuple)):   # per layer: whether it slides
        if len(pattern) != n:
            raise ConfigError(f"GGUF {g}.attention.sliding_window_pattern has {len(pattern)} "
                              f"entries for {n} layers")
        layers = tuple(bool(x) for x in pattern)
    else:   # a period: the last layer of each is global
        layers = tuple((i + 1) % int(pattern) != 0 for i in range(n))
    return {
        "qk_norm": g == "gemma3", "norm_weight_offset": 1.0, "sandwich_norms": True,
        "embed_scale": float(hidden) ** 0.5, "hidden_act": "gelu_tanh",
        "query_pre_attn_scalar": float(hidden // n_heads if n == _GGUF_GEMMA_27B_LAYERS[g]
                                       else head_dim),
        "sliding_window": window or None, "sliding_layers": layers if window else None,
        "rope_local_theta": (_from_f32(key("rope.freq_base_swa", 10000.0)) if g == "gemma3"
                             else None),
        "attn_logit_softcap": (_positive(_from_f32(key("attn_logit_softcapping", 50.0)))
                               if g == "gemma2" else None),
        "final_logit_softcap": _positive(_from_f32(
            key("final_logit_softcapping", 30.0 if g == "gemma2" else 0.0))),
    }


def _from_f32(v) -> float:
    """GGUF stores floats as f32: 1e-5 reads back as 9.9999997e-06. The shortest decimal that
    rounds to the same f32 is the value the model was configured with."""
    import numpy as np

    return float(str(np.float32(v)))
