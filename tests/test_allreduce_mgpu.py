"""The one-shot all-reduce kernel (`pallas_kernels.allreduce_mgpu`): which inputs take it, that it
lowers to a Mosaic GPU kernel reading its peer through XLA's collective metadata (on any
machine: lowering for CUDA runs on a CPU), and on two Hopper GPUs that it equals the exact sum,
alone and chained as a step chains them, and that the engine over it gives the engine over
NCCL's greedy outputs. The engine over `allreduce="oneshot"` on a CPU (the kernel's psum) is
checked against single-device references in tests/test_tp_schedules.py."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from pallas_kernels import allreduce_mgpu as ar
from pallas_kernels import prefix_attention_mgpu as pm


def _x(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def test_serves_two_hopper_gpus_small_16bit_inputs(monkeypatch):
    assert not ar.serves(_x((1, 1, 4096)), 2) or pm.on_hopper()   # never off Hopper
    monkeypatch.setattr(pm, "on_hopper", lambda: True)
    assert ar.serves(_x((1, 1, 4096)), 2)
    assert ar.serves(_x((2, 4, 4096), jnp.float16), 2)               # 64 KiB: the bound
    assert not ar.serves(_x((2, 4, 4096)), 4)                         # two devices only
    assert not ar.serves(_x((1, 1, 4096), jnp.float32), 2)           # 16-bit floats only
    assert not ar.serves(_x((1, 1, 576)), 2)                          # whole tiles only
    assert not ar.serves(_x((3, 4, 4096)), 2)                         # over MAX_BYTES


def test_allreduce_takes_psum_where_the_kernel_does_not_serve():
    mesh = jax.sharding.AbstractMesh((2,), ("m",))
    f = jax.shard_map(lambda x: ar.allreduce(x, "m", 2), mesh=mesh, in_specs=P(),
                      out_specs=P(), check_vma=False)
    text = str(jax.make_jaxpr(f)(jnp.ones((1, 1, 4096), jnp.bfloat16)))
    assert "psum" in text and "pallas_call" not in text


@pytest.mark.skipif(pm.plgpu is None, reason="no Mosaic GPU in this jaxlib")
@pytest.mark.parametrize("shape", [(1, 1, 4096), (8, 4096)])
def test_lowers_to_a_mosaic_kernel_on_collective_metadata(shape):
    mesh = jax.sharding.AbstractMesh((2,), ("m",))
    f = jax.jit(jax.shard_map(lambda x: ar.oneshot(x, "m"), mesh=mesh, in_specs=P(),
                              out_specs=P(), check_vma=False))
    text = f.trace(_x(shape)).lower(lowering_platforms=("cuda",)).as_text()
    assert re.findall(r"custom_call @(\w+)", text) == ["mosaic_gpu_v2"]
    assert "uses_xla_collective_metadata = true" in text   # the peer's buffers, from XLA


def _two_hopper_gpus():
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    return len(gpus) >= 2 and pm.on_hopper()


def _chain(reduce, xs):
    """32 all-reduces in one program, as a step chains them: each input the last sum plus a
    multiple of this device's part."""
    y = reduce(xs[0])
    for i in range(1, 32):
        y = reduce(y + (i % 3) * xs[0])
    return y[None]


@pytest.mark.skipif(not _two_hopper_gpus(), reason="needs two Hopper GPUs")
@pytest.mark.parametrize("shape", [(1, 1, 4096), (2, 4, 4096)])
def test_equals_the_exact_sum_on_two_gpus(shape):
    """Two bf16 operands summed in fp32 and rounded once is what NCCL's bf16 sum gives too, so
    the kernel equals psum bit for bit, once and chained, and both replicas are equal."""
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:2]), ("m",))
    x = jax.random.normal(jax.random.key(0), (2, *shape), jnp.bfloat16)
    want = (x[0].astype(jnp.float32) + x[1].astype(jnp.float32)).astype(jnp.bfloat16)

    def program(fn):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("m"), out_specs=P("m"),
                                     check_vma=False))
    got = np.asarray(program(lambda xs: ar.oneshot(xs[0], "m")[None])(x), np.float32)
    np.testing.assert_array_equal(got[0], np.asarray(want, np.float32))
    np.testing.assert_array_equal(got[1], got[0])
    kernel = program(lambda xs: _chain(lambda y: ar.oneshot(y, "m"), xs))
    psum = program(lambda xs: _chain(lambda y: jax.lax.psum(y, "m"), xs))
    want = np.asarray(psum(x), np.float32)
    for _ in range(3):   # again: the semaphores start each call from zero
        np.testing.assert_array_equal(np.asarray(kernel(x), np.float32), want)


@pytest.mark.skipif(not _two_hopper_gpus(), reason="needs two Hopper GPUs")
@pytest.mark.parametrize("spec", [None, "chain"])
def test_engine_over_the_kernel_equals_the_engine_over_nccl(spec, monkeypatch):
    """The engine over TensorParallel(replicated_attention) in bf16, a hidden state of one tile
    (4096) so that every MLP all-reduce of a decode step or chain cycle takes the kernel: its
    greedy outputs equal the same engine's with XLA's all-reduce token for token (the sums are
    bitwise equal)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import parallel_check as pc
    from jaxspec import build
    from jaxspec.config import ModelConfig
    from jaxspec.engine import EngineConfig
    from jaxspec.parallel import TensorParallel, make_mesh

    cfg = ModelConfig(arch="LlamaForCausalLM", vocab_size=512, hidden_size=4096,
                      intermediate_size=2048, num_layers=2, num_heads=32, num_kv_heads=8,
                      head_dim=128)
    p, d = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), pc.pair(cfg))
    kernel_calls = []
    real = ar.oneshot
    monkeypatch.setattr(ar, "oneshot", lambda *a: kernel_calls.append(a[0].shape) or real(*a))
    outs = {}
    for allreduce in ("xla", "oneshot"):
        monkeypatch.setattr(build, "placement", lambda cfg, dp, tp, impl="shard_map": (
            TensorParallel(make_mesh(tp), cfg, schedule="replicated_attention",
                           allreduce=allreduce)))
        econf = EngineConfig(max_batch=2, max_model_len=pc.MAX_LEN, prefill_chunk=16)
        eng = build.build_engine(cfg, p, econf, draft=d if spec else None, spec=spec,
                                 tensor_parallel=2)
        outs[allreduce] = [r.output for r in pc.serve(eng, pc.PROMPTS, pc.greedy())]
    assert kernel_calls, "no all-reduce took the kernel"
    assert outs["oneshot"] == outs["xla"]
