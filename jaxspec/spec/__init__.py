"""EAGLE speculative decoding: configuration, drafting, tree, verify and the jitted cycle."""
from jaxspec.spec.config import PRESETS, SpecConfig, resolve_spec
from jaxspec.spec.cycle import CycleOut, SpecState, cycle, init_state, jit_cycle

__all__ = ["PRESETS", "SpecConfig", "resolve_spec", "CycleOut", "SpecState", "cycle", "init_state",
           "jit_cycle"]
