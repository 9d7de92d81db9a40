"""KV compaction: write chosen rows of a forward pass's new K/V into each slot's cache rows.

Semantics (`kv_compact_reference`): for every layer l, slot b and d < count[b],
  cache[l, b, :, seq_lens[b] + d] = new[l, b, :, src_idx[b, d]]
and nothing else changes (rows past T are dropped, never wrapped). With src_idx = 0..N-1 this is
the plain KV append of prefill/decode; after a tree verify, src_idx is the accepted path.
`slots` [B] (optional) writes row b of new into cache slot slots[b] instead (a prompt chunk of a
few requests into their slots of the whole batch's cache; slots past the cache are dropped).

Kernel (Pallas, Triton lowering): one program per (layer, slot, KV head, block of kept rows). It
gathers the kept rows of `new` and stores them into the cache rows seq_lens[b] + d with a masked
scatter; the cache is aliased input-to-output, so only the moved rows are written (no copy of the
cache). Programs whose block lies past count[b] return at once.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.head_sharding import MODEL_AXIS, model_axis_size, per_head_shard

from pallas_kernels._compat import CompilerParams as _CompilerParams
from pallas_kernels._compat import load as _load
from pallas_kernels._compat import next_pow2 as _next_pow2
from pallas_kernels._compat import on_gpu
from pallas_kernels._compat import store as _store


def _compact_one(cache, new, seq_lens, src_idx, count, slots=None):
    # cache [L, Bc, Hkv, T, D]; new [L, B, Hkv, N, D]; src_idx [B, M]; count [B]; slots [B]
    t = cache.shape[3]
    m = src_idx.shape[1]
    rows = jnp.take_along_axis(new, src_idx[None, :, None, :, None], axis=3)  # [L,B,Hkv,M,D]
    d = jnp.arange(m)[None, :]
    dst = jnp.where(d < count[:, None], seq_lens[:, None] + d, t)             # t = dropped
    slot_of = jnp.arange(cache.shape[1]) if slots is None else slots
    bidx = jnp.broadcast_to(slot_of[:, None], dst.shape)                      # Bc: dropped
    vals = jnp.transpose(rows, (1, 3, 0, 2, 4))                               # [B,M,L,Hkv,D]
    return cache.at[:, bidx, :, dst].set(vals.astype(cache.dtype), mode="drop")


@jax.jit
def kv_compact_reference(
    k_cache,   # [L, B, Hkv, T, D]
    v_cache,   # [L, B, Hkv, T, D]
    k_new,     # [L, B, Hkv, N, D]
    v_new,     # [L, B, Hkv, N, D]
    seq_lens,  # [B] int32: first destination row per slot
    src_idx,   # [B, M] int32: rows of new to keep, in order
    count,     # [B] int32: how many of src_idx are live
    slots=None,  # [B] int32: the cache slot of each row of new (None: row b is slot b)
):
    return (_compact_one(k_cache, k_new, seq_lens, src_idx, count, slots),
            _compact_one(v_cache, v_new, seq_lens, src_idx, count, slots))


def _kv_compact_kernel(
    seq_lens_ref,  # [B] int32
    src_ref,       # [B, M] int32
    count_ref,     # [B] int32
    *refs,         # with `indirect`: slots [B] int32, the cache slot of each row of new; then
                   # kn, vn [L, B, Hkv, N, D], the caches [L, Bc, Hkv, T, D] (aliased to the
                   # outputs), and the outputs kc, vc
    block_m: int,
    indirect: bool = False,
):
    # No slot map unless asked for: even a constant one costs an iota kernel per call.
    slots_ref, refs = (refs[0], refs[1:]) if indirect else (None, refs)
    kn_ref, vn_ref, _, _, kc_ref, vc_ref = refs   # the inputs' caches are the outputs' buffers
    _, cache_slots, num_kv_heads, t_max, head_dim = kc_ref.shape
    num_rows, num_new, num_src = kn_ref.shape[1], kn_ref.shape[3], src_ref.shape[1]
    lbh, j = pl.program_id(0), pl.program_id(1)
    layer = lbh // (num_rows * num_kv_heads)
    b = (lbh // num_kv_heads) % num_rows
    h = lbh % num_kv_heads
    count = count_ref[b]
    slot = b
    if indirect:   # a slot past the cache (a padding row) writes nothing
        slot = slots_ref[b]
        count = jnp.where((slot >= 0) & (slot < cache_slots), count, 0)
        slot = jnp.clip(slot, 0, cache_slots - 1)

    @pl.when(j * block_m < count)
    def _():
        d = j * block_m + jnp.arange(block_m)
        dst = seq_lens_ref[b] + d
        keep = (d < count) & (d < num_src) & (dst < t_max)
        # Index arrays on every axis (gather/scatter form): interpret mode cannot mix them with
        # slices. Dropped rows point one past the end, so interpret mode drops them too.
        src = _load(src_ref.at[b, jnp.minimum(d, num_src - 1)])
        src = jnp.clip(src, 0, num_new - 1)[:, None]
        dst = jnp.where(keep, dst, t_max)[:, None]
        col = jnp.arange(head_dim)[None, :]
        for new_ref, cache_ref in ((kn_ref, kc_ref), (vn_ref, vc_ref)):
            rows = _load(new_ref.at[layer, b, h, src, col], mask=keep[:, None], other=0)
            _store(cache_ref.at[layer, slot, h, dst, col], rows, mask=keep[:, None])


@functools.partial(jax.jit, static_argnames=("block_m", "num_warps", "interpret"),
                   donate_argnums=(0, 1))
def kv_compact_pallas(
    k_cache,   # [L, Bc, Hkv, T, D]  donated: updated in place
    v_cache,   # [L, Bc, Hkv, T, D]  donated
    k_new,     # [L, B, Hkv, N, D]
    v_new,     # [L, B, Hkv, N, D]
    seq_lens,  # [B] int32
    src_idx,   # [B, M] int32
    count,     # [B] int32
    slots=None,  # [B] int32 (None: row b is slot b, B == Bc)
    *,
    block_m: int | None = None,
    num_warps: int = 4,
    interpret: bool = False,
):
    num_layers, _, hkv, _, d = k_cache.shape
    b, m = k_new.shape[1], src_idx.shape[1]
    slot_map = () if slots is None else (slots.astype(jnp.int32),)
    assert d == _next_pow2(d), f"head dim {d=} must be a power of 2"
    block_m = block_m or min(_next_pow2(m), 32)
    kernel = functools.partial(_kv_compact_kernel, block_m=block_m, indirect=bool(slot_map))
    first_cache = 5 + len(slot_map)
    return pl.pallas_call(
        kernel,
        grid=(num_layers * b * hkv, pl.cdiv(m, block_m)),
        out_shape=[jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                   jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)],
        input_output_aliases={first_cache: 0, first_cache + 1: 1},
        compiler_params=_CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="kv_compact",
    )(seq_lens.astype(jnp.int32), src_idx.astype(jnp.int32), count.astype(jnp.int32), *slot_map,
      k_new.astype(k_cache.dtype), v_new.astype(v_cache.dtype), k_cache, v_cache)


def kv_compact(k_cache, v_cache, k_new, v_new, seq_lens, src_idx, count, slots=None):
    """Dispatch: the Pallas kernel on GPU, the reference elsewhere; under a mesh with a model
    axis, per shard of the kv heads (`head_sharding`). slots [B]: the cache slot of each row of
    new (None: row b is slot b)."""
    args = (k_cache, v_cache, k_new, v_new, seq_lens, src_idx, count)
    args += () if slots is None else (slots,)
    if model_axis_size() is not None and k_cache.shape[2] % model_axis_size() == 0:
        from jax.sharding import PartitionSpec as P
        kv, r = P(None, None, MODEL_AXIS, None, None), P()
        specs = (kv, kv, kv, kv, r, r, r, r)[:len(args)]
        return tuple(per_head_shard(_kv_compact_local, specs, (kv, kv))(*args))
    return _kv_compact_local(*args)


def _kv_compact_local(k_cache, v_cache, k_new, v_new, seq_lens, src_idx, count, slots=None):
    d = k_cache.shape[-1]
    if on_gpu() and d == _next_pow2(d) and src_idx.shape[1] > 0:
        return tuple(kv_compact_pallas(k_cache, v_cache, k_new, v_new, seq_lens, src_idx, count,
                                       slots))
    return kv_compact_reference(k_cache, v_cache, k_new, v_new, seq_lens, src_idx, count, slots)
