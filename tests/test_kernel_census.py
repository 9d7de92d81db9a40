"""bench/kernel_census.py counts the kernels a compiled program launches, by source line."""
from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp

from bench.kernel_census import kernels


def _line_of(marker: str) -> int:
    src, start = inspect.getsourcelines(_program)
    return start + next(i for i, line in enumerate(src) if marker in line)


def _program(x, w):
    h = jnp.tanh(jnp.sin(x) * 2.0 + 1.0)      # elementwise chain: one fusion
    y = h @ w                                  # the matmul
    return jnp.sum(y * y, axis=-1)             # reduction: one more


def _compiled(fn, *args):
    return jax.jit(fn).lower(*args).compile().as_text()


def test_elementwise_chain_is_one_kernel_and_fused_bodies_are_not_counted():
    x = jnp.ones((64, 64), jnp.float32)
    got = kernels(_compiled(lambda a: jnp.tanh(jnp.sin(a) * 2.0 + 1.0), x))
    assert len(got) == 1, got
    assert got[0][1] == "fusion"


def test_kernels_named_by_source_line():
    x, w = jnp.ones((64, 64), jnp.float32), jnp.ones((64, 32), jnp.float32)
    got = kernels(_compiled(_program, x, w))
    where = [src for _, _, _, src in got]
    assert 2 <= len(got) <= 4, got
    assert f"test_kernel_census.py:{_line_of('the matmul')} _program" in where, where
    assert all(src.startswith("test_kernel_census.py:") for src in where), where


def test_two_layers_launch_more_kernels_than_one():
    def stack(x, ws):
        for w in ws:
            x = jnp.tanh(x @ w)
        return x
    x = jnp.ones((8, 64), jnp.float32)
    w = jnp.full((64, 64), 0.01, jnp.float32)
    one, two = (len(kernels(_compiled(stack, x, [w] * n))) for n in (1, 2))
    assert two > one >= 1, (one, two)


def test_profile_table_sums_device_time_by_kind_and_name():
    """bench/profile_cycle.py's accounting of a GPU trace: per-call ms by kernel name and kind,
    kernels per call, and the first-to-last span (synthetic events: no GPU here)."""
    from bench.profile_cycle import kind_of, table
    assert [kind_of(n) for n in ("tree_attention_combine", "tree_attention__5", "kv_compact",
                                 "gemm_fusion_dot_3", "nvjet_sm90_tss", "loop_add_fusion_63",
                                 "void stream_executor::cuda::Run<16ul, float>", "memcpy32_post")
            ] == ["tree_attention_combine", "tree_attention", "kv_compact", "gemm", "gemm",
                  "fusion", "other", "copy"]
    # Two calls, each: a GEMM of 30 us, attention of 10 us, a fusion of 5 us, 2 us apart.
    ev = []
    for c in range(2):
        t0 = 1000.0 * c
        ev += [("gemm_fusion_dot_1", t0, 30.0), ("tree_attention", t0 + 32, 10.0),
               ("loop_add_fusion_2", t0 + 44, 5.0)]
    row = table("synthetic", 0.1, ev, calls=2, top=3)
    assert row["kernels_per_call"] == 3
    assert abs(row["kernel_ms"] - 0.045) < 1e-12
    assert abs(row["by_kind"]["gemm"] - 0.030) < 1e-12
    assert abs(row["by_kind"]["tree_attention"] - 0.010) < 1e-12
    assert abs(row["span_ms"] - (1049.0 / 2 / 1e3)) < 1e-12      # first start to last end
    assert row["by_name"]["loop_add_fusion_2"] == [0.005, 1.0]
