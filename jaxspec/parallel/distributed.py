"""Multi-host tensor parallel through `jax.distributed`.

JAX runs one process per host (multi-controller): every process runs the same program, sees all
devices of all hosts in `jax.devices()` and its own in `jax.local_devices()`. A `Mesh` over the
global device list spans hosts; GSPMD inserts the collectives (NCCL on GPU) as on one host. The
model axis should stay within a host (NVLink); across hosts, data parallel is the cheap split.

Launch (two hosts with 8 GPUs each, all 16 on the model axis, as a model too large for one host
needs; the same program on every host):

    # host 0 (its address is the coordinator)
    JAXSPEC_COORDINATOR=10.0.0.1:1234 JAXSPEC_NUM_PROCESSES=2 JAXSPEC_PROCESS_ID=0 \\
        python my_generate.py
    # host 1
    JAXSPEC_COORDINATOR=10.0.0.1:1234 JAXSPEC_NUM_PROCESSES=2 JAXSPEC_PROCESS_ID=1 \\
        python my_generate.py

    # my_generate.py
    from jaxspec import LLM, SamplingParams
    from jaxspec.parallel import distributed
    distributed.initialize()                  # before any other jax call
    llm = LLM(model_dir, draft=head_path, tensor_parallel=16)   # every device of both hosts
    outs = llm.generate(prompts, SamplingParams(max_tokens=256))   # same prompts everywhere

`LLM(tensor_parallel=n)` (or `build.build_engine(..., tensor_parallel=n)` over weights you
hold) places the backend over the first n global devices. For a mesh of your own, such as
`global_mesh()` (ordered by process, so consecutive devices of the axis share a host), build the
backend over it: `SpecBackend(cfg, params, draft, spec, slots, max_len,
placement=TensorParallel(mesh, cfg))` and drive it with an `engine.Engine`.

Under SLURM, Open MPI or on Cloud TPU, `jax.distributed.initialize()` finds all three values by
itself: leave the variables unset. Every process must load the same weights (each then keeps
only its shards: with several processes `shard_params` / `shard_state` build each array with
`jax.make_array_from_callback` from the process's own copy) and submit the same requests in the
same order: the engines' host loops run in lockstep, and each reads the replicated tokens from
its own devices. The engine's host inputs (admission arguments, the active mask) are identical
on every process; a `TensorParallel` placement's programs make them global arrays replicated
over the mesh before each call (as `global_replicated` does for one value).

Status: checked on one host: fake CPU devices in one process, and two processes of one CPU
device each joined through gloo (tests/multihost_check.py); not yet across machines.
"""
from __future__ import annotations

from typing import Optional

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxspec import envs
from jaxspec.parallel.tensor_parallel import AXIS, make_mesh


def initialize(coordinator_address: Optional[str] = None, num_processes: Optional[int] = None,
               process_id: Optional[int] = None, local_device_ids=None) -> None:
    """`jax.distributed.initialize`, with the three values read from JAXSPEC_COORDINATOR,
    JAXSPEC_NUM_PROCESSES and JAXSPEC_PROCESS_ID when not given (and auto-detected by JAX under
    SLURM / Open MPI / Cloud TPU when those are unset too). A single process skips it."""
    coordinator_address = coordinator_address or envs.JAXSPEC_COORDINATOR
    if num_processes is None:
        num_processes = envs.JAXSPEC_NUM_PROCESSES
    if process_id is None:
        process_id = envs.JAXSPEC_PROCESS_ID
    if num_processes == 1:
        return
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id,
                               local_device_ids=local_device_ids)


def global_mesh(model_parallel: Optional[int] = None, axis: str = AXIS) -> Mesh:
    """The model axis over the first `model_parallel` global devices (all by default), ordered
    by process then local id, so consecutive devices of the axis share a host."""
    devs = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return make_mesh(model_parallel, devs, axis)


def global_replicated(x, mesh: Mesh):
    """A host value that is the same on every process -> a global array replicated on mesh."""
    return jax.make_array_from_process_local_data(NamedSharding(mesh, P()), np.asarray(x))


def is_main_process() -> bool:
    """Process 0: the one that prints and writes results."""
    return jax.process_index() == 0
