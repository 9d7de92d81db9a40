"""EAGLE-1 draft head as pure functions over a small params pytree.

    x      = fc(concat(embed(tokens), features))           # [B, N, 2H] -> [B, N, H]
    hidden = decoder_layer(x)   (input norm skipped: the fc output feeds attention directly)
    logits = lm_head(hidden)    (the target's lm_head; no final norm on the draft side)

Draft params:
  fc          [2H, H]   (rows 0..H-1 read the token embedding, rows H..2H-1 the feature)
  fc_bias     [H]
  layers      one decoder layer in llama.py's stacked layout with L = 1 (attn_norm is kept for
              the layout but unused)
The embedding and the lm_head are the target's: the target params are passed in, not copied.

Feature convention (EAGLE-1 reference, eagle/model/ea_model.py + cnets.py): the feature is the
target's last hidden state AFTER its final norm (HF `LlamaModel(...)[0]`, the very input of the
lm_head), and the draft's output goes to the lm_head without a norm. A draft row pairs the feature
of position t with the token of position t+1 and runs at RoPE position t.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.config import ModelConfig, layout_of
from jaxspec.models import llama
from pallas_kernels.tree_attention import tree_attention


def init_eagle_params(cfg: ModelConfig, key, dtype=jnp.float32, scale=0.02,
                      intermediate_size=None):
    """Random EAGLE-1 head for `cfg` (the target's config): tests and shape benchmarks.
    intermediate_size: the head's MLP width (default the target's)."""
    h, f = cfg.hidden_size, intermediate_size or cfg.intermediate_size
    qkv = cfg.q_size + 2 * cfg.kv_size
    ks = iter(jax.random.split(key, 8))

    def rnd(shape):
        return (scale * jax.random.normal(next(ks), shape, jnp.float32)).astype(dtype)

    layers = {
        "attn_norm": jnp.ones((1, h), dtype), "wqkv": rnd((1, h, qkv)), "wo": rnd((1, cfg.q_size, h)),
        "mlp_norm": (1.0 + rnd((1, h))).astype(dtype), "w_gate_up": rnd((1, h, 2 * f)),
        "w_down": rnd((1, f, h)),
    }
    if cfg.attention_bias:
        layers["bqkv"] = rnd((1, qkv))
    return {"fc": rnd((2 * h, h)), "fc_bias": rnd((h,)), "layers": layers}


def mlp_width(draft_params) -> int:
    """The head's MLP intermediate size (w_down [1, F, H])."""
    return int(draft_params["layers"]["w_down"].shape[1])


def widen_mlp(draft_params, width: int, key, scale=0.02):
    """The same head with its MLP widened to `width`, computing exactly the same function: the
    new gate/up columns are random, the new w_down rows zero, so their products add nothing
    until training moves them (a larger head that starts where a trained one left off)."""
    lp = draft_params["layers"]
    f = mlp_width(draft_params)
    if width < f:
        raise ValueError(f"cannot narrow the head's MLP from {f} to {width}")
    if width == f:
        return draft_params
    gate, up = jnp.split(lp["w_gate_up"], 2, axis=-1)                     # [1, H, F] each
    kg, ku = jax.random.split(key)
    extra = lambda k: (scale * jax.random.normal(k, gate.shape[:-1] + (width - f,),
                                                 jnp.float32)).astype(gate.dtype)
    down = lp["w_down"]
    return {**draft_params, "layers": {
        **lp, "w_gate_up": jnp.concatenate([gate, extra(kg), up, extra(ku)], axis=-1),
        "w_down": jnp.concatenate([down, jnp.zeros((1, width - f) + down.shape[2:], down.dtype)],
                                  axis=1)}}


def layer_params(draft_params):
    """The single decoder layer (from the stacked layout or a one-element list)."""
    return llama.layer_slice(draft_params["layers"], 0)


def fuse_input(params, draft_params, tokens, features):
    """tokens [B, N], features [B, N, H] -> fc input of the decoder layer [B, N, H]."""
    e = params["embed"][jnp.maximum(tokens, 0)].astype(features.dtype)
    x = jnp.concatenate([e, features], axis=-1) @ draft_params["fc"]
    return x + draft_params["fc_bias"]


def qkv(cfg: ModelConfig, draft_params, x, positions):
    """x [B, N, H] -> q [B, N, Hq, D], k, v [B, Hkv, N, D] at RoPE `positions` [B, N]."""
    inv_freq = jnp.asarray(llama.rope_inv_freq(cfg))
    return llama.qkv_proj(cfg, layer_params(draft_params), x, positions, inv_freq, skip_norm=True)


def attend(cfg: ModelConfig, q, cache_k, cache_v, seq_lens, k_new, v_new, mask, slots=None):
    """Draft attention over the committed draft cache (layer 0) plus `k_new` under `mask`;
    slots [B]: the cache slot of each row (None: row b is slot b)."""
    return tree_attention(q, cache_k, cache_v, jnp.int32(0), seq_lens, k_new, v_new, mask,
                          sm_scale=cfg.head_dim ** -0.5, slots=slots,
                          live_rows=layout_of(cfg).live_rows)


def finish_layer(cfg: ModelConfig, draft_params, x, attn):
    """Residual + o-proj, then MLP: x [B, N, H], attn [B, N, Hq, D] -> draft hidden [B, N, H]."""
    lp = layer_params(draft_params)
    b, n, _ = x.shape
    h = x + attn.reshape(b, n, cfg.q_size) @ lp["wo"]
    return h + llama.mlp_block(cfg, lp, h)


def logits(params, hidden):
    """Draft hidden [..., H] -> fp32 logits [..., V] through the target's lm_head, no norm."""
    return llama.project_logits(params, hidden)


def forward(params, draft_params, cfg: ModelConfig, tokens, features, positions, cache_k, cache_v,
            seq_lens, new_mask, slots=None):
    """All rows through the head (no row skipped).

    tokens, positions [B, N]; features [B, N, H]; cache_k/v [1, B, Hkv, T, D]; new_mask [B, N, N].
    Returns (hidden [B, N, H], k_new, v_new [1, B, Hkv, N, D]).
    """
    x = fuse_input(params, draft_params, tokens, features)
    q, k, v = qkv(cfg, draft_params, x, positions)
    o = attend(cfg, q, cache_k, cache_v, seq_lens, k, v, new_mask, slots)
    return finish_layer(cfg, draft_params, x, o), k[None], v[None]
