"""Tensor parallel: target and draft weights and KV caches sharded over a `Mesh` model axis.

The model code is unchanged: `shard_params` places each weight with a `NamedSharding` and the
jitted programs (`spec.cycle.jit_cycle`, `decode.plain_cycle`, the admissions) are compiled by
GSPMD, which inserts the collectives (Megatron style: one all-reduce after the attention output
projection and one after the MLP down projection per layer, plus the vocab reductions of the
lm_head).

Layout, per layer (M = size of the model axis):
  wqkv [H, Q+2K]   re-laid out as the blocked [H, M, (Q+2K)/M] (see `models/llama.py`), block m =
                   [q heads of shard m | its kv heads | their v heads], sharded on M. The fused
                   flat layout puts all q columns before k and v, so sharding its columns directly
                   would give device 0 only q and the last device only v; the blocked layout gives
                   each device whole q heads with the kv heads they read (q head h reads kv head
                   h // (Hq / Hkv), and both are cut into M contiguous ranges), so attention runs
                   without communication.
  bqkv [Q+2K]      the same blocks, [M, (Q+2K)/M].
  wo [Q, H]        row-sharded (its rows are the q heads of the shard): partial sums, all-reduce.
  w_gate_up [H,2F] blocked [H, M, 2F/M], block m = [gate_m | up_m] (matching columns), sharded on M.
  w_down [F, H]    row-sharded.
  embed [V, H]     vocab-sharded (rows; a lookup is a masked local gather plus an all-reduce of
                   [B, N, H]) when V % M == 0 and the embedding is not tied, else replicated.
  lm_head [H, V]   replicated by default: sharded over the vocab, every argmax / top-k / softmax
                   of the cycle would all-gather the logits, [B, N, V] per verify (2 GB in fp32
                   for a 60-node tree at batch 64 with Llama-3's vocab), while a replica costs
                   V * H more bytes read per step (0.5 GB bf16 at Llama-3 8B). vocab="shard"
                   shards both (memory first). Norms, the draft fc and its bias: replicated.
  KV caches        [L, B, Hkv, T, D] sharded on Hkv (each device keeps the kv heads it computes).
Everything else in the decode state (lengths, roots, sampling, counts) is small and replicated.

The draft head's decoder layer is sharded by the same rules (it is a Llama layer).

Requirements: num_kv_heads % M == 0 (then num_heads too) and intermediate_size % M == 0.

Schedules (`TensorParallel(schedule=)`), the collectives of one layer in the compiled program:
  "megatron"              the layout above: two all-reduces of [rows, H] a layer. Weights and KV
                          caches split M ways: what large batches and long contexts need.
  "replicated_attention"  wqkv, bqkv, wo and the KV caches whole on every device, the MLP split
                          as above: attention runs on every device on the whole (replicated)
                          residual stream, and the MLP's partial sums meet in one all-reduce a
                          layer. Each device reads the attention weights whole (at Llama-3 8B 19%
                          of a layer's bytes, so 0.60 of one device's weight bytes a step at M = 2
                          against 0.50) and keeps the whole KV cache: the schedule for few rows a
                          step, where each collective's fixed cost outweighs the bytes (batch 1).
                          Exact as the Megatron form is: the only split sum is the MLP down
                          projection's, as in Megatron; nothing else changes order. Requires
                          intermediate_size % M == 0 only. Its mesh axis is `MLP_AXIS`, not
                          "model": the Pallas kernels then run whole on every device (their
                          operands are replicated) instead of per head shard.
All-reduce (`TensorParallel(allreduce=)`), under the replicated_attention schedule:
  "xla"      GSPMD inserts the MLP's all-reduce (NCCL on GPU).
  "oneshot"  the MLP runs in a shard_map over the mesh axis `allreduce_mgpu.AXIS` and its partial
             sums meet in `pallas_kernels.allreduce_mgpu.allreduce`: on two Hopper GPUs, inputs
             up to 64 KB (a few rows of the hidden state) take a Pallas kernel that reads the
             peer's partial sum over NVLink in one kernel; anything else, and every CPU, takes
             lax.psum. The same sums in the same order as "xla" at two devices.
A sequence-parallel schedule (reduce-scatter before each norm, the norm on 1/M of the rows,
all-gather after it) needs sharding constraints on activations inside the model code; weights
and caches alone cannot ask GSPMD for it. Both Megatron-style schedules keep one full-sum per
RMSNorm input, so at least one collective a norm (two a layer) is the floor for attention split
over heads; one a layer needs the attention replicated.

Kernels: the Pallas kernels (tree attention, KV compaction) are custom calls that GSPMD cannot
split; given sharded operands it would gather them (the whole KV cache) around each call. The
programs of a backend placed by `TensorParallel` trace under `jax.set_mesh(mesh)`, and under a
mesh with a "model" axis the kernel dispatchers run per shard of the kv heads in a `shard_map`
(`pallas_kernels/head_sharding.py`): no communication, on GPU and on CPU alike (the references).
The programs called without the mesh context are still correct (GSPMD around the references on
CPU; gathered operands around the kernels on GPU).

Multi-host: see `jaxspec.parallel.distributed`.
"""
from __future__ import annotations

import re
from typing import Dict, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxspec.config import ConfigError, ModelConfig
from jaxspec.parallel.placement import MaskCache, OneDevice
from pallas_kernels.allreduce_mgpu import AXIS as ONESHOT_AXIS

AXIS = "model"
MLP_AXIS = "mlp"            # the replicated_attention schedule's mesh axis (see the notes)
SCHEDULES = ("megatron", "replicated_attention")
ALLREDUCES = ("xla", "oneshot")


def make_mesh(model_parallel: Optional[int] = None, devices: Optional[Sequence] = None,
              axis: str = AXIS) -> Mesh:
    """A one-axis mesh over the first `model_parallel` devices (all global devices if None)."""
    devs = list(jax.devices() if devices is None else devices)
    n = len(devs) if model_parallel is None else model_parallel
    if not 1 <= n <= len(devs):
        raise ConfigError(f"tensor_parallel={n} needs that many devices; {len(devs)} available")
    return Mesh(np.asarray(devs[:n]), (axis,))


def check_shardable(cfg: ModelConfig, m: int, schedule: str = "megatron") -> None:
    if schedule not in SCHEDULES:
        raise ConfigError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if schedule == "megatron" and cfg.num_kv_heads % m:
        raise ConfigError(
            f"tensor parallel over {m} devices needs num_kv_heads={cfg.num_kv_heads} to be a "
            f"multiple of {m} (each device holds whole kv heads and the q heads that read them)")
    if cfg.intermediate_size % m:
        raise ConfigError(f"tensor parallel over {m} devices needs intermediate_size="
                          f"{cfg.intermediate_size} to be a multiple of {m}")


def check_allreduce(schedule: str, allreduce: str) -> None:
    if allreduce not in ALLREDUCES:
        raise ConfigError(f"allreduce must be one of {', '.join(ALLREDUCES)}, got {allreduce!r}")
    if allreduce == "oneshot" and schedule != "replicated_attention":
        raise ConfigError("allreduce='oneshot' needs schedule='replicated_attention' (the "
                          f"kernel serves the MLP's one all-reduce a layer), got {schedule!r}")


# ------------------------------------------------------------------------------------ layout


def block_qkv(w, cfg: ModelConfig, m: int):
    """[..., Q + 2K] flat fused q/k/v columns -> [..., M, (Q + 2K) / M] per-shard blocks."""
    if w.shape[-1] != cfg.q_size + 2 * cfg.kv_size:
        raise ConfigError(f"wqkv/bqkv last dim {w.shape[-1]} != Q + 2K = "
                          f"{cfg.q_size + 2 * cfg.kv_size} (already blocked?)")
    q, k, v = jnp.split(w, [cfg.q_size, cfg.q_size + cfg.kv_size], axis=-1)
    lead = w.shape[:-1]
    return jnp.concatenate([x.reshape(lead + (m, x.shape[-1] // m)) for x in (q, k, v)], axis=-1)


def block_gate_up(w, m: int):
    """[..., 2F] = [gate | up] -> [..., M, 2F / M], block m = [gate_m | up_m]."""
    g, u = jnp.split(w, 2, axis=-1)
    lead = w.shape[:-1]
    return jnp.concatenate([x.reshape(lead + (m, x.shape[-1] // m)) for x in (g, u)], axis=-1)


def unblock_qkv(w, cfg: ModelConfig):
    """Inverse of block_qkv: [..., M, C] -> [..., Q + 2K]."""
    m = w.shape[-2]
    q, k, v = jnp.split(w, [cfg.q_size // m, (cfg.q_size + cfg.kv_size) // m], axis=-1)
    return jnp.concatenate([x.reshape(x.shape[:-2] + (-1,)) for x in (q, k, v)], axis=-1)


def _blocked_layer(lp: dict, cfg: ModelConfig, m: int, schedule: str = "megatron") -> dict:
    """The layer in the blocked layout of what `schedule` splits (the attention's q/k/v stay
    flat where they are replicated)."""
    out = dict(lp, w_gate_up=block_gate_up(lp["w_gate_up"], m))
    if schedule == "megatron":
        out["wqkv"] = block_qkv(lp["wqkv"], cfg, m)
        if "bqkv" in lp:
            out["bqkv"] = block_qkv(lp["bqkv"], cfg, m)
    return out


_ATTENTION = ("wqkv", "bqkv", "wo")


def _layer_specs(lp: dict, axis: str, schedule: str = "megatron") -> dict:
    """PartitionSpecs of one layer dict (stacked or not) in the blocked layout."""
    def on(x, dim_from_end):
        spec = [None] * x.ndim
        spec[x.ndim - dim_from_end] = axis
        return P(*spec)

    specs = {}
    for name, x in lp.items():
        if schedule == "replicated_attention" and name in _ATTENTION:
            specs[name] = P()
        elif name in ("wqkv", "w_gate_up", "wo", "w_down"):
            specs[name] = on(x, 2)          # block axis / rows
        elif name == "bqkv":
            specs[name] = on(x, 2)
        else:
            specs[name] = P()
    return specs


def _map_layers(layers, fn):
    if isinstance(layers, (list, tuple)):
        return [fn(lp) for lp in layers]
    return fn(layers)


def _vocab_ok(cfg: ModelConfig, m: int, vocab: str) -> bool:
    if vocab not in ("auto", "shard", "replicate"):
        raise ConfigError(f"vocab must be 'auto', 'shard' or 'replicate', got {vocab!r}")
    if vocab == "shard" and cfg.vocab_size % m:
        raise ConfigError(f"vocab_size={cfg.vocab_size} is not a multiple of {m}")
    return vocab != "replicate" and cfg.vocab_size % m == 0


def param_specs(params, cfg: ModelConfig, m: int, axis: str = AXIS, vocab: str = "auto",
                schedule: str = "megatron"):
    """PartitionSpec pytree for target params already in the blocked layout."""
    shard_v = _vocab_ok(cfg, m, vocab)
    specs = {k: P() for k in params if k != "layers"}
    specs["layers"] = _map_layers(params["layers"], lambda lp: _layer_specs(lp, axis, schedule))
    if shard_v and (vocab == "shard" or "lm_head" in params):
        specs["embed"] = P(axis, None)
    if shard_v and vocab == "shard" and "lm_head" in params:
        specs["lm_head"] = P(None, axis)
    return specs


def _place(tree, specs, mesh: Mesh):
    shardings = jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs,
                                       is_leaf=lambda s: isinstance(s, P))
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)
    # Several processes: each builds only its addressable shards from its own (identical) copy.
    def put(x, sh):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sh, lambda idx: x[idx])
    return jax.tree_util.tree_map(put, tree, shardings)


def shard_params(params, cfg: ModelConfig, mesh: Mesh, axis: str = AXIS, vocab: str = "auto",
                 schedule: str = "megatron"):
    """Target params -> blocked layout, placed with NamedShardings over mesh[axis].

    vocab: 'auto' shards an untied embedding over the vocab when it divides evenly and keeps the
    lm_head whole (see the module notes), 'shard' shards both (or the tied embedding),
    'replicate' keeps both whole on every device. schedule: see the module notes."""
    m = mesh.shape[axis]
    check_shardable(cfg, m, schedule)
    blocked = dict(params, layers=_map_layers(params["layers"],
                                              lambda lp: _blocked_layer(lp, cfg, m, schedule)))
    return _place(blocked, param_specs(blocked, cfg, m, axis, vocab, schedule), mesh)


def shard_draft_params(draft_params, cfg: ModelConfig, mesh: Mesh, axis: str = AXIS,
                       schedule: str = "megatron"):
    """EAGLE-1 draft params: its decoder layer as the target's; fc and fc_bias replicated."""
    m = mesh.shape[axis]
    check_shardable(cfg, m, schedule)
    from jaxspec.models.eagle import mlp_width
    f = mlp_width(draft_params)
    if f % m:
        raise ConfigError(f"the draft head's MLP width {f} does not split over {m} devices")
    blocked = dict(draft_params, layers=_map_layers(
        draft_params["layers"], lambda lp: _blocked_layer(lp, cfg, m, schedule)))
    specs = {k: P() for k in blocked if k != "layers"}
    specs["layers"] = _map_layers(blocked["layers"], lambda lp: _layer_specs(lp, axis, schedule))
    return _place(blocked, specs, mesh)


def state_shardings(state, cfg: ModelConfig, mesh: Mesh, axis: str = AXIS,
                    schedule: str = "megatron"):
    """NamedSharding pytree for a decode state: KV caches ([L, B, Hkv, T, D], the only 5-D
    arrays of SpecState / PlainState / KVCache) on the kv-head axis (whole under the
    replicated_attention schedule), the rest replicated."""
    rep = NamedSharding(mesh, P())
    kv = rep if schedule == "replicated_attention" else NamedSharding(
        mesh, P(None, None, axis, None, None))

    def pick(x):
        return kv if x.ndim == 5 and x.shape[2] == cfg.num_kv_heads else rep

    return jax.tree_util.tree_map(pick, state)


def shard_state(state, cfg: ModelConfig, mesh: Mesh, axis: str = AXIS,
                schedule: str = "megatron"):
    """Places a decode state (SpecState, PlainState, KVCache) per `state_shardings`."""
    check_shardable(cfg, mesh.shape[axis], schedule)
    sh = state_shardings(state, cfg, mesh, axis, schedule)
    return _place(state, jax.tree_util.tree_map(lambda s: s.spec, sh), mesh)


# --------------------------------------------------------------------------------- collectives

COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "collective-permute", "all-to-all")
_COLLECTIVE_RE = re.compile(r"\s(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def count_collectives(hlo_text: str) -> Dict[str, int]:
    """{op: instructions} of the collectives in an optimized HLO module's text (an async pair
    counts once, by its -start). A loop body counts once however often it runs: count
    programs whose layers are unrolled (`ModelConfig.with_layout(unroll_layers=True)`)."""
    found = {op: 0 for op in COLLECTIVES}
    for m in _COLLECTIVE_RE.finditer(hlo_text):
        found[m.group(1)] += 1
    return found


# ------------------------------------------------------------------------------ jitted entries


def _global_inputs(tree, mesh: Mesh):
    """Host values (numpy, or arrays on this process's devices only), identical on every
    process, -> global arrays replicated over the mesh; arrays already on it pass through."""
    devices = set(mesh.devices.flat)
    rep = NamedSharding(mesh, P())

    def glob(x):
        if isinstance(x, jax.Array) and x.sharding.device_set == devices:
            return x
        if isinstance(x, (np.ndarray, np.generic, jax.Array)):
            return jax.make_array_from_process_local_data(rep, np.asarray(x))
        return x
    return jax.tree_util.tree_map(glob, tree)


class TensorParallel(OneDevice):
    """A placement (`parallel.placement`) over a one-axis model mesh: weights sharded by the
    layout above, the state's KV caches on kv heads, the programs traced and run under the mesh
    (the kernels per head shard). The draft head must be an EAGLE-1 head (a Llama layer).

    mesh: a one-axis mesh named AXIS (`make_mesh`). schedule: one of SCHEDULES (the module
    notes); "replicated_attention" places everything over the same devices on an axis named
    MLP_AXIS (`self.mesh`). allreduce: one of ALLREDUCES (the module notes); "oneshot" needs
    the replicated_attention schedule and names the axis `allreduce_mgpu.AXIS`."""
    replicas = 1

    def __init__(self, mesh: Mesh, cfg: ModelConfig, vocab: str = "auto",
                 schedule: str = "megatron", allreduce: str = "xla"):
        if AXIS not in mesh.axis_names:
            raise ConfigError(f"TensorParallel needs a mesh with a {AXIS!r} axis (make_mesh), "
                              f"got axes {mesh.axis_names}")
        check_shardable(cfg, mesh.shape[AXIS], schedule)
        check_allreduce(schedule, allreduce)
        self.axis = AXIS
        if schedule == "replicated_attention":
            self.axis = ONESHOT_AXIS if allreduce == "oneshot" else MLP_AXIS
            mesh = Mesh(mesh.devices, (self.axis,))
        self.mesh, self.cfg, self.vocab, self.schedule = mesh, cfg, vocab, schedule
        self.allreduce = allreduce
        self.put_mask = MaskCache(lambda m: jax.device_put(m, NamedSharding(mesh, P())))

    def weights(self, params, draft_params):
        from jaxspec.models.eagle3 import is_eagle3
        if draft_params is not None and is_eagle3(draft_params):
            raise ConfigError("tensor_parallel > 1 with an EAGLE-3 head is not supported; use "
                              "an EAGLE-1 head or tensor_parallel=1")
        params = shard_params(params, self.cfg, self.mesh, self.axis, self.vocab, self.schedule)
        if draft_params is not None:
            draft_params = shard_draft_params(draft_params, self.cfg, self.mesh, self.axis,
                                              self.schedule)
        return params, draft_params

    def state(self, make, slots: int, axes):
        return shard_state(make(slots), self.cfg, self.mesh, self.axis, self.schedule)

    def program(self, jitted, kind: str):
        return _OnMesh(jitted, self.mesh)

    def replicated(self, x):
        return jax.device_put(x, NamedSharding(self.mesh, P()))


class _OnMesh:
    """A jitted program called and lowered under the mesh, its host arguments made global
    (identical on every process) when several processes share the mesh."""

    def __init__(self, jitted, mesh: Mesh):
        self.jitted, self.mesh = jitted, mesh

    def _args(self, args):
        return _global_inputs(args, self.mesh) if jax.process_count() > 1 else args

    def __call__(self, *args):
        with jax.set_mesh(self.mesh):
            return self.jitted(*self._args(args))

    def lower(self, *args):
        with jax.set_mesh(self.mesh):
            return self.jitted.lower(*self._args(args))
