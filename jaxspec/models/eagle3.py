"""EAGLE-3 draft head for inference: cached, tree-shaped, as pure functions.

The same pieces as `jaxspec.models.eagle` (fuse input, qkv with RoPE, attention through the tree
attention kernel, finish layer, logits), with the same signatures, so the drafting code runs
either head (`jaxspec.spec.draft` picks the module from the draft params' type). One row:

    h        = fc(concat(low, mid, high target layer outputs))  [.., 3Ht] -> [.., H]  (catch-up
               rows); a later draft step feeds the head's own previous `out` here, without fc
    residual = h                      (norm_before_residual: hidden_norm(h))
    x        = concat(input_norm(embed(token)), hidden_norm(h))                        [.., 2H]
    out      = residual + o_proj(attn(x)); out = out + mlp(post_attention_norm(out))
    logits   = lm_head(final_norm(out))      over the draft vocabulary [.., Vd]

as SGLang's LlamaForCausalLMEagle3 and SpecForge run it (`jaxspec.train.eagle3.forward` is the
sequence form and the reference of the tests). Draft id i is target id i + d2t[i]; the draft's
top-k is taken over its own vocabulary (scores = the draft's log-probs there) and mapped to target
ids, so the tree, verify and the catch-up only ever see target ids. Lossless sampling needs no
draft probabilities (verify.py), so a token outside the draft vocabulary is simply never drafted.

Positions are EAGLE-1's: a row pairs the feature of position t with the token of t+1 and runs at
RoPE position t. The layer is a Llama decoder layer whatever the target's family (a Qwen3 target's
head has no q/k norm): its shapes, norms' epsilon and RoPE (theta, scaling) are the head's own
(`Eagle3Config.layer_config`), from its config.json, not the target's. Ht, the width of the
target layers fc reads, is the target's hidden size; H, the head's, may differ (the head then
brings its own embedding).

The head is an `Eagle3Head`: its arrays (a pytree) and its shapes (`Eagle3Config`, frozen and
hashable, a static part of the pytree), so jitted functions that take draft params compile per
head shape with no extra static argument.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Tuple

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.config import ModelConfig, RopeScaling, layout_of
from jaxspec.models import llama
from pallas_kernels.tree_attention import tree_attention


def default_aux_layers(num_layers: int) -> Tuple[int, int, int]:
    """SpecForge's default target layers (outputs of layers 1, L/2 - 1, L - 4), clipped to the
    model (SGLang captures the inputs of layers 2, L/2, L - 3: the same states)."""
    ids = (1, num_layers // 2 - 1, num_layers - 4)
    return tuple(min(max(i, 0), num_layers - 1) for i in ids)


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """Shapes of an EAGLE-3 head and the target layers it reads (hashable: a static jit part)."""
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    draft_vocab_size: int
    aux_layers: Tuple[int, ...]
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    norm_before_residual: bool = False
    rope_scaling: Optional[RopeScaling] = None
    target_hidden_size: Optional[int] = None    # Ht; None: the head's hidden_size

    @classmethod
    def from_dict(cls, hc: Mapping, aux_layers) -> "Eagle3Config":
        """From `eagle3_ckpt.head_config`'s dict."""
        names = [f.name for f in dataclasses.fields(cls) if f.name != "aux_layers"]
        return cls(aux_layers=tuple(int(i) for i in aux_layers),
                   **{k: hc[k] for k in names if k in hc})

    def as_dict(self) -> dict:
        """The dict form `jaxspec.train.eagle3.forward` takes (rope_scaling stays a
        RopeScaling)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @property
    def feature_width(self) -> int:
        """fc's input width: three target layers, 3 Ht."""
        return 3 * (self.target_hidden_size or self.hidden_size)

    def layer_config(self, cfg: ModelConfig) -> ModelConfig:
        """The head's decoder layer as a one-layer Llama config: its own shapes, epsilon and
        RoPE; only the vocabulary and context length are the target's."""
        return ModelConfig(arch="LlamaForCausalLM", vocab_size=cfg.vocab_size,
                           hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_layers=1,
                           num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                           head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
                           rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
                           max_position_embeddings=cfg.max_position_embeddings)


@struct.dataclass
class Eagle3Head:
    """params: fc [3Ht, H], input_norm, hidden_norm [H], layers (wqkv [1, 2H, Q + 2K], wo,
    mlp_norm, w_gate_up, w_down), final_norm [H], lm_head [H, Vd], d2t [Vd] int32, t2d [V] bool,
    optionally embed [V, H] (else the target's). Layout: jaxspec/loading/eagle3_ckpt.py."""
    params: dict
    config: Eagle3Config = struct.field(pytree_node=False)


def is_eagle3(draft_params) -> bool:
    return isinstance(draft_params, Eagle3Head)


def cast_head(head: Eagle3Head, dtype) -> Eagle3Head:
    """Floating-point arrays to dtype; the id maps stay integer / bool."""
    return jax.tree_util.tree_map(
        lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, head)


def init_eagle3_head(cfg: ModelConfig, key, draft_ids=None, aux_layers=None,
                     dtype=jnp.float32, scale=0.02, intermediate_size=None) -> Eagle3Head:
    """Random EAGLE-3 head with the target's hidden shape (tests, shape benchmarks, training).

    draft_ids: the target ids of the draft vocabulary, ascending (default: the whole vocab)."""
    import numpy as np

    h, v = cfg.hidden_size, cfg.vocab_size
    f = intermediate_size or cfg.intermediate_size
    ids = np.arange(v) if draft_ids is None else np.asarray(draft_ids)
    vd = len(ids)
    hc = Eagle3Config(hidden_size=h, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                      head_dim=cfg.head_dim, intermediate_size=f, vocab_size=v,
                      draft_vocab_size=vd,
                      aux_layers=tuple(aux_layers or default_aux_layers(cfg.num_layers)),
                      rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
                      rope_scaling=cfg.rope_scaling)
    qkv = hc.num_heads * hc.head_dim + 2 * hc.num_kv_heads * hc.head_dim
    ks = iter(jax.random.split(key, 8))

    def rnd(shape):
        return (scale * jax.random.normal(next(ks), shape, jnp.float32)).astype(dtype)

    t2d = np.zeros(v, bool)
    t2d[ids] = True
    p = {"fc": rnd((3 * h, h)), "input_norm": jnp.ones((h,), dtype),
         "hidden_norm": jnp.ones((h,), dtype),
         "layers": {"wqkv": rnd((1, 2 * h, qkv)), "wo": rnd((1, hc.num_heads * hc.head_dim, h)),
                    "mlp_norm": jnp.ones((1, h), dtype), "w_gate_up": rnd((1, h, 2 * f)),
                    "w_down": rnd((1, f, h))},
         "final_norm": jnp.ones((h,), dtype), "lm_head": rnd((h, vd)),
         "d2t": jnp.asarray(ids - np.arange(vd), jnp.int32), "t2d": jnp.asarray(t2d)}
    return Eagle3Head(p, hc)


def _layer(head: Eagle3Head):
    return {k: v[0] for k, v in head.params["layers"].items()}


def fuse_input(params, head: Eagle3Head, tokens, features):
    """tokens [B, N] (target ids); features [B, N, 3Ht] (target layers: fc applied) or [B, N, H]
    (the head's own previous output). Returns (x [B, N, 2H] for q/k/v, residual [B, N, H])."""
    p, hc = head.params, head.config
    h = features @ p["fc"] if features.shape[-1] == hc.feature_width else features
    hn = llama.rms_norm(h, p["hidden_norm"], hc.rms_norm_eps)
    embed = p["embed"] if "embed" in p else params["embed"]
    e = llama.rms_norm(embed[jnp.maximum(tokens, 0)].astype(h.dtype), p["input_norm"],
                       hc.rms_norm_eps)
    return jnp.concatenate([e, hn], axis=-1), (hn if hc.norm_before_residual else h)


def qkv(cfg: ModelConfig, head: Eagle3Head, x, positions):
    """x: fuse_input's pair -> q [B, N, Hq, D], k, v [B, Hkv, N, D] at RoPE `positions`."""
    hcfg = head.config.layer_config(cfg)
    inv_freq = jnp.asarray(llama.rope_inv_freq(hcfg))
    return llama.qkv_proj(hcfg, {"wqkv": _layer(head)["wqkv"]}, x[0], positions, inv_freq,
                          skip_norm=True)


def attend(cfg: ModelConfig, q, cache_k, cache_v, seq_lens, k_new, v_new, mask, slots=None):
    """As eagle.attend; the scale is the head's own head_dim (read from q)."""
    return tree_attention(q, cache_k, cache_v, jnp.int32(0), seq_lens, k_new, v_new, mask,
                          sm_scale=q.shape[-1] ** -0.5, slots=slots,
                          live_rows=layout_of(cfg).live_rows)


def finish_layer(cfg: ModelConfig, head: Eagle3Head, x, attn):
    """Residual + o-proj, then MLP: x = fuse_input's pair, attn [B, N, Hq, D] -> out [B, N, H]
    (the pre-norm output: the next draft step's feature)."""
    hcfg = head.config.layer_config(cfg)
    lp = _layer(head)
    b, n = attn.shape[:2]
    r = x[1] + attn.reshape(b, n, hcfg.q_size) @ lp["wo"]
    return r + llama.mlp_block(hcfg, lp, r)


def logits(head: Eagle3Head, out):
    """out [..., H] -> fp32 logits over the draft vocabulary [..., Vd]."""
    p = head.params
    normed = llama.rms_norm(out, p["final_norm"], head.config.rms_norm_eps)
    return jnp.dot(normed, p["lm_head"].astype(normed.dtype), preferred_element_type=jnp.float32)


def to_target(head: Eagle3Head, draft_ids):
    """Draft-vocabulary ids -> target ids (i + d2t[i])."""
    return (draft_ids + head.params["d2t"][draft_ids]).astype(jnp.int32)


def target_features(captured):
    """captured [3, B, N, Ht] (llama.forward's capture of `aux_layers`) -> [B, N, 3Ht] in the
    order low, mid, high (the fc's input order)."""
    return jnp.concatenate(list(captured), axis=-1)


def forward(params, head: Eagle3Head, cfg: ModelConfig, tokens, features, positions, cache_k,
            cache_v, seq_lens, new_mask, slots=None):
    """All rows through the head (as eagle.forward). Returns (out [B, N, H], k_new, v_new
    [1, B, Hkv, N, D])."""
    x = fuse_input(params, head, tokens, features)
    q, k, v = qkv(cfg, head, x, positions)
    o = attend(cfg, q, cache_k, cache_v, seq_lens, k, v, new_mask, slots)
    return finish_layer(cfg, head, x, o), k[None], v[None]
