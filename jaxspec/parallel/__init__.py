"""Multi-device decoding, as placements a backend is built over (`placement.py`): data
parallel (each device with its own slots, `data_parallel.py`, through shard_map or jax.pmap) and
tensor parallel (weights and KV caches sharded over a model axis, `tensor_parallel.py`), single-
or multi-host (`distributed.py`).
"""
from jaxspec.parallel.data_parallel import DataParallel, local_devices
from jaxspec.parallel.placement import OneDevice
from jaxspec.parallel.tensor_parallel import (TensorParallel, check_shardable, make_mesh,
                                              shard_draft_params, shard_params, shard_state,
                                              state_shardings)

__all__ = ["DataParallel", "OneDevice", "TensorParallel", "check_shardable", "local_devices",
           "make_mesh", "shard_draft_params", "shard_params", "shard_state", "state_shardings"]
