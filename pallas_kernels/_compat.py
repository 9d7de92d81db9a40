"""Pallas API differences between the jax releases we support (0.10 on CPU, 0.11 on the GPU)."""
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxspec import envs

# Pallas moved between jax releases: `pl.load/pl.store` became `plgpu.load/store`, and the
# compiler-params class was renamed.
load = getattr(plgpu, "load", None) or getattr(pl, "load")
store = getattr(plgpu, "store", None) or getattr(pl, "store")
CompilerParams = (getattr(plgpu, "CompilerParams", None)
                  or getattr(plgpu, "TritonCompilerParams"))


# Large finite negative rather than -inf: a fully masked row must not produce NaN. One value for
# both attention kernels: the Mosaic prefix's empty splits carry it into the Triton merge.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def on_gpu(backend: str | None = None) -> bool:
    """Whether the Pallas GPU kernels serve on `backend` (None: jax's default). JAXSPEC_KERNELS=0
    forces the jnp references, to compare or to rule the kernels out of a GPU problem."""
    backend = jax.default_backend() if backend is None else backend
    return backend == "gpu" and envs.JAXSPEC_KERNELS
