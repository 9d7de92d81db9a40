"""Draft head files: our own EAGLE-1 head format, and public EAGLE-1 / EAGLE-3 checkpoints.

Our format (`save_head` / `load_head`): one safetensors file of the params of
`jaxspec.models.eagle` (flat keys "fc", "fc_bias", "layers.wqkv", ...), fp32 or bf16, plus a JSON
`jaxspec_head` metadata entry (the target's shape, how it was trained). No pickle anywhere.

Public EAGLE-1 heads (SafeAILab/EAGLE, eagle/model/cnets.py), `pytorch_model.bin` or
`model.safetensors` beside a `config.json` (the target's Llama config):
    fc.weight [H, 2H] (input = concat(embed, feature)), fc.bias [H] (optional)
    layers.0.self_attn.{q,k,v,o}_proj.weight (+ q/k/v bias for Qwen2 targets)
    layers.0.mlp.{gate,up,down}_proj.weight, layers.0.post_attention_layernorm.weight
    (layer 0 has no input_layernorm; embed_tokens.weight, when present, is the target's: ignored)
converted to eagle.py's layout (torch [out, in] weights transposed to [in, out], q/k/v and
gate/up fused). HF rotate-half RoPE layout, so q/k need no permutation.

Public EAGLE-3 heads (the layout SGLang and SpecForge load: LlamaForCausalLMEagle3):
    fc.weight [H, 3H] (three target layers fused), midlayer.input_layernorm.weight,
    midlayer.hidden_norm.weight, midlayer.self_attn.{q,k,v}_proj.weight [*, 2H] (the layer reads
    concat(norm(embed), norm(fc out))), midlayer.self_attn.o_proj.weight,
    midlayer.post_attention_layernorm.weight, midlayer.mlp.{gate,up,down}_proj.weight,
    norm.weight, lm_head.weight [Vd, H], d2t [Vd] (draft id -> target id offset), t2d [V] bool
converted to EAGLE3 params (our layout):
    fc [3H, H]; input_norm [H]; hidden_norm [H]
    layers: wqkv [1, 2H, Q + 2K], wo [1, Q, H], mlp_norm [1, H], w_gate_up [1, H, 2F], w_down [1, F, H]
    final_norm [H]; lm_head [H, Vd]; d2t [Vd] int32 (target id = draft id + d2t[draft id]);
    t2d [V] bool (target id is in the draft vocabulary)
Shapes come from the head's own config.json (its intermediate size may differ from the target's).
The forward these params mean is `jaxspec.train.eagle3.forward` (sequence form, tested against a
torch port of the published module) and `jaxspec.models.eagle3` (cached, tree drafting), which
runs them as an `Eagle3Head` (`load_eagle3_head`; `load_draft` tells the two layouts apart).
`save_eagle3` writes a head back in the public layout (model.safetensors + config.json, with
eagle_config.eagle_aux_hidden_state_layer_ids naming the target layers it reads).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Mapping, Optional, Tuple

import numpy as np

from jaxspec import envs
from jaxspec.config import ModelConfig
from jaxspec.loading.common import WeightsError

HEAD_META_KEY = "jaxspec_head"
DEFAULT_HEAD_DIR = Path(__file__).resolve().parents[2] / "checkpoints" / "smollm2-135m-instruct-eagle1"
DEFAULT_HEAD_FILE = "head.safetensors"
DEFAULT_RANKING_FILE = "token_ranking.safetensors"
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


# -- public checkpoints ------------------------------------------------------------------------
def read_state_dict(path) -> Tuple[Dict[str, np.ndarray], dict]:
    """(tensors as numpy, config.json or {}) from a checkpoint dir or a .safetensors / .bin file.

    bf16 tensors come back as ml_dtypes bfloat16 arrays; a .bin is read with
    torch.load(weights_only=True), so no pickled code runs.
    """
    p = Path(path)
    if p.is_dir():
        # a token ranking beside a head (DEFAULT_RANKING_FILE) is not part of its weights
        files = [f for f in sorted(p.glob("*.safetensors")) if f.name != DEFAULT_RANKING_FILE] \
            or sorted(p.glob("pytorch_model*.bin")) or sorted(p.glob("*.bin"))
        if not files:
            raise WeightsError(f"{p}: no *.safetensors or *.bin checkpoint file")
        cfg_path = p / "config.json"
    elif p.is_file():
        files, cfg_path = [p], p.parent / "config.json"
    else:
        raise FileNotFoundError(f"draft checkpoint {str(p)!r} does not exist")
    config = _read_config(cfg_path) if cfg_path.is_file() else {}
    tensors: Dict[str, np.ndarray] = {}
    for f in files:
        tensors.update(_read_file(f))
    return tensors, config


def _read_config(path: Path) -> dict:
    try:
        config = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WeightsError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise WeightsError(f"{path}: not a JSON object")
    return config


def _read_file(f: Path) -> Dict[str, np.ndarray]:
    if f.suffix == ".safetensors":
        from safetensors.numpy import load_file
        try:
            return dict(load_file(str(f)))
        except Exception as e:  # noqa: BLE001 -- the library's errors name no file
            raise WeightsError(f"{f}: unreadable safetensors file ({e})") from e
    try:
        import torch
    except ImportError:
        raise WeightsError(f"{f}: a torch checkpoint needs torch installed to be read (with "
                           "weights_only=True); a .safetensors file needs nothing") from None

    try:
        sd = torch.load(str(f), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise WeightsError(f"{f}: unreadable torch checkpoint ({e})") from e
    if not isinstance(sd, dict):
        raise WeightsError(f"{f}: a torch checkpoint of {type(sd).__name__}, expected a state "
                           "dict of tensors")
    out = {}
    for k, v in sd.items():
        if not isinstance(v, torch.Tensor):
            continue
        if v.dtype == torch.bfloat16:
            import ml_dtypes
            out[k] = v.float().numpy().astype(ml_dtypes.bfloat16)
        else:
            out[k] = v.numpy()
    return out


def _get(sd, name, shape, origin, optional=False):
    if name not in sd:
        if optional:
            return None
        raise WeightsError(f"{origin}: missing tensor {name!r}")
    a = sd[name]
    if tuple(a.shape) != tuple(shape):
        raise WeightsError(f"{origin}: tensor {name!r} has shape {tuple(a.shape)}, expected "
                           f"{tuple(shape)}")
    if not (np.issubdtype(a.dtype, np.floating) or a.dtype.name == "bfloat16"):
        raise WeightsError(f"{origin}: tensor {name!r} has dtype {a.dtype}, expected floating point")
    return np.asarray(a, np.float32)


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
    g = lambda n, s, opt=False: _get(sd, n, s, origin, opt)  # noqa: E731
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
    return _cast(params, dtype)


def _eagle1_params(sd, config, cfg: ModelConfig, origin: str, dtype):
    """A public EAGLE-1 state dict and its config.json -> draft params (jax arrays, fp32 unless
    `dtype`), shapes and config checked against the target `cfg`."""
    import jax
    import jax.numpy as jnp

    _check_config(config, cfg, origin, [("hidden_size", "hidden_size"),
                                        ("num_attention_heads", "num_heads"),
                                        ("num_key_value_heads", "num_kv_heads"),
                                        ("intermediate_size", "intermediate_size")])
    params = convert_eagle1(sd, cfg, origin)
    dt = dtype if dtype is not None else jnp.float32
    return jax.tree_util.tree_map(lambda x: jnp.asarray(x, dt), params)


def load_eagle1(path, cfg: ModelConfig, dtype=None):
    """A public EAGLE-1 checkpoint (dir, .bin or .safetensors) -> draft params (jax arrays)."""
    sd, config = read_state_dict(path)
    origin = str(path)
    return _eagle1_params(sd, config, cfg, origin, dtype)


def eagle3_head_config(config: Mapping, cfg: ModelConfig, sd: Optional[Mapping] = None) -> dict:
    """Shapes of an EAGLE-3 head from its config.json (defaults: the target's; with the state
    dict `sd`, the draft vocabulary and MLP sizes a config leaves out come from its tensors)."""
    config = dict(config)
    if sd is not None:
        named = {k[len("model."):] if k.startswith("model.") else k: v for k, v in sd.items()}
        if "draft_vocab_size" not in config and "d2t" in named:
            config["draft_vocab_size"] = int(np.asarray(named["d2t"]).shape[0])
        gate = named.get("midlayer.mlp.gate_proj.weight")
        if "intermediate_size" not in config and gate is not None:
            config["intermediate_size"] = int(gate.shape[0])
    h = config.get("hidden_size", cfg.hidden_size)
    heads = config.get("num_attention_heads", cfg.num_heads)
    kv_heads = config.get("num_key_value_heads",
                          heads if "num_attention_heads" in config else cfg.num_kv_heads)
    d = config.get("head_dim") or h // heads
    return dict(hidden_size=h, num_heads=heads, num_kv_heads=kv_heads, head_dim=d,
                intermediate_size=config.get("intermediate_size", cfg.intermediate_size),
                vocab_size=config.get("vocab_size", cfg.vocab_size),
                draft_vocab_size=config.get("draft_vocab_size",
                                            config.get("vocab_size", cfg.vocab_size)),
                rms_norm_eps=config.get("rms_norm_eps", cfg.rms_norm_eps),
                rope_theta=config.get("rope_theta", cfg.rope_theta),
                norm_before_residual=bool(config.get("norm_before_residual", False)))


def convert_eagle3(sd: Mapping[str, np.ndarray], hc: Mapping, origin: str = "EAGLE-3 head",
                   dtype=np.float32) -> dict:
    """A public EAGLE-3 state dict -> EAGLE3 params (numpy; layout in the module docstring)."""
    h, f = hc["hidden_size"], hc["intermediate_size"]
    q, kv = hc["num_heads"] * hc["head_dim"], hc["num_kv_heads"] * hc["head_dim"]
    v, vd = hc["vocab_size"], hc["draft_vocab_size"]
    sd = {k[len("model."):] if k.startswith("model.") else k: x for k, x in sd.items()}
    g = lambda n, s, opt=False: _get(sd, n, s, origin, opt)  # noqa: E731
    a, m = "midlayer.self_attn.", "midlayer.mlp."
    wq, wk, wv = g(a + "q_proj.weight", (q, 2 * h)), g(a + "k_proj.weight", (kv, 2 * h)), \
        g(a + "v_proj.weight", (kv, 2 * h))
    params = {
        "fc": g("fc.weight", (h, 3 * h)).T,
        "input_norm": g("midlayer.input_layernorm.weight", (h,)),
        "hidden_norm": g("midlayer.hidden_norm.weight", (h,)),
        "layers": {
            "wqkv": np.concatenate([wq.T, wk.T, wv.T], axis=1)[None],
            "wo": g(a + "o_proj.weight", (h, q)).T[None],
            "mlp_norm": g("midlayer.post_attention_layernorm.weight", (h,))[None],
            "w_gate_up": np.concatenate([g(m + "gate_proj.weight", (f, h)).T,
                                         g(m + "up_proj.weight", (f, h)).T], axis=1)[None],
            "w_down": g(m + "down_proj.weight", (h, f)).T[None],
        },
        "final_norm": g("norm.weight", (h,)),
        "lm_head": g("lm_head.weight", (vd, h)).T,
    }
    params = _cast(params, dtype)
    params["d2t"] = _index_tensor(sd, "d2t", (vd,), origin).astype(np.int32)
    t2d = _index_tensor(sd, "t2d", (v,), origin)
    params["t2d"] = t2d.astype(bool)
    ids = np.arange(vd) + params["d2t"]
    if ids.min() < 0 or ids.max() >= v:
        raise WeightsError(f"{origin}: tensor 'd2t' maps draft ids outside the target vocabulary "
                           f"[0, {v})")
    if int(params["t2d"].sum()) != vd:
        raise WeightsError(f"{origin}: tensor 't2d' marks {int(params['t2d'].sum())} target ids, "
                           f"expected draft_vocab_size={vd}")
    if "embed_tokens.weight" in sd:
        params["embed"] = _cast(g("embed_tokens.weight", (v, h)), dtype)
    return params


def _index_tensor(sd, name, shape, origin):
    if name not in sd:
        raise WeightsError(f"{origin}: missing tensor {name!r}")
    a = np.asarray(sd[name])
    if tuple(a.shape) != tuple(shape):
        raise WeightsError(f"{origin}: tensor {name!r} has shape {tuple(a.shape)}, expected "
                           f"{tuple(shape)}")
    if not (np.issubdtype(a.dtype, np.integer) or a.dtype == bool):
        raise WeightsError(f"{origin}: tensor {name!r} has dtype {a.dtype}, expected an integer "
                           "or bool dtype")
    return a


def load_eagle3(path, cfg: ModelConfig, dtype=None):
    """A public EAGLE-3 checkpoint -> (EAGLE3 params as jax arrays, head shape dict)."""
    import jax
    import jax.numpy as jnp

    sd, config = read_state_dict(path)
    hc = eagle3_head_config(config, cfg)
    if hc["vocab_size"] != cfg.vocab_size:
        raise WeightsError(f"{path}: config.json vocab_size={hc['vocab_size']} but the target "
                           f"has {cfg.vocab_size}")
    params = convert_eagle3(sd, hc, str(path))
    dt = dtype if dtype is not None else jnp.float32
    out = jax.tree_util.tree_map(
        lambda x: jnp.asarray(x, dt) if np.issubdtype(x.dtype, np.floating)
        or x.dtype.name == "bfloat16" else jnp.asarray(x), params)
    return out, hc


def _cast(tree, dtype):
    if isinstance(tree, dict):
        return {k: _cast(v, dtype) for k, v in tree.items()}
    return np.asarray(tree, dtype)


# -- EAGLE-3 heads as Eagle3Head (inference), detection, and the public layout on disk ------------
def eagle3_aux_layers(config: Mapping, cfg: ModelConfig) -> Tuple[int, ...]:
    """The target layers an EAGLE-3 head reads: config.json's
    eagle_config.eagle_aux_hidden_state_layer_ids (SGLang's key; the ids name the layers whose
    outputs are taken) or the same key at the top level, else SpecForge's default."""
    from jaxspec.models.eagle3 import default_aux_layers

    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") \
        or config.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return default_aux_layers(cfg.num_layers)
    ids = tuple(int(i) for i in ids)
    if len(ids) != 3 or not all(0 <= i < cfg.num_layers for i in ids):
        raise WeightsError(f"config.json eagle_aux_hidden_state_layer_ids={list(ids)}: an EAGLE-3 "
                           f"head reads three target layers in [0, {cfg.num_layers})")
    return ids


def is_eagle3_checkpoint(sd: Mapping[str, np.ndarray], config: Mapping) -> bool:
    """EAGLE-3 by config.json (an *Eagle3* architecture) or by its tensors (midlayer.*, d2t)."""
    if any("eagle3" in str(a).lower() for a in config.get("architectures") or ()):
        return True
    names = {k[len("model."):] if k.startswith("model.") else k for k in sd}
    return "d2t" in names or any(k.startswith("midlayer.") for k in names)


def _eagle3_head(sd, config, cfg: ModelConfig, origin: str, dtype):
    import jax
    import jax.numpy as jnp

    from jaxspec.models.eagle3 import Eagle3Config, Eagle3Head

    hc = eagle3_head_config(config, cfg, sd)
    if hc["vocab_size"] != cfg.vocab_size:
        raise WeightsError(f"{origin}: config.json vocab_size={hc['vocab_size']} but the target "
                           f"has {cfg.vocab_size}")
    if hc["num_heads"] % hc["num_kv_heads"] or hc["head_dim"] % 2:
        raise WeightsError(f"{origin}: config.json num_attention_heads={hc['num_heads']}, "
                           f"num_key_value_heads={hc['num_kv_heads']}, head_dim={hc['head_dim']} "
                           "do not make a valid attention layer")
    params = convert_eagle3(sd, hc, origin)
    dt = dtype if dtype is not None else jnp.float32
    params = jax.tree_util.tree_map(
        lambda x: jnp.asarray(x, dt) if np.issubdtype(x.dtype, np.floating)
        or x.dtype.name == "bfloat16" else jnp.asarray(x), params)
    return Eagle3Head(params, Eagle3Config.from_dict(hc, eagle3_aux_layers(config, cfg)))


def load_eagle3_head(path, cfg: ModelConfig, dtype=None):
    """A public EAGLE-3 checkpoint -> `jaxspec.models.eagle3.Eagle3Head` (what the speculative
    cycle runs); the target layers it reads come from its config.json (eagle3_aux_layers)."""
    sd, config = read_state_dict(path)
    return _eagle3_head(sd, config, cfg, str(path), dtype)


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
    public one (dir, .safetensors or .bin) of either layout: an EAGLE-1 params dict, or an
    Eagle3Head (layout told by config.json or the tensor names). Only tensors are read (no
    pickled code runs); a wrong shape names the tensor, its shape and the expected one."""
    own = path if is_own_head_file(path) else own_head_in_dir(path)
    if own is not None:
        return load_head(own, cfg, dtype)
    sd, config = read_state_dict(path)
    origin = str(path)
    if is_eagle3_checkpoint(sd, config):
        return _eagle3_head(sd, config, cfg, origin, dtype)
    return _eagle1_params(sd, config, cfg, origin, dtype)


def eagle3_state_dict(head) -> Dict[str, np.ndarray]:
    """An Eagle3Head -> the public tensors (torch [out, in] layout, q/k/v and gate/up split),
    the inverse of convert_eagle3."""
    p, hc = head.params, head.config
    q, kv = hc.num_heads * hc.head_dim, hc.num_kv_heads * hc.head_dim
    f = hc.intermediate_size
    a = lambda x: np.asarray(x)  # noqa: E731
    lay = {k: a(v)[0] for k, v in p["layers"].items()}
    wqkv = lay["wqkv"]
    sd = {"fc.weight": a(p["fc"]).T,
          "midlayer.input_layernorm.weight": a(p["input_norm"]),
          "midlayer.hidden_norm.weight": a(p["hidden_norm"]),
          "midlayer.self_attn.q_proj.weight": wqkv[:, :q].T,
          "midlayer.self_attn.k_proj.weight": wqkv[:, q:q + kv].T,
          "midlayer.self_attn.v_proj.weight": wqkv[:, q + kv:].T,
          "midlayer.self_attn.o_proj.weight": lay["wo"].T,
          "midlayer.post_attention_layernorm.weight": lay["mlp_norm"],
          "midlayer.mlp.gate_proj.weight": lay["w_gate_up"][:, :f].T,
          "midlayer.mlp.up_proj.weight": lay["w_gate_up"][:, f:].T,
          "midlayer.mlp.down_proj.weight": lay["w_down"].T,
          "norm.weight": a(p["final_norm"]), "lm_head.weight": a(p["lm_head"]).T,
          "d2t": a(p["d2t"]).astype(np.int64), "t2d": a(p["t2d"]).astype(bool)}
    if "embed" in p:
        sd["embed_tokens.weight"] = a(p["embed"])
    return {k: np.ascontiguousarray(v) for k, v in sd.items()}


def eagle3_config_json(head, cfg: ModelConfig, extra: Optional[dict] = None) -> dict:
    """config.json of a public EAGLE-3 head (what SGLang / SpecForge read, and eagle3_head_config
    and eagle3_aux_layers read back)."""
    hc = head.config
    out = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
           "hidden_size": hc.hidden_size, "num_attention_heads": hc.num_heads,
           "num_key_value_heads": hc.num_kv_heads, "head_dim": hc.head_dim,
           "intermediate_size": hc.intermediate_size, "vocab_size": hc.vocab_size,
           "draft_vocab_size": hc.draft_vocab_size, "rms_norm_eps": hc.rms_norm_eps,
           "rope_theta": hc.rope_theta, "norm_before_residual": hc.norm_before_residual,
           "num_hidden_layers": 1, "hidden_act": "silu", "tie_word_embeddings": False,
           "max_position_embeddings": cfg.max_position_embeddings,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(hc.aux_layers)}}
    if extra:
        out["jaxspec"] = extra
    return out


def save_eagle3(out_dir, head, cfg: ModelConfig, dtype="bfloat16",
                meta: Optional[dict] = None) -> Path:
    """Writes an Eagle3Head as OUT_DIR/model.safetensors + config.json in the public layout
    (floating tensors in `dtype`; d2t int64, t2d bool as SpecForge writes them)."""
    import ml_dtypes
    from safetensors.numpy import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dt = ml_dtypes.bfloat16 if str(dtype) == "bfloat16" else np.dtype(dtype)
    sd = {k: (v.astype(dt) if np.issubdtype(v.dtype, np.floating) or v.dtype.name == "bfloat16"
              else v) for k, v in eagle3_state_dict(head).items()}
    save_file(sd, str(out / "model.safetensors"),
              metadata={HEAD_META_KEY: json.dumps(meta or {}, default=str)})
    (out / "config.json").write_text(json.dumps(eagle3_config_json(head, cfg, meta), indent=1,
                                                default=str))
    return out
