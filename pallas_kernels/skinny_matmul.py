"""Weight-streaming matmuls for a few rows, with the layer's elementwise work folded in.

At batch 1 a verify or decode layer multiplies M <= 64 rows by each weight matrix: the GEMMs
are weight reads, and the elementwise kernels between them (a residual add after the o and
down projections, the RMSNorm before gate/up, SiLU(gate) * up after it) each cost a launch and
a few microseconds. Two kernels here take that work into the GEMM itself:

  matmul_add(x, w, r)            x [M, K] @ w [K, N] + r [M, N]          (o, down projections)
  norm_gate_up(x, nw, w, eps)    silu(g) * u, [g | u] = rms_norm(x, nw) @ w [K, 2F]   (MLP in)

One program per (block of N columns, block of M rows) streams its columns of w over the whole
K (no split-K: the epilogue needs the whole sum, and a deterministic result is worth more than
an atomic one); Triton's software pipeline (`num_stages`) keeps the loads in flight. The norm
is folded as rms_norm(x) @ w = rsqrt(mean(x^2) + eps) * ((x * nw) @ w): the row sums of
squares accumulate in the same K loop, so x is read once. The `*_reference` functions state
the semantics as the model computes them (`jaxspec.models.llama`).
"""
from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._compat import CompilerParams as _CompilerParams
from pallas_kernels._compat import load as _load
from pallas_kernels._compat import next_pow2 as _next_pow2
from pallas_kernels._compat import on_gpu
from pallas_kernels._compat import store as _store
from pallas_kernels.head_sharding import model_axis_size

# Rows the kernels serve: beyond this a GEMM is no longer a pure weight read (XLA's tiles win).
MAX_ROWS = 64
# Largest weight (elements) the kernels take. Without split-K a program streams its columns over
# all of K; on the Llama-3-8B products (16.8M+ elements) XLA's GEMMs were 1.2-1.5x faster at
# 32 rows, while on SmolLM2's (at most 1.8M), which are launch- and latency-bound, the fused
# kernels took 2-5 us less a product than XLA's GEMM and elementwise kernels (H200,
# bench/RESULTS.md, thirty-fifth set).
MAX_WEIGHT = 1 << 22


def matmul_add_reference(x, w, r):
    """x [M, K] @ w [K, N] + r [M, N], rounded to x's dtype after the product, as the model's
    `x + o @ wo` does."""
    return r + (x @ w).astype(r.dtype)


def norm_gate_up_reference(x, norm_w, w, eps: float):
    """x [M, K], norm_w [K], w [K, 2F] (gate columns, then up) -> silu(gate) * up [M, F]."""
    xf = x.astype(jnp.float32)
    h = (xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
         * norm_w.astype(jnp.float32)).astype(x.dtype)
    g, u = jnp.split(h @ w, 2, axis=-1)
    return jax.nn.silu(g) * u


def default_config(m: int, k: int, n: int, gate_up: bool = False):
    """(block_m, block_n, block_k, num_warps, num_stages) for M rows over w [K, N]: the best
    of an H200 sweep over SmolLM2's products at M = 1, 4 and 32 (bench/RESULTS.md, thirty-fifth
    set); 64-wide tiles of N and K."""
    block_m = max(16, _next_pow2(min(m, MAX_ROWS)))
    block_n = 64
    while (n // 2 if gate_up else n) % block_n:
        block_n //= 2
    block_k = 64
    while k % block_k:
        block_k //= 2
    return block_m, block_n, block_k, 4, 4


def _matmul_add_kernel(x_ref, w_ref, r_ref, out_ref, *, block_m, block_n, block_k):
    """One [block_m, block_n] tile of x @ w + r; K streamed in block_k steps."""
    j, i = pl.program_id(0), pl.program_id(1)
    m, k = x_ref.shape
    rows = i * block_m + jnp.arange(block_m)
    row_live = rows < m
    cols = pl.ds(j * block_n, block_n)

    def body(s, acc):
        ks = pl.ds(s * block_k, block_k)
        xb = _load(x_ref.at[pl.ds(i * block_m, block_m), ks], mask=row_live[:, None], other=0.0)
        wb = _load(w_ref.at[ks, cols])
        return acc + jnp.dot(xb, wb, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, k // block_k, body, jnp.zeros((block_m, block_n), jnp.float32))
    r = _load(r_ref.at[pl.ds(i * block_m, block_m), cols], mask=row_live[:, None], other=0.0)
    # Rounded before the add, as `r + (x @ w)` rounds the product to bf16 in the model.
    out = r + acc.astype(r_ref.dtype)
    _store(out_ref.at[pl.ds(i * block_m, block_m), cols], out.astype(out_ref.dtype),
           mask=row_live[:, None])


def _norm_gate_up_kernel(x_ref, nw_ref, w_ref, out_ref, *, block_m, block_n, block_k, eps):
    """One [block_m, block_n] tile of silu(g) * u with the RMSNorm folded into the K loop."""
    j, i = pl.program_id(0), pl.program_id(1)
    m, k = x_ref.shape
    f = out_ref.shape[1]
    rows = pl.ds(i * block_m, block_m)
    row_live = i * block_m + jnp.arange(block_m) < m

    def body(s, carry):
        g, u, ss = carry
        ks = pl.ds(s * block_k, block_k)
        xb = _load(x_ref.at[rows, ks], mask=row_live[:, None], other=0.0).astype(jnp.float32)
        nw = _load(nw_ref.at[ks]).astype(jnp.float32)
        xn = (xb * nw[None, :]).astype(w_ref.dtype)
        g = g + jnp.dot(xn, _load(w_ref.at[ks, pl.ds(j * block_n, block_n)]),
                        preferred_element_type=jnp.float32)
        u = u + jnp.dot(xn, _load(w_ref.at[ks, pl.ds(f + j * block_n, block_n)]),
                        preferred_element_type=jnp.float32)
        return g, u, ss + jnp.sum(xb * xb, axis=1)

    zeros = jnp.zeros((block_m, block_n), jnp.float32)
    g, u, ss = lax.fori_loop(0, k // block_k, body, (zeros, zeros, jnp.zeros((block_m,),
                                                                             jnp.float32)))
    scale = lax.rsqrt(ss / k + eps)[:, None]
    # g and u rounded to the weights' dtype as the model's bf16 projection gives them.
    g = (g * scale).astype(out_ref.dtype).astype(jnp.float32)
    u = (u * scale).astype(out_ref.dtype).astype(jnp.float32)
    out = (g * jax.nn.sigmoid(g)).astype(out_ref.dtype).astype(jnp.float32) * u
    _store(out_ref.at[rows, pl.ds(j * block_n, block_n)], out.astype(out_ref.dtype),
           mask=row_live[:, None])


_TUNING = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "interpret")


def _tiles(m, k, n, gate_up, block_m, block_n, block_k, num_warps, num_stages):
    cfg = default_config(m, k, n, gate_up)
    block_m, block_n = block_m or cfg[0], block_n or cfg[1]
    block_k, num_warps, num_stages = block_k or cfg[2], num_warps or cfg[3], num_stages or cfg[4]
    cols = n // 2 if gate_up else n
    assert k % block_k == 0 and cols % block_n == 0, (
        f"K={k} and N={cols} must be multiples of {block_k=} and {block_n=}")
    assert block_m >= 16 and block_n >= 16 and block_k >= 16, "Triton dots need 16+ a side"
    return block_m, block_n, block_k, num_warps, num_stages


@functools.partial(jax.jit, static_argnames=_TUNING)
def matmul_add_pallas(x, w, r, *, block_m=None, block_n=None, block_k=None, num_warps=None,
                      num_stages=None, interpret=False):
    """x [M, K] @ w [K, N] + r [M, N] -> [M, N] in r's dtype."""
    (m, k), n = x.shape, w.shape[1]
    bm, bn, bk, warps, stages = _tiles(m, k, n, False, block_m, block_n, block_k, num_warps,
                                       num_stages)
    kernel = functools.partial(_matmul_add_kernel, block_m=bm, block_n=bn, block_k=bk)
    return pl.pallas_call(
        kernel, grid=(n // bn, pl.cdiv(m, bm)),
        out_shape=jax.ShapeDtypeStruct((m, n), r.dtype),
        compiler_params=_CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret, name="matmul_add",
    )(x.astype(w.dtype), w, r)


@functools.partial(jax.jit, static_argnames=("eps",) + _TUNING)
def norm_gate_up_pallas(x, norm_w, w, *, eps: float, block_m=None, block_n=None, block_k=None,
                        num_warps=None, num_stages=None, interpret=False):
    """x [M, K], norm_w [K], w [K, 2F] -> silu(gate) * up [M, F] in w's dtype."""
    (m, k), f = x.shape, w.shape[1] // 2
    bm, bn, bk, warps, stages = _tiles(m, k, 2 * f, True, block_m, block_n, block_k, num_warps,
                                       num_stages)
    kernel = functools.partial(_norm_gate_up_kernel, block_m=bm, block_n=bn, block_k=bk,
                               eps=eps)
    return pl.pallas_call(
        kernel, grid=(f // bn, pl.cdiv(m, bm)),
        out_shape=jax.ShapeDtypeStruct((m, f), w.dtype),
        compiler_params=_CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret, name="norm_gate_up",
    )(x, norm_w, w)


def fused_gemms(x, w) -> bool:
    """Whether the fused kernels take x [..., K] @ w [K, N]: on the GPU, for at most MAX_ROWS
    rows of bf16, flat (unsharded) weights of at most MAX_WEIGHT elements whose sides are
    multiples of 64.
    JAXSPEC_FUSED_GEMM=0 keeps XLA's GEMMs (to compare)."""
    rows = math.prod(x.shape[:-1])
    return (on_gpu() and os.environ.get("JAXSPEC_FUSED_GEMM", "1") != "0"
            and model_axis_size() is None and w.ndim == 2 and rows <= MAX_ROWS
            and w.dtype == jnp.bfloat16 and x.shape[-1] == w.shape[0] and w.size <= MAX_WEIGHT
            and w.shape[0] % 64 == 0 and w.shape[1] % 64 == 0)


def matmul_add(x, w, r):
    """x [..., K] @ w [K, N] + r [..., N] by the kernel (the caller checked `fused_gemms`)."""
    rows = math.prod(x.shape[:-1])
    out = matmul_add_pallas(x.reshape(rows, -1), w, r.reshape(rows, -1))
    return out.reshape(r.shape)


def norm_gate_up(x, norm_w, w, eps: float):
    """silu(gate) * up of rms_norm(x) @ w, [..., K] -> [..., F], by the kernel."""
    rows = math.prod(x.shape[:-1])
    out = norm_gate_up_pallas(x.reshape(rows, -1), norm_w, w, eps=eps)
    return out.reshape(x.shape[:-1] + (w.shape[1] // 2,))
