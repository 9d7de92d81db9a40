"""Llama-family target model (Llama 2/3, Mistral, Qwen2, SmolLM2) as pure functions.

Params pytree (stacked over layers so a `lax.scan` runs them and the jitted call has few leaves):
  embed       [V, H]
  layers      attn_norm [L, H], wqkv [L, H, Q + 2K], bqkv [L, Q + 2K] (Qwen2 only),
              wo [L, Q, H], mlp_norm [L, H], w_gate_up [L, H, 2F], w_down [L, F, H]
  final_norm  [H]
  lm_head     [H, V] (absent when the embedding is tied)
with Q = num_heads * head_dim, K = num_kv_heads * head_dim. q/k/v and gate/up are fused so a
decode step launches fewer, larger matmuls (small models are launch-bound at batch 1).

Blocked layout (tensor parallel, `jaxspec.parallel.tensor_parallel.shard_params`): wqkv
[L, H, M, (Q + 2K) / M], bqkv [L, M, (Q + 2K) / M] and w_gate_up [L, H, M, 2F / M], where block m
holds q heads, kv heads, gate and up columns of shard m only ([q_m | k_m | v_m], [gate_m | up_m]).
With the block axis sharded over M devices each device computes whole heads and matching gate/up
columns, so no activation is resharded between the fused matmul and its split. The code below
reads both layouts; the flat one is the M = 1 case.

One forward serves prefill/extend, decode and tree verify: N new tokens per slot with explicit
positions attend to the slot's cached prefix (rows < seq_lens) and to each other under
`new_mask` [B, N, N]. The forward does not write the cache: it returns the new K/V and the caller
writes the rows it keeps (`pallas_kernels.kv_compact`), which for a tree verify is only the
accepted path.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig, layout_of
from pallas_kernels.tree_attention import split_packed, tree_attention, tree_attention_packed


def rms_norm(x, w, eps):
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * w.astype(jnp.float32)).astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """[D/2] inverse frequencies, with llama3 / linear scaling applied (numpy, static)."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    rs = cfg.rope_scaling
    if rs is None:
        return inv.astype(np.float32)
    if rs.kind == "linear":
        return (inv / rs.factor).astype(np.float32)
    # llama3: long wavelengths divided by factor, short kept, smooth blend between.
    low_wl = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wl = rs.original_max_position_embeddings / rs.high_freq_factor
    wl = 2 * np.pi / inv
    smooth = (rs.original_max_position_embeddings / wl - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor)
    blended = (1 - smooth) * inv / rs.factor + smooth * inv
    out = np.where(wl > low_wl, inv / rs.factor, np.where(wl < high_wl, inv, blended))
    return out.astype(np.float32)


def rope_tables(positions, inv_freq):
    """positions [B, N] int32 -> (cos, sin) [B, N, 1, D/2] fp32. Computed once per forward and
    shared by every layer: per layer, XLA launched a kernel each for them."""
    ang = positions.astype(jnp.float32)[..., None] * inv_freq          # [B, N, D/2]
    return jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]


def apply_rope(x, positions, inv_freq, tables=None):
    """x [B, N, H, D] (HF rotate-half layout), positions [B, N] int32; tables: rope_tables'."""
    cos, sin = rope_tables(positions, inv_freq) if tables is None else tables
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def qkv_proj(cfg, lp, x, positions, inv_freq, skip_norm=False, tables=None):
    """x [B, N, H] -> q [B, N, Hq, D], k, v [B, Hkv, N, D] (RoPE applied to q and k).

    skip_norm: EAGLE-1 draft layers feed the fc output straight in, without the input norm.
    tables: rope_tables(positions, inv_freq), when the caller shares them between layers.
    """
    if lp["wqkv"].ndim == 2:
        return split_packed(qkv_packed(cfg, lp, x, positions, inv_freq, skip_norm, tables),
                            cfg.num_heads, cfg.num_kv_heads)
    b, n, _ = x.shape
    h = x if skip_norm else rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
    qkv = _fused_matmul(h, lp["wqkv"])                                   # [B, N, M, C]
    if "bqkv" in lp:
        qkv = qkv + lp["bqkv"].reshape(qkv.shape[-2:])
    m = qkv.shape[-2]
    hq, hkv, d = cfg.num_heads // m, cfg.num_kv_heads // m, cfg.head_dim
    # q and k heads of each block rotated together: one elementwise pass instead of two.
    qk, v = jnp.split(qkv, [(cfg.q_size + cfg.kv_size) // m], axis=-1)
    qk = apply_rope(qk.reshape(b, n, m * (hq + hkv), d), positions, inv_freq, tables)
    qk = qk.reshape(b, n, m, hq + hkv, d)
    q = qk[:, :, :, :hq].reshape(b, n, cfg.num_heads, d)
    k = qk[:, :, :, hq:].reshape(b, n, cfg.num_kv_heads, d).transpose(0, 2, 1, 3)
    v = v.reshape(b, n, cfg.num_kv_heads, d).transpose(0, 2, 1, 3)
    return q, k, v


def qkv_packed(cfg, lp, x, positions, inv_freq, skip_norm=False, tables=None):
    """Flat layout: x [B, N, H] -> qkv [B, N, Hq + 2 Hkv, D], q and k heads rotated, v heads as
    projected. One elementwise kernel from the projection to what the attention kernel reads,
    where separate q, k and v took three (`tree_attention_packed`). skip_norm, tables: as in
    `qkv_proj`."""
    b, n, _ = x.shape
    h = x if skip_norm else rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
    qkv = h @ lp["wqkv"]
    if "bqkv" in lp:
        qkv = qkv + lp["bqkv"]
    d = cfg.head_dim
    qk, v = jnp.split(qkv, [cfg.q_size + cfg.kv_size], axis=-1)
    qk = apply_rope(qk.reshape(b, n, cfg.num_heads + cfg.num_kv_heads, d), positions, inv_freq,
                    tables)
    return jnp.concatenate([qk, v.reshape(b, n, cfg.num_kv_heads, d)], axis=2)


def attention_block(cfg, lp, x, positions, inv_freq, cache_k, cache_v, layer, seq_lens, new_mask,
                    skip_norm=False, tables=None, slots=None):
    """Returns (attention output [B, N, H], k_new, v_new [B, Hkv, N, D]). slots [B]: the cache
    slot of each row (None: row b is slot b)."""
    b, n, _ = x.shape
    scale = cfg.head_dim ** -0.5
    if lp["wqkv"].ndim == 2:
        qkv = qkv_packed(cfg, lp, x, positions, inv_freq, skip_norm, tables)
        o = tree_attention_packed(qkv, cache_k, cache_v, layer, seq_lens, new_mask,
                                  num_heads=cfg.num_heads, sm_scale=scale,
                                  causal=layout_of(cfg).causal_chunks,
                                  skip_before=layout_of(cfg).packed_chunks,
                                  slots=slots, live_rows=layout_of(cfg).live_rows)
        _, k, v = split_packed(qkv, cfg.num_heads, cfg.num_kv_heads)
    else:   # blocked (tensor-parallel) weights
        q, k, v = qkv_proj(cfg, lp, x, positions, inv_freq, skip_norm, tables)
        o = tree_attention(q, cache_k, cache_v, layer, seq_lens, k, v, new_mask, sm_scale=scale,
                           causal=layout_of(cfg).causal_chunks,
                           skip_before=layout_of(cfg).packed_chunks, slots=slots,
                           live_rows=layout_of(cfg).live_rows)
    return o.reshape(b, n, cfg.q_size) @ lp["wo"], k, v


def _fused_matmul(x, w):
    """x [..., H] @ w: flat [H, C] or blocked [H, M, C / M] -> [..., M, C / M] (M = 1 if flat)."""
    if w.ndim == 2:
        return (x @ w)[..., None, :]
    return jnp.einsum("...h,hmc->...mc", x, w)


def mlp_block(cfg, lp, x):
    h = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
    g, u = jnp.split(_fused_matmul(h, lp["w_gate_up"]), 2, axis=-1)      # [..., M, F / M] each
    act = jax.nn.silu(g) * u
    return act.reshape(act.shape[:-2] + (-1,)) @ lp["w_down"]


def forward(params, cfg: ModelConfig, tokens, positions, cache_k, cache_v, seq_lens, new_mask,
            capture_layers: Sequence[int] = (), slots=None):
    """Runs all layers over N new tokens per slot.

    tokens, positions [B, N] int32; cache_k/v [L, B, Hkv, T, D] (or [L, Bc, ...] with slots [B]
    naming the cache slot of each row); seq_lens [B]; new_mask [B, N, N].
    Returns (hidden [B, N, H] before the final norm, k_new, v_new [L, B, Hkv, N, D],
    captured [len(capture_layers), B, N, H] = outputs of those layers, or None).
    """
    inv_freq = jnp.asarray(rope_inv_freq(cfg))
    tables = rope_tables(positions, inv_freq)
    x = params["embed"][tokens]

    def layer_fn(x, inp):
        lp, layer = inp
        a, k, v = attention_block(cfg, lp, x, positions, inv_freq, cache_k, cache_v, layer,
                                   seq_lens, new_mask, tables=tables, slots=slots)
        x = x + a
        x = x + mlp_block(cfg, lp, x)
        return x, (k, v, x if capture_layers else None)

    if layout_of(cfg).unroll_layers or isinstance(params["layers"], (list, tuple)):
        ys = [None] * cfg.num_layers
        for i in range(cfg.num_layers):
            lp = layer_slice(params["layers"], i)
            x, ys[i] = layer_fn(x, (lp, jnp.int32(i)))
        k_new, v_new = jnp.stack([y[0] for y in ys]), jnp.stack([y[1] for y in ys])
        # only the chosen layers' outputs are stacked (an [L, B, N, H] stack is large at 8B)
        captured = jnp.stack([ys[i][2] for i in capture_layers]) if capture_layers else None
    else:
        layers = (params["layers"], jnp.arange(cfg.num_layers, dtype=jnp.int32))
        x, (k_new, v_new, outs) = jax.lax.scan(layer_fn, x, layers,
                                               unroll=min(layout_of(cfg).scan_unroll,
                                                          cfg.num_layers))
        captured = outs[jnp.asarray(capture_layers)] if capture_layers else None
    return x, k_new, v_new, captured


def final_norm(params, cfg: ModelConfig, hidden):
    """hidden [..., H] from `forward` -> the normed state the lm_head reads (EAGLE-1's feature)."""
    return rms_norm(hidden, params["final_norm"], cfg.rms_norm_eps)


def project_logits(params, normed):
    """normed [..., H] -> fp32 logits [..., V] (the lm_head alone, as EAGLE-1 drafts use it)."""
    w = params["lm_head"] if "lm_head" in params else params["embed"].T
    return jnp.dot(normed, w.astype(normed.dtype), preferred_element_type=jnp.float32)


def lm_head(params, cfg: ModelConfig, hidden):
    """hidden [..., H] (before the final norm) -> fp32 logits [..., V]."""
    return project_logits(params, final_norm(params, cfg, hidden))


def causal_mask(batch: int, n: int, n_valid=None):
    """[B, N, N] lower-triangular mask; keys past n_valid[b] are hidden (padding)."""
    m = jnp.tril(jnp.ones((n, n), dtype=bool))[None]
    if n_valid is not None:
        m = m & (jnp.arange(n)[None, None, :] < n_valid[:, None, None])
    return jnp.broadcast_to(m, (batch, n, n))


def init_random_params(cfg: ModelConfig, key, dtype=jnp.float32, scale=0.02):
    """Random params of the layout above (tests and shape benchmarks)."""
    h, f, l = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    qkv = cfg.q_size + 2 * cfg.kv_size
    ks = iter(jax.random.split(key, 16))

    def rnd(shape):  # drawn in the target dtype: an 8B model in fp32 would not fit beside it
        return (scale * jax.random.normal(next(ks), shape, dtype)).astype(dtype)

    layers = {
        "attn_norm": (1.0 + rnd((l, h))).astype(dtype), "wqkv": rnd((l, h, qkv)),
        "wo": rnd((l, cfg.q_size, h)), "mlp_norm": (1.0 + rnd((l, h))).astype(dtype),
        "w_gate_up": rnd((l, h, 2 * f)), "w_down": rnd((l, f, h)),
    }
    if cfg.attention_bias:
        layers["bqkv"] = rnd((l, qkv))
    params = {"embed": rnd((cfg.vocab_size, h)), "layers": layers,
              "final_norm": (1.0 + rnd((h,))).astype(dtype)}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = rnd((h, cfg.vocab_size))
    return params


def layer_slice(layers, i: int):
    """Layer i's params from the stacked layout (static slices) or a per-layer list."""
    if isinstance(layers, (list, tuple)):
        return layers[i]
    return jax.tree_util.tree_map(lambda a: a[i], layers)


def unstack_layers(params):
    """Stacked layer params -> a list of per-layer dicts (the unrolled layout)."""
    layers = params["layers"]
    n = jax.tree_util.tree_leaves(layers)[0].shape[0]
    return {**params, "layers": [jax.tree_util.tree_map(lambda a: a[i], layers) for i in range(n)]}
