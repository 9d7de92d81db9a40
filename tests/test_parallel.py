"""Data and tensor parallel: greedy outputs equal the single device's, token for token.

The multi-device checks run in one subprocess with 4 fake CPU devices
(`XLA_FLAGS=--xla_force_host_platform_device_count=4` must be set before jax initialises): tensor
parallel on the first 2 devices and on all 4, data parallel speculative on 2 and plain on 4
(tests/parallel_check.py); the layout and error checks run here.
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

from jaxspec.config import ConfigError, ModelConfig
from jaxspec.models import llama
from jaxspec.parallel import check_shardable, spread
from jaxspec.parallel.tensor_parallel import _blocked_layer, block_qkv, unblock_qkv

ROOT = Path(__file__).resolve().parents[1]
CFG = ModelConfig(arch="Qwen2ForCausalLM", vocab_size=96, hidden_size=32, intermediate_size=48,
                  num_layers=2, num_heads=8, num_kv_heads=4, head_dim=8, attention_bias=True)


def fake_devices_env(n: int) -> dict:
    """A subprocess environment with n fake CPU devices; the caller's XLA_FLAGS are kept."""
    flags = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}"
    return dict(os.environ, XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))


@pytest.fixture(scope="module")
def multi_device_run():
    env = fake_devices_env(4)
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "parallel_check.py"), "2", "4"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    return proc


CHECKS = [f"tp{n}-{what}" for n in (2, 4) for what in ("forward", "spec")]
CHECKS += ["dp2-spec", "dp2-spec-again", "dp2-engine-spec", "dp2-engine-spec-sampled"]
CHECKS += ["dp4-engine-plain", "dp4-engine-plain-sampled"]
CHECKS += ["dp4-plain", "dp4-plain-vs-spec", "tp4-jit-cycle", "tp4-collectives", "tp4-plain-tied",
           "tp4-engine"]


@pytest.mark.parametrize("name", CHECKS)
def test_multi_device(multi_device_run, name):
    out = multi_device_run.stdout.splitlines()
    if f"ok {name}" not in out:
        pytest.fail(f"{name} did not pass (rc {multi_device_run.returncode})\n"
                    + multi_device_run.stdout[-3000:] + multi_device_run.stderr[-6000:])


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


def test_spread_keeps_order_and_balance():
    groups = spread(range(11), replicas=2, slots=3)
    assert groups == [[[0, 1, 2], [3, 4, 5]], [[6, 7, 8], [9, 10]]]
    assert [i for g in groups for r in g for i in r] == list(range(11))
    assert spread(range(3), replicas=4, slots=8) == [[[0], [1], [2], []]]


@pytest.mark.skipif(os.environ.get("JAXSPEC_MULTIHOST") != "1",
                    reason="about a minute on 2 cores: set JAXSPEC_MULTIHOST=1")
def test_multihost_two_processes():
    """Two processes joined by jax.distributed (gloo on CPU), one device each: the tensor-parallel
    runner over the global mesh equals the single-device output (tests/multihost_check.py)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "multihost_check.py")], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert "ok multihost" in proc.stdout.splitlines(), proc.stdout[-3000:] + proc.stderr[-6000:]


@pytest.mark.real_weights
def test_llm_data_and_tensor_parallel_equal_single_device(smollm2_gguf):
    """The public API: LLM(data_parallel=2) and LLM(tensor_parallel=3), plain and speculative."""
    env = fake_devices_env(3)
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "llm_parallel_check.py"),
                           str(smollm2_gguf)], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "LLM data/tensor parallel OK" in proc.stdout
