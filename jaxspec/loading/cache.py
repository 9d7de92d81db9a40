"""On-disk cache of converted params, so a second load skips dequantization and re-layout.

Entries are safetensors files of the flattened params under `$JAXSPEC_CACHE` (default
~/.cache/jaxspec), named by a hash of the source files' absolute paths, sizes and mtimes, the
dtype and the layout version. A damaged entry is removed and rebuilt, never trusted.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import tempfile
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

import ml_dtypes
import numpy as np

from jaxspec import envs
from jaxspec.loading.common import WeightsError
from jaxspec.loading.hf import SafetensorsFile

log = logging.getLogger(__name__)

# Bump when the params layout or the conversion changes, so old entries are not reused.
LAYOUT_VERSION = 1
_NAMES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
          np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.float64): "F64"}


def cache_dir() -> Path:
    return envs.JAXSPEC_CACHE


def cache_key(fingerprint: Sequence[Tuple[str, int, int]], dtype) -> str:
    blob = json.dumps([LAYOUT_VERSION, np.dtype(dtype).name, list(map(list, fingerprint))])
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def entry_path(key: str) -> Path:
    return cache_dir() / f"params-{key}.safetensors"


def load(key: str, shapes: Dict[str, Tuple[int, ...]], dtype) -> Optional[Dict[str, np.ndarray]]:
    """The cached flattened params, or None when absent or unusable (then the entry is removed)."""
    path = entry_path(key)
    if not path.is_file():
        return None
    try:
        st = SafetensorsFile(path)
        if set(st.entries) != set(shapes):
            raise WeightsError(f"holds {sorted(st.entries)}, expected {sorted(shapes)}")
        out = {}
        for name, shape in shapes.items():
            arr = st.read(name)
            if arr.shape != shape or arr.dtype != np.dtype(dtype):
                raise WeightsError(f"{name} is {arr.dtype}{arr.shape}, expected {shape}")
            out[name] = arr
        return out
    except (OSError, WeightsError) as e:
        log.warning("ignoring damaged params cache entry %s (%s); rebuilding", path, e)
        try:
            path.unlink()
        except OSError:
            pass
        return None


def save(key: str, flat: Dict[str, np.ndarray]) -> Optional[Path]:
    """Writes atomically (temp file + rename) so a crash never leaves a half entry in place.
    A cache that cannot be written (read-only home, full disk) only costs the next load time."""
    path = entry_path(key)
    header, offset = {}, 0
    for name, arr in flat.items():
        n = arr.nbytes
        header[name] = {"dtype": _NAMES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {"format": f"jaxspec-params-v{LAYOUT_VERSION}"}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # keep tensor data 8-byte aligned for memory mapping
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".params-", suffix=".tmp")
        with os.fdopen(fd, "wb") as fh:
            fh.write(struct.pack("<Q", len(raw)))
            fh.write(raw)
            for arr in flat.values():
                fh.write(np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data)
        os.replace(tmp, path)
        return path
    except OSError as e:
        log.warning("could not write params cache %s (%s)", path, e)
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        return None
