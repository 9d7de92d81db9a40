"""Continuous batching over a static set of slots (see engine.py for the step).

    request.py        requests, stream deltas, outputs
    scheduler.py      admission order, KV budget, retract (host only)
    prefill_plan.py   admission shapes: buckets and packing (host only)
    admission.py      the device admission programs, one implementation for both backends
    backends.py       the plain and speculative backends, built over a placement
    compile.py        executables and ahead-of-time warm-up
    output.py         stops, detokenization, stream deltas
    engine.py         `Engine.step`, which glues them
    config.py         EngineConfig, every option documented once
"""
from jaxspec.engine.backends import PlainBackend, SpecBackend
from jaxspec.engine.compile import freeze_startup_heap
from jaxspec.engine.config import EngineConfig
from jaxspec.engine.engine import Engine
from jaxspec.engine.request import Request, RequestOutput, StreamDelta
from jaxspec.engine.stats import EngineStats

__all__ = ["Engine", "EngineConfig", "EngineStats", "PlainBackend", "Request", "RequestOutput",
           "SpecBackend", "StreamDelta", "freeze_startup_heap"]
