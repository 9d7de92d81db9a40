"""bench/read_floor.py's streaming kernel reads what its figures count: every row of K and V of
the layer asked for, each once (Pallas interpret mode against jnp)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.read_floor import stream_read, stream_reference


@pytest.mark.parametrize("splits,block", [(1, 64), (4, 32), (2, 128)])
def test_stream_read_sums_every_row_of_the_layer(splits, block):
    ks = jax.random.split(jax.random.key(splits * 7 + block), 2)
    shape = (3, 2, 2, 256, 64)   # [L, B, Hkv, T, D]
    kc = jax.random.normal(ks[0], shape, jnp.bfloat16)
    vc = jax.random.normal(ks[1], shape, jnp.bfloat16)
    got = stream_read(kc, vc, jnp.int32(1), splits=splits, block=block, interpret=True)
    want = stream_reference(kc, vc, 1, splits)
    assert got.shape == (4, splits, 64)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)
    # another layer's sums differ: the kernel read the layer it was given
    other = stream_reference(kc, vc, 2, splits)
    assert not np.allclose(np.asarray(got), np.asarray(other), atol=1e-2)


def test_stream_read_refuses_rows_that_do_not_cut_into_blocks():
    kc = jnp.zeros((1, 1, 1, 192, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="192 rows do not cut into 2 splits of whole 64-row"):
        stream_read(kc, kc, jnp.int32(0), splits=2, block=64, interpret=True)


@pytest.mark.parametrize("splits,block,steps", [(2, 64, 2), (1, 128, 3)])
def test_tma_read_lands_each_ctas_last_block(splits, block, steps):
    """Mosaic GPU's interpreter runs the TMA ring (refilled slots included, with 3 slots over 4
    blocks): each CTA's output is the first 8 rows of the last block it copied, from the layer
    asked for."""
    from bench.read_floor import tma_read
    kc = jax.random.normal(jax.random.key(splits + steps), (3, 2, 2, 512, 64), jnp.bfloat16)
    got = tma_read(kc, kc + 1, jnp.int32(2), splits=splits, block=block, steps=steps,
                   interpret=True)
    chunk = 512 // splits
    want = kc[2].reshape(4, splits, chunk, 64)[:, :, chunk - block:chunk - block + 8]
    assert got.shape == (4, splits, 8, 64)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_touch_kernels_read_only_the_first_block_of_each_split():
    """The launch floor's kernels (rows=block): the stream sums only each split's first block,
    and each TMA CTA lands its first block (so its output is that block's first 8 rows)."""
    from bench.read_floor import tma_read
    kc = jax.random.normal(jax.random.key(4), (2, 1, 2, 256, 64), jnp.bfloat16)
    got = stream_read(kc, kc, jnp.int32(1), splits=4, block=8, rows=8, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(stream_reference(kc, kc, 1, 4, 8)),
                               rtol=1e-5, atol=1e-4)
    assert not np.allclose(np.asarray(got), np.asarray(stream_reference(kc, kc, 1, 4)),
                           atol=1e-2)
    got = tma_read(kc, kc, jnp.int32(1), splits=4, block=8, steps=1, rows=8, interpret=True)
    want = kc[1].reshape(2, 4, 64, 64)[:, :, :8]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
