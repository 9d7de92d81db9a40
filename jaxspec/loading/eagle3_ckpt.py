"""Public EAGLE-3 heads: read as SpecForge, SGLang, vLLM and the EAGLE repository write them,
checked against the target, run as a `jaxspec.models.eagle3.Eagle3Head`; written back in
SpecForge's layout (`save_eagle3`).

Tensors (torch [out, in]; H the head's hidden size, Ht the target's, Q / K the q and kv widths,
F the MLP width, V the target vocabulary, Vd the draft one):
    fc.weight [H, 3Ht]                          concat(low, mid, high target layer outputs) -> H
    midlayer.input_layernorm.weight [H]         norm of the token's embedding
    midlayer.hidden_norm.weight [H]             norm of fc's output (or the previous step's)
    midlayer.self_attn.{q,k,v}_proj.weight [Q | K | K, 2H]   over concat(both norms)
    midlayer.self_attn.o_proj.weight [H, Q]
    midlayer.post_attention_layernorm.weight [H]
    midlayer.mlp.{gate,up}_proj.weight [F, H], midlayer.mlp.down_proj.weight [H, F]
    norm.weight [H]; lm_head.weight [Vd, H]
    d2t [Vd] int: target id = draft id + d2t[draft id]; t2d [V] bool: in the draft vocabulary
    embed_tokens.weight [V, H] (optional; else the target's embedding, as SGLang shares it)
Names by writer: SpecForge (model.safetensors) and the EAGLE repository (pytorch_model.bin, d2t
and t2d left out when the draft vocabulary is the whole one) as above; SGLang's module puts
"model." before all but lm_head; vLLM reads "midlayer." as "layers.0.". All are read.

config.json is a LlamaConfig. A field it leaves out takes LlamaConfig's default, as every
runtime that loads these heads does, not the target's: a Llama-3.1 head from the EAGLE
repository has no rope_theta and runs RoPE at 10000, not at its target's 500000.
    hidden_size, num_attention_heads          required
    num_key_value_heads                       default num_attention_heads
    head_dim                                  SpecForge reads it, the EAGLE repository uses
                                              hidden_size / heads; q_proj's rows tell which
    intermediate_size, draft_vocab_size, vocab_size    default: from the tensors
    rms_norm_eps 1e-6; rope_theta 10000; rope_scaling or rope_parameters (llama3, linear)
    target_hidden_size                        Ht, default hidden_size
    norm_before_residual                      vLLM's variant: residual = hidden_norm(h)
    eagle_config.eagle_aux_hidden_state_layer_ids (or the key at the top level)
                                              the target layers whose outputs fc reads; default
                                              (1, L/2 - 1, L - 4), SpecForge's training rule and
                                              where SGLang and the EAGLE repository capture
Refused with the field named: another draft architecture or model_type, num_hidden_layers != 1,
tied embeddings, a non-SiLU MLP, biases, fc_norm (SpecForge's EAGLE-3.1), norm_output=false,
use_aux_hidden_state=false, speculators-format configs; and a head that does not fit its target
(fc's input width, vocabulary, target layers), naming the tensor or field and both sizes.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Mapping, Optional, Tuple

import numpy as np

from jaxspec.config import ModelConfig, RopeScaling
from jaxspec.loading.common import WeightsError
from jaxspec.loading.state_dict import (cast_tree, float_tensor, index_tensor, read_state_dict,
                                        to_jax)

# Architectures whose EAGLE-3 draft layer is the Llama one defined above: SpecForge's and
# SGLang's class, vLLM's, and the target class the EAGLE repository's training config names.
EAGLE3_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "LlamaForCausalLM")
# config.json fields with the one value this layer implements, and what another value means.
_FIXED_FIELDS = (
    ("num_hidden_layers", 1, "an EAGLE-3 head of more than one decoder layer"),
    ("hidden_act", "silu", "an MLP activation other than SiLU"),
    ("tie_word_embeddings", False, "an lm_head tied to the embedding"),
    ("attention_bias", False, "q/k/v/o biases"),
    ("mlp_bias", False, "MLP biases"),
    ("bias", False, "an fc bias"),
    ("fc_norm", False, "norms on the target layers before fc (SpecForge's EAGLE-3.1)"),
    ("norm_output", True, "logits from the un-normed output"),
)
_LAYER = "midlayer."
_ATTN, _MLP = _LAYER + "self_attn.", _LAYER + "mlp."


# -- names and versions --------------------------------------------------------------------------
def _strip_model(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def has_eagle3_tensors(sd: Mapping) -> bool:
    """The tensors only an EAGLE-3 head has: midlayer.*, d2t / t2d, a hidden_norm (an EAGLE-1
    head's one layer is layers.0.* without it)."""
    names = [_strip_model(k) for k in sd]
    return any(n.startswith(_LAYER) or n in ("d2t", "t2d") or n.endswith("hidden_norm.weight")
               for n in names)


def config_version(config: Mapping) -> Optional[int]:
    """3 or 1 where config.json's architectures name an EAGLE version (SGLang and vLLM classes:
    *Eagle3* / *Eagle*), None where they name a target class (as the EAGLE repository's do)."""
    archs = [str(a).lower() for a in config.get("architectures") or ()]
    if any("eagle3" in a for a in archs):
        return 3
    if any("eagle" in a for a in archs):
        return 1
    return None


def is_eagle3_checkpoint(sd: Mapping[str, np.ndarray], config: Mapping) -> bool:
    """EAGLE-3 by config.json (an *Eagle3* architecture) or by its tensors."""
    return config_version(config) == 3 or has_eagle3_tensors(sd)


def check_version(sd: Mapping, config: Mapping, want: int, origin: str) -> None:
    """WeightsError unless the tensors and config.json both say EAGLE-`want`, naming what each
    says (a head of the other version runs as nothing useful: SGLang loading an EAGLE-3 head as
    EAGLE drafts tokens it never accepts)."""
    tensors = 3 if has_eagle3_tensors(sd) else 1
    conf = config_version(config)
    if conf is not None and conf != tensors:
        raise WeightsError(
            f"{origin}: config.json architectures={config.get('architectures')} name an "
            f"EAGLE-{conf} head but its tensors are an EAGLE-{tensors} head's "
            f"({_version_evidence(sd, tensors)})")
    if tensors != want:
        raise WeightsError(f"{origin}: an EAGLE-{tensors} head ({_version_evidence(sd, tensors)}),"
                           f" not an EAGLE-{want} one; LLM(draft=...) and load_draft tell the "
                           "two apart")


def _version_evidence(sd: Mapping, version: int) -> str:
    names = sorted(_strip_model(k) for k in sd)
    if version == 3:
        shown = [n for n in names if n in ("d2t", "t2d") or n.endswith("hidden_norm.weight")]
        return "tensors " + ", ".join(shown[:3] or [n for n in names if n.startswith(_LAYER)][:3])
    fc = sd.get("fc.weight", sd.get("model.fc.weight"))
    fc_txt = f"fc.weight {tuple(fc.shape)}, " if fc is not None else ""
    return f"{fc_txt}tensors {', '.join(names[:3])}, ... and no hidden_norm, d2t or t2d"


def canonical_names(sd: Mapping[str, np.ndarray], origin: str) -> Dict[str, np.ndarray]:
    """SGLang's "model." prefix dropped, vLLM's "layers.0." read as "midlayer."."""
    out: Dict[str, np.ndarray] = {}
    for k, v in sd.items():
        n = _strip_model(k)
        if n.startswith("layers.0."):
            n = _LAYER + n[len("layers.0."):]
        if n in out:
            raise WeightsError(f"{origin}: tensor {k!r} appears under two names (midlayer.* and "
                               "layers.0.*, or with and without model.)")
        out[n] = v
    return out


# -- config.json ---------------------------------------------------------------------------------
def check_config_supported(config: Mapping, origin: str) -> None:
    """WeightsError naming the first field this layer does not implement."""
    if "speculators_config" in config or "transformer_layer_config" in config:
        raise WeightsError(f"{origin}: a speculators-format config.json (transformer_layer_config,"
                           " speculators_config) is not read; a SpecForge / SGLang config.json "
                           "(a LlamaConfig) is")
    archs = list(config.get("architectures") or ())
    if any(a not in EAGLE3_ARCHS for a in archs):
        raise WeightsError(f"{origin}: config.json architectures={archs}: not a supported EAGLE-3"
                           f" head; supported: {', '.join(EAGLE3_ARCHS)} (a Llama decoder layer "
                           "as SpecForge trains for Llama 3.x and Qwen3 targets)")
    if config.get("model_type", "llama") != "llama":
        raise WeightsError(f"{origin}: config.json model_type={config['model_type']!r}: an "
                           "EAGLE-3 head's layer is read as model_type 'llama' only")
    for key, want, what in _FIXED_FIELDS:
        if config.get(key) is not None and config[key] != want:
            raise WeightsError(f"{origin}: config.json {key}={config[key]!r}: {what} is not "
                               f"supported ({key}={json.dumps(want)} is)")
    eagle = config.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state", True) is not True:
        raise WeightsError(f"{origin}: config.json eagle_config.use_aux_hidden_state="
                           f"{eagle['use_aux_hidden_state']!r}: a head that reads no target "
                           "layers (EAGLE-1 style) is not an EAGLE-3 head")


def _pos_int(config: Mapping, key: str, origin: str) -> int:
    v = config.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise WeightsError(f"{origin}: config.json {key}={v!r}, expected a positive integer")
    return v


def _rope(config: Mapping, origin: str) -> Tuple[float, Optional[RopeScaling]]:
    """(rope_theta, scaling) of the head: transformers >= 5 writes rope_parameters (theta
    included), older versions rope_theta and rope_scaling ("rope_type", or "type")."""
    params = config.get("rope_parameters") or {}
    rs = params or config.get("rope_scaling") or {}
    theta = float(config.get("rope_theta") or params.get("rope_theta") or 10000.0)
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return theta, None

    def need(key):
        if rs.get(key) is None:
            raise WeightsError(f"{origin}: config.json rope_scaling of type {kind!r} has no {key}")
        return rs[key]

    if kind == "llama3":
        return theta, RopeScaling(
            kind="llama3", factor=float(need("factor")),
            low_freq_factor=float(need("low_freq_factor")),
            high_freq_factor=float(need("high_freq_factor")),
            original_max_position_embeddings=int(need("original_max_position_embeddings")))
    if kind == "linear":
        return theta, RopeScaling(kind="linear", factor=float(need("factor")))
    raise WeightsError(f"{origin}: config.json rope_scaling type {kind!r} is not supported for an "
                       "EAGLE-3 head (llama3, linear)")


def _head_dim(config: Mapping, h: int, heads: int, q_rows: Optional[int], origin: str) -> int:
    """config.json's head_dim where q_proj has num_heads x head_dim rows, else hidden / heads
    (the EAGLE repository's rule, which ignores the field)."""
    given = config.get("head_dim")
    implied = h // heads if h % heads == 0 else None
    if q_rows is None:
        return given or implied or 0
    for d in (given, implied):
        if d and d * heads == q_rows:
            return d
    want = given or implied
    raise WeightsError(f"{origin}: tensor '{_ATTN}q_proj.weight' has {q_rows} rows, expected "
                       f"num_attention_heads={heads} x head_dim={want} = {heads * (want or 0)}")


def _rows(sd: Mapping, name: str) -> Optional[int]:
    return int(np.shape(sd[name])[0]) if name in sd else None


def head_config(config: Mapping, sd: Mapping[str, np.ndarray], cfg: ModelConfig,
                origin: str) -> dict:
    """The head's shapes and settings (Eagle3Config's fields but aux_layers) from config.json;
    sd (canonical names) fills in what a config may leave out and decides head_dim."""
    check_config_supported(config, origin)
    for key in ("hidden_size", "num_attention_heads"):
        if key not in config:
            raise WeightsError(f"{origin}: config.json has no {key}")
    h = _pos_int(config, "hidden_size", origin)
    heads = _pos_int(config, "num_attention_heads", origin)
    kv = _pos_int(config, "num_key_value_heads", origin) \
        if config.get("num_key_value_heads") is not None else heads
    if heads % kv:
        raise WeightsError(f"{origin}: config.json num_attention_heads={heads} is not a multiple "
                           f"of num_key_value_heads={kv}")
    d = _head_dim(config, h, heads, _rows(sd, _ATTN + "q_proj.weight"), origin)
    if d <= 0 or d % 2:
        raise WeightsError(f"{origin}: head_dim={d} (config.json head_dim or hidden_size / "
                           "num_attention_heads) must be a positive even number for RoPE")
    filled = {"intermediate_size": _rows(sd, _MLP + "gate_proj.weight"),
              "draft_vocab_size": _rows(sd, "d2t") or _rows(sd, "lm_head.weight"),
              "vocab_size": _rows(sd, "t2d") or cfg.vocab_size}
    for key, v in filled.items():
        if config.get(key) is not None:
            filled[key] = _pos_int(config, key, origin)
        elif v is None:
            raise WeightsError(f"{origin}: config.json has no {key} and no tensor gives it")
    theta, scaling = _rope(config, origin)
    target_h = _pos_int(config, "target_hidden_size", origin) \
        if config.get("target_hidden_size") is not None else None
    return dict(hidden_size=h, num_heads=heads, num_kv_heads=kv, head_dim=d, **filled,
                rms_norm_eps=float(config.get("rms_norm_eps") or 1e-6), rope_theta=theta,
                rope_scaling=scaling, target_hidden_size=target_h,
                norm_before_residual=bool(config.get("norm_before_residual", False)))


def eagle3_aux_layers(config: Mapping, cfg: ModelConfig, origin: str = "config.json"
                      ) -> Tuple[int, ...]:
    """The target layers whose outputs the head reads: eagle_config.
    eagle_aux_hidden_state_layer_ids (SpecForge's and SGLang's key), the same key at the top
    level (vLLM's), else SpecForge's default rule."""
    from jaxspec.models.eagle3 import default_aux_layers

    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") \
        or config.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return default_aux_layers(cfg.num_layers)
    if not isinstance(ids, (list, tuple)) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise WeightsError(f"{origin}: config.json eagle_aux_hidden_state_layer_ids={ids!r}, "
                           "expected a list of three layer ids")
    ids = tuple(ids)
    if len(ids) != 3 or not all(0 <= i < cfg.num_layers for i in ids):
        raise WeightsError(f"{origin}: config.json eagle_aux_hidden_state_layer_ids={list(ids)}: "
                           f"an EAGLE-3 head reads three target layers in [0, {cfg.num_layers}) "
                           f"(the target has num_layers={cfg.num_layers})")
    return ids


# -- tensors -------------------------------------------------------------------------------------
def expected_tensors(hc: Mapping) -> Dict[str, Tuple[int, ...]]:
    """Public name -> torch shape of every floating tensor of a head of config `hc`."""
    h, f = hc["hidden_size"], hc["intermediate_size"]
    q, kv = hc["num_heads"] * hc["head_dim"], hc["num_kv_heads"] * hc["head_dim"]
    th = hc.get("target_hidden_size") or h
    return {"fc.weight": (h, 3 * th), _LAYER + "input_layernorm.weight": (h,),
            _LAYER + "hidden_norm.weight": (h,), _ATTN + "q_proj.weight": (q, 2 * h),
            _ATTN + "k_proj.weight": (kv, 2 * h), _ATTN + "v_proj.weight": (kv, 2 * h),
            _ATTN + "o_proj.weight": (h, q), _LAYER + "post_attention_layernorm.weight": (h,),
            _MLP + "gate_proj.weight": (f, h), _MLP + "up_proj.weight": (f, h),
            _MLP + "down_proj.weight": (h, f), "norm.weight": (h,),
            "lm_head.weight": (hc["draft_vocab_size"], h)}


def convert_eagle3(sd: Mapping[str, np.ndarray], hc: Mapping, origin: str = "EAGLE-3 head",
                   dtype=np.float32) -> dict:
    """A public EAGLE-3 state dict (any naming) -> Eagle3Head params (numpy), every tensor's
    shape and dtype checked, any tensor the layer has no place for named."""
    sd = canonical_names(sd, origin)
    shapes = expected_tensors(hc)
    v, vd = hc["vocab_size"], hc["draft_vocab_size"]
    known = set(shapes) | {"d2t", "t2d", "embed_tokens.weight"}
    extra = sorted(k for k in sd if k not in known and not k.endswith("rotary_emb.inv_freq"))
    if extra:
        raise WeightsError(f"{origin}: unexpected tensor(s) {extra[:8]} (an EAGLE-3 head is the "
                           "one Llama decoder layer midlayer.* with fc, norm, lm_head, d2t, t2d)")
    g = {n: float_tensor(sd, n, s, origin) for n, s in shapes.items()}
    wq, wk, wv = (g[_ATTN + f"{n}_proj.weight"] for n in "qkv")
    params = {
        "fc": g["fc.weight"].T,
        "input_norm": g[_LAYER + "input_layernorm.weight"],
        "hidden_norm": g[_LAYER + "hidden_norm.weight"],
        "layers": {
            "wqkv": np.concatenate([wq.T, wk.T, wv.T], axis=1)[None],
            "wo": g[_ATTN + "o_proj.weight"].T[None],
            "mlp_norm": g[_LAYER + "post_attention_layernorm.weight"][None],
            "w_gate_up": np.concatenate([g[_MLP + "gate_proj.weight"].T,
                                         g[_MLP + "up_proj.weight"].T], axis=1)[None],
            "w_down": g[_MLP + "down_proj.weight"].T[None],
        },
        "final_norm": g["norm.weight"], "lm_head": g["lm_head.weight"].T,
    }
    params = cast_tree(params, dtype)
    if "embed_tokens.weight" in sd:
        params["embed"] = cast_tree(
            float_tensor(sd, "embed_tokens.weight", (v, hc["hidden_size"]), origin), dtype)
    params["d2t"], params["t2d"] = _vocab_maps(sd, v, vd, origin)
    return params


def _vocab_maps(sd: Mapping, v: int, vd: int, origin: str):
    """(d2t [Vd] int32, t2d [V] bool), checked to agree; the identity where a head of the whole
    vocabulary leaves them out (the EAGLE repository drops both then)."""
    if "d2t" not in sd and "t2d" not in sd and vd == v:
        return np.zeros(vd, np.int32), np.ones(v, bool)
    d2t = index_tensor(sd, "d2t", (vd,), origin).astype(np.int64)
    ids = np.arange(vd) + d2t
    if ids.min() < 0 or ids.max() >= v:
        raise WeightsError(f"{origin}: tensor 'd2t' maps draft ids outside the target vocabulary "
                           f"[0, {v})")
    t2d = index_tensor(sd, "t2d", (v,), origin).astype(bool) if "t2d" in sd else None
    if t2d is None:
        t2d = np.zeros(v, bool)
        t2d[ids] = True
    if int(t2d.sum()) != vd:
        raise WeightsError(f"{origin}: tensor 't2d' marks {int(t2d.sum())} target ids, expected "
                           f"draft_vocab_size={vd}")
    if not t2d[ids].all():
        raise WeightsError(f"{origin}: tensors 'd2t' and 't2d' disagree: d2t maps draft ids to "
                           f"target ids t2d does not mark (e.g. {int(ids[~t2d[ids]][0])})")
    return d2t.astype(np.int32), t2d


def check_fits_target(sd: Mapping, hc: Mapping, cfg: ModelConfig, origin: str) -> None:
    """WeightsError naming the tensor or config field and both sizes where the head cannot read
    this target's layers or vocabulary (sd: canonical names)."""
    fc = sd.get("fc.weight")
    if fc is not None and np.ndim(fc) == 2 and fc.shape[1] != 3 * cfg.hidden_size:
        raise WeightsError(
            f"{origin}: tensor 'fc.weight' has shape {tuple(fc.shape)}: it reads three target "
            f"layers of width {fc.shape[1] / 3:g}, the target's hidden_size is {cfg.hidden_size} "
            f"(expected ({fc.shape[0]}, {3 * cfg.hidden_size}))")
    h, th = hc["hidden_size"], hc.get("target_hidden_size")
    if (th or h) != cfg.hidden_size:
        field = f"target_hidden_size={th}" if th else f"hidden_size={h} (no target_hidden_size)"
        raise WeightsError(f"{origin}: config.json {field} but the target's hidden_size is "
                           f"{cfg.hidden_size}")
    if hc["vocab_size"] != cfg.vocab_size:
        raise WeightsError(f"{origin}: config.json vocab_size={hc['vocab_size']} but the target "
                           f"has vocab_size={cfg.vocab_size}")
    if h != cfg.hidden_size and "embed_tokens.weight" not in sd:
        raise WeightsError(f"{origin}: the head's hidden_size={h} differs from the target's "
                           f"{cfg.hidden_size} and it has no embed_tokens.weight of its own")
    if 3 * cfg.hidden_size == h:
        raise WeightsError(f"{origin}: hidden_size={h} is three times the target's: fc's input "
                           "and the head's own output could not be told apart")


def _prepare(sd, config, cfg: ModelConfig, origin: str):
    """(canonical tensors, head config dict) of a checkpoint checked to be an EAGLE-3 head that
    fits `cfg`."""
    if not config:
        raise WeightsError(f"{origin}: an EAGLE-3 head needs its config.json beside it (RoPE, "
                           "norm epsilon and the target layers it reads are not in its tensors)")
    check_version(sd, config, 3, origin)
    sd = canonical_names(sd, origin)
    hc = head_config(config, sd, cfg, origin)
    check_fits_target(sd, hc, cfg, origin)
    return sd, hc


def load_eagle3(path, cfg: ModelConfig, dtype=None):
    """A public EAGLE-3 checkpoint -> (Eagle3Head params as jax arrays, head config dict)."""
    sd, config = read_state_dict(path)
    sd, hc = _prepare(sd, config, cfg, str(path))
    return to_jax(convert_eagle3(sd, hc, str(path)), dtype), hc


def eagle3_head(sd, config, cfg: ModelConfig, origin: str, dtype=None):
    """A public EAGLE-3 state dict and its config.json -> Eagle3Head (floating arrays in
    `dtype`, fp32 by default)."""
    from jaxspec.models.eagle3 import Eagle3Config, Eagle3Head

    sd, hc = _prepare(sd, config, cfg, origin)
    params = to_jax(convert_eagle3(sd, hc, origin), dtype)
    return Eagle3Head(params, Eagle3Config.from_dict(hc, eagle3_aux_layers(config, cfg, origin)))


def load_eagle3_head(path, cfg: ModelConfig, dtype=None):
    """A public EAGLE-3 checkpoint (dir, .safetensors or .bin) -> `Eagle3Head`, what the
    speculative cycle runs."""
    sd, config = read_state_dict(path)
    return eagle3_head(sd, config, cfg, str(path), dtype)


# -- writing -------------------------------------------------------------------------------------
def eagle3_state_dict(head) -> Dict[str, np.ndarray]:
    """An Eagle3Head -> the public tensors (SpecForge's names, torch [out, in] layout, q/k/v and
    gate/up split), the inverse of convert_eagle3."""
    p, hc = head.params, head.config
    q, kv = hc.num_heads * hc.head_dim, hc.num_kv_heads * hc.head_dim
    f = hc.intermediate_size
    a = lambda x: np.asarray(x)  # noqa: E731
    lay = {k: a(v)[0] for k, v in p["layers"].items()}
    wqkv = lay["wqkv"]
    sd = {"fc.weight": a(p["fc"]).T,
          _LAYER + "input_layernorm.weight": a(p["input_norm"]),
          _LAYER + "hidden_norm.weight": a(p["hidden_norm"]),
          _ATTN + "q_proj.weight": wqkv[:, :q].T,
          _ATTN + "k_proj.weight": wqkv[:, q:q + kv].T,
          _ATTN + "v_proj.weight": wqkv[:, q + kv:].T,
          _ATTN + "o_proj.weight": lay["wo"].T,
          _LAYER + "post_attention_layernorm.weight": lay["mlp_norm"],
          _MLP + "gate_proj.weight": lay["w_gate_up"][:, :f].T,
          _MLP + "up_proj.weight": lay["w_gate_up"][:, f:].T,
          _MLP + "down_proj.weight": lay["w_down"].T,
          "norm.weight": a(p["final_norm"]), "lm_head.weight": a(p["lm_head"]).T,
          "d2t": a(p["d2t"]).astype(np.int64), "t2d": a(p["t2d"]).astype(bool)}
    if "embed" in p:
        sd["embed_tokens.weight"] = a(p["embed"])
    return {k: np.ascontiguousarray(v) for k, v in sd.items()}


def _rope_scaling_json(rs: Optional[RopeScaling]) -> Optional[dict]:
    if rs is None:
        return None
    if rs.kind == "linear":
        return {"rope_type": "linear", "factor": rs.factor}
    return {"rope_type": rs.kind, "factor": rs.factor, "low_freq_factor": rs.low_freq_factor,
            "high_freq_factor": rs.high_freq_factor,
            "original_max_position_embeddings": rs.original_max_position_embeddings}


def eagle3_config_json(head, cfg: ModelConfig, extra: Optional[dict] = None) -> dict:
    """config.json of a public EAGLE-3 head: every field SGLang / SpecForge read, written
    explicitly (none left to a default), and the target layers it reads."""
    hc = head.config
    out = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
           "hidden_size": hc.hidden_size, "num_attention_heads": hc.num_heads,
           "num_key_value_heads": hc.num_kv_heads, "head_dim": hc.head_dim,
           "intermediate_size": hc.intermediate_size, "vocab_size": hc.vocab_size,
           "draft_vocab_size": hc.draft_vocab_size, "rms_norm_eps": hc.rms_norm_eps,
           "rope_theta": hc.rope_theta, "rope_scaling": _rope_scaling_json(hc.rope_scaling),
           "norm_before_residual": hc.norm_before_residual,
           "num_hidden_layers": 1, "hidden_act": "silu", "tie_word_embeddings": False,
           "max_position_embeddings": cfg.max_position_embeddings,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(hc.aux_layers)}}
    if hc.target_hidden_size is not None:
        out["target_hidden_size"] = hc.target_hidden_size
    if extra:
        out["jaxspec"] = extra
    return out


def save_eagle3(out_dir, head, cfg: ModelConfig, dtype="bfloat16",
                meta: Optional[dict] = None) -> Path:
    """Writes an Eagle3Head as OUT_DIR/model.safetensors + config.json in SpecForge's layout
    (floating tensors in `dtype`; d2t int64, t2d bool as SpecForge writes them)."""
    import ml_dtypes
    from safetensors.numpy import save_file

    from jaxspec.loading.eagle_ckpt import HEAD_META_KEY

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
