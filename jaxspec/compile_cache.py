"""A persistent XLA compilation cache for GPU runs.

An engine compiles a dozen or more functions at warm-up (the cycle, and one prefill per
admission bucket); on a GPU each takes seconds to tens of seconds. With the cache on disk a
second process with the same shapes (the next benchmark run, a restarted server) loads them
instead. The CPU (tests) is left alone. A directory the user set through JAX's own option or
the JAX_COMPILATION_CACHE_DIR variable wins; JAXSPEC_COMPILE_CACHE=0 turns it off.
"""
from __future__ import annotations

from pathlib import Path

import jax

from jaxspec import envs


def default_dir() -> Path:
    """$XDG_CACHE_HOME/jaxspec/xla (XDG_CACHE_HOME defaults to ~/.cache)."""
    return envs.XDG_CACHE_HOME / "jaxspec" / "xla"


def enable(path=None) -> str | None:
    """Points JAX's compilation cache at `path` (default ~/.cache/jaxspec/xla) on GPU.

    Returns the directory in use, or None when off (CPU, or turned off)."""
    if not envs.JAXSPEC_COMPILE_CACHE or jax.default_backend() != "gpu":
        return None
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    d = Path(path) if path else default_dir()
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError:     # a read-only home: run without the cache rather than fail
        return None
    jax.config.update("jax_compilation_cache_dir", str(d))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    return str(d)
