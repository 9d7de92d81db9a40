"""Shared fixtures: the real SmolLM2 GGUF, HF transformers on it, tiny random HF model dirs."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest


@pytest.fixture(scope="session", autouse=True)
def _isolated_params_cache(tmp_path_factory):
    """Converted-params cache in a temp dir, so tests neither read nor fill ~/.cache/jaxspec."""
    old = os.environ.get("JAXSPEC_CACHE")
    os.environ["JAXSPEC_CACHE"] = str(tmp_path_factory.mktemp("jaxspec-cache"))
    yield
    if old is None:
        os.environ.pop("JAXSPEC_CACHE", None)
    else:
        os.environ["JAXSPEC_CACHE"] = old


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from jaxspec.weights import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2_loaded(smollm2_gguf):
    """(cfg, params, tokenizer) from our loader, fp32."""
    import jax.numpy as jnp

    from jaxspec.weights import load_model

    return load_model(smollm2_gguf, dtype=jnp.float32)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf):
    """HF transformers' own model and tokenizer on the same GGUF file (about 15 s)."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, name = str(smollm2_gguf.parent), smollm2_gguf.name
    try:
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    except ValueError as e:
        if "accelerate" not in str(e):
            raise
        model = _hf_gguf_model_without_accelerate(smollm2_gguf)
    model.eval()
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    return model, tok


def _hf_gguf_model_without_accelerate(path: Path):
    """What `from_pretrained(gguf_file=...)` does, minus its hard requirement on `accelerate`:
    transformers' own GGUF config, dequantization and Q/K un-permutation."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    return model


TINY_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                   rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)


def tiny_hf_config(kind: str):
    """Small transformers configs that exercise each supported family's differences."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    if kind == "llama3":
        return LlamaConfig(**TINY_COMMON, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
    if kind == "qwen2":
        return Qwen2Config(**TINY_COMMON, rope_theta=1000000.0, tie_word_embeddings=True)
    if kind == "mistral":
        return MistralConfig(**TINY_COMMON, sliding_window=256)
    raise ValueError(kind)


def _make_tiny(root: Path, kind: str, shard: bool):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    torch.manual_seed({"llama3": 1, "qwen2": 2, "mistral": 3}[kind])
    model = AutoModelForCausalLM.from_config(tiny_hf_config(kind), dtype=torch.float32)
    with torch.no_grad():  # HF initializes norms to 1 and biases to 0: randomize to test them
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.eval()
    out = root / kind
    model.save_pretrained(out, max_shard_size="100KB" if shard else "1GB")
    return out, model


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """kind -> (model dir, HF model); llama3 is saved sharded."""
    root = tmp_path_factory.mktemp("tiny-hf")
    cache = {}

    def get(kind: str):
        if kind not in cache:
            cache[kind] = _make_tiny(root, kind, shard=(kind == "llama3"))
        return cache[kind]

    return get


def max_kl_per_token(ref_logits, logits) -> float:
    """max over tokens of KL(softmax(ref) || softmax(logits)), in fp64."""
    ref = np.asarray(ref_logits, np.float64)
    got = np.asarray(logits, np.float64)
    lp = ref - np.logaddexp.reduce(ref, axis=-1, keepdims=True)
    lq = got - np.logaddexp.reduce(got, axis=-1, keepdims=True)
    return float((np.exp(lp) * (lp - lq)).sum(-1).max())
