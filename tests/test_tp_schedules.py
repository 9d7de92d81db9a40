"""Tensor-parallel collective schedules (`TensorParallel(schedule=)`) and the XLA collective
flag sets (`xla_options.COLLECTIVE_FLAGS`).

The multi-device checks run in one subprocess with 2 fake CPU devices (the flag must be set
before jax initialises): this file run as a script. In fp32, the engine over the
replicated_attention schedule gives the single-device static-batch references' greedy outputs
token for token (chain and plain; tests/parallel_check.py's model, prompts and references), with
the MLP's all-reduce GSPMD's ("xla") or the explicit one of `allreduce="oneshot"` (lax.psum on
a CPU: the kernel's reference); its layout holds the attention and the KV caches whole and the
MLP split; and the optimized HLO of each schedule's step holds the all-reduces a layer it claims
(megatron 2, replicated_attention 1 either way; no other collective), counted as the difference
between 4 and 2 unrolled layers.

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python tests/test_tp_schedules.py
"""
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from jaxspec.config import ConfigError  # noqa: E402
from jaxspec.xla_options import COLLECTIVE_FLAGS, collective_flags, jit  # noqa: E402

# (schedule, allreduce) pairs checked over two devices, and their all-reduces a layer
PER_LAYER = {("megatron", "xla"): 2, ("replicated_attention", "xla"): 1,
             ("replicated_attention", "oneshot"): 1}
ENGINES = [("replicated_attention", "xla"), ("replicated_attention", "oneshot")]
CHECKS = ([f"tp2-{s}-{a}-{part}" for s, a in ENGINES for part in ("chain", "layout", "plain")]
          + [f"tp2-collectives-{s}-{a}" for s, a in PER_LAYER])


@pytest.fixture(scope="module")
def two_device_run():
    from test_parallel import fake_devices_env
    return subprocess.run([sys.executable, __file__], env=fake_devices_env(2), cwd=ROOT,
                          capture_output=True, text=True, timeout=1200)


@pytest.mark.parametrize("name", CHECKS)
def test_two_devices(two_device_run, name):
    out = two_device_run.stdout.splitlines()
    assert f"ok {name}" in out, (f"{name} did not pass\n" + two_device_run.stdout[-3000:]
                                 + two_device_run.stderr[-6000:])


@pytest.mark.parametrize("name", sorted(COLLECTIVE_FLAGS))
def test_collective_flag_sets_compile(name):
    """Every option name and value of each set exists in the installed jaxlib: an unknown one
    fails the compile (the CPU compiler parses the GPU options, then ignores them)."""
    with collective_flags(name):
        f = jit(lambda x: x * 2 + 1)
    np.testing.assert_array_equal(np.asarray(f(jnp.arange(3.0))), [1.0, 3.0, 5.0])


def test_unknown_flag_option_fails_the_compile():
    """What the test above relies on: a misspelt option is an error, not ignored."""
    f = jax.jit(lambda x: x + 1, compiler_options={"xla_gpu_enable_command_bufer": "FUSION"})
    with pytest.raises(Exception, match="xla_gpu_enable_command_bufer"):
        f(jnp.ones(2))


def test_unknown_names_are_errors():
    from jaxspec.parallel import TensorParallel, make_mesh
    from test_parallel import CFG
    with pytest.raises(ValueError, match="collective flag set"):
        with collective_flags("fast"):
            pass
    with pytest.raises(ConfigError, match="schedule must be one of"):
        TensorParallel(make_mesh(1), CFG, schedule="sequence")
    with pytest.raises(ConfigError, match="allreduce must be one of"):
        TensorParallel(make_mesh(1), CFG, schedule="replicated_attention", allreduce="nccl")
    with pytest.raises(ConfigError, match="needs schedule='replicated_attention'"):
        TensorParallel(make_mesh(1), CFG, allreduce="oneshot")


def test_bench_schedule_items():
    """bench_parallel's --tp-schedules items: SCHEDULE[:VOCAB[:ALLREDUCE]], each bad one named."""
    from types import SimpleNamespace
    from bench.bench_parallel import tp_configs
    items = ["megatron", "replicated_attention:replicate",
             "replicated_attention:replicate:oneshot"]
    assert tp_configs(SimpleNamespace(tp_schedules=items)) == [
        ("megatron", "megatron", "auto", "xla"),
        ("replicated_attention:replicate", "replicated_attention", "replicate", "xla"),
        ("replicated_attention:replicate:oneshot", "replicated_attention", "replicate",
         "oneshot")]
    for bad in ("sequence", "megatron:all", "megatron:auto:oneshot",
                "replicated_attention:auto:nccl", "megatron:auto:xla:x"):
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            tp_configs(SimpleNamespace(tp_schedules=[bad]))


# ------------------------------------------------------------------------ in the subprocess


def _placement_with(schedule, allreduce):
    """build_engine's placement with `schedule` and `allreduce`: the engine and backends built
    as LLM builds them, over the schedule's TensorParallel."""
    from jaxspec import build
    from jaxspec.parallel import TensorParallel, make_mesh
    build.placement = lambda cfg, dp, tp, impl="shard_map": TensorParallel(
        make_mesh(tp), cfg, schedule=schedule, allreduce=allreduce)


def check_engine(schedule, allreduce):
    import parallel_check as pc
    from reference_runner import SpecRunner
    from jaxspec.build import build_engine
    from jaxspec.engine import EngineConfig
    from pallas_kernels import allreduce_mgpu
    _placement_with(schedule, allreduce)
    label = f"tp2-{schedule}-{allreduce}"
    traced = []    # the explicit all-reduces traced: the MLP took the shard_map path
    real = allreduce_mgpu.allreduce
    allreduce_mgpu.allreduce = lambda *a: traced.append(a[1:]) or real(*a)
    p, d = pc.pair()
    ref = SpecRunner(pc.CFG, p, d, "chain", max_slots=4, max_len=pc.MAX_LEN + 16)
    want = [x.token_ids for x in ref.generate(pc.PROMPTS, pc.NEW)]
    econf = EngineConfig(max_batch=4, max_model_len=pc.MAX_LEN, prefill_chunk=16)
    eng = build_engine(pc.CFG, p, econf, draft=d, spec="chain", tensor_parallel=2)
    pc.check(f"{label}-chain", [r.output for r in pc.serve(eng, pc.PROMPTS, pc.greedy())],
             want)
    pl, be = eng.backend.placement, eng.backend
    assert pl.schedule == schedule and pl.allreduce == allreduce and pl.mesh.size == 2
    for kv in (eng.state.target.k, eng.state.target.v, eng.state.draft_k):
        assert kv.sharding.is_fully_replicated, kv.sharding
    for params in (be.params, be.draft_params):
        lp = params["layers"]
        for name in ("wqkv", "bqkv", "wo"):
            assert lp[name].sharding.is_fully_replicated, (name, lp[name].sharding)
        for name in ("w_gate_up", "w_down"):
            assert not lp[name].sharding.is_fully_replicated, (name, lp[name].sharding)
            assert lp[name].addressable_shards[0].data.size * 2 == lp[name].size
    want_axis = [(allreduce_mgpu.AXIS, 2)] if allreduce == "oneshot" else []
    assert sorted(set(traced)) == want_axis, (allreduce, set(traced))
    pc.ok(f"{label}-layout")
    econf = EngineConfig(max_batch=4, max_model_len=pc.MAX_LEN, prefill_chunk=16,
                         decode_steps=pc.PLAIN_STEPS)
    eng = build_engine(pc.CFG, p, econf, tensor_parallel=2)
    pc.check(f"{label}-plain",
             [r.output for r in pc.serve(eng, pc.PROMPTS, pc.greedy())], pc.plain_reference())


def step_collectives(cfg, schedule, allreduce, kind, batch):
    """{op: count} in the optimized HLO of one step (plain) or chain cycle over 2 devices."""
    import parallel_check as pc
    from jaxspec.engine import PlainBackend, SpecBackend
    from jaxspec.parallel import TensorParallel, make_mesh
    from jaxspec.parallel.tensor_parallel import count_collectives
    from jaxspec.sampling import LEAN
    p, d = pc.pair(cfg)
    pl = TensorParallel(make_mesh(2), cfg, schedule=schedule, allreduce=allreduce)
    be = (PlainBackend(cfg, p, batch, 64, n_steps=1, placement=pl) if kind == "plain"
          else SpecBackend(cfg, p, d, "chain", batch, 96, placement=pl))
    state = be.init_state()
    _, low = be.cycle(state, be.placement.put_mask(np.ones((batch,), bool)), LEAN, size=1,
                      lower=True)
    return count_collectives(low.compile().as_text())


def check_collectives(schedule, allreduce):
    import parallel_check as pc
    cfgs = {n: dataclasses.replace(pc.CFG, num_layers=n).with_layout(unroll_layers=True)
            for n in (2, 4)}
    for kind in ("plain", "chain"):
        for batch in (1, 4):
            two, four = (step_collectives(cfgs[n], schedule, allreduce, kind, batch)
                         for n in (2, 4))
            per_layer = {op: (four[op] - two[op]) / 2 for op in two}
            want = {op: PER_LAYER[schedule, allreduce] if op == "all-reduce" else 0
                    for op in two}
            assert per_layer == want, (schedule, allreduce, kind, batch, per_layer, two, four)
            print(f"{schedule} {allreduce} {kind} batch {batch}: per layer "
                  f"{per_layer['all-reduce']:g} "
                  f"all-reduce; 2 layers {two}", flush=True)
    pc.ok(f"tp2-collectives-{schedule}-{allreduce}")


if __name__ == "__main__":
    assert jax.device_count() >= 2, "set XLA_FLAGS=--xla_force_host_platform_device_count=2"
    for s, a in PER_LAYER:
        check_collectives(s, a)
    for s, a in ENGINES:
        check_engine(s, a)
