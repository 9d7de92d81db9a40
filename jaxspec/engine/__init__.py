"""Continuous batching over a static set of slots: see loop.py for the scheduling."""
from jaxspec.engine.backends import PlainBackend, SpecBackend
from jaxspec.engine.loop import Engine, EngineStats, Request, StreamDelta, freeze_startup_heap

__all__ = ["Engine", "EngineStats", "PlainBackend", "Request", "SpecBackend", "StreamDelta",
           "freeze_startup_heap"]
