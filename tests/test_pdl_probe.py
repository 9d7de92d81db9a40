"""bench/pdl_probe.py's small Mosaic GPU kernel doubles what it is given, bit for bit (Mosaic
GPU's interpreter; its `griddepcontrol.wait` variant runs only on the device)."""
import jax
import jax.numpy as jnp
import numpy as np

from bench.pdl_probe import doubled


def test_doubled_is_twice_its_input():
    x = jax.random.normal(jax.random.key(3), (32, 128), jnp.bfloat16)
    got = doubled(x, wait=False, interpret=True)
    assert got.shape == x.shape and got.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(x * 2, np.float32))


def test_streamed_doubles_every_chunk():
    from bench.pdl_probe import streamed
    x = jax.random.normal(jax.random.key(5), (3, 32, 128), jnp.bfloat16)
    got = streamed(x, trigger=False, interpret=True)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(x * 2, np.float32))
