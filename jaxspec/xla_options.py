"""XLA compiler options for the programs jaxspec compiles, and `jit`, which applies them.

GEMMs. XLA's default on the H100 lowers most bf16 matmuls to Triton GEMM fusions; with Triton
GEMMs off it calls cuBLAS, which also takes the residual add after a GEMM as its epilogue
(beta = 1), so the add kernels go. Which is faster depends on the rows of the products:
Triton's GEMMs with few rows, cuBLAS's with many (docs/performance.md). With few rows cuBLAS
runs the fp32-output lm_head as an fp32 GEMV after converting the whole weight to fp32, a
large convert a step. So a program whose smallest product has at
least `CUBLAS_MIN_ROWS` rows (a decode or cycle program over 64 or more slots) is compiled with
Triton GEMMs off; every other program keeps XLA's default.

The options go to each program through `jax.jit(compiler_options=...)`, not process-wide
through XLA_FLAGS: other JAX code in the process keeps XLA's defaults, and it works whenever
jaxspec is imported. Options a backend's compiler does not use are ignored by it (the CPU).
`JAXSPEC_GEMM=auto|cublas|triton` or `gemm_backend(...)` (programs built inside it; benchmarks
time both in one process) choose the GEMMs: auto is the rule above, cublas and triton force one.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Optional

import jax

from jaxspec import envs

CUBLAS_MIN_ROWS = 64
GEMM_BACKENDS = ("auto", "cublas", "triton")
_CUBLAS = {"xla_gpu_enable_triton_gemm": False}
_override: Optional[str] = None


def gemm_choice() -> str:
    """The GEMM rule programs built now follow (one of GEMM_BACKENDS)."""
    return _override or envs.JAXSPEC_GEMM


def compiler_options(rows: Optional[int] = None) -> Dict[str, Any]:
    """Options of a program whose smallest product has `rows` rows (None: not known)."""
    choice = gemm_choice()
    auto_cublas = choice == "auto" and rows is not None and rows >= CUBLAS_MIN_ROWS
    return dict(_CUBLAS) if choice == "cublas" or auto_cublas else {}


def jit(fun=None, *, rows: Optional[int] = None, **kwargs):
    """jax.jit with `compiler_options(rows)`, chosen when the program is built. Also a
    decorator: `@jit` or `@functools.partial(jit, static_argnums=...)`."""
    if fun is None:
        return lambda f: jit(f, rows=rows, **kwargs)
    out = jax.jit(fun, compiler_options=compiler_options(rows), **kwargs)
    # kept so a wrapper of the program (dp_engine's per-device form) applies the same rule
    out.gemm_rows = rows
    return out


@contextlib.contextmanager
def gemm_backend(name: str):
    """Programs built inside follow this GEMM rule (one of GEMM_BACKENDS)."""
    global _override
    if name not in GEMM_BACKENDS:
        raise ValueError(f"unknown GEMM backend {name!r}; choose from {', '.join(GEMM_BACKENDS)}")
    saved, _override = _override, name
    try:
        yield
    finally:
        _override = saved
