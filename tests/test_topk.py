"""Two-stage top_k, top_k_by_chunk_max, top2_by_reduce and top_k_by_rank == jax.lax.top_k bit
for bit: values, indices and tie order."""
from __future__ import annotations

import functools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.spec import SpecConfig
from jaxspec.spec import draft as draft_lib
from jaxspec.spec import topk as topk_lib

CHUNK = 64


@functools.lru_cache(maxsize=None)
def _jitted(k, chunk):
    """lax.top_k and the implementations under test at (k, chunk), as one jitted program (one
    compilation a shape and dtype, not one per implementation; each output still comes from its
    own ops): the random and the tied inputs of one shape and dtype share it."""
    # chunk-max widths: chunk / 8 gives rows of several chunks at CHUNK; 1 and 3 are the edges.
    fns = (functools.partial(topk_lib.top_k, k=k, chunk=chunk),
           functools.partial(topk_lib.top_k_by_chunk_max, k=k, width=max(1, chunk // 8)),
           functools.partial(topk_lib.top_k_by_chunk_max, k=k, width=3, small="top_k"),
           functools.partial(topk_lib.top_k_by_chunk_max, k=k, width=5, small="sort"),
           functools.partial(topk_lib.top_k_by_chunk_max, k=k, width=7, small="rank"))
    fns += (topk_lib.top2_by_reduce,) if k == 2 else ()
    return jax.jit(lambda x: (jax.lax.top_k(x, k), tuple(f(x) for f in fns)))


def _check(x, k, chunk=CHUNK):
    want, got = _jitted(k, chunk)(x)
    assert len(got) == (6 if k == 2 else 5)
    for g in got:
        _assert_same(g, want)


def _assert_same(got, want):
    """got == want (lax.top_k's values and indices) bit for bit."""
    assert got[0].shape == want[0].shape and got[0].dtype == want[0].dtype
    assert got[1].dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got[0], np.float64), np.asarray(want[0], np.float64))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


# V: prime (padded), split evenly into chunks under the bound, a multiple of the bound, below one
# chunk, equal to k, one past a chunk (padded).
VOCABS = [1009, 1000, 4 * CHUNK, 50, 10, CHUNK + 1]


@pytest.mark.parametrize("v", VOCABS)
@pytest.mark.parametrize("k", [1, 2, 4, 10])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_random_matches_lax(v, k, dtype):
    if k > v:
        pytest.skip("k > V")
    key = jax.random.PRNGKey(v * 100 + k)
    x = jax.random.normal(key, (2, 3, v), jnp.float32).astype(dtype)
    _check(x, k)


@pytest.mark.parametrize("v", VOCABS)
@pytest.mark.parametrize("k", [1, 2, 4, 10])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
def test_ties_match_lax(v, k, dtype):
    """Few distinct values: most of the top k are ties, so the index order is what is tested."""
    if k > v:
        pytest.skip("k > V")
    x = jax.random.randint(jax.random.PRNGKey(v + k), (2, 3, v), -3, 3).astype(dtype)
    _check(x, k)


def test_all_equal_and_infinities():
    """Every element tied (the lowest indices win), -inf in the row next to the -inf padding,
    and rows where fewer than k elements are finite."""
    assert topk_lib.chunk_layout(211, CHUNK) == (4, 53)             # one padded element
    _check(jnp.zeros((2, 211), jnp.float32), 10)
    _check(jnp.full((2, 211), -jnp.inf, jnp.float32), 10)
    x = jnp.full((3, 211), -jnp.inf, jnp.float32).at[:, 5].set(1.0).at[:, 210].set(2.0)
    _check(x, 10)
    _check(x.astype(jnp.bfloat16), 10)
    for y in (jnp.zeros((2, 211), jnp.float32), jnp.full((2, 211), -jnp.inf), x):
        _check(y, 2)                                                 # one finite element in x


def _check_short(x, k):
    """The short-row selections: top_k_by_rank and small_top_k equal lax.top_k, and
    top_k_indices_in_order is its index set in ascending order."""
    want = jax.lax.top_k(x, k)
    # one program for the three (one compilation a shape and dtype)
    *got_both, in_order = jax.jit(lambda x: (topk_lib.top_k_by_rank(x, k=k),
                                             topk_lib.small_top_k(x, k=k),
                                             topk_lib.top_k_indices_in_order(x, k=k)))(x)
    for got in got_both:
        assert got[1].dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(got[0], np.float64),
                                      np.asarray(want[0], np.float64))
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    got = in_order
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), np.sort(np.asarray(want[1]), axis=-1))


@pytest.mark.parametrize("w", [1, 4, 13, 64, topk_lib.RANK_MAX_WIDTH, topk_lib.RANK_MAX_WIDTH + 7])
@pytest.mark.parametrize("k", [1, 2, 5])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
def test_short_rows_match_lax(w, k, dtype):
    """Random rows and rows of few distinct values (ties), below and above the rank path's
    width bound."""
    if k > w:
        pytest.skip("k > W")
    x = jax.random.normal(jax.random.PRNGKey(w * 10 + k), (3, 2, w), jnp.float32)
    _check_short((4 * x).astype(dtype), k)
    _check_short(jax.random.randint(jax.random.PRNGKey(w + k), (2, 3, w), -2, 2).astype(dtype), k)


def test_short_rows_infinities_and_zeros():
    """-inf, +inf and signed zeros in the rank order lax.top_k gives them on the CPU."""
    x = jnp.array([[0.0, -0.0, -jnp.inf, 1.0, -0.0, jnp.inf, 0.0, -jnp.inf]], jnp.float32)
    for k in (1, 2, 3, 6, 8):
        _check_short(x, k)
    _assert_same(topk_lib.top2_by_reduce(x), jax.lax.top_k(x, 2))
    _assert_same(topk_lib.top2_by_reduce(x[:, 2:]), jax.lax.top_k(x[:, 2:], 2))   # -inf first


@pytest.mark.parametrize("chunk", [1, 3, 7, 64, 5000])
def test_chunk_sizes(chunk):
    x = jax.random.randint(jax.random.PRNGKey(chunk), (4, 307), 0, 20).astype(jnp.float32)
    _check(x, 10, chunk)


@pytest.mark.parametrize("shape", [(300,), (5, 300), (2, 1, 3, 300)])
def test_batch_dims(shape):
    x = jax.random.normal(jax.random.PRNGKey(len(shape)), shape, jnp.float32)
    _check(x, 10)


def test_chunk_layout():
    assert topk_lib.chunk_layout(128256, 4096) == (32, 4008)         # Llama-3 vocab: no pad
    assert topk_lib.chunk_layout(128256, 2048) == (64, 2004)
    assert topk_lib.chunk_layout(50, 64) == (1, 50)
    for v, c in [(1000, 64), (65, 64), (10, 64), (32771, 4096), (151936, 4096), (997, 3)]:
        n, w = topk_lib.chunk_layout(v, c)
        assert w <= c and 0 <= n * w - v < n, (v, c, n, w)


def test_policy():
    assert topk_lib.use_two_stage(128256, 10, "gpu")
    assert topk_lib.use_two_stage(32000, 10, "gpu")                  # EAGLE-3 draft vocabulary
    assert not topk_lib.use_two_stage(128256, 1, "gpu")
    assert not topk_lib.use_two_stage(331, 10, "gpu")
    assert not topk_lib.use_two_stage(128256, 10, "cpu")
    method = topk_lib.vocab_top_k_method
    assert method(16384, 8, "gpu") == "pallas"                      # the shipped head's vocab
    assert method(128256, 10, "gpu") == "pallas"
    assert method(128256, 16, "gpu", jnp.bfloat16) == "pallas"
    assert method(128256, 17, "gpu") == "chunk_max"                 # past the kernel's MAX_K
    assert method(128256, 10, "gpu", jnp.float16) == "chunk_max"
    assert method(16384, 2, "gpu") == "top2"
    assert method(16384, 8, "cpu") == "lax"


def test_policy_without_the_kernel(monkeypatch):
    """PALLAS_TOP_K off (or JAXSPEC_KERNELS=0): the XLA routes, as measured before the kernel."""
    monkeypatch.setenv("JAXSPEC_KERNELS", "0")
    assert topk_lib.vocab_top_k_method(16384, 8, "gpu") == "two_stage"
    monkeypatch.delenv("JAXSPEC_KERNELS")
    monkeypatch.setattr(topk_lib, "PALLAS_TOP_K", False)
    method = topk_lib.vocab_top_k_method
    assert method(16384, 8, "gpu") == "two_stage"                   # the shipped head's vocab
    assert method(32000, 4, "gpu") == "two_stage"
    assert method(16384, 10, "gpu") == "chunk_max"
    assert method(49152, 8, "gpu") == "chunk_max"
    assert method(16384, 8, "cpu") == "lax"
    assert method(16384, 2, "gpu") == "top2"                        # a batch-64 small tree
    assert method(64, 2, "gpu") == "top2"
    assert method(16384, 3, "gpu") == "two_stage"
    assert method(16384, 2, "cpu") == "lax"
    assert method(16384, 1, "gpu") == "lax"                         # callers take argmax


@pytest.mark.parametrize("kk,pallas", [(2, False), (8, False), (10, False), (10, True)])
def test_top_children_two_stage_equals_lax(kk, pallas, monkeypatch):
    """With the GPU paths on (k = 2: one top-2 reduction, k = 8: chunks of a draft vocabulary,
    k = 10: chunk maxima, or the Pallas kernel in interpret mode), draft's top_children is
    unchanged."""
    v = topk_lib.TWO_STAGE_MIN_VOCAB + 123
    spec = SpecConfig(num_steps=2, topk=kk, num_draft_tokens=min(8, kk + kk * kk + 1))
    logits = 3.0 * jax.random.normal(jax.random.PRNGKey(7), (2, kk, v), jnp.float32)
    logits = jnp.round(logits * 4) / 4                              # ties across the vocab
    monkeypatch.setattr(topk_lib, "PALLAS_TOP_K", pallas)
    monkeypatch.setattr(topk_lib, "kernels_enabled", lambda backend: True)
    monkeypatch.setattr(topk_lib.pallas_topk, "vocab_top_k_pallas", functools.partial(
        topk_lib.pallas_topk.vocab_top_k_pallas, interpret=True))
    with mock.patch.object(topk_lib, "TWO_STAGE_BACKENDS", (jax.default_backend(),)):
        assert topk_lib.vocab_top_k_method(v, kk) == (
            "pallas" if pallas else {2: "top2", 8: "two_stage", 10: "chunk_max"}[kk])
        tok, logp = jax.jit(functools.partial(draft_lib.top_children, spec=spec))(logits)
    vals, want = jax.lax.top_k(logits, kk)
    np.testing.assert_array_equal(np.asarray(tok), np.asarray(want))
    np.testing.assert_allclose(np.asarray(logp),
                               np.asarray(vals - jax.nn.logsumexp(logits, -1, keepdims=True)),
                               rtol=0, atol=1e-6)


def test_chunk_max_tie_across_chunks():
    """The k-th value tied between a chunk with a larger max and an earlier chunk whose max is
    that value: the earlier chunk's element (lower index) must win, as in lax.top_k."""
    x = jnp.full((1, 12), -5.0).at[0, 1].set(1.0)          # chunk 0 (width 4): max 1.0
    x = x.at[0, 8].set(9.0).at[0, 11].set(1.0)            # chunk 2: max 9.0, then a 1.0 at 11
    want = jax.lax.top_k(x, 2)
    for small in topk_lib.SMALL_SELECTIONS:
        got = topk_lib.top_k_by_chunk_max(x, 2, width=4, small=small)
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))   # [8, 1]
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))


def test_sort_top_k_signed_zeros():
    """Signed zeros in lax.top_k's CPU order (+0.0 ahead of -0.0)."""
    x = jnp.array([[0.0, -0.0, 1.0, -0.0, 0.0]], jnp.float32)
    want = jax.lax.top_k(x, 4)
    got = topk_lib._top_k_by_sort(x, 4)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


def test_chunk_max_small_selection_policy():
    """Sorts above SORT_MIN_K, lax.top_k at or below it (both exact; only the ops differ)."""
    x = jax.random.normal(jax.random.PRNGKey(3), (2, 4096), jnp.float32)

    def ops(k):
        text = jax.jit(functools.partial(topk_lib.top_k_by_chunk_max, k=k)).lower(x).as_text()
        return text.count("stablehlo.sort"), "chlo.top_k" in text

    sorts_above, top_k_above = ops(topk_lib.SORT_MIN_K + 2)
    sorts_at, top_k_at = ops(topk_lib.SORT_MIN_K)
    assert not top_k_above and top_k_at
    assert sorts_above > sorts_at >= 1          # at or below: only the chosen chunks' index sort


def test_logsumexp_from_max_is_jax_logsumexp():
    """top_children's logsumexp, its max read from the top-1 value, gives jax.nn.logsumexp's bits,
    with -inf entries and a row that is all -inf."""
    x = 3.0 * jax.random.normal(jax.random.PRNGKey(11), (4, 3, 1000), jnp.float32)
    x = x.at[0, 0, :].set(-jnp.inf).at[1, 0, 5].set(-jnp.inf)
    top = jnp.max(x, axis=-1, keepdims=True)
    got = jax.jit(draft_lib._logsumexp_from_max)(x, top)
    want = jax.jit(functools.partial(jax.nn.logsumexp, axis=-1, keepdims=True))(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
