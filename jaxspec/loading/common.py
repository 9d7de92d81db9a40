"""What every checkpoint reader shares: the error type, the tensor-source protocol and the
assembly of HF-named [out, in] tensors into the stacked params layout of `jaxspec.models.llama`."""
from __future__ import annotations

from typing import Dict, Iterable, Protocol, Tuple

import numpy as np

from jaxspec.config import ModelConfig


class WeightsError(ValueError):
    """A checkpoint is missing pieces, malformed, or of a kind this loader does not support."""


class TensorSource(Protocol):
    """Tensors under HF names (`model.layers.0.self_attn.q_proj.weight`), Linear weights as
    [out, in]. `shape` is cheap (no data read) so every shape is checked before any conversion."""

    def names(self) -> Iterable[str]: ...

    def shape(self, name: str) -> Tuple[int, ...]: ...

    def read(self, name: str) -> np.ndarray: ...

    def describe(self, name: str) -> str:
        """The tensor's own name in the file, for error messages."""
        ...


def norm_names(cfg: ModelConfig) -> Dict[str, str]:
    """HF norm tensor name within a layer -> its params key. Llama's post_attention_layernorm
    is the MLP's input norm; in Gemma's four-norm layers it normalises the attention's output,
    and pre_feedforward_layernorm is the MLP's input norm."""
    out = {"input_layernorm.weight": "attn_norm"}
    if cfg.sandwich_norms:
        out.update({"pre_feedforward_layernorm.weight": "mlp_norm",
                    "post_attention_layernorm.weight": "post_attn_norm",
                    "post_feedforward_layernorm.weight": "post_mlp_norm"})
    else:
        out["post_attention_layernorm.weight"] = "mlp_norm"
    if cfg.qk_norm:
        out.update({"self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm"})
    return out


def expected_shapes(cfg: ModelConfig) -> Dict[str, Tuple[int, ...]]:
    """HF tensor name -> shape ([out, in] for Linear weights) that `cfg` implies."""
    h, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, k = cfg.q_size, cfg.kv_size
    out = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (v, h)
    norms = {n: ((cfg.head_dim,) if key in ("q_norm", "k_norm") else (h,))
             for n, key in norm_names(cfg).items()}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out.update({p + n: shape for n, shape in norms.items()})
        out.update({
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (k, h),
            p + "self_attn.v_proj.weight": (k, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f),
        })
        if cfg.attention_bias:
            out.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (k,),
                        p + "self_attn.v_proj.bias": (k,)})
    return out


def check_source(cfg: ModelConfig, src: TensorSource, origin: str) -> None:
    """Every expected tensor present with its shape; no bias the forward would silently drop."""
    have = set(src.names())
    want = expected_shapes(cfg)
    missing = [n for n in want if n not in have]
    if missing:
        shown = ", ".join(src.describe(n) for n in missing[:5])
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise WeightsError(f"{origin}: missing tensor(s) {shown}{more}")
    for n, shape in want.items():
        got = tuple(src.shape(n))
        if got != shape:
            raise WeightsError(f"{origin}: tensor {src.describe(n)} has shape {got}, "
                               f"expected {shape} from the config")
    dropped = sorted(n for n in have - set(want) if n.endswith(".bias"))
    if dropped:
        raise WeightsError(f"{origin}: tensor {src.describe(dropped[0])} is a bias this "
                           f"{cfg.arch} forward has no place for")


def assemble(cfg: ModelConfig, src: TensorSource, dtype, origin: str) -> Dict[str, object]:
    """Numpy params in the layout of `jaxspec.models.llama` (stacked over layers, qkv and gate/up
    fused, Linear weights as [in, out]), cast to `dtype` tensor by tensor so peak memory stays
    near one copy of the model."""
    check_source(cfg, src, origin)
    dt = np.dtype(dtype)
    layers = {k[len("layers."):]: np.empty(shape, dt)
              for k, shape in param_shapes(cfg).items() if k.startswith("layers.")}
    norms = norm_names(cfg)

    get = src.read
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        for name, key in norms.items():
            layers[key][i] = get(p + name)
        layers["wqkv"][i] = np.concatenate(
            [get(a + "q_proj.weight").T, get(a + "k_proj.weight").T, get(a + "v_proj.weight").T],
            axis=1)
        if cfg.attention_bias:
            layers["bqkv"][i] = np.concatenate(
                [get(a + "q_proj.bias"), get(a + "k_proj.bias"), get(a + "v_proj.bias")])
        layers["wo"][i] = get(a + "o_proj.weight").T
        layers["w_gate_up"][i] = np.concatenate(
            [get(p + "mlp.gate_proj.weight").T, get(p + "mlp.up_proj.weight").T], axis=1)
        layers["w_down"][i] = get(p + "mlp.down_proj.weight").T
    params = {"embed": np.ascontiguousarray(get("model.embed_tokens.weight"), dtype=dt),
              "layers": layers,
              "final_norm": np.asarray(get("model.norm.weight"), dtype=dt)}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = np.ascontiguousarray(get("lm_head.weight").T, dtype=dt)
    return params


def param_shapes(cfg: ModelConfig) -> Dict[str, Tuple[int, ...]]:
    """Flattened name ('layers.wqkv') -> shape of the assembled params."""
    h, f, l = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    qkv = cfg.q_size + 2 * cfg.kv_size
    out = {"embed": (cfg.vocab_size, h), "final_norm": (h,),
           "layers.wqkv": (l, h, qkv), "layers.wo": (l, cfg.q_size, h),
           "layers.w_gate_up": (l, h, 2 * f), "layers.w_down": (l, f, h)}
    for key in norm_names(cfg).values():
        out["layers." + key] = (l, cfg.head_dim) if key in ("q_norm", "k_norm") else (l, h)
    if cfg.attention_bias:
        out["layers.bqkv"] = (l, qkv)
    if not cfg.tie_word_embeddings:
        out["lm_head"] = (h, cfg.vocab_size)
    return out


def flatten(params) -> Dict[str, np.ndarray]:
    out = {}
    for k, v in params.items():
        if isinstance(v, dict):
            out.update({f"{k}.{kk}": vv for kk, vv in flatten(v).items()})
        else:
            out[k] = v
    return out


def unflatten(flat: Dict[str, np.ndarray]):
    out: dict = {}
    for k, v in flat.items():
        node = out
        *parents, leaf = k.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    return out
