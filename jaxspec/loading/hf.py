"""HF model directories: config.json + safetensors (single or sharded), or torch `.bin` files
read with `torch.load(weights_only=True)` when torch is installed (never a plain unpickle)."""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Dict, List, Tuple

import ml_dtypes
import numpy as np

from jaxspec.config import ConfigError, ModelConfig
from jaxspec.loading.common import WeightsError

_ST_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}
_ST_OTHER_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2,
                   "I32": 4, "U32": 4, "I64": 8, "U64": 8}
# Header of a safetensors file is bounded by the format (100 MB); a larger length field means the
# file is not safetensors, and reading it would only waste memory.
_ST_MAX_HEADER = 100 * 2**20


def read_config(model_dir: Path) -> ModelConfig:
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir}: no config.json (not an HF model directory)")
    try:
        d = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WeightsError(f"{path}: not valid JSON ({e})") from None
    try:
        return ModelConfig.from_hf(d)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


class SafetensorsFile:
    """One safetensors file, memory-mapped; the header is checked against the file size so a
    truncated download is reported instead of read past."""

    def __init__(self, path: Path):
        self.path = path
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise WeightsError(f"{path}: truncated safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > min(_ST_MAX_HEADER, size - 8):
                raise WeightsError(f"{path}: corrupt or truncated safetensors file (header of "
                                   f"{n} bytes in a file of {size})")
            raw = fh.read(n)
        try:
            header = json.loads(raw)
            if not isinstance(header, dict):
                raise ValueError("header is not a JSON object")
        except (UnicodeDecodeError, ValueError) as e:
            raise WeightsError(f"{path}: corrupt safetensors header ({e})") from None
        header.pop("__metadata__", None)
        self.data_start = 8 + n
        self.entries: Dict[str, Tuple[str, Tuple[int, ...], int, int]] = {}
        for name, e in header.items():
            try:
                dt_name, shape, (lo, hi) = e["dtype"], tuple(int(s) for s in e["shape"]), e["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise WeightsError(f"{path}: corrupt safetensors entry for {name!r}") from None
            if dt_name not in _ST_DTYPES and dt_name not in _ST_OTHER_SIZES:
                raise WeightsError(f"{path}: tensor {name!r} has unknown dtype {dt_name!r}")
            itemsize = _ST_DTYPES[dt_name].itemsize if dt_name in _ST_DTYPES else _ST_OTHER_SIZES[dt_name]
            if hi - lo != int(np.prod(shape)) * itemsize or lo < 0:
                raise WeightsError(f"{path}: corrupt safetensors entry for {name!r} "
                                   f"(shape {shape} does not fit offsets {lo}..{hi})")
            if self.data_start + hi > size:
                raise WeightsError(f"{path}: truncated safetensors file: tensor {name!r} ends at "
                                   f"byte {self.data_start + hi}, file has {size}")
            self.entries[name] = (dt_name, shape, lo, hi)
        self._mm = None

    def read(self, name: str) -> np.ndarray:
        dt_name, shape, lo, hi = self.entries[name]
        if dt_name not in _ST_DTYPES:
            raise WeightsError(f"{self.path}: tensor {name!r} has dtype {dt_name}; only floating "
                               f"point weights ({', '.join(_ST_DTYPES)}) are supported")
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        raw = self._mm[self.data_start + lo:self.data_start + hi]
        return np.frombuffer(raw, dtype=_ST_DTYPES[dt_name]).reshape(shape)


# A multimodal checkpoint's language model under the names of a text-only one (Gemma 3 4B+:
# Gemma3ForConditionalGeneration, saved as language_model.model.* by transformers 4 and 5, or
# model.language_model.*); its other towers are left out.
_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_OTHER_TOWERS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                 "model.multi_modal_projector.")


class HFSource:
    """Tensors of an HF directory under their HF names (with the `model.` prefix; a multimodal
    checkpoint's language model as a text-only model's)."""

    def __init__(self, model_dir: Path):
        self.dir = model_dir
        self.files = weight_files(model_dir)
        self._where: Dict[str, object] = {}
        self._keys: Dict[str, str] = {}
        self._shapes: Dict[str, Tuple[int, ...]] = {}
        if self.files[0].suffix == ".safetensors":
            for f in self.files:
                st = SafetensorsFile(f)
                for name, (_, shape, _, _) in st.entries.items():
                    self._add(name, st, shape)
        else:
            for f in self.files:
                sd = _torch_load(f)
                for name, arr in sd.items():
                    self._add(name, arr, arr.shape)

    def _add(self, key, where, shape):
        if key.startswith(_OTHER_TOWERS):
            return
        name = key
        for prefix, text in _TEXT_PREFIXES:
            if name.startswith(prefix):
                name = text + name[len(prefix):]
        # Checkpoints saved from the bare decoder lack the "model." prefix.
        if not name.startswith(("model.", "lm_head.")):
            name = "model." + name
        self._where[name] = where
        self._keys[name] = key
        self._shapes[name] = tuple(shape)

    def names(self):
        return self._where.keys()

    def shape(self, name):
        return self._shapes[name]

    def describe(self, name):
        return repr(self._keys.get(name, name))

    def read(self, name):
        w = self._where[name]
        return w.read(self._keys[name]) if isinstance(w, SafetensorsFile) else w


def weight_files(model_dir: Path) -> List[Path]:
    """The checkpoint's files: safetensors preferred; an index lists the shards."""
    for index, single in (("model.safetensors.index.json", "model.safetensors"),
                          ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        ipath = model_dir / index
        if ipath.is_file():
            try:
                shards = sorted(set(json.loads(ipath.read_text())["weight_map"].values()))
            except (UnicodeDecodeError, ValueError, KeyError, AttributeError) as e:
                raise WeightsError(f"{ipath}: corrupt index ({e!r})") from None
            missing = [s for s in shards if not (model_dir / s).is_file()]
            if missing:
                raise FileNotFoundError(f"{ipath}: shard(s) {', '.join(missing)} not found")
            return [model_dir / s for s in shards]
        if (model_dir / single).is_file():
            return [model_dir / single]
    found = sorted(model_dir.glob("*.safetensors")) or sorted(model_dir.glob("*.bin"))
    if not found:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors or *.bin weight files")
    return found


def _torch_load(path: Path) -> Dict[str, np.ndarray]:
    try:
        import torch  # only for legacy .bin checkpoints
    except ImportError:
        raise WeightsError(f"{path}: a torch .bin checkpoint needs torch to be read safely; "
                           f"install torch or convert the model to safetensors") from None
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises many types for a bad file
        raise WeightsError(f"{path}: cannot read torch checkpoint ({type(e).__name__}: {e})") from None
    out = {}
    for name, t in sd.items():
        if not t.is_floating_point():
            continue  # buffers such as position ids; a needed tensor then shows as missing
        out[name] = t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()
    return out


def fingerprint_files(model_dir: Path) -> List[Tuple[str, int, int]]:
    """(absolute path, size, mtime_ns) of config.json and every weight file, for the cache key."""
    paths = [model_dir / "config.json", *weight_files(model_dir)]
    return [(str(p.resolve()), (s := os.stat(p)).st_size, s.st_mtime_ns) for p in paths]
