"""Multi-device decoding: data parallel (`jax.pmap` replicas, each with its own slots) and tensor
parallel (weights and KV caches sharded over a mesh axis, GSPMD), single- or multi-host.

    from jaxspec.parallel import DataParallelSpecRunner, TensorParallelSpecRunner, make_mesh

See data_parallel.py, tensor_parallel.py and distributed.py (multi-host launch).
"""
from jaxspec.parallel.data_parallel import (DataParallelPlainRunner, DataParallelSpecRunner,
                                            local_devices, replicate, spread)
from jaxspec.parallel.tensor_parallel import (TensorParallelSpecRunner, check_shardable, on_mesh,
                                              make_mesh, shard_draft_params, shard_params,
                                              shard_backend, shard_state, state_shardings)
