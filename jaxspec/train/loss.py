"""EAGLE-1 training forward and loss (the EAGLE paper's: smooth-L1 feature regression + 0.1 x
token cross-entropy against the target's distribution).

Alignment (ALGORITHMS.md): draft row t reads concat(embed(x_{t+1}), f_t) at RoPE position t and
predicts f_{t+1}; the target lm_head on the prediction gives x_{t+2}. Features f are the target's
post-final-norm hidden states. Training runs the whole sequence causally in one pass, with plain
jnp attention (differentiable; the Pallas kernels have no VJP).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxspec.config import ModelConfig
from jaxspec.kv import init_cache
from jaxspec.models import eagle, llama

FEATURE_WEIGHT = 1.0     # EAGLE-1: w_reg
TOKEN_WEIGHT = 0.1       # EAGLE-1: w_cls


@functools.partial(jax.jit, static_argnums=(1,))
def target_features(params, cfg: ModelConfig, tokens):
    """Teacher-forced target forward: tokens [B, T] -> post-final-norm features [B, T, H]."""
    b, t = tokens.shape
    cache = init_cache(cfg, b, 16, params["embed"].dtype)   # empty prefix: seq_lens 0
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
    hidden, _, _, _ = llama.forward(params, cfg, tokens, pos, cache.k, cache.v,
                                    jnp.zeros((b,), jnp.int32), llama.causal_mask(b, t))
    return llama.final_norm(params, cfg, hidden)


def causal_attention(cfg: ModelConfig, q, k, v):
    """q [B, T, Hq, D], k/v [B, Hkv, T, D] -> [B, T, Hq, D], causal, GQA, softmax in fp32."""
    b, t, hq, d = q.shape
    g = hq // cfg.num_kv_heads
    qg = q.reshape(b, t, cfg.num_kv_heads, g, d)
    s = jnp.einsum("bthgd,bhsd->bhgts", qg, k, preferred_element_type=jnp.float32) * d ** -0.5
    causal = jnp.tril(jnp.ones((t, t), bool))
    s = jnp.where(causal, s, -1e30)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    o = jnp.einsum("bhgts,bhsd->bthgd", p, v)
    return o.reshape(b, t, hq, d)


def draft_forward(params, draft_params, cfg: ModelConfig, tokens, features):
    """Training forward of an EAGLE-1 head over whole sequences.

    tokens [B, T] int32, features [B, T, H] -> predicted features [B, T - 1, H]; row t is the
    prediction of f_{t+1} from (x_{t+1}, f_t).
    """
    b, t = tokens.shape
    x_tok, f_in = tokens[:, 1:], features[:, :-1]
    pos = jnp.broadcast_to(jnp.arange(t - 1, dtype=jnp.int32)[None], (b, t - 1))
    x = eagle.fuse_input(params, draft_params, x_tok, f_in)
    q, k, v = eagle.qkv(cfg, draft_params, x, pos)
    o = causal_attention(cfg, q, k, v)
    return eagle.finish_layer(cfg, draft_params, x, o)


def smooth_l1(x, y, beta: float = 1.0):
    d = jnp.abs(x - y)
    return jnp.where(d < beta, 0.5 * d * d / beta, d - 0.5 * beta)


def eagle1_loss(draft_params, params, cfg: ModelConfig, tokens, features, loss_mask, noise_key,
                noise: float = 0.0, compute_dtype=None):
    """Scalar loss and metrics for a batch.

    tokens [B, T]; features [B, T, H] (target, post-norm); loss_mask [B, T] = 1 on the tokens
    to be drafted. Row t is counted when x_{t+1} is a masked token (at inference the draft row
    (f_t, x_{t+1}) exists once x_{t+1} is emitted, and it drafts x_{t+2} onward).
    noise: features fed to the head get U(-noise/2, noise/2) added (EAGLE's input noise), the
    regression targets stay clean.
    compute_dtype: dtype of the head's matmuls (the draft params stay fp32 master weights).
    """
    dt = compute_dtype or features.dtype
    dp = jax.tree_util.tree_map(lambda a: a.astype(dt), draft_params)
    feats = features.astype(jnp.float32)
    f_in = feats
    if noise:
        f_in = feats + noise * (jax.random.uniform(noise_key, feats.shape) - 0.5)
    pred = draft_forward(params, dp, cfg, tokens, f_in.astype(dt))          # [B, T-1, H]
    target = feats[:, 1:]
    m = loss_mask[:, 1:].astype(jnp.float32)                                 # [B, T-1]
    denom = jnp.maximum(m.sum(), 1.0)
    vloss = (smooth_l1(pred.astype(jnp.float32), target).mean(-1) * m).sum() / denom
    head_dt = params["embed"].dtype
    t_logits = jax.lax.stop_gradient(llama.project_logits(params, target.astype(head_dt)))
    d_logits = llama.project_logits(params, pred.astype(head_dt))
    t_p = jax.nn.softmax(t_logits, axis=-1)
    d_logp = jax.nn.log_softmax(d_logits, axis=-1)
    ploss = -((t_p * d_logp).sum(-1) * m).sum() / denom
    acc = ((jnp.argmax(d_logits, -1) == jnp.argmax(t_logits, -1)) * m).sum() / denom
    loss = FEATURE_WEIGHT * vloss + TOKEN_WEIGHT * ploss
    return loss, {"loss": loss, "vloss": vloss, "ploss": ploss, "acc": acc}
