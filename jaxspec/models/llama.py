"""Decoder-only target models as pure functions: Llama 2/3 (SmolLM2), Mistral, Qwen2, Qwen3,
Gemma 2 and Gemma 3 (text), one forward for all of them.

Params pytree (stacked over layers so a `lax.scan` runs them and the jitted call has few leaves):
  embed       [V, H]
  layers      attn_norm [L, H], wqkv [L, H, Q + 2K], bqkv [L, Q + 2K] (Qwen2 only),
              wo [L, Q, H], mlp_norm [L, H], w_gate_up [L, H, 2F], w_down [L, F, H];
              q_norm, k_norm [L, D] (Qwen3, Gemma 3: RMSNorm of each q and k head before RoPE);
              post_attn_norm, post_mlp_norm [L, H] (Gemma: norms of the attention's and the
              MLP's outputs before their residual adds)
  final_norm  [H]
  lm_head     [H, V] (absent when the embedding is tied)
with Q = num_heads * head_dim, K = num_kv_heads * head_dim. q/k/v and gate/up are fused so a
decode step launches fewer, larger matmuls (small models are launch-bound at batch 1). The
optional layer params are applied where present, so an EAGLE head's layer (which has none) runs
through the same functions. Family features without params come from the config
(`ModelConfig`: norm weight offset, embedding scale, activation, query scale, sliding windows
and their RoPE base, soft-capping); their defaults are Llama's and compile to nothing.

Sliding-window layers (Mistral, Gemma) mask: a query at position p sees cache rows and new keys
at positions > p - window (cache row t holds position t). The cache keeps every row of every
layer (no ring buffer); the attention kernel skips the key blocks before a window.

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

from jaxspec.config import ModelConfig, layout_of
from jaxspec.models.rope import apply_rope, rope_inv_freq, rope_tables  # noqa: F401 (re-export)
from pallas_kernels import allreduce_mgpu
from pallas_kernels.tree_attention import split_packed, tree_attention, tree_attention_packed


def rms_norm(x, w, eps, offset: float = 0.0):
    """RMSNorm over the last axis in fp32, scaled by (offset + w) (Gemma's norms: offset 1)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    wf = w.astype(jnp.float32)
    return (xf * (wf + offset if offset else wf)).astype(x.dtype)


def norm(cfg: ModelConfig, x, w):
    """The model's RMSNorm of x with weight w (its eps and weight offset)."""
    return rms_norm(x, w, cfg.rms_norm_eps, cfg.norm_weight_offset)


def _qk_norm(cfg, lp, qk, heads_q: int, heads_k: int, blocks: int = 1):
    """qk [..., M * (Hq/M + Hkv/M), D] (per block m its q heads, then its k heads) with q_norm
    and k_norm applied per head, where the layer has them."""
    if "q_norm" not in lp:
        return qk
    d = qk.shape[-1]
    w = jnp.concatenate([jnp.broadcast_to(lp["q_norm"], (heads_q // blocks, d)),
                         jnp.broadcast_to(lp["k_norm"], (heads_k // blocks, d))])
    return norm(cfg, qk, jnp.tile(w, (blocks, 1)) if blocks > 1 else w)


def qkv_proj(cfg, lp, x, positions, inv_freq, skip_norm=False, tables=None):
    """x [B, N, H] -> q [B, N, Hq, D], k, v [B, Hkv, N, D] (RoPE applied to q and k).

    skip_norm: EAGLE-1 draft layers feed the fc output straight in, without the input norm.
    tables: rope_tables(positions, inv_freq), when the caller shares them between layers.
    """
    if lp["wqkv"].ndim == 2:
        return split_packed(qkv_packed(cfg, lp, x, positions, inv_freq, skip_norm, tables),
                            cfg.num_heads, cfg.num_kv_heads)
    b, n, _ = x.shape
    h = x if skip_norm else norm(cfg, x, lp["attn_norm"])
    qkv = _fused_matmul(h, lp["wqkv"])                                   # [B, N, M, C]
    if "bqkv" in lp:
        qkv = qkv + lp["bqkv"].reshape(qkv.shape[-2:])
    m = qkv.shape[-2]
    hq, hkv, d = cfg.num_heads // m, cfg.num_kv_heads // m, cfg.head_dim
    # q and k heads of each block rotated together: one elementwise pass instead of two.
    qk, v = jnp.split(qkv, [(cfg.q_size + cfg.kv_size) // m], axis=-1)
    qk = _qk_norm(cfg, lp, qk.reshape(b, n, m * (hq + hkv), d), cfg.num_heads,
                  cfg.num_kv_heads, m)
    qk = apply_rope(qk, positions, inv_freq, tables)
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
    h = x if skip_norm else norm(cfg, x, lp["attn_norm"])
    qkv = h @ lp["wqkv"]
    if "bqkv" in lp:
        qkv = qkv + lp["bqkv"]
    d = cfg.head_dim
    qk, v = jnp.split(qkv, [cfg.q_size + cfg.kv_size], axis=-1)
    qk = _qk_norm(cfg, lp, qk.reshape(b, n, cfg.num_heads + cfg.num_kv_heads, d),
                  cfg.num_heads, cfg.num_kv_heads)
    qk = apply_rope(qk, positions, inv_freq, tables)
    return jnp.concatenate([qk, v.reshape(b, n, cfg.num_kv_heads, d)], axis=2)


def attention_block(cfg, lp, x, positions, inv_freq, cache_k, cache_v, layer, seq_lens, new_mask,
                    skip_norm=False, tables=None, slots=None, window_start=None):
    """Returns (attention output [B, N, H], k_new, v_new [B, Hkv, N, D]). slots [B]: the cache
    slot of each row (None: row b is slot b). window_start [B, N]: the first cache row each
    query sees (a sliding window's; None: row 0); new_mask then holds the window too."""
    b, n, _ = x.shape
    lay = layout_of(cfg)
    kw = dict(sm_scale=cfg.attn_scale, causal=lay.causal_chunks, skip_before=lay.packed_chunks,
              slots=slots, live_rows=lay.live_rows)
    if window_start is not None:
        kw["window_start"] = window_start
    if cfg.attn_logit_softcap is not None:
        kw["softcap"] = cfg.attn_logit_softcap
    if lp["wqkv"].ndim == 2:
        qkv = qkv_packed(cfg, lp, x, positions, inv_freq, skip_norm, tables)
        o = tree_attention_packed(qkv, cache_k, cache_v, layer, seq_lens, new_mask,
                                  num_heads=cfg.num_heads, **kw)
        _, k, v = split_packed(qkv, cfg.num_heads, cfg.num_kv_heads)
    else:   # blocked (tensor-parallel) weights
        q, k, v = qkv_proj(cfg, lp, x, positions, inv_freq, skip_norm, tables)
        o = tree_attention(q, cache_k, cache_v, layer, seq_lens, k, v, new_mask, **kw)
    out = o.reshape(b, n, cfg.q_size) @ lp["wo"]
    if "post_attn_norm" in lp:
        out = norm(cfg, out, lp["post_attn_norm"])
    return out, k, v


def _fused_matmul(x, w):
    """x [..., H] @ w: flat [H, C] or blocked [H, M, C / M] -> [..., M, C / M] (M = 1 if flat)."""
    if w.ndim == 2:
        return (x @ w)[..., None, :]
    return jnp.einsum("...h,hmc->...mc", x, w)


def _mlp(cfg, h, w_gate_up, w_down):
    """h [..., H] normed -> the gated MLP's output [..., H] before any post-norm."""
    g, u = jnp.split(_fused_matmul(h, w_gate_up), 2, axis=-1)      # [..., M, F / M] each
    gate = (jax.nn.gelu(g, approximate=True) if cfg.hidden_act == "gelu_tanh"
            else jax.nn.silu(g))
    act = gate * u
    return act.reshape(act.shape[:-2] + (-1,)) @ w_down


def _mlp_over_shards(cfg, h, w_gate_up, w_down, m: int):
    """`_mlp` with its weights split over the context mesh's `allreduce_mgpu.AXIS` (size m):
    each device runs its F / m columns of w_gate_up [H, M, 2F / M] and rows of w_down, and the
    partial sums meet in `allreduce_mgpu.allreduce` (the one-shot kernel where it serves)."""
    from jax.sharding import PartitionSpec as P
    axis = allreduce_mgpu.AXIS

    def local(h, wgu, wd):
        return allreduce_mgpu.allreduce(_mlp(cfg, h, wgu, wd), axis, m)
    return jax.shard_map(local, in_specs=(P(), P(None, axis, None), P(axis, None)),
                         out_specs=P(), check_vma=False)(h, w_gate_up, w_down)


def mlp_block(cfg, lp, x):
    """x [..., H] -> the gated MLP's output [..., H] (normed after, where the layer says)."""
    h = norm(cfg, x, lp["mlp_norm"])
    m = allreduce_mgpu.axis_size()
    if m:
        out = _mlp_over_shards(cfg, h, lp["w_gate_up"], lp["w_down"], m)
    else:
        out = _mlp(cfg, h, lp["w_gate_up"], lp["w_down"])
    if "post_mlp_norm" in lp:
        out = norm(cfg, out, lp["post_mlp_norm"])
    return out


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
    sliding = cfg.window_layers
    windowed = any(sliding)
    if windowed:   # what a sliding layer attends with instead: computed once for all of them
        local = dict(tables=tables, window_start=window_start(cfg, positions),
                     mask=window_mask(cfg, positions, new_mask))
        if cfg.rope_local_theta is not None:
            local["tables"] = rope_tables(positions, jnp.asarray(rope_inv_freq(cfg, local=True)))
        full = dict(tables=tables, window_start=jnp.zeros_like(positions), mask=new_mask)
    x = embed(params, cfg, tokens)

    def layer_fn(x, inp):
        lp, layer, slide = inp   # slide: a Python bool, a traced one, or None (no windows)
        kind = dict(tables=tables, window_start=None, mask=new_mask)
        if slide is True:
            kind = local
        elif slide is not None and slide is not False:   # traced: this layer's kind
            kind = jax.tree_util.tree_map(lambda a, b: jnp.where(slide, a, b), local, full)
        a, k, v = attention_block(cfg, lp, x, positions, inv_freq, cache_k, cache_v, layer,
                                  seq_lens, kind["mask"], tables=kind["tables"], slots=slots,
                                  window_start=kind["window_start"])
        x = x + a
        x = x + mlp_block(cfg, lp, x)
        return x, (k, v, x if capture_layers else None)

    # Layers all of one kind run it as a constant; mixed ones (Gemma) pick per layer in a scan.
    uniform = all(sliding) or not windowed
    if layout_of(cfg).unroll_layers or isinstance(params["layers"], (list, tuple)):
        ys = [None] * cfg.num_layers
        for i in range(cfg.num_layers):
            lp = layer_slice(params["layers"], i)
            x, ys[i] = layer_fn(x, (lp, jnp.int32(i), sliding[i] if windowed else None))
        k_new, v_new = jnp.stack([y[0] for y in ys]), jnp.stack([y[1] for y in ys])
        # only the chosen layers' outputs are stacked (an [L, B, N, H] stack is large at 8B)
        captured = jnp.stack([ys[i][2] for i in capture_layers]) if capture_layers else None
    else:
        idx = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        if uniform:
            slide = True if windowed else None
            body = lambda x, inp: layer_fn(x, (*inp, slide))  # noqa: E731
            layers = (params["layers"], idx)
        else:
            body, layers = layer_fn, (params["layers"], idx, jnp.asarray(sliding))
        x, (k_new, v_new, outs) = jax.lax.scan(body, x, layers,
                                               unroll=min(layout_of(cfg).scan_unroll,
                                                          cfg.num_layers))
        captured = outs[jnp.asarray(capture_layers)] if capture_layers else None
    return x, k_new, v_new, captured


def embed(params, cfg: ModelConfig, tokens):
    """tokens [B, N] -> [B, N, H]: embedding rows, times the config's scale in their dtype
    (Gemma's sqrt(H), rounded to the weights' dtype as HF does)."""
    x = params["embed"][tokens]
    if cfg.embed_scale != 1.0:
        x = x * jnp.asarray(cfg.embed_scale, x.dtype)
    return x


def window_start(cfg: ModelConfig, positions):
    """positions [B, N] -> [B, N] the first cache row each query sees through the sliding
    window: keys at positions > p - window (HF's convention), row t holding position t."""
    return jnp.maximum(positions - (cfg.sliding_window - 1), 0).astype(jnp.int32)


def window_mask(cfg: ModelConfig, positions, new_mask):
    """new_mask [B, N, N] restricted to new keys inside each query's sliding window."""
    dist = positions[:, :, None] - positions[:, None, :]
    return new_mask & (dist < cfg.sliding_window)


def final_norm(params, cfg: ModelConfig, hidden):
    """hidden [..., H] from `forward` -> the normed state the lm_head reads (EAGLE-1's feature)."""
    return norm(cfg, hidden, params["final_norm"])


def project_logits(params, normed, cfg: ModelConfig = None):
    """normed [..., H] -> fp32 logits [..., V] (the lm_head alone, as EAGLE-1 drafts use it);
    with cfg, soft-capped where the model is (`final_logit_softcap`)."""
    w = params["lm_head"] if "lm_head" in params else params["embed"].T
    logits = jnp.dot(normed, w.astype(normed.dtype), preferred_element_type=jnp.float32)
    cap = None if cfg is None else cfg.final_logit_softcap
    return logits if cap is None else cap * jnp.tanh(logits / cap)


def lm_head(params, cfg: ModelConfig, hidden):
    """hidden [..., H] (before the final norm) -> fp32 logits [..., V]."""
    return project_logits(params, final_norm(params, cfg, hidden), cfg)


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
    if cfg.qk_norm:
        layers["q_norm"] = (1.0 + rnd((l, cfg.head_dim))).astype(dtype)
        layers["k_norm"] = (1.0 + rnd((l, cfg.head_dim))).astype(dtype)
    if cfg.sandwich_norms:
        layers["post_attn_norm"] = (1.0 + rnd((l, h))).astype(dtype)
        layers["post_mlp_norm"] = (1.0 + rnd((l, h))).astype(dtype)
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
