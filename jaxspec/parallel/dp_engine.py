"""Data parallel under the engine: one continuous-batching engine over the slots of N devices.

The pmap runners (`data_parallel`) decode groups of requests in lockstep: a group waits for its
longest request, and streaming, abort and retract are not there. This makes an engine backend
(`engine.SpecBackend` / `PlainBackend`, built for all N x S slots) data parallel in place: its
state is split over a one-axis mesh along the slot axis (each device holds S slots), and each of
its jitted programs becomes a jit of a `shard_map` of the same single-device program, so every
device runs exactly the single-device code (Pallas kernels included) on its own slots, and the
programs hold no collective. The engine above it does not change: it sees N x S slots and admits
requests into any free one as it does on one device.

Admission: the engine admits requests by global slot index, each device's newcomers on their
own, the devices' calls stacked into one ([N, ...] arguments split over the mesh,
`Engine._prefill`; every form: packed or padded first chunks, later chunks). Each device
maps its rows' global indices to its own slots and prefills only its own newcomers; the first
tokens come back [N * A], device by device.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxspec.config import ConfigError
from jaxspec.engine.backends import MaskCache
from jaxspec.xla_options import jit

AXIS = "data"


def _state_specs(backend):
    """PartitionSpec per state leaf: the slot axis split over AXIS. The axes are the ones the
    backend's admission found (`admit.batch_axes`); every state leaf has one."""
    axes = next(iter(backend._admits.values())).__wrapped__.keywords["axes"]
    return jax.tree_util.tree_map(lambda ax: P(*([None] * ax), AXIS), axes)


def _local_slots(slot_idx, per_device: int):
    """Global slot indices [A] -> this device's (padding, per_device, where another owns it)."""
    local = slot_idx - jax.lax.axis_index(AXIS) * per_device
    return jnp.where((local >= 0) & (local < per_device), local, per_device).astype(slot_idx.dtype)


class _Sharded:
    """The shard_map'ed, jitted forms of one backend's programs (n_w weight arguments first,
    then the donated state)."""

    def __init__(self, mesh: Mesh, state_spec, n_w: int, per_device: int):
        self.mesh, self.state_spec, self.n_w, self.per = mesh, state_spec, n_w, per_device
        self.n = mesh.shape[AXIS]

    def _smap(self, fn, in_specs, out_specs):
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)

    def _rows(self, jitted):
        """The GEMM rule's rows (`xla_options`) of one device's share of `jitted`: a program
        over S slots per device compiles as the single-device program of S slots does (on two
        H200s the chain's cycle lost 25% as XLA's default Triton GEMMs beside cuBLAS at 64)."""
        rows = getattr(jitted, "gemm_rows", None)
        return None if rows is None else rows // self.n

    def cycle(self, jitted):
        inner = jitted.__wrapped__
        specs = (P(),) * self.n_w + (self.state_spec, P(AXIS))
        return jit(self._smap(inner, specs, (self.state_spec, P(AXIS))),
                   rows=self._rows(jitted), donate_argnums=(self.n_w,))

    def admit_stacked(self, jitted):
        """An admission over arguments stacked per device (`Engine._prefill`: weights...,
        state, then [N, ...] slot_idx and the rest of the form's arguments, then the engine
        key): each device runs `jitted`'s program on its own slice, its own newcomers, so no
        device prefills another's. -> (state, first tokens [N * A]) in device order."""
        inner, per, n_w = jitted.__wrapped__, self.per, self.n_w

        def local(*args):
            stacked = jax.tree_util.tree_map(lambda x: x[0], args[n_w + 1:-1])
            idx = _local_slots(stacked[0], per)
            return inner(*args[:n_w + 1], idx, *stacked[1:], args[-1])

        def call(*args):
            n_stacked = len(args) - n_w - 2
            specs = (P(),) * n_w + (self.state_spec,) + (P(AXIS),) * n_stacked + (P(),)
            return self._smap(local, specs, (self.state_spec, P(AXIS)))(*args)
        return jit(call, rows=self._rows(jitted), donate_argnums=(n_w,))

    def advance(self, jitted):
        inner, per = jitted.__wrapped__, self.per

        def local(state, slot_idx, advance):
            return inner(state, _local_slots(slot_idx, per), advance)
        return jit(self._smap(local, (self.state_spec, P(), P()), self.state_spec),
                   rows=self._rows(jitted), donate_argnums=(0,))


def data_parallel_backend(backend, devices: Sequence[jax.Device]):
    """An engine backend built for len(devices) x S slots, made data parallel in place: its state
    split over `devices` along the slot axis, its cycle, admission and key-advance programs run
    per device. Returns the backend."""
    n = len(devices)
    if backend.slots % n:
        raise ConfigError(f"{backend.slots} slots do not split over {n} devices")
    mesh = Mesh(np.asarray(devices), (AXIS,))
    init = backend.init_state
    spec = _state_specs(backend)
    n_w = len(backend.weights)
    sh = _Sharded(mesh, spec, n_w, backend.slots // n)
    # The weights live on every device once: left on one (or uncommitted), each call would copy
    # them to the others (for SmolLM2, 270 MB per call).
    rep = NamedSharding(mesh, P())
    for name in ("params", "draft_params", "key"):
        if getattr(backend, name, None) is not None:
            setattr(backend, name, jax.device_put(getattr(backend, name), rep))
    backend.init_state = lambda: jax.device_put(
        init(), jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), spec))
    backend._cycles = {f: sh.cycle(j) for f, j in backend._cycles.items()}
    # (admissions come stacked per device, `Engine._prefill`: no unstacked form runs)
    backend._admits = {(f, ("stacked", form)): sh.admit_stacked(j)
                       for (f, form), j in backend._admits.items()}
    backend.replica_slots = backend.slots // n
    backend._advance = sh.advance(backend._advance)
    split = NamedSharding(mesh, P(AXIS))
    backend.device_mask = MaskCache(lambda m: jax.device_put(m, split))
    backend.mesh = mesh
    return backend

