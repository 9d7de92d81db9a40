"""Attention of N new (tree) query tokens over a slot's cached prefix plus the N new keys.

Semantics (`tree_attention_reference`): for slot b, query n attends to cache rows t < seq_lens[b]
of layer `layer` (and t >= window_start[b, n] with a sliding window), and to new keys m with
tree_mask[b, n, m] (which holds the window for them). GQA: query head h reads KV head
h // (Hq // Hkv). Scores soft-capped (cap * tanh(s / cap)) where `softcap` is given, before the
mask. Softmax in fp32.

Kernel (Pallas, Triton lowering), flash-decoding style:
  * one program per (row block, prefix split, slot * KV head). The rows of a tile are the N tree
    queries times the G query heads of one KV head (row r = n * G + g), so each KV block is loaded
    once for all of them;
  * the live prefix of slot b (rows < seq_lens[b]) is cut into `num_splits` equal chunks at run
    time, so a short slot costs short loops and batch 1 with a long prefix still fills the GPU.
    The loop is bounded by seq_lens[b]: rows past it are never loaded. `default_config` sizes
    the splits (about 512 keys each). With a sliding window the live prefix starts at the key
    block of the earliest row a tile's queries see: rows before every query's window are never
    loaded either;
  * split 0 also attends to the N new keys under the tree mask (one new key, decoding's, by
    a vector step rather than a key block: `_vector_step`);
  * each program writes an unnormalised partial (o, running max m, sum l); a second Pallas
    kernel merges the splits in one pass (log-sum-exp in base 2) and writes the final layout.
On Hopper, tiles of 64-1024 rows over long prefixes (`mosaic_serves`) take their prefix from
`prefix_attention_mgpu` (Mosaic GPU, wgmma), and with trees of up to 64 tokens their tree part
too (one launch, or two with the combine). For larger trees this kernel skips the prefix and
either merges that kernel's split partials itself before the tree part (2 splits or fewer) or
leaves them with its tree part to the combine pass.
The cache is passed whole and the layer is indexed inside the kernel: slicing it outside would
materialise a copy of the layer. For the same reason the queries' slots may be a subset of the
cache's: `slots` [B] names the cache slot of each query row (a prompt chunk of a few requests
attends to their slots of the whole batch's cache, with no gather of those slots' caches).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import prefix_attention_mgpu as pm
from pallas_kernels.backend_rule import mosaic_serves, mosaic_splits
from pallas_kernels.head_sharding import MODEL_AXIS, model_axis_size, per_head_shard

_LOG2E = 1.4426950408889634
# Split-K sizing (default_config): keys per split, programs wanted for short prefixes, and the
# cap for wide row tiles (2 per SM on the H100's 132).
_SPLIT_KEYS = 512
_MIN_PROGRAMS = 64
_WIDE_TILE_PROGRAMS = 264
# Small KV heads (kv heads x head dim) whose short prefixes one program reads alone (below).
_SMALL_KV_WIDTH = 256
# Decode tiles of at most this many programs before splitting (one slot of 8 wide KV heads)
# take their split count from the wave, not from the keys per split.
_ONE_SLOT_PROGRAMS = 8
_LONG_PREFIX = 8192   # one wave from here up; shorter caches keep the keys-per-split rule
# The Triton kernel beside Mosaic's prefix (its tree part, after one split or beside the
# combine): 64-row tiles of 4 warps, lighter than the prefix's 128-row, 8-warp tiles for that
# short loop; merging two splits' partials as well keeps the prefix's tile, which does it faster.
_MOSAIC_TREE_TILE = (64, 4)
# Up to this many Mosaic splits the tree kernel merges them itself (B >= 8: one launch fewer);
# more (batch 1) go to the combine pass, whose programs have all the splits' loads in flight.
_FUSED_MERGE_SPLITS = 2
# Trees of up to this many tokens go into the Mosaic kernel as one more key block, under their
# mask as an additive bias tile (8 KB a warpgroup: a 128-key tile would overflow shared memory
# with two warpgroups), which saves the Triton kernel's launch; larger ones keep its tree part.
_MOSAIC_TREE_KEYS = 64
# Heads wider than 128 (Gemma's 256): row tiles of at most 64 rows over 32-key blocks in two
# stages, so that the fp32 accumulator stays in registers and the K/V ring in shared memory.
_WIDE_HEAD_TILE = (64, 32)
# fp32 caches: row tiles of at most this many rows by head dim (`_launch`).
_FP32_WIDE_ROWS = {128: 64, 256: 32}


from pallas_kernels._compat import MASK_VALUE  # noqa: F401  (ta.MASK_VALUE for callers)
from pallas_kernels._compat import CompilerParams as _CompilerParams
from pallas_kernels._compat import load as _load
from pallas_kernels._compat import next_pow2 as _next_pow2
from pallas_kernels._compat import on_gpu
from pallas_kernels._compat import store as _store


@functools.partial(jax.jit, static_argnames=("sm_scale", "softcap"))
def tree_attention_reference(
    q,          # [B, N, Hq, D]
    k_cache,    # [L, B, Hkv, T, D]
    v_cache,    # [L, B, Hkv, T, D]
    layer,      # int32 scalar: which layer of the cache
    seq_lens,   # [B] int32: live prefix rows per slot
    k_new,      # [B, Hkv, N, D]
    v_new,      # [B, Hkv, N, D]
    tree_mask,  # [B, N, N] bool: query n may see new key m
    sm_scale: float,
    slots=None,  # [B] int32: the cache slot of each query row (None: row b is slot b)
    window_start=None,  # [B, N] int32: the first cache row query n sees (None: row 0)
    softcap=None,       # scores -> softcap * tanh(scores / softcap) (None: as they are)
):
    b, n, hq, d = q.shape
    hkv, t = k_cache.shape[2], k_cache.shape[3]
    g = hq // hkv
    kc = jax.lax.dynamic_index_in_dim(k_cache, layer, 0, keepdims=False)  # [Bc, Hkv, T, D]
    vc = jax.lax.dynamic_index_in_dim(v_cache, layer, 0, keepdims=False)
    if slots is not None:                                                 # -> [B, Hkv, T, D]
        kc = jnp.take(kc, slots, axis=0, mode="clip")
        vc = jnp.take(vc, slots, axis=0, mode="clip")
    qg = q.reshape(b, n, hkv, g, d).astype(jnp.float32) * sm_scale
    s_pre = _capped(jnp.einsum("bnhgd,bhtd->bhgnt", qg, kc.astype(jnp.float32)), softcap)
    if window_start is None:
        live = jnp.arange(t)[None, :] < seq_lens[:, None]                 # [B, T]
        s_pre = jnp.where(live[:, None, None, None, :], s_pre, MASK_VALUE)
    else:
        rows = jnp.arange(t)[None, None, :]
        live = (rows < seq_lens[:, None, None]) & (rows >= window_start[:, :, None])  # [B, N, T]
        s_pre = jnp.where(live[:, None, None, :, :], s_pre, MASK_VALUE)
    s_new = _capped(jnp.einsum("bnhgd,bhmd->bhgnm", qg, k_new.astype(jnp.float32)), softcap)
    s_new = jnp.where(tree_mask[:, None, None, :, :], s_new, MASK_VALUE)
    s = jnp.concatenate([s_pre, s_new], axis=-1)
    p = jax.nn.softmax(s, axis=-1)
    o = (jnp.einsum("bhgnt,bhtd->bnhgd", p[..., :t], vc.astype(jnp.float32))
         + jnp.einsum("bhgnm,bhmd->bnhgd", p[..., t:], v_new.astype(jnp.float32)))
    return o.reshape(b, n, hq, d).astype(q.dtype)


def _capped(s, softcap):
    """Scores soft-capped: softcap * tanh(s / softcap) (None or 0: s). In base-2 units too, with
    softcap in those units."""
    return s if not softcap else softcap * jnp.tanh(s / softcap)


def _flash_step(q, k, v, valid, carry, scale_log2, softcap=0.0):
    """One online-softmax step over a key block; `valid` [rows, keys] or broadcastable.
    softcap: the soft-cap in base-2 units (the natural one times log2 e; 0: none)."""
    o, m, l = carry
    prec = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    s = jnp.dot(q, k.T, preferred_element_type=jnp.float32, precision=prec) * scale_log2
    s = jnp.where(valid, _capped(s, softcap), MASK_VALUE)
    m_next = jnp.maximum(m, s.max(axis=-1))
    corr = jnp.exp2(m - m_next)
    p = jnp.exp2(s - m_next[:, None])
    l_next = corr * l + p.sum(axis=-1)
    o_next = corr[:, None] * o + jnp.dot(p.astype(v.dtype), v,
                                         preferred_element_type=jnp.float32, precision=prec)
    return o_next, m_next, l_next


def _vector_step(q, k, v, seen, carry, scale_log2, softcap=0.0):
    """`_flash_step` over one key: k, v [D], seen a scalar bool. Products and sums on the
    vector units: a 16-row dot's block costs a decode tile about as much as a prefix block
    (its layout changes and barriers), for one key. Decoding (N == 1) takes it."""
    o, m, l = carry
    f32 = jnp.float32
    s = jnp.sum(q.astype(f32) * k.astype(f32)[None, :], axis=1) * scale_log2
    s = jnp.where(seen, _capped(s, softcap), MASK_VALUE)
    m_next = jnp.maximum(m, s)
    corr, p = jnp.exp2(m - m_next), jnp.exp2(s - m_next)
    return corr[:, None] * o + p[:, None] * v.astype(f32)[None, :], m_next, corr * l + p


def _store_rows(out_ref, o, b, h, r, live, group, col0=0):
    """Store rows r = n * G + g of KV head h to out[b, n, h * G + g, col0:] (final layout)."""
    col = col0 + jnp.arange(o.shape[-1])[None, :]
    n, g = r // group, r % group
    _store(out_ref.at[b, n[:, None], (h * group + g)[:, None], col], o.astype(out_ref.dtype),
           mask=live[:, None])


def _tree_attention_kernel(
    layer_ref,     # [1] int32
    seq_lens_ref,  # [B] int32
    *refs,         # with `indirect`: slots [B] int32, the cache slot of each query row; with
                   # `windowed`: window_start [B, N] int32, each query's first cache row; then
                   # q [B, Hkv, R, D] (rows r = n * G + g; packed: qkv [B, N, Hq + 2 Hkv, D]),
                   # k, v [L, Bc, Hkv, T, D], kn, vn [B, Hkv, N, D] (packed: the same qkv),
                   # mask [B, N, N] int8; with `merge_in`: the prefix's split partials
                   # po [BH, S', R', D], pm, pl [BH, S', R'] (R' >= R); then the outputs:
                   # S == 1: out [B, N, Hq, D]; else o [BH, S, R, D], m, l [BH, S, R] (f32)
    scale_log2: float,
    num_kv_heads: int,
    num_splits: int,
    group: int,
    num_new: int,
    block_r: int,
    block_k: int,
    block_n: int,
    packed: bool = False,
    causal: bool = False,
    skip_before: bool = False,
    indirect: bool = False,
    merge_in: bool = False,
    new_only: bool = False,
    windowed: bool = False,
    softcap: float = 0.0,
):
    # No slot map unless asked for: even a constant one costs an iota kernel per call.
    slots_ref, refs = (refs[0], refs[1:]) if indirect else (None, refs)
    window_ref, refs = (refs[0], refs[1:]) if windowed else (None, refs)
    q_ref, k_ref, v_ref, kn_ref, vn_ref, mask_ref = refs[:6]
    out_refs = refs[9:] if merge_in else refs[6:]
    rb, split, bh = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    b, h = bh // num_kv_heads, bh % num_kv_heads
    t_max = k_ref.shape[3]
    num_rows = num_new * group
    layer = layer_ref[0]
    slot = jnp.clip(slots_ref[b], 0, k_ref.shape[1] - 1) if indirect else b
    seq_len = jnp.clip(seq_lens_ref[b], 0, t_max)

    # Inputs are not padded to the block sizes: loads past the end are masked instead (no extra
    # XLA pad ops around the kernel, which cost as much as the kernel at batch 1).
    r = rb * block_r + jnp.arange(block_r)
    row_live = r < num_rows
    rows = pl.ds(rb * block_r, block_r)
    # This split's share of the live prefix, a whole number of key blocks.
    if windowed:   # row r's window starts at its query's row; the tile's earliest bounds the loop
        lo = _load(window_ref.at[b, jnp.minimum(r // group, num_new - 1)])
        first = jnp.clip(jnp.min(jnp.where(row_live, lo, t_max)), 0, seq_len)
        first = (first // block_k) * block_k     # the first live prefix row, a block's first
        chunk = pl.cdiv(pl.cdiv(seq_len - first, num_splits), block_k) * block_k
        start = first + split * chunk
    else:
        chunk = pl.cdiv(pl.cdiv(seq_len, num_splits), block_k) * block_k
        start = split * chunk
    end = jnp.minimum(start + chunk, seq_len)
    num_blocks = pl.cdiv(jnp.maximum(end - start, 0), block_k)
    head_dim = k_ref.shape[-1]
    if packed:   # row r is query head h * G + g of token n = r // G
        n_of_r = jnp.minimum(r // group, num_new - 1)[:, None]
        q = _load(q_ref.at[b, n_of_r, (h * group + r % group)[:, None],
                           jnp.arange(head_dim)[None, :]], mask=row_live[:, None], other=0.0)
    else:
        q = _load(q_ref.at[b, h, rows, :], mask=row_live[:, None], other=0.0)
    carry = (jnp.zeros((block_r, head_dim), jnp.float32),
             jnp.full((block_r,), MASK_VALUE, jnp.float32),
             jnp.zeros((block_r,), jnp.float32))
    key_iota = jnp.arange(block_k)

    def prefix_body(i, carry):
        t0 = start + i * block_k
        live = (t0 + key_iota) < end
        k = _load(k_ref.at[layer, slot, h, pl.ds(t0, block_k), :], mask=live[:, None],
                  other=0.0)
        v = _load(v_ref.at[layer, slot, h, pl.ds(t0, block_k), :], mask=live[:, None],
                  other=0.0)
        valid = live[None, :]
        if windowed:
            valid = valid & ((t0 + key_iota)[None, :] >= lo[:, None])
        return _flash_step(q, k, v, valid, carry, scale_log2, softcap)

    if merge_in:   # the prefix was done by another kernel: start from its merged splits
        carry = _merge_partials(*refs[6:9], bh, rows, row_live)
    elif not new_only:   # (new_only: the prefix's partials are merged by the combine pass)
        carry = lax.fori_loop(0, num_blocks, prefix_body, carry)

    # Rows past the last query read the last query's mask row; they are never stored.
    query = jnp.minimum(r // group, num_new - 1)
    new_iota = jnp.arange(block_n)
    kh = num_kv_heads * group + h   # packed: k heads follow the Hq query heads, v heads the k's

    def block_body(j, carry):
        m0 = j * block_n
        key_live = (m0 + new_iota) < num_new
        if packed:
            k = _load(kn_ref.at[b, pl.ds(m0, block_n), kh, :], mask=key_live[:, None], other=0.0)
            v = _load(vn_ref.at[b, pl.ds(m0, block_n), kh + num_kv_heads, :],
                      mask=key_live[:, None], other=0.0)
        else:
            k = _load(kn_ref.at[b, h, pl.ds(m0, block_n), :], mask=key_live[:, None], other=0.0)
            v = _load(vn_ref.at[b, h, pl.ds(m0, block_n), :], mask=key_live[:, None], other=0.0)
        # Index arrays on both axes (a gather): interpret mode cannot mix them with slices.
        cols = jnp.minimum(m0 + new_iota, num_new - 1)
        allowed = _load(mask_ref.at[b, query[:, None], cols[None, :]]) != 0
        return _flash_step(q, k, v, allowed & key_live[None, :], carry, scale_log2, softcap)

    def vector_body(j, carry):   # num_new == 1: one key, one value row, one mask bit
        k, v = ((kn_ref[b, 0, kh, :], vn_ref[b, 0, kh + num_kv_heads, :]) if packed
                else (kn_ref[b, h, 0, :], vn_ref[b, h, 0, :]))
        return _vector_step(q, k, v, mask_ref[b, 0, 0] != 0, carry, scale_log2, softcap)

    new_body = vector_body if num_new == 1 else block_body

    # Explicit int32: a select of two Python ints lowered to i1 under the Triton backend.
    num_new_blocks = (split == 0).astype(jnp.int32) * jnp.int32(pl.cdiv(num_new, block_n))
    if causal:   # no query sees a later key: stop after the block holding this block's last query
        last_query = jnp.minimum((rb * block_r + block_r - 1) // group, num_new - 1)
        num_new_blocks = jnp.minimum(num_new_blocks, last_query // block_n + 1)
    first_block = jnp.int32(0)
    if skip_before:   # start at the block holding the first key this block's first query sees
        first_query = jnp.minimum((rb * block_r) // group, num_new - 1)
        all_cols = jnp.arange(_next_pow2(num_new))
        row = _load(mask_ref.at[b, jnp.full((1,), first_query)[:, None],
                                jnp.minimum(all_cols, num_new - 1)[None, :]])
        seen = (row[0] != 0) & (all_cols < num_new)
        first_block = jnp.min(jnp.where(seen, all_cols, num_new - 1)) // block_n
        # At least one block on split 0: a row that sees no key at all (a padding row) must
        # still come out finite, as it does when every block is visited.
        first_block = jnp.minimum(first_block, jnp.maximum(num_new_blocks - 1, 0))
    o, m, l = lax.fori_loop(first_block, num_new_blocks, new_body, carry)

    if num_splits == 1 and not new_only:  # No combine: normalise, write the final layout.
        _store_rows(out_refs[0], o / l[:, None], b, h, r, row_live, group)
    else:
        o_ref, m_ref, l_ref = out_refs
        _store(o_ref.at[bh, split, rows, :], o, mask=row_live[:, None])
        _store(m_ref.at[bh, split, rows], m, mask=row_live)
        _store(l_ref.at[bh, split, rows], l, mask=row_live)


def _merge_partials(po_ref, pm_ref, pl_ref, bh, rows, row_live):
    """(o, m, l) of the row block `rows` (a pl.ds of block_r rows; row_live [block_r]) of KV
    head bh merged over the splits of partials po [BH, S, R', D], pm, pl [BH, S, R'], one split
    at a time (the running max as in `_flash_step`); the carry `_tree_attention_kernel`
    continues from. Whole-block loads: an index-array gather of the same rows cost more."""
    def body(sp, carry):
        o, m, l = carry
        m_s = _load(pm_ref.at[bh, sp, rows], mask=row_live, other=MASK_VALUE)
        l_s = _load(pl_ref.at[bh, sp, rows], mask=row_live, other=0.0)
        o_s = _load(po_ref.at[bh, sp, rows, :], mask=row_live[:, None], other=0.0)
        m_next = jnp.maximum(m, m_s)
        a, w = jnp.exp2(m - m_next), jnp.exp2(m_s - m_next)
        return a[:, None] * o + w[:, None] * o_s, m_next, a * l + w * l_s

    block_r, head_dim = row_live.shape[0], po_ref.shape[-1]
    carry = (jnp.zeros((block_r, head_dim), jnp.float32),
             jnp.full((block_r,), MASK_VALUE, jnp.float32), jnp.zeros((block_r,), jnp.float32))
    return lax.fori_loop(0, pm_ref.shape[1], body, carry)


def _combine_kernel(
    o_ref,     # [BH, S, R, D] f32, unnormalised partials
    m_ref,     # [BH, S, R] f32
    l_ref,     # [BH, S, R] f32
    *refs,     # with `extra`: the tree part's o2 [BH, 1, R, D], m2, l2 [BH, 1, R]; then
               # out [B, N, Hq, D]
    extra: bool = False,
    num_kv_heads: int,
    group: int,
    block_r: int,
    block_s: int,
    block_d: int,
):
    """Merge the splits' partial softmaxes (base-2 log-sum-exp) into the final layout.

    One program per (slot * KV head, row block, head-dim block): at batch 1 a program per
    (b, h) alone left 8 programs to do all the loads, a few us of latency per call. The splits
    are read `block_s` at a time as one [block_s, block_r, block_d] gather, merged with a running
    max in one pass, so with block_s >= num_splits every load of the program is in flight at once.
    With `extra` the merge starts from the tree part's partial (the prefix's splits by Mosaic
    GPU may have more rows, padding, than R: only rows < R are read).
    """
    out_ref = refs[-1]
    bh, rb, db = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    b, h = bh // num_kv_heads, bh % num_kv_heads
    num_splits, num_rows = m_ref.shape[1], out_ref.shape[1] * group   # N * G
    r = rb * block_r + jnp.arange(block_r)
    row_live = r < num_rows
    rr = jnp.minimum(r, num_rows - 1)[None, :]
    col = db * block_d + jnp.arange(block_d)[None, None, :]

    def body(c, carry):
        acc, den, m_run = carry
        s = c * block_s + jnp.arange(block_s)
        live = (s < num_splits)[:, None] & row_live[None, :]
        s = jnp.minimum(s, num_splits - 1)[:, None]
        m = _load(m_ref.at[bh, s, rr], mask=live, other=MASK_VALUE)
        l = _load(l_ref.at[bh, s, rr], mask=live, other=0.0)
        o = _load(o_ref.at[bh, s[:, :, None], rr[:, :, None], col], mask=live[:, :, None],
                  other=0.0)
        m_next = jnp.maximum(m_run, m.max(axis=0))
        corr = jnp.exp2(m_run - m_next)
        w = jnp.where(live, jnp.exp2(m - m_next[None, :]), 0.0)
        return (corr[:, None] * acc + (w[:, :, None] * o).sum(axis=0),
                corr * den + (w * l).sum(axis=0), m_next)

    carry = (jnp.zeros((block_r, block_d), jnp.float32), jnp.zeros((block_r,), jnp.float32),
             jnp.full((block_r,), MASK_VALUE, jnp.float32))
    if extra:
        o2_ref, m2_ref, l2_ref = refs[:3]
        r2 = rr[0]
        carry = (_load(o2_ref.at[bh, 0, r2[:, None], col[0]], mask=row_live[:, None],
                       other=0.0),
                 _load(l2_ref.at[bh, 0, r2], mask=row_live, other=0.0),
                 _load(m2_ref.at[bh, 0, r2], mask=row_live, other=MASK_VALUE))
    acc, den, _ = lax.fori_loop(0, pl.cdiv(num_splits, block_s), body, carry)
    den = jnp.where(row_live, den, 1.0)
    _store_rows(out_ref, acc / den[:, None], b, h, r, row_live, group, db * block_d)


def combine_config(rows, head_dim, num_splits, num_heads_total=1):
    """(block_r, block_d, block_s) of the combine: a [block_s, block_r, block_d] f32 tile of at
    most 8K elements (64 registers a thread at 4 warps). The head dim is cut in 32-wide blocks
    only while B * Hkv row blocks leave SMs idle: at batch 64 the extra programs cost more than
    they hide."""
    block_r = min(_next_pow2(rows), 16)   # no dot here, so G rows at N == 1 are fine
    programs = num_heads_total * pl.cdiv(rows, block_r)
    block_d = min(32, head_dim) if programs < _WIDE_TILE_PROGRAMS else head_dim
    block_s = max(1, min(_next_pow2(num_splits), 8192 // (block_r * block_d)))
    return block_r, block_d, block_s


def default_config(batch, num_new, num_q_heads, num_kv_heads, head_dim, cache_len):
    """Static block sizes for a shape: (block_r, block_k, num_splits, num_warps, num_stages).

    Splits: about 512 keys of the cache per split, at least 64 programs while a split keeps 4
    key blocks (short prefixes at batch 1); one slot of wide heads at N = 1 fills one wave of 2
    programs per SM, and tiles of more than 16 rows no more than 2 programs per SM, in one wave
    (each split's partials of 64+ rows, written then merged, cost more than the extra
    parallelism gives).
    """
    rows = num_new * (num_q_heads // num_kv_heads)
    # Up to 128 rows per tile: fewer re-reads of each KV block than 64-row tiles, and larger
    # dots. Heads wider than 128 halve the tile (`_WIDE_HEAD_TILE`).
    block_r = min(max(16, _next_pow2(rows)), 128 if head_dim <= 128 else _WIDE_HEAD_TILE[0])
    block_k = 64
    programs = batch * num_kv_heads * pl.cdiv(rows, block_r)
    by_length = pl.cdiv(cache_len, _SPLIT_KEYS)
    fill = min(pl.cdiv(_MIN_PROGRAMS, programs), cache_len // (4 * block_k))
    num_splits = max(1, by_length, fill)
    if rows > 16:   # whole waves: a second, partial wave costs nearly a whole one
        num_splits = max(1, min(num_splits, _WIDE_TILE_PROGRAMS // programs))
    elif (programs <= _ONE_SLOT_PROGRAMS and num_kv_heads * head_dim > _SMALL_KV_WIDTH
          and cache_len >= _LONG_PREFIX):
        # One slot of wide heads decoding a long prefix: one wave of 2 programs per SM, while a
        # split keeps 4 key blocks (fewer splits leave SMs idle, more add a second wave).
        num_splits = min(_WIDE_TILE_PROGRAMS // programs, cache_len // (4 * block_k))
    num_warps = 4 if block_r <= 32 else 8
    if (rows <= 16 and programs < _MIN_PROGRAMS and cache_len <= _SPLIT_KEYS
            and num_kv_heads * head_dim <= _SMALL_KV_WIDTH):
        # Decode-like tiles over a few small heads and at most 512 keys (SmolLM2 at batch 1):
        # one split of 128-key blocks and no combine kernel, whose launch costs more than the
        # splits save on so little work. Wider heads keep the rule.
        block_k, num_splits = 128, 1
    if head_dim > 128:
        return block_r, min(block_k, _WIDE_HEAD_TILE[1]), num_splits, num_warps, 2
    return block_r, block_k, num_splits, num_warps, 3


_TUNING = ("block_r", "block_k", "block_n", "num_splits", "num_warps", "num_stages",
           "interpret", "causal", "skip_before", "live_rows", "backend", "mosaic_ring",
           "mosaic_profile", "softcap")


@functools.partial(jax.jit, static_argnames=("sm_scale",) + _TUNING)
def tree_attention_pallas(
    q,          # [B, N, Hq, D]
    k_cache,    # [L, B, Hkv, T, D]
    v_cache,    # [L, B, Hkv, T, D]
    layer,      # int32 scalar
    seq_lens,   # [B] int32
    k_new,      # [B, Hkv, N, D]
    v_new,      # [B, Hkv, N, D]
    tree_mask,  # [B, N, N] bool
    slots=None,  # [B] int32 cache slot of each row (None: row b is slot b)
    window_start=None,  # [B, N] int32 first cache row of each query (None: row 0)
    *,
    sm_scale: float,
    **tuning,
):
    b, n, hq, d = q.shape
    hkv = k_cache.shape[2]
    assert hq % hkv == 0, f"{hq=} must be a multiple of {hkv=}"
    return _launch(_query_rows(q, hkv), k_cache, v_cache, layer, seq_lens,
                   k_new.astype(k_cache.dtype), v_new.astype(v_cache.dtype), tree_mask,
                   (b, n, hq, d), q.dtype, slots, window_start, sm_scale=sm_scale, packed=False,
                   **tuning)


@functools.partial(jax.jit, static_argnames=("num_heads", "sm_scale") + _TUNING)
def tree_attention_packed_pallas(qkv, k_cache, v_cache, layer, seq_lens, tree_mask, slots=None,
                                 window_start=None, *, num_heads: int, sm_scale: float,
                                 **tuning):
    """`tree_attention_packed` by the kernel, which reads q, k_new and v_new out of qkv itself:
    no slice or transpose kernel between the projection and the attention."""
    b, n, heads, d = qkv.shape
    hkv = k_cache.shape[2]
    assert heads == num_heads + 2 * hkv and num_heads % hkv == 0, (
        f"qkv holds {heads} heads; expected {num_heads} query + 2 x {hkv} KV heads")
    qkv = qkv.astype(k_cache.dtype)
    return _launch(qkv, k_cache, v_cache, layer, seq_lens, qkv, qkv, tree_mask,
                   (b, n, num_heads, d), k_cache.dtype, slots, window_start, sm_scale=sm_scale,
                   packed=True, **tuning)


def _query_rows(q, num_kv_heads):
    """q [B, N, Hq, D] -> [B, Hkv, N * G, D], rows r = n * G + g of each KV head (a bitcast when
    N == 1; q is small next to the cache)."""
    b, n, hq, d = q.shape
    g = hq // num_kv_heads
    return q.reshape(b, n, num_kv_heads, g, d).transpose(0, 2, 1, 3, 4).reshape(
        b, num_kv_heads, n * g, d)


def _launch(q_in, k_cache, v_cache, layer, seq_lens, kn_in, vn_in, tree_mask, q_shape, dtype,
            slots, window_start=None, *,
            sm_scale: float, packed: bool, block_r=None, block_k=None, block_n=None,
            num_splits=None, num_warps=None, num_stages=None, interpret=False, causal=False,
            skip_before=False, live_rows=0, backend=None, mosaic_ring=None, mosaic_profile="",
            softcap=None):
    """The attention kernel (and the combine when split) for queries of q_shape [B, N, Hq, D].
    causal: the caller's masks never let a query see a later new key (prompt chunks, packs):
    each row block stops at its last query's key block instead of visiting them all.
    skip_before: the first key a query sees never moves back from one query to the next (packs
    of prompts laid end to end): each row block starts at the key block its first query first
    sees (one mask row read per program) instead of at key 0.
    live_rows: no slot's prefix is longer while this program runs (0: the cache's length); the
    default split count is sized for it. Only speed depends on it.
    backend: "triton", "mosaic" (the prefix by `prefix_attention_mgpu`, and the tree part too up
    to `_MOSAIC_TREE_KEYS` tokens), or None: `mosaic_serves` decides.
    mosaic_ring: (keys a block, ring slots) of the Mosaic kernel (None: its defaults).
    mosaic_profile: a directory for the Mosaic kernel's timelines (`prefix_partials_mgpu`'s
    `profile`; device only).
    window_start [B, N]: each query's first cache row (a sliding window); softcap: scores
    soft-capped. Either takes the Triton kernel (Mosaic's has neither)."""
    b, n, hq, d = q_shape
    hkv = k_cache.shape[2]
    t = k_cache.shape[3]
    assert d == _next_pow2(d) and d >= 16, f"head dim {d=} must be a power of 2 >= 16"
    g = hq // hkv
    rows = n * g
    live_len = min(t, live_rows) if live_rows else t
    cfg = default_config(b, n, hq, hkv, d, live_len)
    if jnp.dtype(k_cache.dtype).itemsize > 2 and d >= 128:
        # 4-byte tiles (fp32 caches): fewer rows and two stages keep q and the K/V ring inside
        # shared memory, which the 16-bit tiles of these head dims fill.
        cfg = (min(cfg[0], _FP32_WIDE_ROWS[d]), cfg[1], cfg[2], cfg[3], 2)
    plain = window_start is None and not softcap
    if backend == "mosaic" and not plain:
        raise ValueError("the Mosaic prefix kernel takes no sliding window or soft-cap")
    mosaic = backend == "mosaic" or (backend is None and plain and mosaic_serves(
        rows, live_len, t, d, dtype, batch=b))
    if mosaic:
        ring = mosaic_ring or (pm.BLOCK_KV, pm.STEPS)
        num_splits = num_splits or mosaic_splits(b, hkv, rows, live_len, ring[0])
        if num_splits == 1 or num_splits > _FUSED_MERGE_SPLITS:   # (see _MOSAIC_TREE_TILE)
            cfg = (_MOSAIC_TREE_TILE[0], cfg[1], cfg[2], _MOSAIC_TREE_TILE[1], cfg[4])
    block_r = block_r or cfg[0]
    block_k = block_k or cfg[1]
    num_warps = num_warps or cfg[3]
    num_stages = num_stages or cfg[4]
    # Causal chunks take 128-key blocks: half the loop trips.
    block_n = block_n or (128 if causal and n >= 128 else min(64, max(16, _next_pow2(n))))
    assert block_r == _next_pow2(block_r) and block_k == _next_pow2(block_k), (
        f"{block_r=} and {block_k=} must be powers of 2")
    layer = jnp.reshape(layer, (1,)).astype(jnp.int32)
    kernel = functools.partial(
        _tree_attention_kernel, scale_log2=sm_scale * _LOG2E, num_kv_heads=hkv, group=g,
        num_new=n, block_r=block_r, block_k=block_k, block_n=block_n, packed=packed,
        causal=causal, skip_before=skip_before, indirect=slots is not None,
        windowed=window_start is not None, softcap=(softcap or 0.0) * _LOG2E)
    slot_map = () if slots is None else (slots.astype(jnp.int32),)
    window = () if window_start is None else (window_start.astype(jnp.int32),)
    operands = (layer, seq_lens.astype(jnp.int32), *slot_map, *window, q_in, k_cache, v_cache,
                kn_in, vn_in, tree_mask.astype(jnp.int8))
    params = _CompilerParams(num_warps=num_warps, num_stages=num_stages)
    if mosaic:
        tree_split = pm.tree_split_pays(b, hkv, pm.padded_rows(rows), live_len, num_splits,
                                        ring[0])
        return _launch_mosaic(kernel, operands, q_in, k_cache, v_cache, layer, seq_lens, slots,
                              q_shape, dtype, packed=packed, block_r=block_r, params=params,
                              num_splits=num_splits, sm_scale=sm_scale, interpret=interpret,
                              kn_in=kn_in, vn_in=vn_in, tree_mask=tree_mask, ring=ring,
                              tree_split=tree_split, profile=mosaic_profile)
    f32 = jnp.float32
    num_splits = num_splits or cfg[2]
    out_shape = jax.ShapeDtypeStruct(q_shape, dtype)
    if num_splits > 1:
        out_shape = [jax.ShapeDtypeStruct((b * hkv, num_splits, rows, d), f32),
                     jax.ShapeDtypeStruct((b * hkv, num_splits, rows), f32),
                     jax.ShapeDtypeStruct((b * hkv, num_splits, rows), f32)]
    out = pl.pallas_call(
        functools.partial(kernel, num_splits=num_splits),
        grid=(pl.cdiv(rows, block_r), num_splits, b * hkv),
        out_shape=out_shape,
        compiler_params=params,
        interpret=interpret,
        name="tree_attention",
    )(*operands)
    if num_splits == 1:
        return out
    return _combine(out, (), q_shape, dtype, hkv, interpret)


def _launch_mosaic(kernel, operands, q_in, k_cache, v_cache, layer, seq_lens, slots, q_shape,
                   dtype, *, packed, block_r, params, num_splits, sm_scale, interpret,
                   kn_in, vn_in, tree_mask, ring, tree_split, profile):
    """`_launch` with the prefix's splits by Mosaic GPU (`prefix_attention_mgpu`). Trees of up
    to `_MOSAIC_TREE_KEYS` tokens go into that kernel too (then one launch, or two with the
    combine over several splits), their keys and values after the query rows in one array (so
    XLA builds the kernel's inputs from the projection in one fusion) and, where `tree_split`,
    as a split of their own; larger ones take `kernel` (the Triton kernel, configured) for the
    tree part, which with few splits merges the prefix's splits too."""
    b, n, hq, d = q_shape
    hkv = k_cache.shape[2]
    rows = n * (hq // hkv)
    q_rows = _query_rows(q_in[:, :, :hq], hkv) if packed else q_in
    pad = pm.padded_rows(rows) - rows   # whole warpgroup tiles; padding rows are never read
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, pad), (0, 0))) if pad else q_rows
    bias = None
    if n <= _MOSAIC_TREE_KEYS:   # one fusion gathers and pads the rows, keys and values
        kn, vn, bias = _mosaic_tree_operands(kn_in, vn_in, tree_mask, q_shape, hkv, rows + pad,
                                             packed, k_cache.dtype)
        q_rows = jnp.concatenate([q_rows.astype(k_cache.dtype), kn, vn], axis=2)
    prefix = pm.prefix_partials_mgpu(q_rows, k_cache, v_cache, layer, seq_lens, slots, bias,
                                     scale_log2=sm_scale * _LOG2E, num_splits=num_splits,
                                     block_kv=ring[0], steps=ring[1],
                                     tree_split=tree_split and bias is not None,
                                     profile=profile, interpret=interpret)
    if not isinstance(prefix, (tuple, list)):   # normalised rows [B * Hkv, R', D]
        o = prefix[:, :rows].reshape(b, hkv, n, hq // hkv, d)
        return o.transpose(0, 2, 1, 3, 4).reshape(q_shape).astype(dtype)
    if bias is not None:
        return _combine(prefix, (), q_shape, dtype, hkv, interpret)
    grid = (pl.cdiv(rows, block_r), 1, b * hkv)
    if num_splits <= _FUSED_MERGE_SPLITS:   # the Triton kernel merges them before the tree part
        return pl.pallas_call(
            functools.partial(kernel, num_splits=1, merge_in=True), grid=grid,
            out_shape=jax.ShapeDtypeStruct(q_shape, dtype), compiler_params=params,
            interpret=interpret, name="tree_attention_merge",
        )(*operands, *prefix)
    # Many splits (small batches): the tree part alone, then the combine's wide merge.
    f32 = jnp.float32
    tree_part = pl.pallas_call(
        functools.partial(kernel, num_splits=1, new_only=True), grid=grid,
        out_shape=[jax.ShapeDtypeStruct((b * hkv, 1, rows, d), f32),
                   jax.ShapeDtypeStruct((b * hkv, 1, rows), f32),
                   jax.ShapeDtypeStruct((b * hkv, 1, rows), f32)],
        compiler_params=params, interpret=interpret, name="tree_attention_new",
    )(*operands)
    return _combine(prefix, tree_part, q_shape, dtype, hkv, interpret)


def _mosaic_tree_operands(kn_in, vn_in, tree_mask, q_shape, num_kv_heads, padded_rows, packed,
                          dtype):
    """The tree's keys and values [B, Hkv, NT, D] (NT = `_MOSAIC_TREE_KEYS`, zero rows past N)
    and its mask as an additive bias [B, R', NT] (row r = n * G + g reads mask row n; 0 where
    seen, MASK_VALUE elsewhere and on the padding rows), for `prefix_partials_mgpu`'s
    tree_bias (the keys and values go after the query rows)."""
    b, n, hq, d = q_shape
    if packed:   # both are the same qkv [B, N, Hq + 2 Hkv, D]
        _, kn_in, vn_in = split_packed(kn_in, hq, num_kv_heads)
    keys = ((0, 0), (0, 0), (0, _MOSAIC_TREE_KEYS - n), (0, 0))
    kn, vn = jnp.pad(kn_in, keys).astype(dtype), jnp.pad(vn_in, keys).astype(dtype)
    seen = jnp.repeat(tree_mask.astype(bool), hq // num_kv_heads, axis=1)        # [B, R, N]
    bias = jnp.where(seen, 0.0, MASK_VALUE).astype(dtype)
    bias = jnp.pad(bias, ((0, 0), (0, padded_rows - n * (hq // num_kv_heads)),
                          (0, _MOSAIC_TREE_KEYS - n)), constant_values=MASK_VALUE)
    return kn, vn, bias


def _combine(partials, extra, q_shape, dtype, num_kv_heads, interpret):
    """Merge the splits' partials [BH, S, R', D], [BH, S, R'] x 2 (and `extra`, the tree part's
    [BH, 1, R, D], [BH, 1, R] x 2) into q_shape's layout [B, N, Hq, D] (R = N * G <= R')."""
    b, n, hq, d = q_shape
    g = hq // num_kv_heads
    num_splits = partials[1].shape[1]
    combine_r, combine_d, block_s = combine_config(n * g, d, num_splits, b * num_kv_heads)
    combine = functools.partial(_combine_kernel, num_kv_heads=num_kv_heads, group=g,
                                block_r=combine_r, block_s=block_s, block_d=combine_d,
                                extra=bool(extra))
    return pl.pallas_call(
        combine,
        grid=(b * num_kv_heads, pl.cdiv(n * g, combine_r), d // combine_d),
        out_shape=jax.ShapeDtypeStruct(q_shape, dtype),
        compiler_params=_CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="tree_attention_combine",
    )(*partials, *extra)


def kernel_supported(q, k_cache) -> bool:
    """Shapes the kernel is built and checked for; the reference covers the rest."""
    d = q.shape[-1]
    return (on_gpu() and d in (64, 128, 256)
            and q.shape[2] % k_cache.shape[2] == 0 and q.shape[1] <= 4096
            and k_cache.dtype == q.dtype)


def tree_attention(q, k_cache, v_cache, layer, seq_lens, k_new, v_new, tree_mask, *, sm_scale,
                   causal: bool = False, skip_before: bool = False, slots=None,
                   live_rows: int = 0, window_start=None, softcap=None):
    """Dispatch: the Pallas kernel on GPU, the reference elsewhere; under a mesh with a model
    axis, per shard of the heads (`head_sharding`). causal: the masks never let a query see a
    later new key (the kernel skips those key blocks; the reference computes the same);
    skip_before: nor a key before the first one the previous query sees (packs). slots [B]:
    the cache slot of each query row (None: row b is slot b). live_rows: the longest prefix
    while this runs (0: not known), which sizes the kernel's splits. window_start [B, N]: the
    first cache row each query sees (a sliding window; tree_mask holds it for the new keys).
    softcap: scores -> softcap * tanh(scores / softcap) before the mask (Gemma 2)."""
    kw = dict(sm_scale=sm_scale, causal=causal, skip_before=skip_before, live_rows=live_rows,
              softcap=softcap)
    if model_axis_size() is not None and k_cache.shape[2] % model_axis_size() == 0:
        from jax.sharding import PartitionSpec as P
        h, r = MODEL_AXIS, P()
        kv, new = P(None, None, h, None, None), P(None, h, None, None)
        extra = {k: x for k, x in (("slots", slots), ("window_start", window_start))
                 if x is not None}

        def fn(*a):
            return _tree_attention_local(*a[:8], **dict(zip(extra, a[8:])), **kw)

        args = (q, k_cache, v_cache, layer, seq_lens, k_new, v_new, tree_mask, *extra.values())
        specs = (P(None, None, h, None), kv, kv, r, r, new, new, r) + (r,) * len(extra)
        return per_head_shard(fn, specs, P(None, None, h, None))(*args)
    return _tree_attention_local(q, k_cache, v_cache, layer, seq_lens, k_new, v_new, tree_mask,
                                 slots, window_start, **kw)


def _tree_attention_local(q, k_cache, v_cache, layer, seq_lens, k_new, v_new, tree_mask,
                          slots=None, window_start=None, *, sm_scale, causal=False,
                          skip_before=False, live_rows=0, softcap=None):
    if kernel_supported(q, k_cache):
        return tree_attention_pallas(q, k_cache, v_cache, layer, seq_lens, k_new, v_new,
                                     tree_mask, slots, window_start, sm_scale=sm_scale,
                                     causal=causal, skip_before=skip_before, live_rows=live_rows,
                                     softcap=softcap)
    return tree_attention_reference(q, k_cache, v_cache, layer, seq_lens, k_new, v_new,
                                    tree_mask, sm_scale=sm_scale, slots=slots,
                                    window_start=window_start, softcap=softcap)


def split_packed(qkv, num_heads: int, num_kv_heads: int):
    """qkv [B, N, Hq + 2 Hkv, D] -> q [B, N, Hq, D], k, v [B, Hkv, N, D]."""
    q = qkv[:, :, :num_heads]
    k = qkv[:, :, num_heads:num_heads + num_kv_heads].transpose(0, 2, 1, 3)
    v = qkv[:, :, num_heads + num_kv_heads:].transpose(0, 2, 1, 3)
    return q, k, v


def tree_attention_packed(qkv, k_cache, v_cache, layer, seq_lens, tree_mask, *, num_heads,
                          sm_scale, causal: bool = False, skip_before: bool = False, slots=None,
                          live_rows: int = 0, window_start=None, softcap=None):
    """`tree_attention` with q, k_new and v_new packed in one array, qkv [B, N, Hq + 2 Hkv, D]
    (query heads, then KV heads' keys, then their values), as a fused projection gives them.
    On the GPU the kernel reads them in place; elsewhere, or under a model mesh, they are split
    and `tree_attention` runs."""
    kw = dict(sm_scale=sm_scale, causal=causal, skip_before=skip_before, live_rows=live_rows,
              softcap=softcap)
    if model_axis_size() is None:
        kv_heads = k_cache.shape[2]
        probe = jax.ShapeDtypeStruct(qkv.shape[:2] + (num_heads, qkv.shape[-1]), qkv.dtype)
        if kernel_supported(probe, k_cache) and qkv.shape[2] == num_heads + 2 * kv_heads:
            return tree_attention_packed_pallas(qkv, k_cache, v_cache, layer, seq_lens,
                                                tree_mask, slots, window_start,
                                                num_heads=num_heads, **kw)
    q, k, v = split_packed(qkv, num_heads, k_cache.shape[2])
    return tree_attention(q, k_cache, v_cache, layer, seq_lens, k, v, tree_mask, slots=slots,
                          window_start=window_start, **kw)
