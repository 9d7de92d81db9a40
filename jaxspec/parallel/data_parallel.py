"""Data parallel: the engine's slots split over N local devices, each running the one-device
programs on its own slots.

`DataParallel` is a placement (`parallel.placement`): a backend built over it holds its state
split along the slot axis (each device S of the N x S slots) and the weights once on every
device, and each of its programs runs per device on that device's share. The programs hold no
collective, and the engine above does not change: it sees N x S slots and admits requests into
any free one. Two implementations of "per device", the same results:
  "shard_map"  a jit of a `shard_map` of the one-device program over a one-axis mesh; the state
               is one global array per leaf, outputs come back concatenated over the devices
  "pmap"       `jax.pmap` of the same program; the state and outputs carry a leading device
               axis [N, S, ...]
Admission: each device's newcomers are admitted on their own, the devices' argument tuples
stacked into one call ([N, ...] arguments), so no device prefills another's rows. Slot indices
stay global; each device maps them to its own slots (others' become padding).
Each device's program is compiled under the GEMM rule (`xla_options`) of its own S slots, as a
one-device backend of S slots is.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxspec.config import ConfigError
from jaxspec.parallel.placement import MaskCache, OneDevice
from jaxspec.xla_options import compiler_options, gemm_backend, gemm_choice, jit

AXIS = "data"
IMPLS = ("shard_map", "pmap")


def local_devices(replicas: Optional[int] = None) -> Tuple[jax.Device, ...]:
    """The first `replicas` local devices (all of them when None)."""
    devs = jax.local_devices()
    n = len(devs) if replicas is None else replicas
    if not 1 <= n <= len(devs):
        raise ConfigError(f"data_parallel={n} needs that many local devices; "
                          f"{len(devs)} available ({devs[0].platform})")
    return tuple(devs[:n])


def _local_slots(slot_idx, per_device: int):
    """Global slot indices [A] -> this device's (padding, per_device, where another owns it)."""
    local = slot_idx - jax.lax.axis_index(AXIS) * per_device
    return jnp.where((local >= 0) & (local < per_device), local, per_device).astype(slot_idx.dtype)


class DataParallel(OneDevice):
    """A placement over `devices`, the slots split evenly (see the module docstring)."""

    def __init__(self, devices: Sequence[jax.Device], impl: str = "shard_map"):
        if impl not in IMPLS:
            raise ConfigError(f"data_parallel_impl must be one of {IMPLS}, got {impl!r}")
        self.devices, self.impl = tuple(devices), impl
        self.replicas = len(self.devices)
        self.mesh = Mesh(np.asarray(self.devices), (AXIS,))
        self.per = None               # slots per device, set by `state`
        self._spec = None             # the state's PartitionSpecs (shard_map)
        # The GEMM rule in force here: the per-device programs are built later, with the state
        # (`program`), perhaps outside the `gemm_backend` context this placement was made in.
        self._gemm = gemm_choice()
        split = NamedSharding(self.mesh, P(AXIS))
        if impl == "pmap":
            put = jax.pmap(lambda x: x, AXIS, devices=self.devices)
            self.put_mask = MaskCache(lambda m: put(m.reshape(self.replicas, -1)))
        else:
            self.put_mask = MaskCache(lambda m: jax.device_put(m, split))

    def weights(self, params, draft_params):
        return self.replicated((params, draft_params))

    def replicated(self, x):
        # On every device once: left on one, each call would copy it to the others.
        return jax.device_put(x, NamedSharding(self.mesh, P()))

    def state(self, make, slots: int, axes):
        if slots % self.replicas:
            raise ConfigError(f"{slots} slots do not split over {self.replicas} devices")
        self.per = slots // self.replicas
        if self.impl == "pmap":
            init = jax.pmap(lambda _: make(self.per), AXIS, devices=self.devices)
            return init(np.arange(self.replicas))
        if min(jax.tree_util.tree_leaves(axes)) < 0:
            # A leaf without a slot axis would be one array for all devices, which each
            # device's program writes on its own.
            raise ConfigError("data parallel needs a slot axis on every state leaf")
        self._spec = jax.tree_util.tree_map(lambda ax: P(*([None] * ax), AXIS), axes)
        shard = jax.tree_util.tree_map(lambda s: NamedSharding(self.mesh, s), self._spec)
        return jit(lambda: make(slots), out_shardings=shard)()

    def stack(self, parts):
        return jax.tree_util.tree_map(lambda *x: np.stack(x), *parts)

    def host(self, x) -> np.ndarray:
        x = np.asarray(x)
        return x.reshape((-1,) + x.shape[2:]) if self.impl == "pmap" else x

    def program(self, jitted, kind: str):
        """The per-device form of a backend program (weights, draft weights, donated state,
        then kind's arguments), compiled under the GEMM rule (`xla_options`) of one device's
        share of the rows."""
        inner, per = jitted.__wrapped__, self.per
        if per is None:
            raise RuntimeError("a data-parallel program is built over the state's split: "
                               "place the state (`state`) first")
        local = {"cycle": inner,
                 "admit": functools.partial(_admit_local, inner, per, self.impl == "pmap"),
                 "advance": functools.partial(_advance_local, inner, per)}[kind]
        rows = getattr(jitted, "gemm_rows", None)
        rows = None if rows is None else rows // self.replicas
        donate = 0 if kind == "advance" else 2
        with gemm_backend(self._gemm):
            if self.impl == "pmap":
                return _Pmapped(local, _pmap_axes(kind), donate, self.devices, rows)
            return jit(self._shard_map(local, kind), rows=rows, donate_argnums=(donate,))

    def _shard_map(self, local, kind: str):
        st = self._spec

        def smap(fn, in_specs, out_specs):
            return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                                 check_vma=False)
        if kind == "cycle":
            return smap(local, (P(), P(), st, P(AXIS)), (st, P(AXIS)))
        if kind == "advance":
            return smap(local, (st, P(), P()), st)

        def call(*args):
            specs = (P(), P(), st) + (P(AXIS),) * (len(args) - 4) + (P(),)
            return smap(local, specs, (st, P(AXIS)))(*args)
        return call


def _pmap_axes(kind: str):
    """n arguments -> jax.pmap's in_axes of a `kind` program: the weights and the engine key
    on every device whole (None), the state and the stacked arguments split (0)."""
    if kind == "cycle":
        return lambda n: (None, None, 0, 0)
    if kind == "advance":
        return lambda n: (0, None, None)
    return lambda n: (None, None) + (0,) * (n - 3) + (None,)


class _Pmapped:
    """`jax.pmap` of a per-device program, called and lowered as a jitted program is. An
    admission's argument count depends on its form: one pmap per count.

    jax.pmap takes no compiler options, so where the GEMM rule asks for some, calls run
    executables compiled from the pmap's lowering with them (`lower(...).compile()` applies
    them too, as warm-up compiles)."""

    def __init__(self, local, axes, donate: int, devices, rows: Optional[int]):
        self.gemm_rows, self.options = rows, compiler_options(rows)
        self._mapped = functools.lru_cache(maxsize=None)(
            lambda n: jax.pmap(local, AXIS, in_axes=axes(n), donate_argnums=(donate,),
                               devices=devices))
        self._compiled = {}

    def __call__(self, *args):
        if not self.options:
            return self._mapped(len(args))(*args)
        leaves, tree = jax.tree_util.tree_flatten(args)
        key = (tree, tuple((np.shape(x), np.result_type(x)) for x in leaves))
        fn = self._compiled.get(key)
        if fn is None:
            fn = self._compiled[key] = self.lower(*args).compile()
        return fn(*args)

    def lower(self, *args):
        return _Lowered(self._mapped(len(args)).lower(*args), self.options)


class _Lowered:
    """A pmap's Lowered whose compile() applies the program's compiler options."""

    def __init__(self, lowered, options):
        self.lowered, self.options = lowered, options

    def compile(self):
        return self.lowered.compile(self.options or None)

    def __getattr__(self, name):
        return getattr(self.lowered, name)


def _admit_local(inner, per: int, pmapped: bool, params, draft, state, *args):
    """One device's admission: its slice of the stacked arguments, global slot indices mapped
    to its own slots (`_local_slots`)."""
    stacked, key = args[:-1], args[-1]
    if not pmapped:             # shard_map hands each device a [1, ...] slice
        stacked = jax.tree_util.tree_map(lambda x: x[0], stacked)
    idx = _local_slots(stacked[0], per)
    return inner(params, draft, state, idx, *stacked[1:], key)


def _advance_local(inner, per: int, state, slot_idx, advance):
    return inner(state, _local_slots(slot_idx, per), advance)
