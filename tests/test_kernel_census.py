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
