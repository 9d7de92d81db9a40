"""The Pallas vocabulary top-k (interpret mode) == jax.lax.top_k bit for bit: values, indices,
tie order, signed zeros, infinities and NaNs, rows whose chunks hold fewer than k elements; in
each of its forms (one launch or two)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import vocab_topk as vt


# fused: the default's choice (by the row's chunks), one launch, two passes.
FORMS = [None, True, False]


def _check(x, k, chunk, forms=FORMS[:1]):
    want = vt.vocab_top_k_reference(x, k)
    for fused in forms:
        got = vt.vocab_top_k_pallas(x, k, chunk=chunk, fused=fused, interpret=True)
        assert got[0].dtype == x.dtype and got[1].dtype == jnp.int32
        assert got[0].shape == got[1].shape == (x.shape[0], k)
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
        # the same bits, not only equal values: signed zeros, NaNs' payloads
        bits = np.uint16 if x.dtype == jnp.bfloat16 else np.uint32
        np.testing.assert_array_equal(np.asarray(got[0]).view(bits), np.asarray(want[0]).view(bits))


# (V, chunk, k, dtype): many chunks with a short last one, one chunk (V under it), a power of
# 2, chunks narrower than k (fewer survivors than k each); k from 1 to the kernel's MAX_K.
CASES = [(1009, 128, 10, jnp.float32), (1009, 128, 3, jnp.bfloat16),
         (300, 4096, 16, jnp.float32), (300, 4096, 1, jnp.bfloat16),
         (1024, 256, 10, jnp.bfloat16), (1024, 256, 16, jnp.float32),
         (40, 8, 10, jnp.float32), (40, 8, 16, jnp.bfloat16)]


@pytest.mark.parametrize("v,chunk,k,dtype", CASES)
def test_random_and_tied_rows(v, chunk, k, dtype):
    x = jax.random.normal(jax.random.PRNGKey(v + k), (3, v), jnp.float32)
    _check((5 * x).astype(dtype), k, chunk)
    ties = jax.random.randint(jax.random.PRNGKey(v * k), (3, v), -2, 2)     # most of the top
    _check(ties.astype(dtype), k, chunk, FORMS)                            # k are ties


def test_infinities_and_signed_zeros():
    """+0.0 ahead of -0.0 (lax.top_k's order on the CPU), -inf rows, fewer finite values than k."""
    row = jnp.array([0.0, -0.0, -jnp.inf, 1.0, -0.0, jnp.inf, 0.0, -jnp.inf, -2.0], jnp.float32)
    x = jnp.stack([row, jnp.full_like(row, -jnp.inf), jnp.full_like(row, -0.0),
                   jnp.zeros_like(row).at[4].set(-0.0)])
    for k, chunk in ((1, 2), (3, 4), (9, 2), (9, 16)):
        _check(x, k, chunk)


def test_nans_in_lax_order():
    """NaNs rank by their bits as lax.top_k ranks them: a positive-sign NaN above +inf, a
    negative-sign one below -inf; the NaN of all-ones bits has the lowest key there is, the
    one that also pads the rounds, and whole rows of it still come out in lax.top_k's order."""
    bits = np.array([0xFFFFFFFF, 0xFFFFFFFE, 0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800000,
                     0x3F800000, 0x80000000, 0x0, 0xFFFFFFFF, 0xFFFFFFFF], np.uint32)
    row = jnp.asarray(bits.view(np.float32))
    lowest = jnp.asarray(np.full(11, 0xFFFFFFFF, np.uint32).view(np.float32))
    x = jnp.stack([row, lowest, row[::-1]])
    for k, chunk in ((3, 2), (9, 4), (11, 16)):
        _check(x, k, chunk, FORMS[1:])


def test_draft_step_shape():
    """A draft step's rows at a real vocabulary width, the default chunks (n > 1)."""
    x = 3.0 * jax.random.normal(jax.random.PRNGKey(1), (4, 16384 + 77), jnp.float32)
    x = jnp.round(x * 8) / 8                                               # ties across chunks
    assert vt.chunks(x.shape[1]) == (5, 3293)
    _check(x, 10, vt.CHUNK)


def test_leading_axes():
    """[B, K, V] rows, as a draft step holds its logits."""
    x = jax.random.normal(jax.random.PRNGKey(2), (2, 3, 700), jnp.float32)
    _check(x.reshape(6, 700), 5, 128)
    got = vt.vocab_top_k_pallas(x, 5, chunk=128, interpret=True)
    want = vt.vocab_top_k_reference(x, 5)
    assert got[1].shape == (2, 3, 5)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))


def test_bad_input_is_refused():
    x = jnp.zeros((2, 50), jnp.float32)
    with pytest.raises(ValueError, match="k=17"):
        vt.vocab_top_k_pallas(x, 17, interpret=True)
    with pytest.raises(ValueError, match="k=0"):
        vt.vocab_top_k_pallas(x, 0, interpret=True)
    with pytest.raises(ValueError, match="row width 5"):
        vt.vocab_top_k_pallas(x[:, :5], 6, interpret=True)
    with pytest.raises(TypeError, match="int32"):
        vt.vocab_top_k_pallas(x.astype(jnp.int32), 3, interpret=True)


def test_launches_by_the_rows_chunks():
    """One launch for the 16,384-token draft rows (4 chunks), two passes for 128,256 (32), as
    measured (FUSED_MAX_CHUNKS); `fused` overrides the rule."""
    def launches(v, fused=None):
        x = jax.ShapeDtypeStruct((10, v), jnp.float32)
        return str(jax.make_jaxpr(lambda x: vt.vocab_top_k_pallas(x, 10, fused=fused))(x)) \
            .count("pallas_call")

    assert vt.chunks(16384)[0] <= vt.FUSED_MAX_CHUNKS < vt.chunks(128256)[0]
    assert (launches(16384), launches(128256)) == (1, 2)
    assert (launches(16384, False), launches(128256, True)) == (2, 1)


def test_device_programs_lower():
    """Both forms lower to Triton for the GPU from this CPU (what interpret mode skips: the
    atomic count and the barriers of the one-launch form), one custom call or two."""
    x = jnp.zeros((8, 16384), jnp.float32)
    for fused, calls in ((True, 1), (False, 2)):
        run = jax.jit(lambda x, fused=fused: vt.vocab_top_k_pallas(x, 8, fused=fused))
        text = run.trace(x).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("custom_call @__gpu$xla.gpu.triton") == calls
        # the arrival count and the barriers around it, in the one-launch program only
        assert ("atomic_rmw" in text, "gpu.barrier" in text) == (fused, fused)
