"""Draft head files: our own EAGLE-1 head format, public EAGLE-1 checkpoints, and the one entry
that tells every kind apart (`load_draft`). Public EAGLE-3 heads: `jaxspec.loading.eagle3_ckpt`.

Our format (`save_head` / `load_head`): one safetensors file of the params of
`jaxspec.models.eagle` (flat keys "fc", "fc_bias", "layers.wqkv", ...), fp32 or bf16, plus a JSON
`jaxspec_head` metadata entry (the target's shape, how it was trained). No pickle anywhere.

Public EAGLE-1 heads (SafeAILab/EAGLE, eagle/model/cnets.py), `pytorch_model.bin` or
`model.safetensors` beside a `config.json` (the target's Llama / Qwen2 config):
    fc.weight [H, 2H] (input = concat(embed, feature)), fc.bias [H] (optional)
    layers.0.self_attn.{q,k,v,o}_proj.weight (+ q/k/v bias for Qwen2 targets)
    layers.0.mlp.{gate,up,down}_proj.weight, layers.0.post_attention_layernorm.weight
    (layer 0 has no input_layernorm; embed_tokens.weight, when present, is the target's: ignored)
converted to eagle.py's layout (torch [out, in] weights transposed to [in, out], q/k/v and
gate/up fused). HF rotate-half RoPE layout, so q/k need no permutation.

Which version a public checkpoint is: its tensors (an EAGLE-3 head has midlayer.* or a
hidden_norm, and d2t / t2d; an EAGLE-1 head's one layer is layers.0.* without a hidden_norm) and
config.json's architectures where they name one (*Eagle3* SGLang / vLLM classes; *Eagle* their
EAGLE-1 ones; the EAGLE repository writes the target's class). When the two disagree, or a loader
for one version is given the other, the error says which is which.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Mapping, Optional, Tuple

import numpy as np

from jaxspec import envs
from jaxspec.config import ModelConfig
from jaxspec.loading.common import WeightsError
from jaxspec.loading.eagle3_ckpt import (  # noqa: F401 -- the public EAGLE-3 API, also here
    check_version, eagle3_config_json, eagle3_head, eagle3_state_dict, is_eagle3_checkpoint,
    load_eagle3, load_eagle3_head, save_eagle3)
from jaxspec.loading.state_dict import (  # noqa: F401 -- read_state_dict: also here
    RANKING_FILE, cast_tree, float_tensor, read_state_dict, to_jax)

HEAD_META_KEY = "jaxspec_head"
DEFAULT_HEAD_DIR = Path(__file__).resolve().parents[2] / "checkpoints" / "smollm2-135m-instruct-eagle1"
DEFAULT_HEAD_FILE = "head.safetensors"
DEFAULT_RANKING_FILE = RANKING_FILE
# The default model's shape: the shipped head was trained for it and nothing else.
DEFAULT_TARGET_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                            num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64)


# -- our own head files ------------------------------------------------------------------------
def eagle1_shapes(cfg: ModelConfig, mlp_width: Optional[int] = None) -> Dict[str, Tuple[int, ...]]:
    """Flat key -> shape of an EAGLE-1 head for target `cfg` (eagle.init_eagle_params' layout);
    mlp_width: the head's MLP intermediate size (default the target's)."""
    h, f = cfg.hidden_size, mlp_width or cfg.intermediate_size
    qkv = cfg.q_size + 2 * cfg.kv_size
    shapes = {"fc": (2 * h, h), "fc_bias": (h,), "layers.attn_norm": (1, h),
              "layers.wqkv": (1, h, qkv), "layers.wo": (1, cfg.q_size, h),
              "layers.mlp_norm": (1, h), "layers.w_gate_up": (1, h, 2 * f),
              "layers.w_down": (1, f, h)}
    if cfg.attention_bias:
        shapes["layers.bqkv"] = (1, qkv)
    return shapes


def flatten_head(draft_params) -> Dict[str, np.ndarray]:
    out = {"fc": draft_params["fc"], "fc_bias": draft_params["fc_bias"]}
    for k, v in draft_params["layers"].items():
        out[f"layers.{k}"] = v
    return {k: np.asarray(v) for k, v in out.items()}


def unflatten_head(flat: Mapping[str, np.ndarray]) -> dict:
    params: dict = {"layers": {}}
    for k, v in flat.items():
        if k.startswith("layers."):
            params["layers"][k[len("layers."):]] = v
        else:
            params[k] = v
    return params


def save_head(path, draft_params, meta: Optional[dict] = None) -> Path:
    """Writes an EAGLE-1 head as one safetensors file (bf16 stays bf16: ml_dtypes arrays)."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    flat = {k: np.ascontiguousarray(v) for k, v in flatten_head(draft_params).items()}
    # the width from w_gate_up, so that a w_down of another width is the tensor load_head names
    meta = {**(meta or {}), "mlp_width": int(flat["layers.w_gate_up"].shape[-1]) // 2}
    save_file(flat, str(path), metadata={HEAD_META_KEY: json.dumps(meta)})
    return path


def read_head_meta(path) -> dict:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            text = (f.metadata() or {}).get(HEAD_META_KEY, "{}")
    except Exception as e:  # noqa: BLE001 -- the library's errors name no file
        raise WeightsError(f"{path}: unreadable safetensors file ({e})") from None
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as e:
        raise WeightsError(f"{path}: its {HEAD_META_KEY} metadata is not JSON ({e})") from None
    if not isinstance(meta, dict):
        raise WeightsError(f"{path}: its {HEAD_META_KEY} metadata is not a JSON object")
    return meta


def load_head(path, cfg: ModelConfig, dtype=None):
    """An EAGLE-1 head file from `save_head` -> draft params (jax arrays) for target `cfg`.

    dtype: None keeps the stored dtype. Every tensor's shape is checked against `cfg`.
    """
    import jax.numpy as jnp
    from safetensors.numpy import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"draft head file {str(path)!r} does not exist")
    try:
        flat = load_file(str(path))
    except Exception as e:  # noqa: BLE001 -- the library's errors name no file
        raise WeightsError(f"{path}: unreadable safetensors file ({e})") from None
    check_shapes(flat, eagle1_shapes(cfg, _mlp_width(read_head_meta(path), cfg, path)), str(path))
    params = unflatten_head(flat)
    cast = (lambda a: jnp.asarray(a, dtype)) if dtype is not None else jnp.asarray
    import jax
    return jax.tree_util.tree_map(cast, params)


def _mlp_width(meta: Mapping, cfg: ModelConfig, path) -> int:
    """The head's MLP width from its metadata (heads saved before it was recorded: the
    target's)."""
    f = meta.get("mlp_width", cfg.intermediate_size)
    if not isinstance(f, int) or isinstance(f, bool) or f <= 0:
        raise WeightsError(f"{path}: metadata mlp_width must be a positive integer, got {f!r}")
    return f


def matches_default_target(cfg: ModelConfig) -> bool:
    return all(getattr(cfg, k) == v for k, v in DEFAULT_TARGET_SHAPE.items())


def default_head_path() -> Path:
    """checkpoints/ of the source tree; JAXSPEC_DRAFT_HEAD names another file (an installed
    wheel does not carry checkpoints/)."""
    return envs.JAXSPEC_DRAFT_HEAD or DEFAULT_HEAD_DIR / DEFAULT_HEAD_FILE


def default_ranking_path() -> Path:
    """The token ranking shipped beside the default head (`spec.draft_vocab`)."""
    return default_head_path().parent / DEFAULT_RANKING_FILE


def load_default_head(cfg: ModelConfig, dtype=None):
    """The shipped EAGLE-1 head of the default model (SmolLM2-135M-Instruct) as draft params.

    dtype: None -> the default target dtype (bf16 on GPU, fp32 elsewhere), so the head matches
    the target params `load_model` returns. Raises ValueError for any other target shape.
    """
    if not matches_default_target(cfg):
        raise ValueError(
            "the shipped draft head is for SmolLM2-135M-Instruct "
            f"({DEFAULT_TARGET_SHAPE}); this target is {cfg.arch} with hidden_size="
            f"{cfg.hidden_size}, num_layers={cfg.num_layers}, vocab_size={cfg.vocab_size}: "
            "train a head for it (jaxspec train-eagle) or load a public one")
    if dtype is None:
        from jaxspec.weights import default_dtype
        dtype = default_dtype()
    return load_head(default_head_path(), cfg, dtype)


def check_shapes(flat: Mapping[str, np.ndarray], expected: Mapping[str, Tuple[int, ...]],
                 origin: str) -> None:
    missing = [k for k in expected if k not in flat]
    if missing:
        raise WeightsError(f"{origin}: missing tensor(s) {missing}")
    extra = [k for k in flat if k not in expected]
    if extra:
        raise WeightsError(f"{origin}: unexpected tensor(s) {extra}")
    for k, shape in expected.items():
        if tuple(flat[k].shape) != tuple(shape):
            raise WeightsError(f"{origin}: tensor {k!r} has shape {tuple(flat[k].shape)}, "
                               f"expected {tuple(shape)}")
        if not np.issubdtype(flat[k].dtype, np.floating) and flat[k].dtype.name != "bfloat16":
            raise WeightsError(f"{origin}: tensor {k!r} has dtype {flat[k].dtype}, expected a "
                               "floating-point dtype")


# -- public EAGLE-1 checkpoints --------------------------------------------------------------
# config.json architectures of an EAGLE-1 head this layer runs: the target classes the EAGLE
# repository writes (Llama, Qwen2), SGLang's and vLLM's EAGLE-1 classes.
EAGLE1_ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLMEagle",
                "Qwen2ForCausalLMEagle", "EagleLlamaForCausalLM")


def _check_config(config: Mapping, cfg: ModelConfig, origin: str, keys) -> None:
    for hf_key, ours in keys:
        if hf_key in config and config[hf_key] != getattr(cfg, ours):
            raise WeightsError(f"{origin}: config.json {hf_key}={config[hf_key]} but the target "
                               f"has {ours}={getattr(cfg, ours)}")


def convert_eagle1(sd: Mapping[str, np.ndarray], cfg: ModelConfig, origin: str = "EAGLE-1 head",
                   dtype=np.float32) -> dict:
    """A public EAGLE-1 state dict -> draft params (numpy) of jaxspec.models.eagle for `cfg`."""
    h, f, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    sd = {k[len("model."):] if k.startswith("model.") else k: v for k, v in sd.items()}
    g = lambda n, s, opt=False: float_tensor(sd, n, s, origin, opt)  # noqa: E731
    a = "layers.0.self_attn."
    m = "layers.0.mlp."
    fc = g("fc.weight", (h, 2 * h))
    fc_b = g("fc.bias", (h,), True)
    wq, wk, wv = g(a + "q_proj.weight", (q, h)), g(a + "k_proj.weight", (kv, h)), \
        g(a + "v_proj.weight", (kv, h))
    layers = {
        "attn_norm": np.ones((1, h), np.float32),   # EAGLE-1's layer 0 has no input norm
        "wqkv": np.concatenate([wq.T, wk.T, wv.T], axis=1)[None],
        "wo": g(a + "o_proj.weight", (h, q)).T[None],
        "mlp_norm": g("layers.0.post_attention_layernorm.weight", (h,))[None],
        "w_gate_up": np.concatenate([g(m + "gate_proj.weight", (f, h)).T,
                                     g(m + "up_proj.weight", (f, h)).T], axis=1)[None],
        "w_down": g(m + "down_proj.weight", (h, f)).T[None],
    }
    biases = [g(a + f"{n}_proj.bias", (s,), True) for n, s in (("q", q), ("k", kv), ("v", kv))]
    if cfg.attention_bias:
        if any(b is None for b in biases):
            raise WeightsError(f"{origin}: the target has q/k/v biases but the head lacks "
                               f"{a}q_proj.bias / k_proj.bias / v_proj.bias")
        layers["bqkv"] = np.concatenate(biases)[None]
    elif any(b is not None for b in biases):
        raise WeightsError(f"{origin}: the head has q/k/v biases but the target has none")
    known = {"fc.weight", "fc.bias", "embed_tokens.weight", "layers.0.input_layernorm.weight",
             "layers.0.post_attention_layernorm.weight"} | {
        a + f"{n}_proj.{w}" for n in "qkvo" for w in ("weight", "bias")} | {
        m + f"{n}_proj.weight" for n in ("gate", "up", "down")}
    extra = sorted(k for k in sd if k not in known and not k.endswith("rotary_emb.inv_freq"))
    if extra:
        raise WeightsError(f"{origin}: unexpected tensor(s) {extra[:8]} (an EAGLE-1 head has one "
                           "decoder layer; is this an EAGLE-3 or a multi-layer head?)")
    params = {"fc": fc.T, "fc_bias": fc_b if fc_b is not None else np.zeros((h,), np.float32),
              "layers": layers}
    return cast_tree(params, dtype)


def _eagle1_params(sd, config, cfg: ModelConfig, origin: str, dtype):
    """A public EAGLE-1 state dict and its config.json -> draft params (jax arrays, fp32 unless
    `dtype`), shapes and config checked against the target `cfg`."""
    check_version(sd, config, 1, origin)
    archs = list(config.get("architectures") or ())
    if any(a not in EAGLE1_ARCHS for a in archs):
        raise WeightsError(f"{origin}: config.json architectures={archs}: not a supported EAGLE-1 "
                           f"head; supported: {', '.join(EAGLE1_ARCHS)}")
    _check_config(config, cfg, origin, [("hidden_size", "hidden_size"),
                                        ("num_attention_heads", "num_heads"),
                                        ("num_key_value_heads", "num_kv_heads"),
                                        ("intermediate_size", "intermediate_size")])
    return to_jax(convert_eagle1(sd, cfg, origin), dtype)


def load_eagle1(path, cfg: ModelConfig, dtype=None):
    """A public EAGLE-1 checkpoint (dir, .bin or .safetensors) -> draft params (jax arrays)."""
    sd, config = read_state_dict(path)
    origin = str(path)
    return _eagle1_params(sd, config, cfg, origin, dtype)


# Tensor names of our own EAGLE-1 layout (`eagle1_shapes`); public heads name theirs
# "fc.weight", "layers.0.*", "midlayer.*".
OWN_HEAD_NAMES = frozenset(("fc", "fc_bias", "layers.attn_norm", "layers.wqkv", "layers.bqkv",
                            "layers.wo", "layers.mlp_norm", "layers.w_gate_up", "layers.w_down"))


def is_own_head_file(path) -> bool:
    """A single .safetensors file written by `save_head`: the jaxspec_head entry and tensors of
    our layout (`save_eagle3` writes the entry too, beside the public EAGLE-3 tensors)."""
    path = Path(path)
    if not (path.is_file() and path.suffix == ".safetensors"):
        return False
    try:
        from safetensors import safe_open
        with safe_open(str(path), framework="numpy") as f:
            return (HEAD_META_KEY in (f.metadata() or {})
                    and not OWN_HEAD_NAMES.isdisjoint(f.keys()))
    except Exception:       # not readable as safetensors: the public loader says why
        return False


def own_head_in_dir(path) -> Optional[Path]:
    """The head file of a directory in our shipped layout (head.safetensors beside
    token_ranking.safetensors and a card), or None for any other directory."""
    p = Path(path)
    if not p.is_dir():
        return None
    own = [f for f in sorted(p.glob("*.safetensors")) if is_own_head_file(f)]
    if len(own) > 1:
        raise WeightsError(f"{p}: several head files ({', '.join(f.name for f in own)}): pass "
                           "the one to load")
    return own[0] if own else None


def load_draft(path, cfg: ModelConfig, dtype=None):
    """A draft checkpoint -> draft params: our own head (`save_head`, what `jaxspec
    train-eagle` writes: the file, or a directory holding it as the shipped head does), or a
    public one (dir, .safetensors or .bin) of either version: an EAGLE-1 params dict, or an
    Eagle3Head (the version told by the tensor names and config.json, which must agree). Only
    tensors are read (no pickled code runs); a wrong shape names the tensor, its shape and the
    expected one."""
    own = path if is_own_head_file(path) else own_head_in_dir(path)
    if own is not None:
        return load_head(own, cfg, dtype)
    sd, config = read_state_dict(path)
    origin = str(path)
    if is_eagle3_checkpoint(sd, config):
        return eagle3_head(sd, config, cfg, origin, dtype)
    return _eagle1_params(sd, config, cfg, origin, dtype)
