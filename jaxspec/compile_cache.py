"""A persistent XLA compilation cache for GPU runs.

An engine compiles a dozen or more functions at warm-up (the cycle, and one prefill per
admission bucket); on a GPU each takes seconds to tens of seconds. With the cache on disk a
second process with the same shapes (the next benchmark run, a restarted server) loads them
instead. The CPU (tests) is left alone. A directory the user set through JAX's own option or
the JAX_COMPILATION_CACHE_DIR variable wins; JAXSPEC_COMPILE_CACHE=0 turns it off.
"""
from __future__ import annotations

import os
from pathlib import Path

import jax

DEFAULT_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "jaxspec" / "xla"


def enable(path=None) -> str | None:
    """Points JAX's compilation cache at `path` (default ~/.cache/jaxspec/xla) on GPU.

    Returns the directory in use, or None when off (CPU, or turned off)."""
    if os.environ.get("JAXSPEC_COMPILE_CACHE", "1") == "0" or jax.default_backend() != "gpu":
        return None
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    d = Path(path) if path else DEFAULT_DIR
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError:     # a read-only home: run without the cache rather than fail
        return None
    jax.config.update("jax_compilation_cache_dir", str(d))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    return str(d)
