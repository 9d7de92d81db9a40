"""The GEMM rule of `jaxspec.xla_options`: which programs get cuBLAS GEMMs, overrides, errors,
that the options compile on the CPU, and that every program jaxspec builds goes through it."""
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import xla_options
from jaxspec.config import ModelConfig
from jaxspec.engine import backends
from jaxspec.spec import SpecConfig
from jaxspec.spec.cycle import jit_cycle

CUBLAS = {"xla_gpu_enable_triton_gemm": False}
CFG = ModelConfig(arch="LlamaForCausalLM", vocab_size=97, hidden_size=32, intermediate_size=48,
                  num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)


def test_rule_by_rows(monkeypatch):
    monkeypatch.delenv("JAXSPEC_GEMM", raising=False)
    assert xla_options.compiler_options(None) == {}
    assert xla_options.compiler_options(1) == {}
    assert xla_options.compiler_options(xla_options.CUBLAS_MIN_ROWS - 1) == {}
    assert xla_options.compiler_options(xla_options.CUBLAS_MIN_ROWS) == CUBLAS
    assert xla_options.compiler_options(256) == CUBLAS


def test_env_and_context_override(monkeypatch):
    monkeypatch.setenv("JAXSPEC_GEMM", "cublas")
    assert xla_options.compiler_options(None) == CUBLAS
    monkeypatch.setenv("JAXSPEC_GEMM", "triton")
    assert xla_options.compiler_options(512) == {}
    with xla_options.gemm_backend("auto"):          # the context wins over the environment
        assert xla_options.compiler_options(512) == CUBLAS
        with xla_options.gemm_backend("cublas"):
            assert xla_options.compiler_options(1) == CUBLAS
        assert xla_options.compiler_options(1) == {}
    assert xla_options.compiler_options(512) == {}


def test_unknown_backend_is_named(monkeypatch):
    with pytest.raises(ValueError, match="'cudnn'"):
        with xla_options.gemm_backend("cudnn"):
            pass
    monkeypatch.setenv("JAXSPEC_GEMM", "fast")
    with pytest.raises(ValueError, match="JAXSPEC_GEMM.*'fast'"):
        xla_options.compiler_options(64)


def test_options_compile_on_cpu():
    x = jnp.arange(12.0).reshape(3, 4)
    f = xla_options.jit(lambda a: a @ a.T + 1.0, rows=64)
    np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(x @ x.T + 1.0))
    with xla_options.gemm_backend("cublas"):
        g = xla_options.jit(lambda a: a.sum(0))
    np.testing.assert_array_equal(np.asarray(g(x)), np.asarray(x.sum(0)))


@pytest.fixture
def recorded(monkeypatch):
    """compiler_options of each jax.jit that xla_options builds."""
    seen = []
    real = jax.jit

    def spy(fun, **kw):
        seen.append(kw.get("compiler_options"))
        return real(fun, **kw)
    monkeypatch.setattr(xla_options.jax, "jit", spy)
    monkeypatch.delenv("JAXSPEC_GEMM", raising=False)
    return seen


def test_engine_programs_follow_slots(recorded):
    spec = SpecConfig(2, 1, 3)
    jit_cycle(CFG, spec, slots=64)
    jit_cycle(CFG, spec, slots=4)
    assert recorded == [CUBLAS, {}]
    del recorded[:]
    backends._jit_plain_cycles(CFG, 64, 2, "rule")
    assert recorded == [CUBLAS] * len(backends.VARIANTS)


def test_cached_programs_keep_the_rule_apart(recorded):
    spec = SpecConfig(1, 1, 2)
    a = jit_cycle(CFG, spec, slots=64)
    with xla_options.gemm_backend("triton"):
        b = jit_cycle(CFG, spec, slots=64)
    assert a is not b and recorded == [CUBLAS, {}]
    assert jit_cycle(CFG, spec, slots=64) is a


def test_every_program_goes_through_the_options():
    """A bare jax.jit in the package would compile without the GEMM rule."""
    root = pathlib.Path(xla_options.__file__).parent
    bare = [f"{p.relative_to(root)}:{i + 1}" for p in root.rglob("*.py")
            if p.name != "xla_options.py"
            for i, line in enumerate(p.read_text().splitlines())
            if re.search(r"\bjax\.jit\b", line) and not line.lstrip().startswith("#")]
    assert bare == []
