"""Every environment variable jaxspec reads, typed and documented, in one place.

    from jaxspec import envs
    if envs.JAXSPEC_KERNELS: ...

Each variable is parsed when its attribute is read, not at import: a value set in `os.environ`
while the process runs (a test's monkeypatch, a launcher script) counts from the next read. An
unset or empty variable gives its default; a value that does not parse raises `EnvError`, which
names the variable and what it expects. `describe()` lists every variable (name, type, default,
what it does) and `markdown_table()` renders it as the table of docs/configuration.md.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence

if TYPE_CHECKING:
    JAXSPEC_CACHE: Path
    JAXSPEC_COMPILE_CACHE: bool
    JAXSPEC_COORDINATOR: Optional[str]
    JAXSPEC_CYCLE_COPIES: int
    JAXSPEC_DRAFT_HEAD: Optional[Path]
    JAXSPEC_GEMM: str
    JAXSPEC_KERNELS: bool
    JAXSPEC_MOSAIC: bool
    JAXSPEC_NUM_PROCESSES: Optional[int]
    JAXSPEC_PREFILL_UNROLL: int
    JAXSPEC_PROCESS_ID: Optional[int]
    XDG_CACHE_HOME: Path


class EnvError(ValueError):
    """An environment variable holds a value its type does not accept."""


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _raw(name: str) -> Optional[str]:
    """The variable's value, stripped; None when unset or empty."""
    value = os.environ.get(name)
    if value is None or not value.strip():
        return None
    return value.strip()


def _int(name: str, default: Optional[int], minimum: int) -> Callable[[], Optional[int]]:
    def read():
        raw = _raw(name)
        if raw is None:
            return default
        try:
            value = int(raw)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise EnvError(f"{name} must be an int >= {minimum}, got {raw!r}")
        return value
    return read


def _bool(name: str, default: bool) -> Callable[[], bool]:
    def read():
        raw = _raw(name)
        if raw is None:
            return default
        if raw.lower() in _TRUE:
            return True
        if raw.lower() in _FALSE:
            return False
        raise EnvError(f"{name} must be a bool (1/0, true/false, yes/no, on/off), got {raw!r}")
    return read


def _choice(name: str, default: str, choices: Sequence[str]) -> Callable[[], str]:
    def read():
        raw = _raw(name)
        if raw is None:
            return default
        if raw.lower() not in choices:
            raise EnvError(f"{name} must be one of {', '.join(choices)}, got {raw!r}")
        return raw.lower()
    return read


def _path(name: str, default: Callable[[], Optional[Path]]) -> Callable[[], Optional[Path]]:
    def read():
        raw = _raw(name)
        return default() if raw is None else Path(raw).expanduser()
    return read


def _address(name: str) -> Callable[[], Optional[str]]:
    def read():
        raw = _raw(name)
        if raw is None:
            return None
        host, sep, port = raw.rpartition(":")
        if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
            raise EnvError(f"{name} must be host:port (e.g. 10.0.0.1:1234), got {raw!r}")
        return raw
    return read


@dataclasses.dataclass(frozen=True)
class Variable:
    """One environment variable: its parser and what the docs say about it."""
    name: str
    type: str       # as docs/configuration.md shows it
    default: str    # as docs/configuration.md shows it
    doc: str        # one line: what it does
    read: Callable[[], Any]


_GEMMS = ("auto", "cublas", "triton")

VARIABLES: tuple[Variable, ...] = (
    Variable("JAXSPEC_CACHE", "path", "~/.cache/jaxspec",
             "Directory of the converted-params cache (`jaxspec.loading.cache`).",
             _path("JAXSPEC_CACHE", lambda: Path.home() / ".cache" / "jaxspec")),
    Variable("JAXSPEC_COMPILE_CACHE", "bool", "1",
             "Persistent XLA compilation cache on GPU runs (`jaxspec.compile_cache`); 0 turns "
             "it off.",
             _bool("JAXSPEC_COMPILE_CACHE", True)),
    Variable("JAXSPEC_COORDINATOR", "str (host:port)", "unset (JAX detects it)",
             "Coordinator address for `jaxspec.parallel.distributed.initialize` (multi-host).",
             _address("JAXSPEC_COORDINATOR")),
    Variable("JAXSPEC_CYCLE_COPIES", "int >= 1", "1",
             "Loaded copies of each cycle program, run in turn (the engine's warm-up compiles "
             "them).",
             _int("JAXSPEC_CYCLE_COPIES", 1, 1)),
    Variable("JAXSPEC_DRAFT_HEAD", "path", "unset (checkpoints/ of the source tree)",
             "File of the draft head `load_default_head` loads for the default model.",
             _path("JAXSPEC_DRAFT_HEAD", lambda: None)),
    Variable("JAXSPEC_GEMM", f"choice: {' / '.join(_GEMMS)}", "auto",
             "GEMM backend of compiled programs (`jaxspec.xla_options`): auto picks cuBLAS "
             "for programs of 64+ rows, cublas and triton force one.",
             _choice("JAXSPEC_GEMM", "auto", _GEMMS)),
    Variable("JAXSPEC_KERNELS", "bool", "1",
             "Pallas GPU kernels on GPU; 0 runs their jnp references (plain XLA) instead.",
             _bool("JAXSPEC_KERNELS", True)),
    Variable("JAXSPEC_MOSAIC", "bool", "1",
             "Mosaic GPU's prefix-attention kernel where `backend_rule` picks it on Hopper; 0 "
             "keeps the Triton kernel everywhere.",
             _bool("JAXSPEC_MOSAIC", True)),
    Variable("JAXSPEC_NUM_PROCESSES", "int >= 1", "unset (JAX detects it)",
             "Number of processes for `jaxspec.parallel.distributed.initialize`; 1 skips it.",
             _int("JAXSPEC_NUM_PROCESSES", None, 1)),
    Variable("JAXSPEC_PREFILL_UNROLL", "int >= 1", "1",
             "Layers per scan iteration of prefill programs (`ModelConfig.for_prefill`).",
             _int("JAXSPEC_PREFILL_UNROLL", 1, 1)),
    Variable("JAXSPEC_PROCESS_ID", "int >= 0", "unset (JAX detects it)",
             "This process's index for `jaxspec.parallel.distributed.initialize`.",
             _int("JAXSPEC_PROCESS_ID", None, 0)),
    Variable("XDG_CACHE_HOME", "path", "~/.cache",
             "Base of the XLA compilation cache's directory (`$XDG_CACHE_HOME/jaxspec/xla`).",
             _path("XDG_CACHE_HOME", lambda: Path.home() / ".cache")),
)

# name -> parser, read on each attribute access (the module `__getattr__`)
environment_variables: Dict[str, Callable[[], Any]] = {v.name: v.read for v in VARIABLES}


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(environment_variables))


def describe() -> List[Dict[str, str]]:
    """Each variable's name, type, default and doc, in name order."""
    return [{"name": v.name, "type": v.type, "default": v.default, "doc": v.doc}
            for v in sorted(VARIABLES, key=lambda v: v.name)]


def markdown_table() -> str:
    """`describe()` as the Markdown table of docs/configuration.md."""
    rows = ["| Variable | Type | Default | What it does |", "| --- | --- | --- | --- |"]
    rows += [f"| `{d['name']}` | {d['type']} | {d['default']} | {d['doc']} |"
             for d in describe()]
    return "\n".join(rows) + "\n"
