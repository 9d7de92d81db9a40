"""Multi-device decoding: data parallel (each device with its own slots: one continuous-batching
engine over all of them, dp_engine.py, LLM's default; or lockstep `jax.pmap` runners,
data_parallel.py) and tensor parallel (weights and KV caches sharded over a mesh axis, GSPMD),
single- or multi-host.

    from jaxspec.parallel import DataParallelSpecRunner, TensorParallelSpecRunner, make_mesh

See dp_engine.py, data_parallel.py, tensor_parallel.py and distributed.py (multi-host launch).
"""
from jaxspec.parallel.data_parallel import (DataParallelPlainRunner, DataParallelSpecRunner,
                                            local_devices, replicate, spread)
from jaxspec.parallel.tensor_parallel import (TensorParallelSpecRunner, check_shardable, on_mesh,
                                              make_mesh, shard_draft_params, shard_params,
                                              shard_backend, shard_state, state_shardings)

__all__ = ["DataParallelPlainRunner", "DataParallelSpecRunner", "local_devices", "replicate",
           "spread", "TensorParallelSpecRunner", "check_shardable", "on_mesh", "make_mesh",
           "shard_draft_params", "shard_params", "shard_backend", "shard_state",
           "state_shardings"]
