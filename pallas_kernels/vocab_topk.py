"""Exact top-k of wide rows (a draft step's logits over the vocabulary): two Pallas (Triton) passes.

Why: a tree draft step takes the top 10 of [10, 128256] fp32 logits. XLA's GPU TopK runs one
thread block per row (ten SMs busy), and the chunk-maxima route (`jaxspec.spec.topk`) spends
most of its 43 us on two XLA sort kernels of 1,002 and 1,280 elements a row (bench/RESULTS.md,
forty-eighth set). Here:
  pass 1, program (row, chunk): its chunk's top k, by k rounds of "the largest key left, the
          lowest index among its ties", all in registers;
  pass 2, program (row): the top k of the row's chunks' survivors, the same way.
An element of the row's top k is within its chunk's top k (fewer than k elements are ahead of
it in the row, so fewer in its chunk), and pass 2 ranks by value then original index, so the
result is lax.top_k's whatever the chunking.

Order: lax.top_k's on the CPU. Values are compared as integer keys made from their fp32 bits
(`_keys`: a total order, +0.0 ahead of -0.0, a NaN of positive sign ahead of +inf); equal keys
by the lower index. XLA's GPU TopK compares with `>`, so on the GPU the two may differ only on
rows that hold both signed zeros or NaN.

Semantics: `vocab_top_k_reference` (jax.lax.top_k). Runs in Pallas interpret mode on a CPU
(the tests).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._compat import CompilerParams, load, next_pow2, store

CHUNK = 4096          # pass 1's widest chunk: 32 chunks of 4,008 for 128,256 (320 programs
                      # for a draft step's ten rows)
MAX_K = 16            # rounds are unrolled: k of them in each pass
NONE = jnp.iinfo(jnp.int32).max     # the index of "no element" (padding, rounds past the end)
LOWEST = jnp.iinfo(jnp.int32).min
DTYPES = (jnp.float32, jnp.bfloat16)    # the rows it takes (keys come from fp32 bits)


def vocab_top_k_reference(x, k: int):
    """x [..., V] -> (values [..., k] in x's dtype, indices [..., k] int32)."""
    return lax.top_k(x, k)


def _monotone(bits):
    """int32 fp32 bits <-> int32 keys in the values' order (a total order: negative values'
    magnitude bits flipped). The map is its own inverse."""
    return bits ^ ((bits >> 31) & jnp.int32(0x7FFFFFFF))


def _keys(x):
    """fp32 -> int32 keys in the same order as the values."""
    return _monotone(lax.bitcast_convert_type(x, jnp.int32))


def _take_top(keys, idx, k: int, kp: int):
    """k rounds over 1-D keys, idx (idx NONE: no element): the largest key left, then the lowest
    index among its ties. -> keys, idx [kp]; rounds with nothing left, and slots past k, hold
    (LOWEST, NONE)."""
    live = idx != NONE
    slot = jnp.arange(kp, dtype=jnp.int32)
    out_key = jnp.full((kp,), LOWEST, jnp.int32)
    out_idx = jnp.full((kp,), NONE, jnp.int32)
    for j in range(k):
        best = jnp.max(jnp.where(live, keys, LOWEST))
        at = jnp.min(jnp.where(live & (keys == best), idx, NONE))
        out_key = jnp.where(slot == j, jnp.where(at == NONE, LOWEST, best), out_key)
        out_idx = jnp.where(slot == j, at, out_idx)
        live = live & (idx != at)
    return out_key, out_idx


def _chunk_kernel(x_ref, key_ref, idx_ref, *, width: int, block: int, k: int, kp: int):
    """Program (row, chunk): x_ref [R, V] -> key_ref, idx_ref [R, n, kp] at (row, chunk)."""
    r, c = pl.program_id(0), pl.program_id(1)
    v = x_ref.shape[1]
    lane = jnp.arange(block, dtype=jnp.int32)
    cols = c * width + lane
    ok = (lane < width) & (cols < v)
    # Index arrays on every axis (gather form): interpret mode cannot mix them with slices.
    x = load(x_ref.at[r, jnp.where(ok, cols, 0)], mask=ok, other=0.0)
    keys, idx = _take_top(_keys(x.astype(jnp.float32)), jnp.where(ok, cols, NONE), k, kp)
    out = jnp.arange(kp, dtype=jnp.int32)
    store(key_ref.at[r, c, out], keys)
    store(idx_ref.at[r, c, out], idx)


def _merge_kernel(key_ref, idx_ref, val_ref, top_ref, *, k: int, kp: int):
    """Program (row): the top k of key_ref, idx_ref [R, S] -> val_ref [R, kp] fp32 (the values,
    back from their keys), top_ref [R, kp] int32."""
    r = pl.program_id(0)
    width = key_ref.shape[1]
    lanes = jnp.arange(next_pow2(width), dtype=jnp.int32)
    ok = lanes < width
    at = jnp.where(ok, lanes, 0)
    keys, idx = _take_top(load(key_ref.at[r, at], mask=ok, other=LOWEST),
                          load(idx_ref.at[r, at], mask=ok, other=NONE), k, kp)
    out = jnp.arange(kp, dtype=jnp.int32)
    store(val_ref.at[r, out], lax.bitcast_convert_type(_monotone(keys), jnp.float32))
    store(top_ref.at[r, out], idx)


def chunks(v: int, chunk: int = CHUNK) -> tuple[int, int]:
    """(n, width): pass 1 cuts a row of v into n chunks of width (the last may be short), the
    fewest of at most `chunk`."""
    n = -(-v // chunk)
    return n, -(-v // n)


@functools.partial(jax.jit, static_argnames=("k", "chunk", "num_warps", "interpret"))
def vocab_top_k_pallas(x, k: int, *, chunk: int = CHUNK, num_warps: int = 4,
                       interpret: bool = False):
    """x [..., V] fp32 or bf16 -> (values [..., k] in x's dtype, indices [..., k] int32), equal
    to lax.top_k(x, k) (order as in the module's docstring)."""
    lead, v = x.shape[:-1], x.shape[-1]
    x = x.reshape(-1, v)
    r = x.shape[0]
    if not 1 <= k <= min(v, MAX_K):
        raise ValueError(f"k={k} must be in 1..{min(v, MAX_K)} (row width {v}, MAX_K {MAX_K})")
    if x.dtype not in DTYPES:
        raise TypeError(f"vocab_top_k_pallas takes fp32 or bf16 rows, got {x.dtype}")
    n, width = chunks(v, chunk)
    kp = next_pow2(k)
    params = CompilerParams(num_warps=num_warps, num_stages=1)
    i32 = jnp.int32
    keys, idx = pl.pallas_call(
        functools.partial(_chunk_kernel, width=width, block=next_pow2(width), k=k, kp=kp),
        grid=(r, n),
        out_shape=[jax.ShapeDtypeStruct((r, n, kp), i32)] * 2,
        compiler_params=params, interpret=interpret, name="vocab_top_k_chunks",
    )(x)
    vals, top = pl.pallas_call(
        functools.partial(_merge_kernel, k=k, kp=kp),
        grid=(r,),
        out_shape=[jax.ShapeDtypeStruct((r, kp), jnp.float32), jax.ShapeDtypeStruct((r, kp), i32)],
        compiler_params=params, interpret=interpret, name="vocab_top_k_merge",
    )(keys.reshape(r, n * kp), idx.reshape(r, n * kp))
    return vals[:, :k].astype(x.dtype).reshape(lead + (k,)), top[:, :k].reshape(lead + (k,))
