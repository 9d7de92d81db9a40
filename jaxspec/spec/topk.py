"""Exact top-k over a wide last axis in two stages: a top-k per chunk, then one over the survivors.

Why: XLA's GPU TopK kernel (xla/service/gpu/kernels/topk_kernel.cu.h, k <= 16) runs one thread
block per row. A tree draft step asks for the top 10 of [B, K, V] = [1, 10, 128256] fp32 logits:
ten rows, so ten of an H100's 132 SMs each scan 128K elements while the rest idle. Cut into n
chunks, the same work is B*K*n rows (320 at n = 32) that fill the GPU, and the second stage is a
small top-k over n*k candidates per row.

Exactness (same values and indices as jax.lax.top_k, whose order is: larger value first, the lower
index first among equal values):
- An element among the k first of its row has fewer than k elements ahead of it, so fewer than k
  ahead of it within its own chunk: it survives the first stage, which keeps min(k, width) per
  chunk.
- The survivors are laid out chunk by chunk, each chunk's in lax.top_k order, so among equal
  values their position order is their original index order; the second lax.top_k, breaking ties
  by position, therefore ranks them as the first would have.
- Padding sits at the end of the row with the lowest value of the dtype (-inf for floats): every
  real element is ahead of every padded one (a larger value, or an equal one at a lower index),
  so with V >= k no padded index is ever returned.
All of this needs the comparator to be a consistent order. On CPU NaN sorts first and it holds;
the GPU kernel compares with `>` and `==`, which is no order once NaN is in a row, so rows holding
NaN may come out differently there (lax.top_k's own answer is then arbitrary too).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import vocab_topk as pallas_topk
from pallas_kernels._compat import on_gpu as kernels_enabled

# Chunk width bound, to be tuned on the GPU with bench/bench_draft_ops.py. At 128256 it gives 32
# chunks of 4008: 320 rows for the ten of a draft step, about 2.4 blocks per H100 SM, and 320
# survivors per row for the second stage. Widths under 65535 keep the kernel's 16-bit indices.
DEFAULT_CHUNK = 4096
# Chunk width of `top_k_by_chunk_max`: 1002 chunk maxima for 128256 (no padding), 384 for
# SmolLM2's 49152, and a final top-k over k * 128 candidates.
CHUNK_MAX_WIDTH = 128
# top_k_by_chunk_max selects by sorting above this k: XLA's GPU TopK kernel instantiates for
# k <= 8 and k <= 16, and the k <= 16 one is slow whatever the width.
SORT_MIN_K = 8
# Below this width one block per row is short work and the second launch is not worth it. Set
# under 32000 so that EAGLE-3's draft vocabulary (32000 wide, the same ten rows) is split too;
# bench_draft_ops.py --vocab 32000 measures that case.
TWO_STAGE_MIN_VOCAB = 16384
# Draft vocabularies (FR-Spec's 16,384, EAGLE-3's 32,000) at k <= SORT_MIN_K: the two-stage
# top-k in chunks of this width, faster there than the chunk maxima or lax.top_k. Wider rows
# (a full 128K vocab) keep the chunk maxima, faster at that width.
DRAFT_VOCAB_MAX = 32768
DRAFT_VOCAB_CHUNK = 1024
# Rows at most this wide take their top-k by pairwise ranks (`top_k_by_rank`): a tree's
# per-step selection of K of K*K children and its choice of N - 1 candidates, which XLA runs as
# sort kernels, several a cycle. The [..., W, W] comparisons are one fused kernel at these
# widths, faster than the sorts up to this width (a 6x10x60 tree's 510 candidates included).
RANK_MAX_WIDTH = 512
# Wide rows at 3 <= k <= 16 on the GPU: the Pallas kernel (`pallas_kernels.vocab_topk`, one
# launch or two) instead of the routes below.
PALLAS_TOP_K = True
# How top_k_by_chunk_max may take its two small top-ks (see its `small`), and how it takes
# them by default above SORT_MIN_K.
SMALL_SELECTIONS = ("rank", "sort", "top_k")
SMALL_ABOVE_MIN_K = "sort"
# Backends whose TopK the split helps. Not CPU: there lax.top_k is already a per-row partial sort
# and the split costs more than it saves.
TWO_STAGE_BACKENDS = ("gpu",)


def use_two_stage(v: int, k: int, backend: str | None = None) -> bool:
    """Whether the top-k of rows V wide goes through `top_k` rather than lax.top_k.

    backend: jax.default_backend() when None. The answer only moves time: both paths return the
    same values and indices. k == 1 stays one-stage: callers take argmax for it.
    """
    backend = jax.default_backend() if backend is None else backend
    return backend in TWO_STAGE_BACKENDS and k > 1 and v >= TWO_STAGE_MIN_VOCAB


def chunk_layout(v: int, chunk: int) -> tuple[int, int]:
    """(n chunks, width <= chunk) for a row of v.

    With m = ceil(v / chunk): the fewest n in [m, 2m) that divide v, so the row reshapes in place
    (128256 = 32 x 4008 = 64 x 2004 = 128 x 1002); failing that, m chunks of ceil(v / m), padding
    fewer than m elements. Padding is a copy of the whole row (the TopK kernel does not fuse its
    input), and padding to a multiple of `chunk` would also add up to a chunk of dead width.
    """
    if chunk < 1:
        raise ValueError(f"{chunk=} must be >= 1")
    m = -(-v // chunk)
    for n in range(m, 2 * m):
        if v % n == 0:
            return n, v // n
    return m, -(-v // m)


def _lowest(dtype):
    """The value no element of `dtype` sorts below: -inf for floats, the minimum for integers."""
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.array(-jnp.inf, dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.array(jnp.iinfo(dtype).min, dtype)
    raise TypeError(f"top_k: unsupported dtype {dtype}")


def top_k(x, k: int, *, chunk: int | None = None):
    """jax.lax.top_k(x, k) over the last axis, computed per chunk then over the survivors.

    x [..., V]; chunk: bound on the chunk width (DEFAULT_CHUNK when None), a static int.
    Returns (values [..., k] descending, indices [..., k] int32), equal to lax.top_k's.
    """
    chunk = DEFAULT_CHUNK if chunk is None else chunk
    if x.ndim == 0 or not 1 <= k <= x.shape[-1]:
        return jax.lax.top_k(x, k)                     # lax's own errors and empty results
    v = x.shape[-1]
    n, width = chunk_layout(v, chunk)
    if n == 1:
        return jax.lax.top_k(x, k)
    lead = x.shape[:-1]
    pad = n * width - v
    if pad:
        x = jnp.pad(x, [(0, 0)] * len(lead) + [(0, pad)], constant_values=_lowest(x.dtype))
    kc = min(k, width)
    # Both stages on 2-D [rows, width] (free reshapes): the form XLA's GPU TopK rewrite expects.
    vals, idx = jax.lax.top_k(x.reshape(-1, width), kc)                  # [R * n, kc]
    idx = idx.reshape(-1, n, kc) + jnp.arange(0, n * width, width, dtype=jnp.int32)[:, None]
    vals, sel = jax.lax.top_k(vals.reshape(-1, n * kc), k)                # [R, k]
    idx = jnp.take_along_axis(idx.reshape(-1, n * kc), sel, axis=-1)
    return vals.reshape(lead + (k,)), idx.reshape(lead + (k,)).astype(jnp.int32)


def _descending_key(x):
    """An integer key whose ascending order is x's descending order in lax.top_k's CPU order
    (a total order: +0.0 ahead of -0.0), ties kept as ties. Floats: the IEEE bits made
    monotone (negatives' magnitude bits flipped), then inverted. XLA's GPU TopK compares with
    `>`, so there -0.0 and +0.0 tie and the two may differ on rows holding both (as on rows
    holding NaN)."""
    if jnp.issubdtype(x.dtype, jnp.integer):
        return ~x
    bits = jnp.dtype(x.dtype).itemsize * 8
    i = jax.lax.bitcast_convert_type(x, jnp.dtype(f"int{bits}"))
    mono = i ^ ((i >> (bits - 1)) & jnp.array((1 << (bits - 1)) - 1, i.dtype))
    return ~mono


def _top_k_by_sort(x, k: int):
    """lax.top_k(x, k) of 2-D x by one stable sort of the row (for short rows, where XLA's TopK
    kernel at k in 9..16 costs tens of microseconds regardless of width)."""
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
    _, vals, idx = jax.lax.sort((_descending_key(x), x, iota), dimension=1, is_stable=True,
                                num_keys=1)
    return vals[:, :k], idx[:, :k]


def top_k_by_chunk_max(x, k: int, *, width: int | None = None, small: str | None = None):
    """jax.lax.top_k(x, k) over the last axis: only the k chunks with the largest maxima can
    hold the top k, so it reduces each `width`-wide chunk to its max, takes the top k of those,
    and runs the final top-k over the k chosen chunks alone.

    Exact, ties included: take e in the top k, in a chunk c that was not chosen. The chosen
    chunks' maxima are k elements, each ahead of e in lax.top_k's order: a larger value than e,
    or (max(c_i) == max(c) == e's value, chunk c_i chosen first, so c_i < c) an equal value at a
    lower index. Then e has k elements ahead of it and is not in the top k. The chosen chunks
    are gathered in index order, so the final top-k breaks ties by original index. Padding (the
    lowest value, at the end of the last chunk, which always holds a real element) is never
    returned. NaN as in `top_k`.

    small: how the two small top-ks (over the n chunk maxima, over the k * width candidates)
    run. "rank": pairwise ranks (`top_k_by_rank`), fused reductions with no sort kernel;
    "sort": one stable sort of the row on a total-order key; "top_k": lax.top_k, whose
    GPU kernel at k in 9..16 is slow whatever the width. None: "sort" for k > SORT_MIN_K
    (SMALL_ABOVE_MIN_K), else "top_k" (XLA's k <= 8 kernel). Ranks tie the sorts at k = 10.
    With "sort" or "rank", signed zeros follow lax.top_k's CPU order (see `_descending_key`).

    Why: XLA's TopK kernel at k <= 16 over a draft step's chunk rows is slow, where a
    max-reduction and two small selections read the row once."""
    width = CHUNK_MAX_WIDTH if width is None else width
    if x.ndim == 0 or not 1 <= k <= x.shape[-1]:
        return jax.lax.top_k(x, k)                     # lax's own errors and empty results
    v = x.shape[-1]
    n = -(-v // width)
    if n <= k:                                         # every chunk would be chosen
        return jax.lax.top_k(x, k)
    lead = x.shape[:-1]
    pad = n * width - v
    if pad:
        x = jnp.pad(x, [(0, 0)] * len(lead) + [(0, pad)], constant_values=_lowest(x.dtype))
    if small is None:
        small = SMALL_ABOVE_MIN_K if k > SORT_MIN_K else "top_k"
    if small not in SMALL_SELECTIONS:
        raise ValueError(f"{small=} must be one of {SMALL_SELECTIONS}")
    rows = x.reshape(-1, n, width)                                        # [R, n, w]
    maxima = rows.max(axis=-1)                                            # [R, n]
    if small == "rank":
        chosen, select = top_k_indices_in_order(maxima, k, by_rank=True), top_k_by_rank
    else:
        select = _top_k_by_sort if small == "sort" else jax.lax.top_k
        chosen = jnp.sort(select(maxima, k)[1], axis=-1)                  # [R, k]
    cand = jnp.take_along_axis(rows, chosen[:, :, None], axis=1)          # [R, k, w]
    vals, pos = select(cand.reshape(-1, k * width), k)                    # [R, k]
    idx = jnp.take_along_axis(chosen, pos // width, axis=-1) * width + pos % width
    return vals.reshape(lead + (k,)), idx.reshape(lead + (k,)).astype(jnp.int32)


def _top2_merge(a, b):
    """Merge two (key, index, key, index) top-2 sets into the top 2 of their four elements
    (the lesser key first, then the lower index): associative and commutative, so XLA may
    reduce in any order."""
    a1, ai1, a2, ai2 = a
    b1, bi1, b2, bi2 = b

    def ahead(k, i, k2, i2):
        return (k < k2) | ((k == k2) & (i < i2))

    a_first = ahead(a1, ai1, b1, bi1)
    f1, fi1 = jnp.where(a_first, a1, b1), jnp.where(a_first, ai1, bi1)
    # The second is the better of the loser's first and the winner's second.
    c1, ci1 = jnp.where(a_first, a2, a1), jnp.where(a_first, ai2, ai1)
    c2, ci2 = jnp.where(a_first, b1, b2), jnp.where(a_first, bi1, bi2)
    c_first = ahead(c1, ci1, c2, ci2)
    return f1, fi1, jnp.where(c_first, c1, c2), jnp.where(c_first, ci1, ci2)


def top2_by_reduce(x):
    """jax.lax.top_k(x, 2) over the last axis in one reduction pass: every element enters as
    (its `_descending_key`, its index) and `_top2_merge` keeps the best two (lax.top_k's order:
    the larger value, then the lower index). On the GPU this is one fused reduction kernel,
    several times faster than XLA's TopK kernel on a draft vocabulary's rows. Exact but for NaN
    (as in `top_k`)."""
    if x.ndim == 0 or x.shape[-1] < 2:
        return jax.lax.top_k(x, 2)                     # lax's own errors
    key = _descending_key(x)
    last = x.ndim - 1
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, last)
    worst = jnp.iinfo(key.dtype).max
    none = jnp.iinfo(jnp.int32).max
    _, i1, _, i2 = jax.lax.reduce(
        (key, iota, jnp.full_like(key, worst), jnp.full_like(iota, none)),
        (jnp.array(worst, key.dtype), jnp.int32(none), jnp.array(worst, key.dtype),
         jnp.int32(none)),
        _top2_merge, (last,))
    idx = jnp.stack([i1, i2], axis=-1)
    return jnp.take_along_axis(x, idx, axis=-1), idx


def _ranks(x):
    """[..., W] -> int32 [..., W]: each element's place in lax.top_k's order (0 = first), from
    pairwise comparisons (a [..., W, W] array: for short rows only)."""
    key = _descending_key(x)
    w = x.shape[-1]
    iota = jnp.arange(w, dtype=jnp.int32)
    ahead = ((key[..., None, :] < key[..., :, None])
             | ((key[..., None, :] == key[..., :, None]) & (iota[None, :] < iota[:, None])))
    return jnp.sum(ahead, axis=-1, dtype=jnp.int32)                    # [..., W]


def top_k_by_rank(x, k: int):
    """jax.lax.top_k(x, k) of short rows by pairwise ranks: elementwise work and sums that XLA
    fuses, where a top-k of a few dozen elements is a sort kernel of its own on the GPU. Exact
    (a total order on `_descending_key`, ties by index; NaN as in `top_k`)."""
    if x.ndim == 0 or not 1 <= k <= x.shape[-1]:
        return jax.lax.top_k(x, k)
    rank = _ranks(x)
    iota = jnp.arange(x.shape[-1], dtype=jnp.int32)
    hit = rank[..., None, :] == jnp.arange(k, dtype=jnp.int32)[:, None]    # [..., k, W]
    idx = jnp.sum(jnp.where(hit, iota, 0), axis=-1, dtype=jnp.int32)
    return jnp.take_along_axis(x, idx, axis=-1), idx


def top_k_indices_in_order(x, k: int, *, by_rank: bool | None = None):
    """int32 [..., k]: the indices of lax.top_k(x, k), ascending (the set, in index order).
    by_rank (None: rows of at most RANK_MAX_WIDTH): by pairwise ranks with no sort at all;
    otherwise by lax.top_k and a sort of the k indices."""
    by_rank = x.shape[-1] <= RANK_MAX_WIDTH if by_rank is None else by_rank
    if not by_rank or not 1 <= k <= x.shape[-1]:
        _, idx = jax.lax.top_k(x, k)
        return jnp.sort(idx.astype(jnp.int32), axis=-1)
    chosen = _ranks(x) < k                                               # [..., W]
    place = jnp.cumsum(chosen, axis=-1, dtype=jnp.int32) - 1            # its slot among them
    iota = jnp.arange(x.shape[-1], dtype=jnp.int32)
    hit = chosen[..., None, :] & (place[..., None, :] == jnp.arange(k, dtype=jnp.int32)[:, None])
    return jnp.sum(jnp.where(hit, iota, 0), axis=-1, dtype=jnp.int32)


def small_top_k(x, k: int):
    """lax.top_k(x, k) for the tree's short rows: by ranks up to RANK_MAX_WIDTH, else lax."""
    if x.shape[-1] <= RANK_MAX_WIDTH:
        return top_k_by_rank(x, k)
    return jax.lax.top_k(x, k)


def vocab_top_k_method(v: int, k: int, backend: str | None = None, dtype=jnp.float32) -> str:
    """How `vocab_top_k` selects the top k of rows V wide: "lax" (jax.lax.top_k), "top2"
    (`top2_by_reduce`: k = 2 on the GPU), "pallas" (`pallas_kernels.vocab_topk`: wide fp32 or
    bf16 rows at 3 <= k <= its MAX_K on the GPU, while PALLAS_TOP_K), "two_stage" (`top_k` in
    DRAFT_VOCAB_CHUNK-wide chunks: draft vocabularies at small k) or "chunk_max"
    (`top_k_by_chunk_max`: wide vocabularies). All give lax.top_k's result."""
    backend = jax.default_backend() if backend is None else backend
    if backend in TWO_STAGE_BACKENDS and k == 2 and v >= 2:
        return "top2"
    if not use_two_stage(v, k, backend):
        return "lax"
    if (PALLAS_TOP_K and kernels_enabled(backend) and k <= pallas_topk.MAX_K
            and jnp.dtype(dtype) in pallas_topk.DTYPES):
        return "pallas"
    return "two_stage" if v <= DRAFT_VOCAB_MAX and k <= SORT_MIN_K else "chunk_max"


def vocab_top_k(x, k: int):
    """x [..., V] -> (values, indices [..., k] int32): lax.top_k's result, by the method
    `vocab_top_k_method` picks (one reduction for k = 2 on the GPU; the Pallas kernel, or
    chunks, where a wide row's one-block-per-row TopK would leave SMs idle)."""
    method = vocab_top_k_method(x.shape[-1], k, dtype=x.dtype)
    if method == "top2":
        return top2_by_reduce(x)
    if method == "pallas":
        return pallas_topk.vocab_top_k_pallas(x, k)
    if method == "two_stage":
        return top_k(x, k, chunk=DRAFT_VOCAB_CHUNK)
    if method == "chunk_max":
        return top_k_by_chunk_max(x, k)
    return jax.lax.top_k(x, k)
