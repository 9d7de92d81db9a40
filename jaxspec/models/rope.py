"""Rotary position embeddings (HF's rotate-half layout): frequencies from a ModelConfig, the
cos/sin tables of a forward's positions, and their application to q and k heads."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> np.ndarray:
    """[D/2] inverse frequencies, with llama3 / linear scaling applied (numpy, static).
    local: those of sliding-window layers where the config gives them their own base
    (`rope_local_theta`, Gemma 3; unscaled), else the global ones."""
    d = cfg.head_dim
    if local and cfg.rope_local_theta is not None:
        return (1.0 / (cfg.rope_local_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
                ).astype(np.float32)
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    rs = cfg.rope_scaling
    if rs is None:
        return inv.astype(np.float32)
    if rs.kind == "linear":
        return (inv / rs.factor).astype(np.float32)
    # llama3: long wavelengths divided by factor, short kept, smooth blend between.
    low_wl = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wl = rs.original_max_position_embeddings / rs.high_freq_factor
    wl = 2 * np.pi / inv
    smooth = (rs.original_max_position_embeddings / wl - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor)
    blended = (1 - smooth) * inv / rs.factor + smooth * inv
    out = np.where(wl > low_wl, inv / rs.factor, np.where(wl < high_wl, inv, blended))
    return out.astype(np.float32)


def rope_tables(positions, inv_freq):
    """positions [B, N] int32 -> (cos, sin) [B, N, 1, D/2] fp32. Computed once per forward and
    shared by every layer: per layer, XLA launched a kernel each for them."""
    ang = positions.astype(jnp.float32)[..., None] * inv_freq          # [B, N, D/2]
    return jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]


def apply_rope(x, positions, inv_freq, tables=None):
    """x [B, N, H, D] (HF rotate-half layout), positions [B, N] int32; tables: rope_tables'."""
    cos, sin = rope_tables(positions, inv_freq) if tables is None else tables
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
