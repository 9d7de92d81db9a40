"""A one-shot all-reduce of small activations between two GPUs (Mosaic GPU, Hopper).

At batch 1 a tensor-parallel step's all-reduces move a few KB each (one token's hidden state,
8 KB at Llama-3 8B), so their cost is fixed latency, not bandwidth. This kernel reads the peer's
partial sum straight from its memory over NVLink (Mosaic GPU's peer references, which XLA's
collective metadata backs in a single process; no NVLink multicast) and adds it to its own:
one kernel, two cross-device semaphore handshakes, no NCCL launch.

    each device d of the two:  signal the peer "my input is ready", wait for its signal
                               y = x_0 + x_1 in fp32, rounded once to x's dtype (tile by tile,
                                   x_peer read through its peer reference)
                               signal the peer "done reading you", wait for its signal (so
                                   neither returns, and lets XLA reuse its input, while the
                                   other still reads it)

Both devices add in the same order (x_0 + x_1 is x_1 + x_0 in fp32), so the replicas stay
bitwise equal, which the replicated residual stream needs. `allreduce` takes the kernel where it
serves (`serves`) and `lax.psum` elsewhere; `reference` is the psum. Call both inside a
`shard_map` over `axis_name`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.head_sharding import context_axis_size

TILE = 4096            # elements a tile: 32 a thread of one warpgroup (128 threads), one token
#                        of an 8B model's hidden state, its loads all in flight at once
MAX_BYTES = 64 * 1024  # larger inputs take lax.psum: one thread block reads the peer tile by
#                        tile, which pays for latency-bound sizes, not bandwidth-bound ones
DEVICES = 2
# The mesh axis of `TensorParallel(schedule="replicated_attention", allreduce="oneshot")`: the
# model code runs the MLP in a shard_map over it with `allreduce`. The choice rides on the axis
# name because the traced program differs with it and jit keys its cache on the context mesh.
AXIS = "mlp_oneshot"


def axis_size():
    """Size of the context mesh's AXIS when the MLP should run over it, else None."""
    return context_axis_size(AXIS)


def reference(x, axis_name):
    return lax.psum(x, axis_name)


def serves(x, num_devices: int) -> bool:
    """Whether `allreduce` takes the kernel: two devices, Hopper, a 16-bit float input of whole
    tiles up to MAX_BYTES."""
    from pallas_kernels import prefix_attention_mgpu as pm   # its device checks
    return (num_devices == DEVICES and x.size % TILE == 0
            and x.size * x.dtype.itemsize <= MAX_BYTES
            and jnp.dtype(x.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and pm.on_hopper())


def allreduce(x, axis_name, num_devices: int):
    """Sum of x over `axis_name` (size num_devices), inside a shard_map: the one-shot kernel
    where `serves` says so, else lax.psum."""
    if serves(x, num_devices):
        return oneshot(x, axis_name)
    return reference(x, axis_name)


def oneshot(x, axis_name):
    """The kernel: x [...] (a multiple of TILE elements) -> its sum over the two devices."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    flat = x.reshape(-1)

    def oneshot_allreduce(x_ref, y_ref, ready, done):   # named for profiles
        """x_ref, y_ref [flat.size] in GMEM; ready, done: semaphores the peer signals."""
        peer = {axis_name: 1 - lax.axis_index(axis_name)}
        pl.semaphore_signal(ready, device_id=peer)
        pl.semaphore_wait(ready)
        x_peer = plgpu.remote_ref(x_ref, peer)
        for i in range(flat.size // TILE):   # at most MAX_BYTES: a few tiles, unrolled
            at = pl.ds(i * TILE, TILE)
            total = x_ref[at].astype(jnp.float32) + x_peer[at].astype(jnp.float32)
            y_ref[at] = total.astype(y_ref.dtype)
        pl.semaphore_signal(done, device_id=peer)
        pl.semaphore_wait(done)

    call = plgpu.kernel(
        oneshot_allreduce, out_type=jax.ShapeDtypeStruct(flat.shape, flat.dtype),
        scratch_types=[plgpu.SemaphoreType.REGULAR, plgpu.SemaphoreType.REGULAR])
    return call(flat).reshape(x.shape)
