"""GGUF files (llama.cpp), read with the `gguf` package and dequantized to numpy; no torch.

llama.cpp's converter permutes the rows of Q and K of "llama" models so that its RoPE can rotate
adjacent pairs; the forward here (like HF) rotates halves, so the permutation is undone on load.
For Gemma it stores every norm weight plus one (its RMSNorm multiplies by the weight, Gemma's by
1 + weight); the one is taken off on load, so the params mean what an HF checkpoint's do.
"""
from __future__ import annotations

import collections
import dataclasses
import os
import re
import weakref
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import numpy as np

from jaxspec.config import ConfigError, ModelConfig, RopeScaling, model_config_from_gguf
from jaxspec.loading.common import WeightsError

# Types whose dequantization `gguf` implements and whose outputs have been compared to llama.cpp.
SUPPORTED_QUANTS = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# Arrays of the tokenizer: large, and wanted only by the tokenizer.
_TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                     "tokenizer.ggml.scores")

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias", "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# Gemma's four norms a layer: "ffn_norm" is the MLP's input norm as in llama, which HF names
# pre_feedforward_layernorm there (its post_attention_layernorm follows the attention).
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES, "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_GEMMA_ARCHS = ("gemma2", "gemma3")
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
_BLK = re.compile(r"blk\.(\d+)\.(.+)")


def layer_names(arch: str) -> Dict[str, str]:
    """GGUF tensor name within a block -> HF name within a layer, for `general.architecture`."""
    return _GEMMA_LAYER_NAMES if arch in _GEMMA_ARCHS else _LAYER_NAMES


def hf_name(gguf_name: str, arch: str = "llama") -> Optional[str]:
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    m = _BLK.fullmatch(gguf_name)
    names = layer_names(arch)
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}"
    return None


# Parsing a GGUF's fields is pure Python over every token string: 4 s for SmolLM2's 49,152
# tokens and 48,900 merges, on each load. A process that builds several LLMs on one file (a
# script comparing settings, the test suite) parses it once: readers are kept by the file's
# identity (path, size, mtime, inode), so a file rewritten in place is read and checked again.
_READERS: "collections.OrderedDict[tuple, Any]" = collections.OrderedDict()
_KEEP_READERS = 2
_METADATA: "weakref.WeakKeyDictionary[Any, Dict[bool, Dict[str, Any]]]" = weakref.WeakKeyDictionary()


def open_gguf(path: Path, reuse: bool = True):
    """A `gguf.GGUFReader`, with every way a damaged file fails turned into a WeightsError.

    reuse: hand back the reader of an earlier call on the same unchanged file (read-only: it
    maps the file and holds the parsed fields)."""
    st = Path(path).stat()
    key = (str(Path(path).resolve()), st.st_size, st.st_mtime_ns, st.st_ino)
    if reuse and key in _READERS:
        _READERS.move_to_end(key)
        return _READERS[key]
    reader = _open_checked(Path(path), st.st_size)
    if reuse:
        _READERS[key] = reader
        while len(_READERS) > _KEEP_READERS:
            _READERS.popitem(last=False)
    return reader


def _open_checked(path: Path, size: int):
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - the reader raises many types on a damaged file
        raise WeightsError(f"{path}: not a readable GGUF file, corrupt or truncated ({size} bytes; "
                           f"{type(e).__name__}: {e})") from None
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size or t.data.nbytes != int(t.n_bytes):
            raise WeightsError(f"{path}: truncated GGUF file: tensor {t.name!r} ends at byte "
                               f"{end}, file has {size}")
    return reader


def metadata(reader, include_tokenizer: bool = False) -> Dict[str, Any]:
    """Key -> plain Python value (str, int, float, bool, list); a new dict each call, its values
    converted once per reader (the tokenizer's lists are shared: read them, don't change them)."""
    done = _METADATA.setdefault(reader, {})
    if include_tokenizer not in done:
        out = {}
        for k, field in reader.fields.items():
            if k.startswith("GGUF.") or (k in _TOKENIZER_ARRAYS and not include_tokenizer):
                continue
            try:
                out[k] = field.contents()
            except Exception as e:  # noqa: BLE001
                raise WeightsError(f"{reader.data.filename}: corrupt GGUF metadata {k!r} "
                                   f"({e})") from None
        done[include_tokenizer] = out
    return dict(done[include_tokenizer])


def read_config(path: Path, reader) -> ModelConfig:
    meta = metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    if "tokenizer.ggml.tokens" in reader.fields:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    elif "token_embd.weight" in tensors:
        vocab = int(tensors["token_embd.weight"].shape[1])
    else:
        raise WeightsError(f"{path}: neither a token list nor token_embd.weight; vocab size unknown")
    try:
        cfg = model_config_from_gguf(meta, vocab_size=vocab,
                                     tie_word_embeddings="output.weight" not in tensors)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    if "rope_freqs.weight" in tensors:
        freqs = _dequantize(path, tensors["rope_freqs.weight"]).reshape(-1)
        cfg = dataclasses.replace(cfg, rope_scaling=_llama3_scaling_from_factors(path, cfg, freqs))
    return cfg


def _llama3_scaling_from_factors(path, cfg: ModelConfig, factors: np.ndarray) -> RopeScaling:
    """llama.cpp stores llama3 RoPE scaling as per-frequency divisors; recover the parameters
    (the released models use one of a few settings) so the forward computes the same frequencies."""
    from jaxspec.models.llama import rope_inv_freq

    base = rope_inv_freq(dataclasses.replace(cfg, rope_scaling=None)).astype(np.float64)
    for factor in (8.0, 16.0, 32.0, 4.0, 2.0):
        for orig in (8192, 4096, 2048, 16384):
            rs = RopeScaling("llama3", factor, 1.0, 4.0, orig)
            scaled = rope_inv_freq(dataclasses.replace(cfg, rope_scaling=rs)).astype(np.float64)
            if factors.shape == base.shape and np.allclose(base / scaled, factors, rtol=1e-4):
                return rs
    raise WeightsError(f"{path}: tensor 'rope_freqs.weight' matches no llama3 RoPE scaling "
                       f"this loader knows")


def _dequantize(path, t) -> np.ndarray:
    import gguf

    qtype = t.tensor_type.name
    if qtype not in SUPPORTED_QUANTS:
        raise WeightsError(f"{path}: tensor {t.name!r} has unsupported type {qtype}; "
                           f"supported: {', '.join(SUPPORTED_QUANTS)}")
    shape = tuple(int(s) for s in reversed(t.shape))  # GGUF lists dims innermost first
    try:
        return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type)).reshape(shape)
    except Exception as e:  # noqa: BLE001
        raise WeightsError(f"{path}: cannot dequantize tensor {t.name!r} ({qtype}): {e}") from None


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp convert_hf_to_gguf `LlamaModel.permute` on rows [n_head * D, ...]."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFSource:
    def __init__(self, path: Path, reader, cfg: ModelConfig):
        self.path, self.cfg = path, cfg
        self.arch = reader.fields["general.architecture"].contents()
        self.permuted = self.arch == "llama"
        self.norm_shift = self.arch in _GEMMA_ARCHS
        self._t = {}
        for t in reader.tensors:
            n = hf_name(t.name, self.arch)
            if n is not None:
                self._t[n] = t
        for t in self._t.values():
            if t.tensor_type.name not in SUPPORTED_QUANTS:
                raise WeightsError(f"{path}: tensor {t.name!r} has unsupported type "
                                   f"{t.tensor_type.name}; supported: {', '.join(SUPPORTED_QUANTS)}")

    def names(self):
        return self._t.keys()

    def shape(self, name) -> Tuple[int, ...]:
        return tuple(int(s) for s in reversed(self._t[name].shape))

    def describe(self, name):
        t = self._t.get(name)
        if t is not None:
            return repr(t.name)
        gg = {v: k for k, v in _TOP_NAMES.items()}.get(name)
        if gg is None:
            m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
            inv = {v: k for k, v in layer_names(self.arch).items()}
            gg = f"blk.{m.group(1)}.{inv[m.group(2)]}" if m and m.group(2) in inv else name
        return repr(gg)

    def read(self, name) -> np.ndarray:
        w = _dequantize(self.path, self._t[name])
        if self.permuted and ".self_attn.q_proj." in name:
            w = _unpermute(w, self.cfg.num_heads)
        elif self.permuted and ".self_attn.k_proj." in name:
            w = _unpermute(w, self.cfg.num_kv_heads)
        elif self.norm_shift and name.endswith("norm.weight"):
            w = w.astype(np.float32) - 1.0
        return w


def fingerprint(path: Path):
    s = os.stat(path)
    return [(str(path.resolve()), s.st_size, s.st_mtime_ns)]
