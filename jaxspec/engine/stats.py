"""What the engine did, for benchmarks and tests: calls, admissions, where the host's time went."""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from typing import List


@dataclasses.dataclass
class EngineStats:
    cycles: int = 0                     # device calls of cycles (or plain decode steps)
    admissions: int = 0                 # requests admitted (resumes included)
    prefill_chunks: int = 0             # admission calls
    retracts: int = 0
    host_s: float = 0.0                 # time in step() not spent waiting on the device
    wait_s: float = 0.0                 # time blocked reading device outputs
    dispatch_s: float = 0.0             # of host_s: in the backend's admission and cycle calls
    admit_dispatch_s: float = 0.0       # of dispatch_s: in the admission calls
    # admission calls by (requests, tokens a row, features, form): what the device ran besides
    # the cycles; call sizes of the cycle calls
    admit_shapes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    call_sizes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    step_s: List[float] = dataclasses.field(default_factory=list)
    step_start: List[float] = dataclasses.field(default_factory=list)   # perf_counter at each
    # per step: (admission calls, cycle call size or 0, short build, seconds in the admission
    # calls, in the cycle call, waiting on the device): where a slow step's time went
    step_what: List[tuple] = dataclasses.field(default_factory=list)
    _cur: list = dataclasses.field(default_factory=lambda: [0, 0, False, 0.0, 0.0, 0.0])

    @contextlib.contextmanager
    def step(self, engine):
        t0 = time.perf_counter()
        self._cur = [0, 0, False, 0.0, 0.0, 0.0]
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            self.step_s.append(dt)
            self.step_start.append(t0)
            self.step_what.append(tuple(self._cur))
            self.host_s += dt - self._cur[5]

    @contextlib.contextmanager
    def timed(self, kind: str, what: tuple):
        """A dispatch: an admission call of shape `what`, or a cycle call (size, short)."""
        t = time.perf_counter()
        yield
        dt = time.perf_counter() - t
        self.dispatch_s += dt
        if kind == "admit":
            self.admit_dispatch_s += dt
            self.prefill_chunks += 1
            self.admit_shapes[what] += 1
            self._cur[0] += 1
            self._cur[3] += dt
        else:
            self.cycles += 1
            self.call_sizes[what[0]] += 1
            self._cur[1:3] = what
            self._cur[4] += dt

    @contextlib.contextmanager
    def waiting(self):
        t = time.perf_counter()
        yield
        dt = time.perf_counter() - t
        self.wait_s += dt
        self._cur[5] += dt
