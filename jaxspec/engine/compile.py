"""Compilation: the executables a backend runs, and the engine's ahead-of-time warm-up.

A backend call traces its program under its placement (`parallel.placement`) and either runs it
or, with lower=True, returns (key, Lowered). Warm-up lowers every program serving may run,
compiles them concurrently (XLA compiles without the GIL) and files the executables here; a call
whose key is filed runs that executable, any other goes through jit (compiling on its first use)
and counts in `jit_calls`, so a test can assert that serving never compiles.
"""
from __future__ import annotations

import collections
import gc
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, List, Sequence

import jax

from jaxspec.sampling import VARIANTS, Features, seed_key


class Programs:
    """Compiled executables by key, with `copies` loaded copies of each cycle program taken in
    turn. Why several: the host dispatches a cycle before the previous one has ended, so
    consecutive calls of one executable get different buffers and XLA updates the executable's
    CUDA graph before launching it; copies taken in turn each see the buffers of two calls
    before, which the allocator tends to hand back."""

    def __init__(self, copies: int = 1):
        if copies < 1:
            raise ValueError(f"cycle_copies must be >= 1, got {copies}")
        self.copies = copies
        self.executables: Dict[tuple, jax.stages.Compiled] = {}
        self.spares: Dict[tuple, List[jax.stages.Compiled]] = {}
        self._turn: collections.Counter = collections.Counter()
        self.jit_calls = 0      # calls that found no executable: after warm-up, a missed shape

    def copies_of(self, key: tuple) -> int:
        return self.copies if key[0] == "cycle" else 1

    def add(self, key: tuple, compiled):
        """Files a compiled copy of `key`: a spare until the key has copies_of(key) copies; once
        it has, the next one starts them over (a second warm-up replaces the first's)."""
        spares = self.spares.get(key, [])
        if key in self.executables and 1 + len(spares) < self.copies_of(key):
            self.spares[key] = spares + [compiled]
        else:
            self.executables[key] = compiled
            self.spares.pop(key, None)

    def call(self, key: tuple, jitted, args, lower: bool):
        """Runs the executable filed under key (else jitted); lower: (key, Lowered) instead."""
        if lower:
            return key, jitted.lower(*args)
        fn = self.executables.get(key)
        if fn is None:
            self.jit_calls += 1
            fn = jitted
        elif self.spares.get(key):
            turn = self._turn[key] % (len(self.spares[key]) + 1)
            self._turn[key] += 1
            fn = self.spares[key][turn - 1] if turn else fn
        return fn(*args)


def freeze_startup_heap():
    """Collects, then freezes what is left (gc.freeze), so Python's cyclic collector leaves the
    startup heap (compiled programs, jit caches) out of every later collection: a full
    collection that walks it stalls the host while the device waits. Frozen objects are still
    freed when their last reference goes; the next call unfreezes and collects first, so an
    engine dropped before another one warms up does not keep its device buffers."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def check_variants(variants: Sequence[Features]) -> tuple:
    variants = tuple(dict.fromkeys(variants))
    if not variants or any(f not in VARIANTS for f in variants):
        raise ValueError(f"variants must be a non-empty selection of {VARIANTS}, got {variants}")
    return variants


def warmup(programs: List[Callable], backend, state, workers: int, execute: bool):
    """Lowers, compiles (on `workers` threads) and files every program of `programs` (each
    call(state, lower=False) on idle or padding arguments, which leave the state as it was);
    then runs each once if `execute` (a GPU loads modules and builds CUDA graphs on a first
    run), else only the first (a cycle). Returns the state."""
    with ThreadPoolExecutor(workers) as pool:
        jobs, copies = [], []
        for call in programs:
            key, low = call(state, lower=True)
            copies.append(backend.programs.copies_of(key))
            jobs += [(key, pool.submit(low.compile)) for _ in range(copies[-1])]
        for key, job in jobs:
            backend.programs.add(key, job.result())
    seed_key(0)   # compiles the host's seeded-key derivation
    runs = list(zip(programs, copies)) if execute else [(programs[0], 1)]
    for call, n in runs:
        for _ in range(n):               # each copy once: calls take them in turn
            out = call(state)
            state = out[0] if isinstance(out, tuple) else out
    jax.block_until_ready(state)
    return state
