"""jaxspec: EAGLE speculative decoding for Llama-family models in JAX, with Pallas GPU kernels."""
from jaxspec.config import ConfigError, ModelConfig
from jaxspec.sampling import SamplingParams

# name -> module; imported on first use so `import jaxspec` stays light (LLM pulls in loaders)
_LAZY = {"LLM": "jaxspec.llm", "RequestOutput": "jaxspec.llm",
         "EngineConfig": "jaxspec.engine.config", "SpecConfig": "jaxspec.spec.config",
         "DraftConfig": "jaxspec.spec.config"}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jaxspec' has no attribute {name!r}")


__all__ = ["LLM", "RequestOutput", "SamplingParams", "EngineConfig", "SpecConfig", "DraftConfig",
           "ModelConfig", "ConfigError"]
