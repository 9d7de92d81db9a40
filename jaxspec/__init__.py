"""jaxspec: EAGLE speculative decoding for Llama-family models in JAX, with Pallas GPU kernels."""
from jaxspec.config import ConfigError, ModelConfig
from jaxspec.sampling import SamplingParams


def __getattr__(name):
    # LLM pulls in the loaders; import it lazily so `import jaxspec` stays light.
    if name in ("LLM", "RequestOutput"):
        from jaxspec import llm
        return getattr(llm, name)
    raise AttributeError(name)


__all__ = ["LLM", "RequestOutput", "SamplingParams", "ModelConfig", "ConfigError"]
