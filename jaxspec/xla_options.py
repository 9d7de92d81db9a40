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

Collectives (tensor parallel). `COLLECTIVE_FLAGS` names sets of XLA GPU options about the
collectives that `collective_flags(name)` adds to the programs built inside it, so a benchmark
compares them in one process; outside it (the default, "default") nothing is added. Each option
exists in jaxlib 0.10.2's XLA (an unknown name or enum value fails the compile; the tests compile
every set):
  cmdbuf       xla_gpu_enable_command_buffer with COLLECTIVES beside the kernel kinds: the
               all-reduces are recorded in the program's CUDA graphs instead of splitting them
               into pieces launched one by one around each collective.
  sync         xla_gpu_disable_async_collectives for all-reduce, reduce-scatter, all-gather:
               the collectives run on the compute stream (no cross-stream events), where a
               batch-1 step has nothing to overlap them with.
  cmdbuf_sync  both.
  lhs          xla_gpu_enable_latency_hiding_scheduler: async collectives scheduled to overlap
               the independent work around them.
  oneshot      xla_gpu_unsupported_use_all_reduce_one_shot_kernel: XLA's own one-shot kernel
               for the all-reduces of one host that fit it (each device reads its peers'
               buffers and sums them in one kernel) instead of NCCL's.
  cmdbuf_oneshot  cmdbuf and oneshot.
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

_CMDBUF = {"xla_gpu_enable_command_buffer":
           "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,COLLECTIVES"}
_SYNC = {"xla_gpu_disable_async_collectives": "ALLREDUCE,REDUCESCATTER,ALLGATHER"}
_ONESHOT = {"xla_gpu_unsupported_use_all_reduce_one_shot_kernel": True}
COLLECTIVE_FLAGS: Dict[str, Dict[str, Any]] = {
    "default": {}, "cmdbuf": _CMDBUF, "sync": _SYNC, "cmdbuf_sync": {**_CMDBUF, **_SYNC},
    "lhs": {"xla_gpu_enable_latency_hiding_scheduler": True}, "oneshot": _ONESHOT,
    "cmdbuf_oneshot": {**_CMDBUF, **_ONESHOT}}
_collectives = "default"


def gemm_choice() -> str:
    """The GEMM rule programs built now follow (one of GEMM_BACKENDS)."""
    return _override or envs.JAXSPEC_GEMM


def compiler_options(rows: Optional[int] = None) -> Dict[str, Any]:
    """Options of a program whose smallest product has `rows` rows (None: not known)."""
    choice = gemm_choice()
    auto_cublas = choice == "auto" and rows is not None and rows >= CUBLAS_MIN_ROWS
    gemm = dict(_CUBLAS) if choice == "cublas" or auto_cublas else {}
    return {**gemm, **COLLECTIVE_FLAGS[_collectives]}


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


@contextlib.contextmanager
def collective_flags(name: str):
    """Programs built inside get the XLA options of COLLECTIVE_FLAGS[name] (module notes)."""
    global _collectives
    if name not in COLLECTIVE_FLAGS:
        raise ValueError(f"unknown collective flag set {name!r}; choose from "
                         f"{', '.join(COLLECTIVE_FLAGS)}")
    saved, _collectives = _collectives, name
    try:
        yield
    finally:
        _collectives = saved
