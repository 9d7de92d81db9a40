"""Public draft-head checkpoints as plain data: their tensors (numpy) and config.json (a dict).

A checkpoint is a directory (every *.safetensors file in it, else every pytorch_model*.bin / *.bin)
or one file, with the config.json beside it. Only tensors are read: safetensors directly, a torch
file through torch.load(weights_only=True), so no pickled code runs. Every tensor taken is checked
for shape and dtype, and a wrong one is named with what was expected.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Mapping, Tuple

import numpy as np

from jaxspec.loading.common import WeightsError

# A token ranking shipped beside a head (`spec.draft_vocab`) is not part of its weights.
RANKING_FILE = "token_ranking.safetensors"


def read_state_dict(path) -> Tuple[Dict[str, np.ndarray], dict]:
    """(tensors as numpy, config.json or {}) from a checkpoint dir or a .safetensors / .bin file.
    bf16 tensors come back as ml_dtypes bfloat16 arrays."""
    p = Path(path)
    if p.is_dir():
        files = [f for f in sorted(p.glob("*.safetensors")) if f.name != RANKING_FILE] \
            or sorted(p.glob("pytorch_model*.bin")) or sorted(p.glob("*.bin"))
        if not files:
            raise WeightsError(f"{p}: no *.safetensors or *.bin checkpoint file")
        cfg_path = p / "config.json"
    elif p.is_file():
        files, cfg_path = [p], p.parent / "config.json"
    else:
        raise FileNotFoundError(f"draft checkpoint {str(p)!r} does not exist")
    config = read_config_json(cfg_path) if cfg_path.is_file() else {}
    tensors: Dict[str, np.ndarray] = {}
    for f in files:
        tensors.update(_read_file(f))
    return tensors, config


def read_config_json(path: Path) -> dict:
    try:
        config = json.loads(Path(path).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WeightsError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise WeightsError(f"{path}: not a JSON object")
    return config


def _read_file(f: Path) -> Dict[str, np.ndarray]:
    if f.suffix == ".safetensors":
        from safetensors.numpy import load_file
        try:
            return dict(load_file(str(f)))
        except Exception as e:  # noqa: BLE001 -- the library's errors name no file
            raise WeightsError(f"{f}: unreadable safetensors file ({e})") from e
    try:
        import torch
    except ImportError:
        raise WeightsError(f"{f}: a torch checkpoint needs torch installed to be read (with "
                           "weights_only=True); a .safetensors file needs nothing") from None

    try:
        sd = torch.load(str(f), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise WeightsError(f"{f}: unreadable torch checkpoint ({e})") from e
    if not isinstance(sd, dict):
        raise WeightsError(f"{f}: a torch checkpoint of {type(sd).__name__}, expected a state "
                           "dict of tensors")
    out = {}
    for k, v in sd.items():
        if not isinstance(v, torch.Tensor):
            continue
        if v.dtype == torch.bfloat16:
            import ml_dtypes
            out[k] = v.float().numpy().astype(ml_dtypes.bfloat16)
        else:
            out[k] = v.numpy()
    return out


def float_tensor(sd: Mapping[str, np.ndarray], name: str, shape, origin: str,
                 optional: bool = False):
    """sd[name] as fp32 after checking its shape and that it is floating point (None when
    optional and absent)."""
    if name not in sd:
        if optional:
            return None
        raise WeightsError(f"{origin}: missing tensor {name!r}")
    a = sd[name]
    if tuple(a.shape) != tuple(shape):
        raise WeightsError(f"{origin}: tensor {name!r} has shape {tuple(a.shape)}, expected "
                           f"{tuple(shape)}")
    if not (np.issubdtype(a.dtype, np.floating) or a.dtype.name == "bfloat16"):
        raise WeightsError(f"{origin}: tensor {name!r} has dtype {a.dtype}, expected floating point")
    return np.asarray(a, np.float32)


def index_tensor(sd: Mapping[str, np.ndarray], name: str, shape, origin: str):
    """sd[name] after checking its shape and that it is integer or bool."""
    if name not in sd:
        raise WeightsError(f"{origin}: missing tensor {name!r}")
    a = np.asarray(sd[name])
    if tuple(a.shape) != tuple(shape):
        raise WeightsError(f"{origin}: tensor {name!r} has shape {tuple(a.shape)}, expected "
                           f"{tuple(shape)}")
    if not (np.issubdtype(a.dtype, np.integer) or a.dtype == bool):
        raise WeightsError(f"{origin}: tensor {name!r} has dtype {a.dtype}, expected an integer "
                           "or bool dtype")
    return a


def cast_tree(tree, dtype):
    """Nested dicts of arrays -> the same with every leaf a numpy array of `dtype`."""
    if isinstance(tree, dict):
        return {k: cast_tree(v, dtype) for k, v in tree.items()}
    return np.asarray(tree, dtype)


def to_jax(tree, dtype=None):
    """Numpy params -> jax arrays: floating leaves in `dtype` (None: fp32), id maps as they are."""
    import jax
    import jax.numpy as jnp

    dt = dtype if dtype is not None else jnp.float32
    return jax.tree_util.tree_map(
        lambda x: jnp.asarray(x, dt) if np.issubdtype(x.dtype, np.floating)
        or x.dtype.name == "bfloat16" else jnp.asarray(x), tree)
