"""Which Pallas GPU backend serves a tree-attention tile: the Triton kernel, or Mosaic GPU's
prefix kernel (`prefix_attention_mgpu`) on Hopper, by the rule measured on the H200
(bench/RESULTS.md, thirty-seventh, forty-third and forty-fifth sets; bench/KERNELS.md) with one
exception the H100 measured (fifty-eighth set). Pure Python: the rule is tested on any machine
with `prefix_attention_mgpu.on_hopper` (and `device_kind`) patched.
"""
from __future__ import annotations

import jax.numpy as jnp

from jaxspec import envs
from pallas_kernels import prefix_attention_mgpu as pm

# Tiles of this many rows per KV head take Mosaic GPU's prefix kernel on Hopper: from one
# warpgroup's 64 (N >= 16 at G = 4) up to tree sizes; prompt chunks keep the Triton kernel,
# which was measured for them (causal bounds, packs).
_MOSAIC_ROWS = (64, 1024)
# ... over prefixes of at least this many rows (live_rows, else the cache's length): from 8K on
# it won or tied at every batch (H200: 1.01-1.31x at batch 1, 1.19-1.45x at 8 and 64).
_MOSAIC_MIN_LIVE = 8192
# Under 8K, (from this batch, over this many rows) by head dim (bench/RESULTS.md, forty-third
# set, with the tree inside the kernel and the row tiles side by side; the thirty-eighth set's
# narrower rule predates both). The bound is the one the program is built for, and a slot's
# prefix may run well under it, so a bound is taken only where Mosaic won or tied at half of it:
#   * head dim 128 over 1K+ rows: 1.03-1.65x at 1-4K from batch 2 to 64 (1.38x at B 64, N 64,
#     1K), and at 512 it won or tied. Under 1K Triton stays: over 256 rows N 16 lost by 17-25%
#     (B 8, 64), though N 64 won from batch 4 over 256-512. Batch 1 joined at 1K in the
#     forty-fifth set, by the GPU's kernel time: 1.17-1.33x at N 16-64 over 1K and 1.27-1.35x
#     over 512 at the split counts of the forty-fourth set's rule (the forty-third set's wall-time
#     loss at B 1, N 64, 1K was at the old count, on calls near the host's dispatch time);
#   * head dim 64 (SmolLM2's) from batch 8 over 1K+: 1.04-1.22x at B 8-64 (B 64, N 32, 2K: 58.5
#     against 71.5-72.1 us), tied or won at 512. Batch 1-4 tied, or lost (B 1, N 32, 2K).
_MOSAIC_SHORT = {128: ((1, 1024),), 64: ((8, 1024),)}
# On the H100 (not the H200) tiles of one warpgroup's rows from batch 32 over prefixes under
# 4K took Triton's kernel: kernel us, Triton against Mosaic, N 16 over 8 KV heads: B 32, 1K
# 56.1 / 61.0; B 64, 1K 107.1 / 115.6; B 64, 2K 194.3 / 201.3; 4K a tie (370.9 / 375.0), 8K
# Mosaic's (723.5 / 731.0), and batch 8-16 Mosaic's (B 16, 1K 31.9 against 39.3;
# bench/RESULTS.md, fifty-eighth set). The H200 had Mosaic ahead at all of them (fifty-ninth
# set: B 64, 1K 86.5 / 89.6; B 64, 2K 145.0 / 164.1). (Rows up to, from batch, under live rows).
_H100_TRITON = (64, 32, 4096)


def mosaic_serves(rows, live_len, cache_len, head_dim, dtype, *, batch=1) -> bool:
    """Whether `backend=None` takes Mosaic GPU's prefix kernel: on Hopper, for tiles of
    `_MOSAIC_ROWS` rows over a cache of whole key blocks, in 16-bit floats, over prefixes long
    enough for the batch (`_mosaic_prefix_long_enough`; bench/RESULTS.md, thirty-seventh and
    forty-third sets), but for the H100's own exception (`_H100_TRITON`)."""
    if not envs.JAXSPEC_MOSAIC:   # A/B runs: Triton's prefix everywhere
        return False
    return (_MOSAIC_ROWS[0] <= rows <= _MOSAIC_ROWS[1]
            and _mosaic_prefix_long_enough(live_len, head_dim, batch)
            and not _h100_triton_tile(rows, live_len, batch)
            and cache_len % pm.BLOCK_KV == 0 and head_dim in (64, 128)
            and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and pm.on_hopper())


def _mosaic_prefix_long_enough(live_len, head_dim, batch) -> bool:
    """8K+ live rows at any batch; shorter bounds by head dim and batch (`_MOSAIC_SHORT`)."""
    if live_len >= _MOSAIC_MIN_LIVE:
        return True
    return any(batch >= from_batch and live_len >= min_live
               for from_batch, min_live in _MOSAIC_SHORT.get(head_dim, ()))


def _h100_triton_tile(rows, live_len, batch) -> bool:
    """One warpgroup's rows at a large batch over a short prefix, on an H100 (`_H100_TRITON`)."""
    max_rows, from_batch, under_live = _H100_TRITON
    return (rows <= max_rows and batch >= from_batch and live_len < under_live
            and "H100" in pm.device_kind())


def mosaic_splits(batch, num_kv_heads, rows, live_len, block_kv=pm.BLOCK_KV) -> int:
    """Mosaic's default split count for `rows` query rows, padded to whole warpgroups."""
    return pm.default_splits(batch, num_kv_heads, pm.padded_rows(rows), live_len, block_kv)
