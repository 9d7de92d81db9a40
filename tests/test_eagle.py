"""EAGLE-1 draft head: layout and the layer's math against a direct formulation."""
import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.models import eagle, llama

CFG = ModelConfig(arch="LlamaForCausalLM", vocab_size=101, hidden_size=32, intermediate_size=48,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)


def test_layout():
    d = eagle.init_eagle_params(CFG, jax.random.PRNGKey(0))
    assert d["fc"].shape == (64, 32) and d["fc_bias"].shape == (32,)
    lay = d["layers"]
    assert lay["wqkv"].shape == (1, 32, CFG.q_size + 2 * CFG.kv_size)
    assert lay["w_gate_up"].shape == (1, 32, 96) and lay["w_down"].shape == (1, 48, 32)
    assert "embed" not in d and "lm_head" not in d   # shared with the target


def _direct(params, d, tokens, feats, positions):
    """fc(concat(embed, feature)) -> attention without input norm (causal, GQA, RoPE) -> MLP with
    its post-attention norm -> target lm_head without a final norm. One slot, no cache."""
    lp = jax.tree_util.tree_map(lambda a: a[0], d["layers"])
    x = jnp.concatenate([params["embed"][tokens], feats], -1) @ d["fc"] + d["fc_bias"]
    n = x.shape[0]
    q, k, v = jnp.split(x @ lp["wqkv"], [CFG.q_size, CFG.q_size + CFG.kv_size], -1)
    inv = jnp.asarray(llama.rope_inv_freq(CFG))
    q = llama.apply_rope(q.reshape(1, n, CFG.num_heads, CFG.head_dim), positions[None], inv)[0]
    k = llama.apply_rope(k.reshape(1, n, CFG.num_kv_heads, CFG.head_dim), positions[None], inv)[0]
    v = v.reshape(n, CFG.num_kv_heads, CFG.head_dim)
    g = CFG.num_heads // CFG.num_kv_heads
    k, v = jnp.repeat(k, g, axis=1), jnp.repeat(v, g, axis=1)
    s = jnp.einsum("nhd,mhd->hnm", q, k) / np.sqrt(CFG.head_dim)
    s = jnp.where(jnp.tril(jnp.ones((n, n), bool))[None], s, -1e30)
    o = jnp.einsum("hnm,mhd->nhd", jax.nn.softmax(s, -1), v).reshape(n, CFG.q_size)
    h = x + o @ lp["wo"]
    hn = llama.rms_norm(h, lp["mlp_norm"], CFG.rms_norm_eps)
    gg, u = jnp.split(hn @ lp["w_gate_up"], 2, -1)
    h = h + (jax.nn.silu(gg) * u) @ lp["w_down"]
    return h, h @ params["lm_head"]


def test_forward_matches_direct_formulation():
    params = llama.init_random_params(CFG, jax.random.PRNGKey(1), scale=0.3)
    d = eagle.init_eagle_params(CFG, jax.random.PRNGKey(2), scale=0.3)
    d["layers"]["attn_norm"] = d["layers"]["attn_norm"] * 7.0   # must be ignored
    n = 6
    toks = jax.random.randint(jax.random.PRNGKey(3), (n,), 0, CFG.vocab_size)
    feats = jax.random.normal(jax.random.PRNGKey(4), (n, CFG.hidden_size))
    pos = jnp.arange(n, dtype=jnp.int32) + 3
    empty = jnp.zeros((1, 1, CFG.num_kv_heads, 8, CFG.head_dim))
    hid, k, v = eagle.forward(params, d, CFG, toks[None], feats[None], pos[None], empty, empty,
                              jnp.zeros((1,), jnp.int32), llama.causal_mask(1, n))
    ref_h, ref_logits = _direct(params, d, toks, feats, pos)
    np.testing.assert_allclose(hid[0], ref_h, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(eagle.logits(params, hid)[0], ref_logits, rtol=1e-4, atol=1e-4)
    assert k.shape == (1, 1, CFG.num_kv_heads, n, CFG.head_dim)


def test_cached_rows_equal_one_pass():
    """Rows written to the draft cache then attended equal the same rows in one pass."""
    params = llama.init_random_params(CFG, jax.random.PRNGKey(5), scale=0.3)
    d = eagle.init_eagle_params(CFG, jax.random.PRNGKey(6), scale=0.3)
    n, split = 7, 4
    toks = jax.random.randint(jax.random.PRNGKey(7), (1, n), 0, CFG.vocab_size)
    feats = jax.random.normal(jax.random.PRNGKey(8), (1, n, CFG.hidden_size))
    pos = jnp.arange(n, dtype=jnp.int32)[None]
    cache = jnp.zeros((1, 1, CFG.num_kv_heads, 16, CFG.head_dim))
    zero = jnp.zeros((1,), jnp.int32)
    full, _, _ = eagle.forward(params, d, CFG, toks, feats, pos, cache, cache, zero,
                               llama.causal_mask(1, n))
    _, k, v = eagle.forward(params, d, CFG, toks[:, :split], feats[:, :split], pos[:, :split],
                            cache, cache, zero, llama.causal_mask(1, split))
    ck = cache.at[:, :, :, :split].set(k)
    cv = cache.at[:, :, :, :split].set(v)
    rest, _, _ = eagle.forward(params, d, CFG, toks[:, split:], feats[:, split:], pos[:, split:],
                               ck, cv, jnp.array([split], jnp.int32),
                               llama.causal_mask(1, n - split))
    np.testing.assert_allclose(rest[0], full[0, split:], rtol=1e-4, atol=1e-5)
