"""KV compaction kernel (Pallas interpret mode on CPU): bit-exact, and nothing else written."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import kv_compact as kvc

NUM_LAYERS, HKV, T, D = 3, 2, 24, 64


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


def _run(seq_lens, src_idx, count, n, dtype, seed=0):
    b = len(seq_lens)
    ks = jax.random.split(jax.random.key(seed), 2)
    shape = (NUM_LAYERS, b, HKV, T, D)
    # Poisoned caches: NaN in K, a sentinel in V; any stray write or lost row shows.
    k_cache = jnp.full(shape, jnp.nan, dtype)
    v_cache = jnp.full(shape, -12345.0, dtype)
    k_new = jax.random.normal(ks[0], (NUM_LAYERS, b, HKV, n, D), dtype)
    v_new = jax.random.normal(ks[1], (NUM_LAYERS, b, HKV, n, D), dtype)
    args = (k_new, v_new, jnp.asarray(seq_lens, jnp.int32), jnp.asarray(src_idx, jnp.int32),
            jnp.asarray(count, jnp.int32))
    ref = kvc.kv_compact_reference(k_cache, v_cache, *args)
    # The kernel's entry donates the caches: hand it copies.
    out = kvc.kv_compact_pallas(jnp.copy(k_cache), jnp.copy(v_cache), *args, interpret=True)
    return k_cache, v_cache, k_new, v_new, out, ref


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_bit_exact_and_untouched_elsewhere(dtype):
    # Slot 0: tree verify, accepted path out of order; slot 1: count 0; slot 2: runs past T
    # (two rows land, the rest are dropped); slot 3: plain append from row 0.
    seq_lens = [5, 9, T - 2, 0]
    src_idx = [[3, 0, 6, 2], [1, 2, 3, 4], [7, 1, 5, 0], [0, 1, 2, 3]]
    count = [3, 0, 4, 4]
    k_cache, v_cache, k_new, v_new, out, ref = _run(seq_lens, src_idx, count, 8, dtype)
    for o, r in zip(out, ref):
        np.testing.assert_array_equal(_bits(o), _bits(r))
    # Independent check of the written rows and of everything else.
    expect_k, expect_v = np.array(k_cache), np.array(v_cache)
    for b, (s, src, c) in enumerate(zip(seq_lens, src_idx, count)):
        for d in range(c):
            if s + d < T:
                expect_k[:, b, :, s + d] = np.asarray(k_new)[:, b, :, src[d]]
                expect_v[:, b, :, s + d] = np.asarray(v_new)[:, b, :, src[d]]
    np.testing.assert_array_equal(_bits(out[0]), _bits(expect_k))
    np.testing.assert_array_equal(_bits(out[1]), _bits(expect_v))


def test_plain_append_many_rows():
    # Prefill-style append: src = arange, more rows than one kernel block, last slot clipped by T.
    n = 40
    seq_lens = [0, T - 7]
    src_idx = [list(range(n))] * 2
    count = [T, n]
    *_, out, ref = _run(seq_lens, src_idx, count, n, jnp.bfloat16, seed=1)
    for o, r in zip(out, ref):
        np.testing.assert_array_equal(_bits(o), _bits(r))


def test_dispatch_uses_reference_off_gpu():
    shape = (1, 1, HKV, T, D)
    kc = jnp.zeros(shape, jnp.bfloat16) + 1
    new = jnp.ones((1, 1, HKV, 2, D), jnp.bfloat16) * 3
    k, v = kvc.kv_compact(kc, kc, new, new, jnp.array([4]), jnp.array([[1, 0]]), jnp.array([2]))
    assert float(k[0, 0, 0, 5, 0]) == 3.0 and float(k[0, 0, 0, 6, 0]) == 1.0


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_rows_into_chosen_slots_of_a_larger_cache(dtype):
    """slots: 3 rows of new go to slots 4, 1 and 6 (padding: dropped) of a 5-slot cache; every
    other slot and row keeps its poison, bit for bit, in the kernel and the reference."""
    cache_slots, n = 5, 6
    seq_lens, count = [3, 7, 0], [4, 2, 5]
    src_idx = [[0, 1, 2, 3, 4, 5]] * 3
    slots = jnp.asarray([4, 1, cache_slots], jnp.int32)
    ks = jax.random.split(jax.random.key(3), 2)
    shape = (NUM_LAYERS, cache_slots, HKV, T, D)
    k_cache, v_cache = jnp.full(shape, jnp.nan, dtype), jnp.full(shape, -12345.0, dtype)
    k_new = jax.random.normal(ks[0], (NUM_LAYERS, 3, HKV, n, D), dtype)
    v_new = jax.random.normal(ks[1], (NUM_LAYERS, 3, HKV, n, D), dtype)
    args = (k_new, v_new, jnp.asarray(seq_lens, jnp.int32), jnp.asarray(src_idx, jnp.int32),
            jnp.asarray(count, jnp.int32), slots)
    ref = kvc.kv_compact_reference(k_cache, v_cache, *args)
    out = kvc.kv_compact_pallas(jnp.copy(k_cache), jnp.copy(v_cache), *args, interpret=True)
    expect_k, expect_v = np.array(k_cache), np.array(v_cache)
    for row, slot in enumerate([4, 1]):
        s, c = seq_lens[row], count[row]
        expect_k[:, slot, :, s:s + c] = np.asarray(k_new)[:, row, :, :c]
        expect_v[:, slot, :, s:s + c] = np.asarray(v_new)[:, row, :, :c]
    for got in (out, ref):
        np.testing.assert_array_equal(_bits(got[0]), _bits(expect_k))
        np.testing.assert_array_equal(_bits(got[1]), _bits(expect_v))
