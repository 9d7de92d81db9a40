"""Test models: a target and an EAGLE head built to agree (the speculative cycle's tests), and
tiny random Llama directories beside a tokenizer (the API's and the server's tests)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.models import eagle, llama


def agreeing_pair(cfg, scale: float, lm_head_scale: float, feature: float = 0.1):
    """A target whose next token depends mostly on the current one (large embeddings, small
    layers of weight `scale`, unit final norm) and a head whose fc passes the token embedding
    straight through to the lm_head (its layer adds nothing): the draft usually predicts the
    target's next token, so accepts are long.

    The fc's feature block is a random map of RMS gain `feature` (not zero): the draft's
    outputs and its KV then depend on every target feature it is given, so a feature taken from
    the wrong row (a catch-up that does not gather the accepted path's features) changes the
    drafts and the draft cache, which tests compare with references. At 0.1 a chain still
    accepts about 94% of its drafts on the tests' configs. Returns (target params, draft
    params)."""
    p = llama.init_random_params(cfg, jax.random.PRNGKey(2), scale=scale)
    p = dict(p, embed=jax.random.normal(jax.random.PRNGKey(3), p["embed"].shape),
             lm_head=lm_head_scale * jax.random.normal(jax.random.PRNGKey(7), p["lm_head"].shape),
             final_norm=jnp.ones_like(p["final_norm"]))
    h = cfg.hidden_size
    feat = feature / np.sqrt(h) * jax.random.normal(jax.random.PRNGKey(8), (h, h))
    d = eagle.init_eagle_params(cfg, jax.random.PRNGKey(4), scale=scale)
    d = dict(d, fc=jnp.concatenate([jnp.eye(h), feat], 0), fc_bias=jnp.zeros((h,)),
             layers=dict(d["layers"], wo=jnp.zeros_like(d["layers"]["wo"]),
                         w_down=jnp.zeros_like(d["layers"]["w_down"])))
    return p, d


def agreeing_eagle3_pair(cfg, scale: float, lm_head_scale: float, aux_layers=None,
                         extra_vocab: int = 24, sharp: float = 160.0, peak: float = 4.0):
    """The EAGLE-3 counterpart of `agreeing_pair`, with a reduced draft vocabulary.

    Target: as agreeing_pair, with embedding dims 0..15 zero. Head (its own embedding, one
    attention head of dim H): embedding row t = [ones(16) | the target's e_t[16:] scaled to unit
    RMS], so input_norm leaves it as is; q and k read the constant block only (q scaled by
    `sharp`), so after RoPE each row attends to itself (the constant vector's score is largest at
    distance 0: by >= 1.08 x sharp / 8 over distances 1..400 with theta 1e4); v and o_proj pass
    the token part through; norm_before_residual with a zero hidden_norm drops the feature path,
    and the MLP adds nothing. The draft logits are then the target's lm_head at e_t over the
    draft vocabulary (times `peak`, so a tree's best nodes are the deep ones): the target's
    greedy successors of every token (plus a few others), so the draft usually predicts the
    target's next token. Returns (target params, Eagle3Head)."""
    import numpy as np

    from jaxspec.models import eagle3

    h, v = cfg.hidden_size, cfg.vocab_size
    assert h >= 32, "the constant block takes 16 dims"
    p = llama.init_random_params(cfg, jax.random.PRNGKey(2), scale=scale)
    emb = jax.random.normal(jax.random.PRNGKey(3), p["embed"].shape).at[:, :16].set(0.0)
    lm = lm_head_scale * jax.random.normal(jax.random.PRNGKey(7), (h, v))
    p = dict(p, embed=emb, lm_head=lm, final_norm=jnp.ones_like(p["final_norm"]))
    succ = np.asarray(jnp.argmax(llama.rms_norm(emb, jnp.ones((h,)), cfg.rms_norm_eps) @ lm, -1))
    rng = np.random.default_rng(0)
    ids = np.union1d(succ, rng.choice(v, extra_vocab, replace=False))
    head = eagle3.init_eagle3_head(cfg, jax.random.PRNGKey(4), draft_ids=ids,
                                   aux_layers=aux_layers, scale=scale)
    hc = dataclasses.replace(head.config, num_heads=1, num_kv_heads=1, head_dim=h,
                             norm_before_residual=True)
    tok = emb[:, 16:] * jnp.sqrt((h - 16) / jnp.sum(emb[:, 16:] ** 2, -1, keepdims=True))
    own_embed = jnp.concatenate([jnp.ones((v, 16)), tok], axis=1)
    eye = jnp.eye(h)
    wq = jnp.zeros((2 * h, h)).at[:16, :16].set(sharp * eye[:16, :16])
    wk = jnp.zeros((2 * h, h)).at[:16, :16].set(eye[:16, :16])
    wv = jnp.zeros((2 * h, h)).at[16:h, 16:h].set(eye[16:, 16:])
    wo = jnp.zeros((h, h)).at[16:, 16:].set(eye[16:, 16:])
    layers = dict(head.params["layers"], wqkv=jnp.concatenate([wq, wk, wv], 1)[None],
                  wo=wo[None], w_down=jnp.zeros_like(head.params["layers"]["w_down"]))
    params = dict(head.params, embed=own_embed, hidden_norm=jnp.zeros((h,)), layers=layers,
                  lm_head=peak * lm[:, ids])
    return p, eagle3.Eagle3Head(params, hc)


def candidate_paths(cands, slot):
    """Drafted candidates (tokens, scores, parents) of one slot -> {token path from the root's
    child: cumulative score}, the form the step-by-step drafting references produce."""
    tok, score, par = (np.asarray(x[slot]) for x in cands)
    out = {}
    for c in range(tok.shape[0]):
        path, j = [], c
        while j >= 0:
            path.append(int(tok[j]))
            j = int(par[j])
        out[tuple(reversed(path))] = float(score[c])
    return out


def write_tiny_llama(d, vocab_size: int, context: int, bos: int, eos: int,
                     tie: bool = False):
    """config.json and model.safetensors of a 2-layer random Llama (hidden 64) in directory d,
    beside whatever tokenizer files the caller wrote there. Returns d."""
    import json

    from safetensors.numpy import save_file

    from jaxspec.config import ModelConfig
    from jaxspec.loading.common import expected_shapes

    config = dict(architectures=["LlamaForCausalLM"], model_type="llama",
                  vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=context, rms_norm_eps=1e-5, rope_theta=10000.0,
                  tie_word_embeddings=tie, bos_token_id=bos, eos_token_id=eos)
    (d / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)
    shapes = expected_shapes(ModelConfig.from_hf(config))
    save_file({n: (rng.standard_normal(s) * (1.0 if len(s) == 1 else 0.3)).astype(np.float32)
               for n, s in shapes.items()}, str(d / "model.safetensors"))
    return d
