"""Test models for the speculative cycle: a target and an EAGLE head built to agree."""
import jax
import jax.numpy as jnp

from jaxspec.models import eagle, llama


def agreeing_pair(cfg, scale: float, lm_head_scale: float):
    """A target whose next token depends mostly on the current one (large embeddings, small
    layers of weight `scale`, unit final norm) and a head whose fc passes the token embedding
    straight through to the lm_head (its layer adds nothing): the draft usually predicts the
    target's next token, so accepts are long. Returns (target params, draft params)."""
    p = llama.init_random_params(cfg, jax.random.PRNGKey(2), scale=scale)
    p = dict(p, embed=jax.random.normal(jax.random.PRNGKey(3), p["embed"].shape),
             lm_head=lm_head_scale * jax.random.normal(jax.random.PRNGKey(7), p["lm_head"].shape),
             final_norm=jnp.ones_like(p["final_norm"]))
    h = cfg.hidden_size
    d = eagle.init_eagle_params(cfg, jax.random.PRNGKey(4), scale=scale)
    d = dict(d, fc=jnp.concatenate([jnp.eye(h), jnp.zeros((h, h))], 0), fc_bias=jnp.zeros((h,)),
             layers=dict(d["layers"], wo=jnp.zeros_like(d["layers"]["wo"]),
                         w_down=jnp.zeros_like(d["layers"]["w_down"])))
    return p, d
