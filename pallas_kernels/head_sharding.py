"""Run a kernel per shard of the kv-head axis under tensor parallel.

GSPMD cannot split a Pallas custom call: given sharded operands it gathers them to every device
around the call, which for the KV cache means moving all of it. Under a mesh with a "model" axis
(set with `jax.set_mesh(mesh)` around the call that traces, as `jaxspec.parallel` does), the
dispatchers wrap their kernel in a `shard_map` over that axis instead: each device runs it on its
own heads (attention of a q head reads only its own kv head group; compaction moves rows per
head), with no communication. Outside such a mesh nothing changes.
"""
from __future__ import annotations

from typing import Optional

import jax

MODEL_AXIS = "model"


def model_axis_size() -> Optional[int]:
    """Size of the context mesh's model axis when the kernels should run per shard, else None
    (`context_axis_size`)."""
    return context_axis_size(MODEL_AXIS)


def context_axis_size(axis: str) -> Optional[int]:
    """Size of the context mesh's `axis` when code should run per shard of it, else None (no
    mesh, no such axis, size 1, or already inside a shard_map over it)."""
    get = getattr(jax.sharding, "get_abstract_mesh", None)
    mesh = get() if get is not None else None
    if mesh is None or getattr(mesh, "empty", True) or axis not in mesh.axis_names:
        return None
    if axis in getattr(mesh, "manual_axes", ()):
        return None
    n = mesh.shape[axis]
    return n if n > 1 else None


def per_head_shard(fn, in_specs, out_specs):
    """shard_map of fn over the context mesh's model axis (check_vma off: Pallas calls carry no
    varying-axis annotations)."""
    return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, check_vma=False)
