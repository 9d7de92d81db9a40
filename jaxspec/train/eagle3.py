"""EAGLE-3 head forward over whole sequences, on the params `load_eagle3` converts
(layout in jaxspec/loading/eagle_ckpt.py): the training form (causal, no cache) and the
reference of the cached, tree-shaped inference path (`jaxspec.models.eagle3`); and EAGLE-3
training: the draft vocabulary, the training-time-test forward and its loss (below).

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


import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.models import llama
from jaxspec.models.eagle3 import Eagle3Config
from jaxspec.train.loss import causal_attention
from jaxspec.xla_options import jit


def head_model_config(cfg: ModelConfig, hc: dict) -> ModelConfig:
    """The head's decoder layer as inference runs it (`Eagle3Config.layer_config`): its own
    shapes, epsilon and RoPE, never the target's scaling or q/k norms."""
    return Eagle3Config.from_dict(hc, ()).layer_config(cfg)


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


# -- training (SpecForge's recipe: training-time test over chained passes) -------------------------
#
# Head params split in two: the trained arrays (a dict: fc, norms, layers, final_norm, lm_head) and
# the fixed draft vocabulary (d2t, t2d) with the head's shapes, which the loss closes over. The
# embedding is the target's, frozen (as SpecForge trains it).

TRAINED_KEYS = ("fc", "input_norm", "hidden_norm", "layers", "final_norm", "lm_head")


def build_draft_vocab(tokens, loss_mask, vocab_size: int, draft_vocab_size: int) -> np.ndarray:
    """The draft vocabulary: the `draft_vocab_size` most frequent target ids among the tokens the
    head learns to draft (loss_mask == 1), ties and any shortfall filled by the most frequent
    ids of all tokens, then by the lowest ids. Sorted ascending (d2t = ids - arange)."""
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size={draft_vocab_size} must be in [1, {vocab_size}]")
    tokens = np.asarray(tokens)
    drafted = np.bincount(tokens[np.asarray(loss_mask) > 0].ravel(), minlength=vocab_size)
    seen = np.bincount(tokens.ravel(), minlength=vocab_size)
    # lexicographic: drafted count, then count anywhere, then low id first
    order = np.lexsort((np.arange(vocab_size), -seen, -drafted))
    return np.sort(order[:draft_vocab_size]).astype(np.int64)


def init_train_head(params, cfg: ModelConfig, key, draft_ids, aux_layers=None,
                    scale: float = 0.02):
    """A random EAGLE-3 head to train, fp32. lm_head starts as the target's columns of the draft
    vocabulary and final_norm as the target's (the head's output then reads like a target
    hidden state from the first step), and fc passes the highest target layer through (plus
    noise), as EAGLE-1's identity-initialised fc does."""
    from jaxspec.models import eagle3 as e3

    head = e3.init_eagle3_head(cfg, key, draft_ids=draft_ids, aux_layers=aux_layers,
                               dtype=jnp.float32, scale=scale)
    h = cfg.hidden_size
    w = params["lm_head"] if "lm_head" in params else params["embed"].T
    p = dict(head.params,
             fc=head.params["fc"].at[2 * h:].add(jnp.eye(h, dtype=jnp.float32)),
             lm_head=jnp.asarray(w, jnp.float32)[:, jnp.asarray(draft_ids)],
             # a copy: the trained arrays are donated to the train step, the target's are not
             final_norm=jnp.array(params["final_norm"], jnp.float32, copy=True))
    return e3.Eagle3Head(p, head.config)


def split_head(head):
    """Eagle3Head -> (trained dict, fixed dict: d2t, t2d and embed if the head has its own)."""
    trained = {k: head.params[k] for k in TRAINED_KEYS}
    return trained, {k: v for k, v in head.params.items() if k not in TRAINED_KEYS}


def _target_forward(params, cfg: ModelConfig, aux_layers, tokens):
    """Teacher-forced target forward: tokens [B, T] -> (aux [B, T, 3H] = the outputs of
    `aux_layers` concatenated, normed [B, T, H] = the post-final-norm hidden)."""
    from jaxspec.kv import init_cache

    b, t = tokens.shape
    cache = init_cache(cfg, b, 16, params["embed"].dtype)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
    hidden, _, _, cap = llama.forward(params, cfg, tokens, pos, cache.k, cache.v,
                                      jnp.zeros((b,), jnp.int32), llama.causal_mask(b, t),
                                      tuple(aux_layers))
    return jnp.concatenate(list(cap), axis=-1), llama.final_norm(params, cfg, hidden)


target_features = jit(_target_forward, static_argnums=(1, 2))


def forward_ttt(p, hc: dict, cfg: ModelConfig, embed, tokens, aux, steps: int, loss_fn):
    """`steps` chained passes of the head (the training-time test) over whole sequences.

    Pass 0 row t reads (x_{t+1}, fc(aux_t)) at position t; pass k row t reads (x_{t+1}, pass
    k-1's output at row t - 1, no fc), as the k-th draft step of a chain does at inference, and
    attends to pass 0's rows <= t - k and its chain ancestors (loss.ttt_attention). Every pass's
    row t predicts x_{t+2}. loss_fn(k, out [B, T-1, H]) -> (loss, metrics) is applied to each
    pass under jax.checkpoint, so the [B, T, Vd] logits of a pass are recomputed in the
    backward pass instead of kept for all passes. Returns the lists of per-pass results.
    """
    from jaxspec.train.loss import ttt_attention

    hcfg = head_model_config(cfg, hc)
    eps = hcfg.rms_norm_eps
    lp = {k: v[0] for k, v in p["layers"].items()}
    b, t = tokens.shape
    x_tok = tokens[:, 1:]
    pos = jnp.broadcast_to(jnp.arange(t - 1, dtype=jnp.int32)[None], (b, t - 1))
    inv_freq = jnp.asarray(llama.rope_inv_freq(hcfg))
    e = llama.rms_norm(embed[x_tok].astype(p["fc"].dtype), p["input_norm"], eps)
    h = aux[:, :-1] @ p["fc"]
    h0 = h
    ks, vs, results = [], [], []
    for k in range(steps):
        hn = llama.rms_norm(h, p["hidden_norm"], eps)
        residual = hn if hc.get("norm_before_residual") else h
        x = jnp.concatenate([e, hn], axis=-1)
        q, kk, vv = llama.qkv_proj(hcfg, {"wqkv": lp["wqkv"]}, x, pos, inv_freq, skip_norm=True)
        ks.append(kk)
        vs.append(vv)
        a = ttt_attention(hcfg, q, ks, vs).reshape(b, t - 1, hcfg.q_size) @ lp["wo"]
        r = residual + a
        out = r + llama.mlp_block(hcfg, lp, r)
        results.append(jax.checkpoint(lambda o, kk=k: loss_fn(kk, o))(out))
        # the next pass's row t reads this pass's row t - 1 (row 0 never counts for k >= 1)
        h = jnp.concatenate([h0[:, :1], out[:, :-1]], axis=1)
    return results


def eagle3_loss(trained, fixed, hc: dict, params, cfg: ModelConfig, tokens, aux, normed,
                loss_mask, noise_key, noise: float = 0.0, compute_dtype=None, ttt_steps: int = 7,
                ttt_decay: float = 0.8):
    """Scalar loss and metrics for a batch (SpecForge's EAGLE-3 objective).

    tokens [B, T]; aux [B, T, 3H] target layers; normed [B, T, H] the target's post-norm hidden
    (its distribution of x_{t+1} is lm_head(normed_t)); loss_mask [B, T] = 1 on drafted tokens.
    Each pass k's row t (t >= k, x_{t+1} masked) is scored by the forward KL(target || draft) of
    the draft's distribution over its vocabulary against the target's distribution of x_{t+2}
    restricted to the draft vocabulary and renormalised; rows whose target top-1 lies outside
    the draft vocabulary carry no loss (the head cannot draft it). Pass k weighs ttt_decay**k
    (weights normalised to sum 1). noise: U(-noise/2, noise/2) on the aux features (scaled by
    their RMS). acc_k: the draft's top-1 (as a target id) equals the target's top-1 over all
    masked rows of pass k (out-of-vocabulary rows count as misses: what inference sees).
    """
    dt = compute_dtype or aux.dtype
    p = jax.tree_util.tree_map(lambda a: a.astype(dt), trained)
    auxf = aux.astype(jnp.float32)
    if noise:
        rms = jnp.sqrt(jnp.mean(auxf * auxf, axis=-1, keepdims=True))
        auxf = auxf + noise * rms * (jax.random.uniform(noise_key, auxf.shape) - 0.5)
    ids = jnp.arange(fixed["d2t"].shape[0]) + fixed["d2t"]                     # draft -> target
    head_dt = params["embed"].dtype
    nxt = jax.lax.stop_gradient(normed[:, 1:].astype(head_dt))                  # [B, T-1, H]
    w = params["lm_head"] if "lm_head" in params else params["embed"].T
    t_full = jnp.dot(nxt, w.astype(head_dt), preferred_element_type=jnp.float32)
    t_top = jnp.argmax(t_full, -1)
    in_vocab = fixed["t2d"][t_top]
    t_logp = jax.nn.log_softmax(jnp.take(t_full, ids, axis=-1), axis=-1)       # [B, T-1, Vd]
    t_p = jnp.exp(t_logp)
    del t_full
    m0 = loss_mask[:, 1:].astype(jnp.float32)
    rows = jnp.arange(m0.shape[1])

    def loss_fn(k, out):
        m = m0 * (rows >= k)
        mv = m * in_vocab
        normed_out = llama.rms_norm(out, p["final_norm"], hc.get("rms_norm_eps", 1e-5))
        logits = jnp.dot(normed_out, p["lm_head"], preferred_element_type=jnp.float32)
        # KL = cross-entropy minus the target's entropy (a constant): same gradient, and 0 is a
        # perfect head, whatever the target's entropy
        kl = (t_p * (t_logp - jax.nn.log_softmax(logits, axis=-1))).sum(-1)
        loss = (kl * mv).sum() / jnp.maximum(mv.sum(), 1.0)
        hit = ids[jnp.argmax(logits, -1)] == t_top
        acc = (hit * m).sum() / jnp.maximum(m.sum(), 1.0)
        return loss, acc

    embed = fixed.get("embed", params["embed"])
    res = forward_ttt(p, hc, cfg, embed, tokens, auxf.astype(dt), ttt_steps, loss_fn)
    weights = [ttt_decay ** k for k in range(ttt_steps)]
    loss = sum(wk / sum(weights) * lk for wk, (lk, _) in zip(weights, res))
    metrics = {"loss": loss, "ploss": res[0][0], "acc": res[0][1],
               "vocab_cover": (m0 * in_vocab).sum() / jnp.maximum(m0.sum(), 1.0)}
    for k in range(1, ttt_steps):
        metrics[f"acc_{k}"] = res[k][1]
    return loss, metrics
