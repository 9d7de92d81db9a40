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
from jaxspec.xla_options import jit

FEATURE_WEIGHT = 1.0     # EAGLE-1: w_reg
TOKEN_WEIGHT = 0.1       # EAGLE-1: w_cls


@functools.partial(jit, static_argnums=(1,))
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


def ttt_attention(cfg: ModelConfig, q, ks, vs):
    """Attention of pass k = len(ks) - 1 of a multi-step ("training-time test") forward.

    q [B, T, Hq, D]; ks/vs: the K/V [B, Hkv, T, D] of passes 0..k. Pass k's row t stands for the
    k-th draft step at position t: it sees pass 0 (true features, the committed draft KV) at rows
    <= t - k, and its ancestors in the chain, pass j's row t - (k - j) for j = 1..k (itself
    included). k = 0 is plain causal attention.
    """
    b, t, hq, d = q.shape
    k = len(ks) - 1
    g = hq // cfg.num_kv_heads
    qg = q.reshape(b, t, cfg.num_kv_heads, g, d)
    scale = d ** -0.5
    s0 = jnp.einsum("bthgd,bhsd->bhgts", qg, ks[0], preferred_element_type=jnp.float32) * scale
    rows = jnp.arange(t)
    s0 = jnp.where(rows[None, :] <= rows[:, None] - k, s0, -1e30)
    diag, vals = [], []
    for j in range(1, k + 1):
        shift = k - j
        kj = jnp.roll(ks[j], shift, axis=2)                 # row t holds pass j's row t - shift
        vals.append(jnp.roll(vs[j], shift, axis=2))
        sj = jnp.einsum("bthgd,bhtd->bhgt", qg, kj, preferred_element_type=jnp.float32) * scale
        diag.append(jnp.where(rows >= shift, sj, -1e30)[..., None])
    p = jax.nn.softmax(jnp.concatenate([s0] + diag, axis=-1), axis=-1)   # [B, Hkv, G, T, T + k]
    o = jnp.einsum("bhgts,bhsd->bthgd", p[..., :t].astype(vs[0].dtype), vs[0])
    for j in range(1, k + 1):
        o = o + jnp.einsum("bhgt,bhtd->bthgd", p[..., t + j - 1].astype(vals[j - 1].dtype),
                           vals[j - 1])
    return o.reshape(b, t, hq, d).astype(q.dtype)


def draft_forward_ttt(params, draft_params, cfg: ModelConfig, tokens, features, steps: int):
    """`steps` chained passes of the head (EAGLE-3's training-time test, on an EAGLE-1 head).

    Pass 0 is `draft_forward`. Pass k's row t reads (x_{t+1}, pass k-1's prediction of f_t) at
    position t, as the k-th draft step of a chain does at inference, and predicts f_{t+1}.
    Returns predictions [steps, B, T - 1, H].
    """
    b, t = tokens.shape
    x_tok = tokens[:, 1:]
    pos = jnp.broadcast_to(jnp.arange(t - 1, dtype=jnp.int32)[None], (b, t - 1))
    f_in = features[:, :-1]
    ks, vs, preds = [], [], []
    for _ in range(steps):
        x = eagle.fuse_input(params, draft_params, x_tok, f_in)
        q, k, v = eagle.qkv(cfg, draft_params, x, pos)
        ks.append(k)
        vs.append(v)
        pred = eagle.finish_layer(cfg, draft_params, x, ttt_attention(cfg, q, ks, vs))
        preds.append(pred)
        # Row t of the next pass reads this pass's prediction of f_t (row t - 1's output).
        f_in = jnp.concatenate([features[:, :1].astype(pred.dtype), pred[:, :-1]], axis=1)
    return jnp.stack(preds)


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
                noise: float = 0.0, compute_dtype=None, ttt_steps: int = 1,
                ttt_decay: float = 0.8, feature_weight: float = FEATURE_WEIGHT,
                token_weight: float = TOKEN_WEIGHT, target_temperature: float = 1.0):
    """Scalar loss and metrics for a batch.

    tokens [B, T]; features [B, T, H] (target, post-norm); loss_mask [B, T] = 1 on the tokens
    to be drafted. Row t is counted when x_{t+1} is a masked token (at inference the draft row
    (f_t, x_{t+1}) exists once x_{t+1} is emitted, and it drafts x_{t+2} onward).
    noise: features fed to the head get U(-noise/2, noise/2) added (EAGLE's input noise), the
    regression targets stay clean.
    compute_dtype: dtype of the head's matmuls (the draft params stay fp32 master weights).
    ttt_steps > 1: also train the head on its own predicted features (draft_forward_ttt); pass k
    weighs ttt_decay**k (weights normalised to sum 1), pass k's row t counts for t >= k. Metrics
    are pass 0's, plus acc_k per pass.
    feature_weight, token_weight: w_reg and w_cls (EAGLE-1: 1.0 and 0.1). Acceptance depends on
    the token term alone; a larger w_cls trades feature fit for top-1 agreement.
    target_temperature: the token term's target is softmax(target logits / T). T < 1 sharpens
    it towards the target's top-1, the token greedy verification accepts (T -> 0: a hard-label
    cross-entropy); 1 is EAGLE's distribution match, which also ranks the runners-up a tree
    drafts. The acc metrics compare argmaxes and do not depend on T.
    """
    dt = compute_dtype or features.dtype
    dp = jax.tree_util.tree_map(lambda a: a.astype(dt), draft_params)
    feats = features.astype(jnp.float32)
    f_in = feats
    if noise:
        f_in = feats + noise * (jax.random.uniform(noise_key, feats.shape) - 0.5)
    preds = draft_forward_ttt(params, dp, cfg, tokens, f_in.astype(dt), ttt_steps)
    target = feats[:, 1:]
    m0 = loss_mask[:, 1:].astype(jnp.float32)                                # [B, T-1]
    head_dt = params["embed"].dtype
    t_logits = jax.lax.stop_gradient(llama.project_logits(params, target.astype(head_dt), cfg))
    t_p = jax.nn.softmax(t_logits / target_temperature if target_temperature != 1.0 else t_logits,
                         axis=-1)
    t_top = jnp.argmax(t_logits, -1)
    weights = [ttt_decay ** k for k in range(ttt_steps)]
    loss, metrics = 0.0, {}
    for k in range(ttt_steps):
        m = m0 * (jnp.arange(m0.shape[1]) >= k)
        denom = jnp.maximum(m.sum(), 1.0)
        pred = preds[k]
        vloss = (smooth_l1(pred.astype(jnp.float32), target).mean(-1) * m).sum() / denom
        d_logits = llama.project_logits(params, pred.astype(head_dt))
        ploss = -((t_p * jax.nn.log_softmax(d_logits, axis=-1)).sum(-1) * m).sum() / denom
        acc = ((jnp.argmax(d_logits, -1) == t_top) * m).sum() / denom
        loss_k = feature_weight * vloss + token_weight * ploss
        loss = loss + weights[k] / sum(weights) * loss_k
        if k == 0:
            metrics.update(vloss=vloss, ploss=ploss, acc=acc)
        else:
            metrics[f"acc_{k}"] = acc
    return loss, {"loss": loss, **metrics}
