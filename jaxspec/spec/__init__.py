"""EAGLE speculative decoding: configuration, drafting, tree, verify, the jitted cycle, runner."""
from jaxspec.spec.config import PRESETS, SpecConfig, resolve_spec
from jaxspec.spec.cycle import CycleOut, SpecState, cycle, init_state, jit_cycle, jit_prefill, prefill
from jaxspec.spec.runner import SpecResult, SpecRunner

__all__ = ["PRESETS", "SpecConfig", "resolve_spec", "CycleOut", "SpecState", "cycle", "init_state",
           "jit_cycle", "jit_prefill", "prefill", "SpecResult", "SpecRunner"]
