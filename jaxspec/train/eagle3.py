"""EAGLE-3 head forward over whole sequences, on the params `load_eagle3` converts
(layout in jaxspec/loading/eagle_ckpt.py). The training form (causal, no cache), and the
reference for a cached, tree-shaped inference path, which is not written yet.

One step, as SGLang / SpecForge run `midlayer` (norm-after-residual variant unless the head's
config says norm_before_residual):
    h        = fc(concat(low, mid, high target layers))   [.., 3H] -> [.., H]; a later chained
               step feeds the head's own previous output here instead and skips fc
    residual = h                        (norm_before_residual: hidden_norm(h))
    x        = concat(input_norm(embed(token)), hidden_norm(h))          [.., 2H]
    a        = attention(x) (q/k/v read 2H, RoPE at the feature's position, causal)
    residual = residual + a ; m = mlp(post_attention_norm(residual))
    out      = m + residual            -> fed to the next chained step
    logits   = lm_head(final_norm(out)) over the draft vocabulary; draft id i is target id
               i + d2t[i]
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.models import llama
from jaxspec.train.loss import causal_attention


def head_model_config(cfg: ModelConfig, hc: dict) -> ModelConfig:
    """The target config with the head's own shapes (for RoPE and the attention split)."""
    return dataclasses.replace(cfg, hidden_size=hc["hidden_size"], num_heads=hc["num_heads"],
                               num_kv_heads=hc["num_kv_heads"], head_dim=hc["head_dim"],
                               intermediate_size=hc["intermediate_size"],
                               rms_norm_eps=hc.get("rms_norm_eps", cfg.rms_norm_eps),
                               rope_theta=hc.get("rope_theta", cfg.rope_theta), num_layers=1)


def forward(p, hc: dict, cfg: ModelConfig, embed, tokens, features, positions):
    """p: EAGLE3 params; embed [V, H] (the target's, or p["embed"]); tokens, positions [B, T];
    features [B, T, 3H] (fused target layers) or [B, T, H] (the head's own previous output).
    Returns (out [B, T, H], draft-vocab logits [B, T, Vd] in fp32)."""
    hcfg = head_model_config(cfg, hc)
    eps = hcfg.rms_norm_eps
    lp = {k: v[0] for k, v in p["layers"].items()}
    h = features @ p["fc"] if features.shape[-1] != hc["hidden_size"] else features
    hn = llama.rms_norm(h, p["hidden_norm"], eps)
    residual = hn if hc.get("norm_before_residual") else h
    e = llama.rms_norm(embed[tokens].astype(h.dtype), p["input_norm"], eps)
    x = jnp.concatenate([e, hn], axis=-1)
    q, k, v = llama.qkv_proj(hcfg, {"wqkv": lp["wqkv"]}, x, positions,
                             jnp.asarray(llama.rope_inv_freq(hcfg)), skip_norm=True)
    b, t, _ = x.shape
    a = causal_attention(hcfg, q, k, v).reshape(b, t, hcfg.q_size) @ lp["wo"]
    residual = residual + a
    out = residual + llama.mlp_block(hcfg, lp, residual)
    normed = llama.rms_norm(out, p["final_norm"], eps)
    logits = jnp.dot(normed, p["lm_head"].astype(normed.dtype), preferred_element_type=jnp.float32)
    return out, logits


def draft_to_target(d2t) -> np.ndarray:
    """Draft-vocabulary ids -> target ids: i + d2t[i]."""
    d2t = np.asarray(d2t)
    return np.arange(d2t.shape[0]) + d2t
