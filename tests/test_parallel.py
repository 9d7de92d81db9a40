"""Data and tensor parallel: placements a backend is built over, driven by the one engine;
greedy outputs equal the single device's, token for token.

The multi-device checks run in two subprocesses side by side, each with 4 fake CPU devices
(`XLA_FLAGS=--xla_force_host_platform_device_count=4` must be set before jax initialises):
data parallel over 2 devices through shard_map and through jax.pmap (speculative and plain;
streaming, aborts, retracts, sampled requests; layouts; each device prefills only its own
newcomers; nothing compiles after warm-up), tensor parallel over 2 and 4 devices (speculative and
plain, the layout, the kernels per head shard, the GSPMD-only paths) (tests/parallel_check.py);
the layout and error checks run here.
"""
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.build import placement
from jaxspec.config import ConfigError, ModelConfig
from jaxspec.models import llama
from jaxspec.parallel import DataParallel, OneDevice, check_shardable, local_devices
from jaxspec.parallel.tensor_parallel import _blocked_layer, block_qkv, unblock_qkv

ROOT = Path(__file__).resolve().parents[1]
CFG = ModelConfig(arch="Qwen2ForCausalLM", vocab_size=96, hidden_size=32, intermediate_size=48,
                  num_layers=2, num_heads=8, num_kv_heads=4, head_dim=8, attention_bias=True)


def fake_devices_env(n: int) -> dict:
    """A subprocess environment with n fake CPU devices; the caller's XLA_FLAGS are kept."""
    flags = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}"
    return dict(os.environ, XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))


# Two processes of about equal work (each computes the single-device references once).
GROUPS = [("dp:shard_map", "tp:2"), ("dp:pmap", "tp:4", "tp-gspmd:4")]


def _dp(impl):
    spec = [f"dp2-{impl}-spec{x}" for x in ("", "-own-slots", "-layout", "-again",
                                             "-own-newcomers", "-churn")]
    return spec + [f"dp2-{impl}-plain{x}" for x in ("-cold", "", "-vs-spec")]


def _tp(n):
    return [f"tp{n}-{x}" for x in ("forward", "spec", "spec-layout", "kernels", "plain")]


CHECKS = {"dp:shard_map": _dp("shard_map"), "dp:pmap": _dp("pmap"), "tp:2": _tp(2),
          "tp:4": _tp(4), "tp-gspmd:4": ["tp4-gspmd", "tp4-plain-tied"]}


@pytest.fixture(scope="module")
def multi_device_runs():
    """{group: the finished process that ran it}."""
    env = fake_devices_env(4)
    procs = [(g, subprocess.Popen([sys.executable, str(ROOT / "tests" / "parallel_check.py"),
                                   *g], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)) for g in GROUPS]
    out = {}
    for groups, proc in procs:
        try:
            stdout, stderr = proc.communicate(timeout=1500)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        for g in groups:
            out[g] = (proc.returncode, stdout, stderr)
    return out


@pytest.mark.parametrize("name", [(g, c) for g in CHECKS for c in CHECKS[g]],
                         ids=lambda x: x[1])
def test_multi_device(multi_device_runs, name):
    group, check = name
    rc, stdout, stderr = multi_device_runs[group]
    if f"ok {check}" not in stdout.splitlines():
        pytest.fail(f"{check} did not pass (rc {rc})\n" + stdout[-3000:] + stderr[-6000:])


def test_blocked_layout_round_trip():
    w = jnp.arange(5 * (CFG.q_size + 2 * CFG.kv_size), dtype=jnp.float32).reshape(5, -1)
    for m in (1, 2, 4):
        b = block_qkv(w, CFG, m)
        assert b.shape == (5, m, w.shape[1] // m)
        np.testing.assert_array_equal(unblock_qkv(b, CFG), w)
    # Block 1 of 2 starts with q head 4 (q columns 32..) and holds kv heads 2, 3.
    b = block_qkv(w, CFG, 2)
    q, k = CFG.q_size, CFG.kv_size
    np.testing.assert_array_equal(b[:, 1, :q // 2], w[:, q // 2:q])
    np.testing.assert_array_equal(b[:, 1, q // 2:q // 2 + k // 2], w[:, q + k // 2:q + k])


@pytest.mark.parametrize("m", [2, 4])
def test_blocked_forward_equals_flat(m):
    """The blocked layout on one device computes what the flat one does."""
    p = llama.init_random_params(CFG, jax.random.PRNGKey(0), scale=0.2)
    pb = dict(p, layers=_blocked_layer(p["layers"], CFG, m))
    toks = jnp.asarray([[3, 9, 27, 81, 50, 1]], jnp.int32)
    pos = jnp.arange(6, dtype=jnp.int32)[None]
    k = jnp.zeros((2, 1, 4, 8, 8))

    def run(params):
        h, kn, vn, _ = llama.forward(params, CFG, toks, pos, k, k, jnp.zeros((1,), jnp.int32),
                                     llama.causal_mask(1, 6))
        return llama.lm_head(params, CFG, h), kn

    (a, ka), (b, kb) = run(p), run(pb)
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(kb, ka, rtol=1e-5, atol=1e-5)


def test_kv_heads_must_divide():
    check_shardable(CFG, 4)
    with pytest.raises(ConfigError, match="num_kv_heads=4 to be a multiple of 8"):
        check_shardable(CFG, 8)
    with pytest.raises(ConfigError, match="intermediate_size=44"):
        check_shardable(dataclasses.replace(CFG, num_kv_heads=8, intermediate_size=44), 8)


def test_placement_choices_and_errors():
    """build's placement: one device by default (either impl), the impl checked, data and tensor
    parallel not together, no more devices than there are."""
    assert isinstance(placement(CFG), OneDevice)
    assert isinstance(placement(CFG, data_parallel_impl="pmap"), OneDevice)
    with pytest.raises(ConfigError, match="data_parallel_impl must be one of"):
        placement(CFG, data_parallel_impl="engine")
    with pytest.raises(ConfigError, match="data_parallel_impl must be one of"):
        DataParallel(jax.devices()[:1], impl="engine")
    with pytest.raises(ConfigError, match="not supported"):
        placement(CFG, data_parallel=2, tensor_parallel=2)
    for bad in (0, 1.5, True):
        with pytest.raises(ConfigError, match="data_parallel must be an int >= 1"):
            placement(CFG, data_parallel=bad)
    n = len(jax.local_devices())
    with pytest.raises(ConfigError, match=f"data_parallel={n + 1} needs that many"):
        local_devices(n + 1)
    with pytest.raises(ConfigError, match=f"tensor_parallel={len(jax.devices()) + 1} needs"):
        placement(CFG, tensor_parallel=len(jax.devices()) + 1)


@pytest.mark.parametrize("impl", ["shard_map", "pmap"])
def test_data_parallel_state_checks(impl):
    """The programs come after the state (they are built over its split); under shard_map every
    state leaf needs a slot axis (one array for all devices would be written by each)."""
    pl = DataParallel(jax.devices()[:1], impl)
    with pytest.raises(RuntimeError, match="place the state"):
        pl.program(jax.jit(lambda p, d, s, a: (s, a)), "cycle")
    if impl == "shard_map":
        with pytest.raises(ConfigError, match="slot axis on every state leaf"):
            pl.state(lambda b: (jnp.zeros((b,)), jnp.zeros(())), 2, (0, -1))


@pytest.mark.skipif(os.environ.get("JAXSPEC_MULTIHOST") != "1",
                    reason="about a minute on 2 cores: set JAXSPEC_MULTIHOST=1")
def test_multihost_two_processes():
    """Two processes joined by jax.distributed (gloo on CPU), one device each: the engine over a
    backend placed tensor parallel on the global mesh equals the single-device output
    (tests/multihost_check.py)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "multihost_check.py")], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert "ok multihost" in proc.stdout.splitlines(), proc.stdout[-3000:] + proc.stderr[-6000:]


@pytest.mark.real_weights
def test_llm_data_and_tensor_parallel_equal_single_device(smollm2_gguf):
    """The public API: LLM(data_parallel=2) through jax.pmap and shard_map (the default), and
    LLM(tensor_parallel=3), plain and speculative; streams and aborts under data parallel."""
    env = fake_devices_env(3)
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "llm_parallel_check.py"),
                           str(smollm2_gguf)], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=1500)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    for impl in ("pmap", "shard_map"):
        assert f"ok LLM data_parallel=2 {impl}" in proc.stdout.splitlines()
    assert "LLM data/tensor parallel OK" in proc.stdout
