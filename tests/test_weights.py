"""Loader behaviour: GGUF round trips, HF directory variants, the conversion cache, bad input."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxspec.config import ConfigError, ModelConfig
from jaxspec.loading import cache as params_cache
from jaxspec.loading import common
from jaxspec.loading.common import WeightsError, expected_shapes
from jaxspec.weights import load_model, load_params

Q = gguf.GGMLQuantizationType

TINY = ModelConfig(arch="LlamaForCausalLM", vocab_size=96, hidden_size=64, intermediate_size=96,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
                   rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=True)

_GGUF_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
_GGUF_LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
               "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
               "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
               "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
               "self_attn.v_proj.bias": "attn_v.bias", "mlp.gate_proj.weight": "ffn_gate.weight",
               "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}


def random_hf_tensors(cfg: ModelConfig, seed=0):
    rng = np.random.default_rng(seed)
    return {n: (1.0 if "norm" in n else 0.0) + 0.1 * rng.standard_normal(s).astype(np.float32)
            for n, s in expected_shapes(cfg).items()}


def hf_config_json(cfg: ModelConfig, **over):
    d = {"architectures": [cfg.arch], "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
         "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
         "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
         "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
         "max_position_embeddings": cfg.max_position_embeddings,
         "tie_word_embeddings": cfg.tie_word_embeddings}
    d.update(over)
    return d


def write_hf_dir(path: Path, cfg: ModelConfig, tensors, **config_over) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config_json(cfg, **config_over)))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def llama_cpp_permute(w, n_head):
    """convert_hf_to_gguf `LlamaModel.permute`: interleave the RoPE halves of each head."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, cfg: ModelConfig, tensors, arch="llama", quant=None, extra=None):
    """A GGUF as llama.cpp's converter writes it (Q/K permuted for "llama"); `quant` maps HF
    names to a GGML type."""
    quant = quant or {}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    for name, arr in tensors.items():
        if name in _GGUF_TOP:
            gname = _GGUF_TOP[name]
        else:
            i, rest = name[len("model.layers."):].split(".", 1)
            gname = f"blk.{i}.{_GGUF_LAYER[rest]}"
        if arch == "llama" and ".q_proj." in name:
            arr = llama_cpp_permute(arr, cfg.num_heads)
        elif arch == "llama" and ".k_proj." in name:
            arr = llama_cpp_permute(arr, cfg.num_kv_heads)
        qt = quant.get(name, Q.F32)
        if qt == Q.F32:
            w.add_tensor(gname, np.ascontiguousarray(arr, np.float32))
        elif qt == Q.F16:
            w.add_tensor(gname, np.ascontiguousarray(arr, np.float16))
        else:
            w.add_tensor(gname, gguf.quants.quantize(arr, qt), raw_dtype=qt)
    for gname, (arr, qt) in (extra or {}).items():
        w.add_tensor(gname, arr, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def assert_params_equal(a, b, rtol=0.0, atol=0.0):
    fa, fb = common.flatten(a), common.flatten(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        np.testing.assert_allclose(np.asarray(fa[k], np.float32), np.asarray(fb[k], np.float32),
                                   rtol=rtol, atol=atol, err_msg=k)


# ---------------------------------------------------------------------------------------------
# GGUF round trips


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_round_trip_matches_safetensors(tmp_path, arch):
    cfg = TINY if arch == "llama" else dataclasses.replace(
        TINY, arch="Qwen2ForCausalLM", attention_bias=True, tie_word_embeddings=False)
    tensors = random_hf_tensors(cfg)
    q8 = "model.layers.0.self_attn.q_proj.weight"  # quantized and permuted: both must be undone
    f16 = "model.layers.1.mlp.up_proj.weight"
    write_gguf(tmp_path / "m.gguf", cfg, tensors, arch=arch, quant={q8: Q.Q8_0, f16: Q.F16})

    expect = dict(tensors)
    expect[q8] = gguf.quants.dequantize(gguf.quants.quantize(tensors[q8], Q.Q8_0), Q.Q8_0)
    expect[f16] = tensors[f16].astype(np.float16).astype(np.float32)
    write_hf_dir(tmp_path / "hf", cfg, expect)

    cfg_g, p_g = load_params(tmp_path / "m.gguf", dtype=jnp.float32, use_cache=False)
    cfg_h, p_h = load_params(tmp_path / "hf", dtype=jnp.float32, use_cache=False)
    assert cfg_g.arch == cfg.arch and cfg_g.tie_word_embeddings == cfg.tie_word_embeddings
    assert cfg_g.attention_bias == cfg.attention_bias
    assert dataclasses.replace(cfg_h, eos_token_ids=(), bos_token_id=None, sliding_window=None) == \
        dataclasses.replace(cfg_g, eos_token_ids=(), bos_token_id=None, sliding_window=None)
    assert_params_equal(p_g, p_h)
    assert not np.allclose(expect[q8], tensors[q8])  # the quantization did change values


def test_gguf_without_unpermute_would_differ(tmp_path):
    """Guards the test above: the permutation is not the identity at these sizes."""
    w = random_hf_tensors(TINY)["model.layers.0.self_attn.q_proj.weight"]
    assert not np.array_equal(llama_cpp_permute(w, TINY.num_heads), w)


def test_gguf_llama3_rope_freqs_recovered(tmp_path):
    from jaxspec.config import RopeScaling
    from jaxspec.models.llama import rope_inv_freq

    rs = RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    cfg = dataclasses.replace(TINY, rope_theta=500000.0, rope_scaling=rs)
    base = rope_inv_freq(dataclasses.replace(cfg, rope_scaling=None))
    factors = (base.astype(np.float64) / rope_inv_freq(cfg)).astype(np.float32)
    write_gguf(tmp_path / "m.gguf", cfg, random_hf_tensors(cfg),
               extra={"rope_freqs.weight": (factors, Q.F32)})
    got, _ = load_params(tmp_path / "m.gguf", use_cache=False)
    assert got.rope_scaling == rs and got.rope_theta == 500000.0


def test_default_model_facts(smollm2_loaded):
    cfg, params, tok = smollm2_loaded
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim, cfg.intermediate_size, cfg.vocab_size) == \
        ("LlamaForCausalLM", 30, 576, 9, 3, 64, 1536, 49152)
    assert cfg.tie_word_embeddings and "lm_head" not in params and cfg.rope_theta == 100000.0
    assert params["layers"]["wqkv"].shape == (30, 576, 576 + 2 * 192)
    assert params["embed"].dtype == jnp.float32
    assert tok.decode(list(tok.eos_token_ids)) == "<|im_end|>"


# ---------------------------------------------------------------------------------------------
# HF directory variants, dtype, cache


def test_bf16_load(tmp_path):
    tensors = random_hf_tensors(TINY)
    write_hf_dir(tmp_path / "hf", TINY, tensors)
    _, p32 = load_params(tmp_path / "hf", dtype=jnp.float32, use_cache=False)
    _, p16 = load_params(tmp_path / "hf", dtype=jnp.bfloat16, use_cache=False)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(p16))
    assert_params_equal(p16, jax.tree.map(lambda x: x.astype(jnp.bfloat16), p32))


def test_bf16_safetensors_source(tmp_path):
    tensors = random_hf_tensors(TINY)
    bf = {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
    write_hf_dir(tmp_path / "hf", TINY, bf)
    _, p = load_params(tmp_path / "hf", dtype=jnp.float32, use_cache=False)
    np.testing.assert_array_equal(np.asarray(p["embed"]),
                                  bf["model.embed_tokens.weight"].astype(np.float32))


def test_torch_bin_checkpoint(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    tensors = random_hf_tensors(TINY)
    write_hf_dir(tmp_path / "st", TINY, tensors)
    d = tmp_path / "bin"
    d.mkdir()
    shutil.copy(tmp_path / "st" / "config.json", d)
    torch.save({k: torch.from_numpy(v) for k, v in tensors.items()}, d / "pytorch_model.bin")
    _, p_bin = load_params(d, use_cache=False)
    _, p_st = load_params(tmp_path / "st", use_cache=False)
    assert_params_equal(p_bin, p_st)
    monkeypatch.setitem(sys.modules, "torch", None)  # as if torch were not installed
    with pytest.raises(WeightsError, match="needs torch"):
        load_params(d, use_cache=False)


def test_cache_hit_and_corrupt_entry_rebuilt(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path / "cache"))
    write_gguf(tmp_path / "m.gguf", TINY, random_hf_tensors(TINY),
               quant={"model.embed_tokens.weight": Q.Q8_0})
    _, first = load_params(tmp_path / "m.gguf")
    entries = list((tmp_path / "cache").glob("params-*.safetensors"))
    assert len(entries) == 1

    def no_conversion(*a, **k):
        raise AssertionError("converted again despite a cache entry")

    with monkeypatch.context() as m:
        m.setattr("jaxspec.weights.assemble", no_conversion)
        _, second = load_params(tmp_path / "m.gguf")
    assert_params_equal(first, second)

    entries[0].write_bytes(entries[0].read_bytes()[:1000])  # a torn write
    _, third = load_params(tmp_path / "m.gguf")
    assert "damaged params cache entry" in caplog.text
    assert_params_equal(first, third)
    assert params_cache.SafetensorsFile(entries[0]).entries  # rebuilt and readable

    _, p16 = load_params(tmp_path / "m.gguf", dtype=jnp.bfloat16)  # dtype is part of the key
    assert p16["embed"].dtype == jnp.bfloat16
    assert len(list((tmp_path / "cache").glob("params-*.safetensors"))) == 2


def test_gguf_parsed_once_a_process_until_the_file_changes(tmp_path):
    """A second load of an unchanged GGUF reuses the parsed reader; a file rewritten in place
    (new size or mtime) is parsed and checked again, so a damaged rewrite is still an error."""
    from jaxspec.loading import gguf_file
    path = tmp_path / "m.gguf"
    tensors = random_hf_tensors(TINY)
    write_gguf(path, TINY, tensors)
    first = gguf_file.open_gguf(path)
    assert gguf_file.open_gguf(path) is first
    assert gguf_file.open_gguf(path, reuse=False) is not first
    meta = gguf_file.metadata(first)
    meta["general.architecture"] = "changed by a caller"
    assert gguf_file.metadata(first)["general.architecture"] == "llama"   # a new dict each call

    other = dict(tensors)
    other["model.norm.weight"] = tensors["model.norm.weight"] + 1.0
    write_gguf(path, TINY, other)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1_000_000))
    second = gguf_file.open_gguf(path)
    assert second is not first
    _, p = load_params(path, dtype=jnp.float32, use_cache=False)
    np.testing.assert_array_equal(np.asarray(p["final_norm"]), other["model.norm.weight"])

    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
    with pytest.raises(WeightsError, match="truncated GGUF file|not a readable GGUF"):
        gguf_file.open_gguf(path)


def test_load_model_does_not_import_torch(smollm2_gguf):
    code = ("import sys; from jaxspec.weights import load_model; "
            "cfg, p, tok = load_model(); tok.apply_chat_template([{'role': 'user', 'content': 'hi'}]); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"


# ---------------------------------------------------------------------------------------------
# Bad input: each a clear exception naming the problem


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_params(tmp_path / "empty")
    write_hf_dir(tmp_path / "hf", TINY, random_hf_tensors(TINY))
    (tmp_path / "hf" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_params(tmp_path / "hf")


def test_truncated_and_corrupt_safetensors(tmp_path):
    d = write_hf_dir(tmp_path / "hf", TINY, random_hf_tensors(TINY))
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightsError, match="truncated safetensors file: tensor '.*' ends at byte"):
        load_params(d, use_cache=False)
    f.write_bytes(data[:6])
    with pytest.raises(WeightsError, match="truncated safetensors"):
        load_params(d, use_cache=False)
    f.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all" + data[100:])
    with pytest.raises(WeightsError, match="corrupt safetensors header"):
        load_params(d, use_cache=False)
    f.write_bytes(os.urandom(4096))
    with pytest.raises(WeightsError, match="corrupt"):
        load_params(d, use_cache=False)


def test_truncated_and_corrupt_gguf(tmp_path, smollm2_gguf):
    trunc = tmp_path / "trunc.gguf"
    with open(smollm2_gguf, "rb") as src, open(trunc, "wb") as dst:
        dst.write(src.read(smollm2_gguf.stat().st_size // 2))
    with pytest.raises(WeightsError, match="truncated GGUF file|not a readable GGUF"):
        load_model(trunc, use_cache=False)
    with open(smollm2_gguf, "rb") as src, open(trunc, "wb") as dst:
        dst.write(src.read(200_000))  # cut inside the tokenizer metadata
    with pytest.raises(WeightsError, match="not a readable GGUF"):
        load_model(trunc, use_cache=False)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + os.urandom(5000))
    with pytest.raises(WeightsError, match="not a readable GGUF"):
        load_model(junk, use_cache=False)


def test_unsupported_architecture(tmp_path):
    write_hf_dir(tmp_path / "gpt2", TINY, random_hf_tensors(TINY), architectures=["GPT2LMHeadModel"])
    with pytest.raises(ConfigError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_model(tmp_path / "gpt2")
    write_gguf(tmp_path / "g.gguf", TINY, random_hf_tensors(TINY), arch="gemma")
    with pytest.raises(ConfigError, match="unsupported GGUF architecture 'gemma'"):
        load_params(tmp_path / "g.gguf")


def test_unsupported_quant_type(tmp_path):
    tensors = random_hf_tensors(TINY)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    byte_shape = gguf.quants.quant_shape_to_byte_shape((TINY.hidden_size, TINY.intermediate_size), Q.IQ4_NL)
    extra = {"blk.1.ffn_down.weight": (np.zeros(byte_shape, np.uint8), Q.IQ4_NL)}
    write_gguf(tmp_path / "m.gguf", TINY, tensors, extra=extra)
    with pytest.raises(WeightsError, match="tensor 'blk.1.ffn_down.weight' has unsupported type IQ4_NL"):
        load_params(tmp_path / "m.gguf", use_cache=False)


def test_wrong_shape_missing_tensor_and_integer_dtype(tmp_path):
    tensors = random_hf_tensors(TINY)
    write_hf_dir(tmp_path / "a", TINY, tensors, intermediate_size=128)
    with pytest.raises(WeightsError, match=r"tensor 'model.layers.0.mlp.gate_proj.weight' has shape "
                                           r"\(96, 64\), expected \(128, 64\)"):
        load_params(tmp_path / "a", use_cache=False)

    missing = {k: v for k, v in tensors.items() if k != "model.layers.1.self_attn.k_proj.weight"}
    write_hf_dir(tmp_path / "b", TINY, missing)
    with pytest.raises(WeightsError, match="missing tensor.*'model.layers.1.self_attn.k_proj.weight'"):
        load_params(tmp_path / "b", use_cache=False)

    ints = dict(tensors, **{"model.norm.weight": np.ones(TINY.hidden_size, np.int32)})
    write_hf_dir(tmp_path / "c", TINY, ints)
    with pytest.raises(WeightsError, match="'model.norm.weight' has dtype I32; only floating"):
        load_params(tmp_path / "c", use_cache=False)

    t = random_hf_tensors(TINY)
    t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:16]
    write_gguf(tmp_path / "d.gguf", TINY, t)
    with pytest.raises(WeightsError, match=r"tensor 'blk.0.attn_k.weight' has shape \(16, 64\), "
                                           r"expected \(32, 64\)"):
        load_params(tmp_path / "d.gguf", use_cache=False)


def test_unexpected_bias_is_refused(tmp_path):
    tensors = random_hf_tensors(TINY)
    tensors["model.layers.0.self_attn.o_proj.bias"] = np.ones(TINY.hidden_size, np.float32)
    write_hf_dir(tmp_path / "hf", TINY, tensors)
    with pytest.raises(WeightsError, match="o_proj.bias' is a bias"):
        load_params(tmp_path / "hf", use_cache=False)


def test_gguf_without_tokenizer(tmp_path):
    write_gguf(tmp_path / "m.gguf", TINY, random_hf_tensors(TINY))
    with pytest.raises(WeightsError, match="carries no tokenizer"):
        load_model(tmp_path / "m.gguf", use_cache=False)
