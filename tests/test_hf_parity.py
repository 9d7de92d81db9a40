"""Parity with HF transformers: real SmolLM2 weights from the GGUF, tiny random Llama-3 / Qwen2 /
Mistral checkpoints, and the GGUF tokenizer."""
from __future__ import annotations

import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import max_kl_per_token
from jaxspec.kv import init_cache
from jaxspec.models import llama
from jaxspec.weights import load_params

torch = pytest.importorskip("torch")

PROMPT = "The quick brown fox jumps over the lazy dog, and then it ran into the forest to find"


def our_logits(cfg, params, ids):
    """Full forward from an empty cache -> fp32 logits [N, V]."""
    tokens = jnp.asarray([ids], jnp.int32)
    n = tokens.shape[1]
    cache = init_cache(cfg, 1, 8, jnp.float32)
    hidden, _, _, _ = llama.forward(params, cfg, tokens, jnp.arange(n, dtype=jnp.int32)[None],
                                    cache.k, cache.v, jnp.zeros((1,), jnp.int32),
                                    llama.causal_mask(1, n))
    return np.asarray(llama.lm_head(params, cfg, hidden))[0]


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


@pytest.mark.real_weights
def test_smollm2_gguf_logits_match_transformers(smollm2_loaded, hf_smollm2):
    cfg, params, tok = smollm2_loaded
    model, _ = hf_smollm2
    ids = tok.encode(PROMPT)
    assert 15 <= len(ids) <= 30
    ref = hf_logits(model, ids)
    got = our_logits(cfg, params, ids)
    kl = max_kl_per_token(ref, got)
    print(f"SmolLM2-135M-Instruct GGUF vs transformers: {len(ids)} tokens, max KL/token {kl:.3e}, "
          f"max |dlogit| {np.abs(ref - got).max():.3e}")
    assert kl < 1e-4
    np.testing.assert_array_equal(ref.argmax(-1), got.argmax(-1))


@pytest.mark.parametrize("kind", ["llama3", "qwen2", "mistral"])
def test_tiny_hf_checkpoints_match_transformers(tiny_hf, kind):
    path, model = tiny_hf(kind)
    cfg, params = load_params(path, dtype=jnp.float32)
    assert cfg.attention_bias == (kind == "qwen2")
    assert (cfg.rope_scaling is not None) == (kind == "llama3")
    assert ("lm_head" in params) != cfg.tie_word_embeddings
    ids = list(np.random.default_rng(0).integers(0, cfg.vocab_size, size=24))
    ref = hf_logits(model, ids)
    got = our_logits(cfg, params, ids)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_sharded_checkpoint_is_sharded(tiny_hf):
    path, _ = tiny_hf("llama3")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 1


TOKENIZER_TEXTS = [
    "Hello, world!",
    "  Leading spaces and\ttabs\nnew lines\n\n",
    "Ünïcödé: 日本語のテキスト, emoji 🤗 and accents café",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "def f(x):\n    return x ** two  # code",
]


def test_gguf_tokenizer_matches_transformers(smollm2_loaded, hf_smollm2):
    _, _, tok = smollm2_loaded
    _, ref = hf_smollm2
    for text in TOKENIZER_TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text), text
        assert tok.decode(ids) == ref.decode(ids) == text
    msgs = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is the capital of France?"}]
    want = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert tok.render_chat(msgs) == want
    assert tok.apply_chat_template(msgs) == ref.encode(want, add_special_tokens=False)
    assert tok.apply_chat_template(msgs)[-4:] == ref.encode("<|im_start|>assistant\n")
    assert tok.eos_token_ids == (ref.convert_tokens_to_ids("<|im_end|>"),)
    assert tok.pad_token_id == ref.pad_token_id


def test_decode_through_the_backend_equals_the_wrapper(smollm2_loaded):
    """Tokenizer.decode calls the `tokenizers` backend directly (the wrapper's id checks cost
    more than the decode); its text equals the wrapper's on random ids, special ones and
    broken UTF-8 included, with and without skipping special tokens."""
    _, _, tok = smollm2_loaded
    assert tok._backend is not None
    rng = np.random.default_rng(0)
    special = tok.encode("<|im_start|>user<|im_end|>", add_special_tokens=False)
    for n in (1, 7, 128):
        ids = [int(i) for i in rng.integers(0, tok.vocab_size, n)] + special
        for skip in (False, True):
            assert tok.decode(ids, skip) == tok.hf.decode(ids, skip_special_tokens=skip)


def test_gguf_tokenizer_splits_digits_like_smollm2(smollm2_loaded):
    """SmolLM2's tokenizer.json (and llama.cpp's "smollm" pre-tokenizer) split every digit;
    transformers' GGUF path does not, so numbers are checked here on their own."""
    _, _, tok = smollm2_loaded
    ids = tok.encode("year 2024")
    assert [tok.decode([i]) for i in ids[-4:]] == ["2", "0", "2", "4"]


def test_hf_dir_tokenizer(tmp_path, smollm2_loaded, tiny_hf):
    """An HF directory brings its own tokenizer files: load_model wraps what transformers loads
    from them (which may rebuild parts of it from the model type, as it does for Qwen2)."""
    from transformers import AutoTokenizer

    from jaxspec.weights import load_model

    _, _, gguf_tok = smollm2_loaded
    src, _ = tiny_hf("qwen2")
    d = tmp_path / "with-tokenizer"
    shutil.copytree(src, d)
    gguf_tok.hf.save_pretrained(d)
    ref = AutoTokenizer.from_pretrained(d)
    cfg, params, tok = load_model(d, dtype=jnp.float32)
    assert cfg.arch == "Qwen2ForCausalLM" and "bqkv" in params["layers"]
    for text in TOKENIZER_TEXTS:
        assert tok.encode(text) == ref.encode(text)
        assert tok.decode(tok.encode(text)) == text
    msgs = [{"role": "user", "content": "Hi there"}]
    want = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(msgs) == ref.encode(want, add_special_tokens=False)
    assert tok.eos_token_ids[0] == ref.convert_tokens_to_ids("<|im_end|>")
