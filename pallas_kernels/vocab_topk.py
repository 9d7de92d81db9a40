"""Exact top-k of wide rows (a draft step's logits over the vocabulary) in Pallas (Triton).

Why: a tree draft step takes the top 10 of [10, 128256] fp32 logits. XLA's GPU TopK runs one
thread block per row (ten SMs busy), and the chunk-maxima route (`jaxspec.spec.topk`) spends
most of its time on two XLA sort kernels of 1,002 and 1,280 elements a row. Here:
  pass 1, program (row, chunk): its chunk's top k, by k rounds of "the largest key left, the
          lowest index among its ties", all in registers;
  pass 2, program (row): the top k of the row's chunks' survivors, the same way.
Rows of few chunks take both in one launch: the last of a row's programs to finish merges
(`_fused_kernel`). The survivors are columns; values come from the row itself, bit for bit.
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
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._compat import CompilerParams, load, next_pow2, store

CHUNK = 4096          # pass 1's widest chunk: 32 chunks of 4,008 for 128,256 (320 programs
                      # for a draft step's ten rows)
MAX_K = 16            # rounds are unrolled: k of them in each pass
NONE = jnp.iinfo(jnp.int32).max     # the index of "no element" (padding, rounds past the end)
LOWEST = jnp.iinfo(jnp.int32).min
DTYPES = (jnp.float32, jnp.bfloat16)    # the rows it takes (keys come from fp32 bits)
FUSED_MAX_CHUNKS = 8   # one launch (`_fused_kernel`) for rows of at most this many chunks, where
                       # the merge is small: the SmolLM2 engine's 16,384-token draft rows (4
                       # chunks). Two passes over 128,256 (32 chunks), where one launch's merge
                       # of 32 chunks' survivors by the last program costs more than a launch


def vocab_top_k_reference(x, k: int):
    """x [..., V] -> (values [..., k] in x's dtype, indices [..., k] int32)."""
    return lax.top_k(x, k)


def _keys(x):
    """fp32 -> int32 keys in the same order as the values (a total order on the bits: negative
    values' magnitude bits flipped)."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    return bits ^ ((bits >> 31) & jnp.int32(0x7FFFFFFF))


def _picks(keys, live, k: int, kp: int):
    """k rounds of two reductions: the largest live key, then the lowest lane among its ties.
    -> lanes [kp] int32 (NONE: no pick, for rounds past the live elements and slots past k).
    Two int32 reductions are faster than one argmax reduction of (key, lane) pairs."""
    lane = jnp.arange(keys.shape[0], dtype=jnp.int32)
    slot = jnp.arange(kp, dtype=jnp.int32)
    out = jnp.full((kp,), NONE, jnp.int32)
    for j in range(k):
        best = jnp.max(jnp.where(live, keys, LOWEST))
        at = jnp.min(jnp.where(live & (keys == best), lane, NONE))
        out = jnp.where(slot == j, at, out)
        live = live & (lane != at)
    return out


def _chunk_picks(x_ref, r, c, *, width: int, block: int, k: int, kp: int):
    """Program (row, chunk)'s top k of x_ref [R, V] -> their columns [kp] (NONE past k)."""
    v = x_ref.shape[1]
    lane = jnp.arange(block, dtype=jnp.int32)
    cols = c * width + lane
    ok = (lane < width) & (cols < v)
    # Index arrays on every axis (gather form): interpret mode cannot mix them with slices.
    x = load(x_ref.at[r, jnp.where(ok, cols, 0)], mask=ok, other=0.0)
    at = _picks(_keys(x.astype(jnp.float32)), ok, k, kp)
    return jnp.where(at == NONE, NONE, c * width + at)


def _merge(x_ref, cols_ref, val_ref, top_ref, r, *, k: int, kp: int):
    """Row r's top k of its chunks' survivors cols_ref [R, S] (columns of x_ref, NONE: none)
    -> val_ref [R, kp] (x's dtype), top_ref [R, kp] int32. The survivors of equal keys sit in
    column order (chunk by chunk, ties by the lower column in each), so the lower lane is the
    lower column."""
    width = cols_ref.shape[1]
    lanes = jnp.arange(next_pow2(width), dtype=jnp.int32)
    ok = lanes < width
    cols = load(cols_ref.at[r, jnp.where(ok, lanes, 0)], mask=ok, other=NONE)
    live = cols != NONE
    x = load(x_ref.at[r, jnp.where(live, cols, 0)], mask=live, other=0.0)
    at = _picks(_keys(x.astype(jnp.float32)), live, k, kp)
    got = at != NONE
    top = load(cols_ref.at[r, jnp.where(got, at, 0)], mask=got, other=NONE)
    has = top != NONE
    out = jnp.arange(kp, dtype=jnp.int32)
    store(val_ref.at[r, out], load(x_ref.at[r, jnp.where(has, top, 0)], mask=has, other=0.0))
    store(top_ref.at[r, out], top)


def _chunk_kernel(x_ref, cols_ref, *, kp: int, **picks):
    """Pass 1, program (row, chunk): x_ref [R, V] -> cols_ref [R, n * kp] at (row, chunk)."""
    r, c = pl.program_id(0), pl.program_id(1)
    store(cols_ref.at[r, c * kp + jnp.arange(kp, dtype=jnp.int32)],
          _chunk_picks(x_ref, r, c, kp=kp, **picks))


def _merge_kernel(x_ref, cols_ref, val_ref, top_ref, *, k: int, kp: int):
    """Pass 2, program (row): the row's top k of its survivors."""
    _merge(x_ref, cols_ref, val_ref, top_ref, pl.program_id(0), k=k, kp=kp)


def _fused_kernel(x_ref, arrivals_in, cols_ref, val_ref, top_ref, arrivals_ref, *, kp: int,
                  interpret: bool, **picks):
    """One pass, program (row, chunk): pass 1, then the last of the row's chunks to arrive (an
    acq_rel atomic count, `arrivals` zero at launch and aliased in place) merges the row's
    survivors, in place of a second launch. The CTA barrier puts every thread's stores before
    the arrival, whose release (gpu scope) publishes them; the last program's acquire, then a
    second barrier, put its threads' loads after every other program's release."""
    del arrivals_in                     # the same buffer as arrivals_ref
    _chunk_kernel(x_ref, cols_ref, kp=kp, **picks)
    r = pl.program_id(0)
    if not interpret:
        plgpu.debug_barrier()
    ticket = plgpu.atomic_add(arrivals_ref, (r,), jnp.int32(1))
    if not interpret:
        plgpu.debug_barrier()

    @pl.when(ticket == pl.num_programs(1) - 1)
    def _():
        _merge(x_ref, cols_ref, val_ref, top_ref, r, k=picks["k"], kp=kp)


def chunks(v: int, chunk: int | None = None) -> tuple[int, int]:
    """(n, width): pass 1 cuts a row of v into n chunks of width (the last may be short), the
    fewest of at most `chunk` (None: CHUNK, read when called)."""
    chunk = CHUNK if chunk is None else chunk
    n = -(-v // chunk)
    return n, -(-v // n)


def vocab_top_k_pallas(x, k: int, *, chunk: int | None = None, num_warps: int = 4,
                       fused: bool | None = None, interpret: bool = False):
    """x [..., V] fp32 or bf16 -> (values [..., k] in x's dtype, indices [..., k] int32), equal
    to lax.top_k(x, k) (order as in the module's docstring). `fused`: one launch whose last
    program of a row merges, or two passes; None: by FUSED_MAX_CHUNKS. `chunk` None: CHUNK.
    Both module defaults are read when called, so a benchmark can set them."""
    v = x.shape[-1]
    if not 1 <= k <= min(v, MAX_K):
        raise ValueError(f"k={k} must be in 1..{min(v, MAX_K)} (row width {v}, MAX_K {MAX_K})")
    if x.dtype not in DTYPES:
        raise TypeError(f"vocab_top_k_pallas takes fp32 or bf16 rows, got {x.dtype}")
    chunk = CHUNK if chunk is None else chunk
    fused = chunks(v, chunk)[0] <= FUSED_MAX_CHUNKS if fused is None else bool(fused)
    return _top_k(x, k, chunk=chunk, num_warps=num_warps, fused=fused, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("k", "chunk", "num_warps", "fused", "interpret"))
def _top_k(x, k: int, *, chunk: int, num_warps: int, fused: bool, interpret: bool):
    lead, v = x.shape[:-1], x.shape[-1]
    x = x.reshape(-1, v)
    r = x.shape[0]
    n, width = chunks(v, chunk)
    kp = next_pow2(k)
    picks = dict(width=width, block=next_pow2(width), k=k, kp=kp)
    params = CompilerParams(num_warps=num_warps, num_stages=1)
    cols = jax.ShapeDtypeStruct((r, n * kp), jnp.int32)
    outs = [jax.ShapeDtypeStruct((r, kp), x.dtype), jax.ShapeDtypeStruct((r, kp), jnp.int32)]
    if fused:
        _, vals, top, _ = pl.pallas_call(
            functools.partial(_fused_kernel, interpret=interpret, **picks),
            grid=(r, n), out_shape=[cols, *outs, jax.ShapeDtypeStruct((r,), jnp.int32)],
            input_output_aliases={1: 3}, compiler_params=params, interpret=interpret,
            name="vocab_top_k",
        )(x, jnp.zeros((r,), jnp.int32))
    else:
        survivors = pl.pallas_call(
            functools.partial(_chunk_kernel, **picks), grid=(r, n), out_shape=cols,
            compiler_params=params, interpret=interpret, name="vocab_top_k_chunks",
        )(x)
        vals, top = pl.pallas_call(
            functools.partial(_merge_kernel, k=k, kp=kp), grid=(r,),
            out_shape=outs, compiler_params=params, interpret=interpret,
            name="vocab_top_k_merge",
        )(x, survivors)
    return vals[:, :k].reshape(lead + (k,)), top[:, :k].reshape(lead + (k,))
