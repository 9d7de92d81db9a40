"""Which Pallas GPU backend serves a tree-attention tile: the Triton kernel, or Mosaic GPU's
prefix kernel (`prefix_attention_mgpu`) on Hopper wherever it is the faster of the two, with one
exception for the H100 (docs/performance.md has the figures). Pure Python: the rule is tested
on any machine with `prefix_attention_mgpu.on_hopper` (and `device_kind`) patched.
"""
from __future__ import annotations

import jax.numpy as jnp

from jaxspec import envs
from pallas_kernels import prefix_attention_mgpu as pm

# Tiles of this many rows per KV head take Mosaic GPU's prefix kernel on Hopper: from one
# warpgroup's 64 (N >= 16 at G = 4) up to tree sizes; prompt chunks keep the Triton kernel,
# which is tuned for them (causal bounds, packs).
_MOSAIC_ROWS = (64, 1024)
# ... over prefixes of at least this many rows (live_rows, else the cache's length): from here
# on Mosaic wins or ties at every batch.
_MOSAIC_MIN_LIVE = 8192
# Under 8K, (from this batch, over this many rows) by head dim. The bound is the one the
# program is built for, and a slot's prefix may run well under it, so a bound is taken only
# where Mosaic also wins or ties at half of it:
#   * head dim 128 over 1K+ rows at any batch (under 1K the Triton kernel can still win);
#   * head dim 64 (SmolLM2's) from batch 8 over 1K+ (at batch 1-4 Mosaic ties or loses).
_MOSAIC_SHORT = {128: ((1, 1024),), 64: ((8, 1024),)}
# On the H100 (not the H200) tiles of one warpgroup's rows from batch 32 over prefixes under
# 4K take Triton's kernel, the faster one there. (Rows up to, from batch, under live rows.)
_H100_TRITON = (64, 32, 4096)


def mosaic_serves(rows, live_len, cache_len, head_dim, dtype, *, batch=1) -> bool:
    """Whether `backend=None` takes Mosaic GPU's prefix kernel: on Hopper, for tiles of
    `_MOSAIC_ROWS` rows over a cache of whole key blocks, in 16-bit floats, over prefixes long
    enough for the batch (`_mosaic_prefix_long_enough`), but for the H100's own exception
    (`_H100_TRITON`)."""
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
