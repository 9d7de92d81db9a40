"""bench/pdl_probe.py's small Mosaic GPU kernel doubles what it is given, bit for bit (Mosaic
GPU's interpreter; its `griddepcontrol.wait` variant runs only on the device)."""
import jax
import jax.numpy as jnp
import numpy as np

from bench.pdl_probe import doubled, doubled_chunks, timed_variant


def test_doubled_is_twice_its_input():
    x = jax.random.normal(jax.random.key(3), (32, 128), jnp.bfloat16)
    got = doubled(x, wait=False, interpret=True)
    assert got.shape == x.shape and got.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(x * 2, np.float32))


def test_doubled_chunks_doubles_every_chunk():
    x = jax.random.normal(jax.random.key(5), (3, 32, 128), jnp.bfloat16)
    got = doubled_chunks(x, interpret=True)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(x * 2, np.float32))


def test_timed_variant_returns_outputs_and_says_what_it_could_not_time(capsys):
    """On a machine with no GPU kernels in its trace the variant's outputs still come back (as
    f32), and the line says there was nothing to time; a refused variant gives None, said."""
    x = jnp.arange(4, dtype=jnp.bfloat16)
    got = timed_variant("cpu", "a call", jax.jit(lambda a: [a * 2]), (x,), reps=1, execs=1)
    np.testing.assert_array_equal(got[0], np.arange(4, dtype=np.float32) * 2)

    def refuse(a):
        raise NotImplementedError("no rule for griddepcontrol_wait")
    assert timed_variant("refused", "a call", refuse, (x,), reps=1) is None
    out = capsys.readouterr().out
    assert "cpu: no GPU kernels in the trace" in out
    assert "refused: NotImplementedError: no rule for griddepcontrol_wait" in out


def test_doubled_chunks_of_fewer_ctas_doubles_the_leading_chunks():
    """The pair's second kernel: one CTA over the first chunk of a whole [C, R, D] input."""
    x = jax.random.normal(jax.random.key(7), (3, 32, 128), jnp.bfloat16)
    got = doubled_chunks(x, ctas=1, interpret=True)
    assert got.shape == (1, 32, 128)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(x[:1] * 2, np.float32))


def test_doubled_chunks_in_loops_doubles_every_chunk_once():
    """A CTA doubling chunks c, c + ctas, ... in turn: 2 CTAs of 3 chunks cover all 6."""
    x = jax.random.normal(jax.random.key(9), (6, 32, 128), jnp.bfloat16)
    got = doubled_chunks(x, loops=3, interpret=True)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(x * 2, np.float32))
