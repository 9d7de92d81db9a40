"""Tree attention kernel (Pallas interpret mode on CPU) against the jnp reference."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import tree_attention as ta

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def _inputs(seed, b, n, hq, hkv, d, t, num_layers, dtype, seq_lens):
    ks = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(ks[0], (b, n, hq, d), dtype)
    kc = jax.random.normal(ks[1], (num_layers, b, hkv, t, d), dtype)
    vc = jax.random.normal(ks[2], (num_layers, b, hkv, t, d), dtype)
    kn = jax.random.normal(ks[3], (b, hkv, n, d), dtype)
    vn = jax.random.normal(ks[4], (b, hkv, n, d), dtype)
    # A random tree-like mask: every node sees itself (no query is left with no key at all).
    mask = jax.random.bernoulli(ks[5], 0.5, (b, n, n)) | jnp.eye(n, dtype=bool)
    return q, kc, vc, jnp.asarray(seq_lens, jnp.int32), kn, vn, mask


def _pack(q, kn, vn):
    """q [B, N, Hq, D], k/v [B, Hkv, N, D] -> qkv [B, N, Hq + 2 Hkv, D]."""
    return jnp.concatenate([q, kn.transpose(0, 2, 1, 3), vn.transpose(0, 2, 1, 3)], axis=2)


def _kernel(entry, q, kc, vc, layer, sl, kn, vn, mask, slots=None, window_start=None, **tune):
    """The Pallas kernel by its separate-input entry or its packed one (`_pack`)."""
    if entry == "packed":
        return ta.tree_attention_packed_pallas(_pack(q, kn, vn), kc, vc, layer, sl, mask, slots,
                                               window_start, num_heads=q.shape[2], **tune)
    return ta.tree_attention_pallas(q, kc, vc, layer, sl, kn, vn, mask, slots, window_start,
                                    **tune)


def _rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


# b, n, hq, hkv, d, t, seq_lens: GQA groups 1/4/8; N 1/7/16/64; prefixes ending at the last row,
# slots of very different lengths (0 included); a first prompt chunk as admission runs it (empty
# prefix, a cache only as long as the chunk, SmolLM2's 9 query heads over 3 KV heads).
CASES = [
    (2, 1, 8, 2, 64, 96, [96, 0]),
    (3, 7, 8, 8, 64, 80, [0, 80, 13]),
    (2, 16, 8, 1, 64, 64, [64, 5]),
    (1, 64, 4, 1, 64, 40, [40]),
    (2, 16, 9, 3, 64, 16, [0, 0]),
]


@pytest.mark.parametrize("entry", ["separate", "packed"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}n{c[1]}g{c[2] // c[3]}")
def test_kernel_matches_reference(case, dtype, entry):
    b, n, hq, hkv, d, t, seq_lens = case
    q, kc, vc, sl, kn, vn, mask = _inputs(0, b, n, hq, hkv, d, t, 2, dtype, seq_lens)
    scale = 1 / math.sqrt(d)
    layer = jnp.int32(1)
    ref = ta.tree_attention_reference(q, kc, vc, layer, sl, kn, vn, mask, sm_scale=scale)

    # One split (the kernel's own store), and small blocks with several splits so a handful of
    # rows already cross block/split edges (the combine's store): both kernel calls in one
    # jitted program (one compilation a case).
    @jax.jit
    def both(q, kc, vc, sl, kn, vn, mask):
        outs = []
        for splits in (1, 3):
            outs.append(_kernel(entry, q, kc, vc, layer, sl, kn, vn, mask, sm_scale=scale,
                                block_k=16, num_splits=splits, interpret=True))
        return outs

    outs = both(q, kc, vc, sl, kn, vn, mask)
    assert len(outs) == 2
    for out in outs:
        assert out.shape == q.shape and out.dtype == q.dtype
        assert np.isfinite(np.asarray(out, np.float32)).all()
        assert _rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("entry", ["separate", "packed"])
def test_rows_read_their_slots_of_a_larger_cache(entry):
    """slots: 3 query rows attend to slots 4, 0 and 5 (padding: clipped, prefix 0) of a 6-slot
    cache; each must equal the reference on that slot's cache alone, and the reference with
    slots must equal the reference on the gathered cache."""
    b, n, hq, hkv, d, t = 6, 7, 8, 2, 64, 48
    q6, kc, vc, _, kn6, vn6, mask6 = _inputs(5, b, n, hq, hkv, d, t, 2, jnp.float32, [0] * b)
    q, kn, vn, mask = q6[:3], kn6[:3], vn6[:3], mask6[:3]
    slots = jnp.asarray([4, 0, b], jnp.int32)
    sl = jnp.asarray([37, 48, 0], jnp.int32)
    layer = jnp.int32(1)
    scale = 1 / math.sqrt(d)
    gathered = [jnp.take(c, slots, axis=1, mode="clip") for c in (kc, vc)]
    ref = ta.tree_attention_reference(q, *gathered, layer, sl, kn, vn, mask, sm_scale=scale)
    ref_slots = ta.tree_attention_reference(q, kc, vc, layer, sl, kn, vn, mask, sm_scale=scale,
                                            slots=slots)
    np.testing.assert_allclose(np.asarray(ref_slots), np.asarray(ref), rtol=1e-6, atol=1e-6)
    for splits in (1, 3):
        out = _kernel(entry, q, kc, vc, layer, sl, kn, vn, mask, slots, sm_scale=scale,
                      block_k=16, num_splits=splits, interpret=True)
        assert _rel_err(out, ref) < TOL[jnp.float32]
    # A wrong slot map reads other caches: the check can fail.
    wrong = ta.tree_attention_reference(q, kc, vc, layer, sl, kn, vn, mask, sm_scale=scale,
                                        slots=jnp.asarray([3, 0, b], jnp.int32))
    assert _rel_err(wrong, ref) > 1e-2


def test_packed_split_and_dispatch_off_gpu():
    q, kc, vc, sl, kn, vn, mask = _inputs(5, 2, 3, 8, 2, 64, 24, 1, jnp.float32, [9, 20])
    qkv = _pack(q, kn, vn)
    for got, want in zip(ta.split_packed(qkv, 8, 2), (q, kn, vn)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    out = ta.tree_attention_packed(qkv, kc, vc, jnp.int32(0), sl, mask, num_heads=8,
                                   sm_scale=0.125)
    ref = ta.tree_attention_reference(q, kc, vc, jnp.int32(0), sl, kn, vn, mask, sm_scale=0.125)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
    with pytest.raises(AssertionError, match="expected 4 query"):
        ta.tree_attention_packed_pallas(qkv, kc, vc, jnp.int32(0), sl, mask, num_heads=4,
                                        sm_scale=0.125, interpret=True)


def test_reads_only_the_given_layer_and_live_rows():
    # Poison everything the kernel must not read: other layers and rows at or past seq_lens.
    b, n, hq, hkv, d, t = 2, 4, 8, 2, 64, 48
    sl = [20, 33]
    q, kc, vc, sl, kn, vn, mask = _inputs(1, b, n, hq, hkv, d, t, 3, jnp.float32, sl)
    live = jnp.arange(t)[None, None, None, :, None] < sl[None, :, None, None, None]
    is_layer = (jnp.arange(3) == 2)[:, None, None, None, None]
    kc_p = jnp.where(live & is_layer, kc, jnp.nan)
    vc_p = jnp.where(live & is_layer, vc, jnp.nan)
    layer = jnp.int32(2)
    out = ta.tree_attention_pallas(q, kc_p, vc_p, layer, sl, kn, vn, mask, sm_scale=0.1,
                                   block_k=16, num_splits=2, interpret=True)
    ref = ta.tree_attention_reference(q, kc, vc, layer, sl, kn, vn, mask, sm_scale=0.1)
    assert _rel_err(out, ref) < TOL[jnp.float32]


def test_dispatch_uses_reference_off_gpu():
    q, kc, vc, sl, kn, vn, mask = _inputs(2, 1, 2, 4, 2, 64, 16, 1, jnp.float32, [9])
    out = ta.tree_attention(q, kc, vc, jnp.int32(0), sl, kn, vn, mask, sm_scale=0.125)
    ref = ta.tree_attention_reference(q, kc, vc, jnp.int32(0), sl, kn, vn, mask, sm_scale=0.125)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


def test_live_rows_sizes_the_splits_not_the_result():
    """live_rows: the longest prefix a program will see sizes its default split count (64
    SmolLM2 slots: 4 splits for a 2,048-row cache, 1 for 512 live rows); the result is the
    reference's whatever it says, also when a slot's prefix is longer than it claims."""
    assert ta.default_config(64, 1, 9, 3, 64, 2048)[2] == 4
    assert ta.default_config(64, 1, 9, 3, 64, 512)[2] == 1
    q, kc, vc, sl, kn, vn, mask = _inputs(9, 3, 4, 8, 2, 64, 1024, 2, jnp.float32, [1000, 7, 300])
    ref = ta.tree_attention_reference(q, kc, vc, jnp.int32(1), sl, kn, vn, mask, sm_scale=0.125)
    for live_rows in (0, 320, 64):
        out = ta.tree_attention_pallas(q, kc, vc, jnp.int32(1), sl, kn, vn, mask, sm_scale=0.125,
                                       block_k=16, live_rows=live_rows, interpret=True)
        assert _rel_err(out, ref) < TOL[jnp.float32]


def test_default_config_fills_gpu_at_batch_one():
    block_r, block_k, splits, _, _ = ta.default_config(1, 1, 32, 8, 128, 32768)
    assert block_r == 16 and 8 * splits >= 132


def test_small_heads_read_short_prefixes_in_one_program():
    """SmolLM2's 3 KV heads of 64 at batch 1: up to 512 keys, one split of 128-key blocks; more
    keys, wider heads, many programs or wide tiles keep the split rule."""
    assert ta.default_config(1, 1, 9, 3, 64, 512)[1:3] == (128, 1)
    assert ta.default_config(1, 1, 9, 3, 64, 2048)[1:3] == (64, 8)
    assert ta.default_config(1, 1, 32, 8, 128, 512)[1:3] == (64, 2)
    assert ta.default_config(64, 1, 9, 3, 64, 512)[1:3] == (64, 1)
    assert ta.default_config(1, 32, 9, 3, 64, 512)[1] == 64
    # and the kernel at that setting equals the reference (prefixes shorter and longer than a
    # block, one that ends at the cache's last row)
    q, kc, vc, sl, kn, vn, mask = _inputs(5, 3, 1, 9, 3, 64, 512, 1, jnp.float32, [512, 100, 1])
    out = ta.tree_attention_pallas(q, kc, vc, jnp.int32(0), sl, kn, vn, mask, sm_scale=0.125,
                                   block_k=128, num_splits=1, interpret=True)
    ref = ta.tree_attention_reference(q, kc, vc, jnp.int32(0), sl, kn, vn, mask, sm_scale=0.125)
    assert _rel_err(out, ref) < TOL[jnp.float32]


def test_combine_merges_more_splits_than_one_chunk():
    # 20 splits over 400 rows with a combine chunk of 16 splits: the running max is carried
    # from one chunk of partials to the next.
    b, n, hq, hkv, d, t = 2, 16, 8, 2, 64, 400
    assert ta.combine_config(n * hq // hkv, d, 20)[2] < 20
    q, kc, vc, sl, kn, vn, mask = _inputs(3, b, n, hq, hkv, d, t, 1, jnp.float32, [400, 170])
    out = ta.tree_attention_pallas(q, kc, vc, jnp.int32(0), sl, kn, vn, mask, sm_scale=0.125,
                                   block_k=16, num_splits=20, interpret=True)
    ref = ta.tree_attention_reference(q, kc, vc, jnp.int32(0), sl, kn, vn, mask, sm_scale=0.125)
    assert _rel_err(out, ref) < TOL[jnp.float32]


@pytest.mark.parametrize("b,n,t", [(1, 1, 1024), (1, 1, 32768), (8, 1, 8192), (64, 1, 1024),
                                   (1, 16, 8192), (8, 16, 8192), (1, 60, 1152), (64, 60, 2048),
                                   (4, 16, 16)])
def test_default_config_splits_stay_whole_and_fill(b, n, t):
    block_r, block_k, splits, _, _ = ta.default_config(b, n, 32, 8, 128, t)
    programs = b * 8 * -(-n * 4 // block_r)
    assert splits == 1 or t // splits >= 4 * block_k      # no split shorter than 4 key blocks
    assert programs * splits >= min(64, programs * max(1, t // (4 * block_k)))


@pytest.mark.parametrize("entry", ["separate", "packed"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("heads", [(8, 2), (9, 3), (8, 8)], ids=lambda h: f"g{h[0] // h[1]}")
def test_one_token_tree_by_vector_step(heads, dtype, entry):
    """Decoding's one new key folded in by `_vector_step` rather than a key block: against the
    reference with one split and with three (the combine), an empty prefix, a full one, and a
    slot whose new token is masked out."""
    hq, hkv = heads
    b, d, t = 3, 64, 48
    q, kc, vc, sl, kn, vn, mask = _inputs(7, b, 1, hq, hkv, d, t, 2, dtype, [0, t, 17])
    mask = mask.at[2].set(False)   # slot 2 attends to its prefix only
    ref = np.asarray(ta.tree_attention_reference(q, kc, vc, jnp.int32(1), sl, kn, vn, mask,
                                                 sm_scale=0.125), np.float64)

    @jax.jit
    def run(q, kc, vc, sl, kn, vn, mask):
        return [_kernel(entry, q, kc, vc, jnp.int32(1), sl, kn, vn, mask, sm_scale=0.125,
                        block_k=16, num_splits=splits, interpret=True) for splits in (1, 3)]

    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    for out in run(q, kc, vc, sl, kn, vn, mask):
        np.testing.assert_allclose(np.asarray(out, np.float64), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("entry", ["separate", "packed"])
def test_causal_bound_keeps_every_key_a_query_sees(entry):
    """causal=True stops each row block at its last query's key block. Packs (block-diagonal
    causal) and causal chunks after a prefix give the reference's result, at block sizes where
    row blocks end mid-token and key blocks end mid-request."""
    hq, hkv, d, n = 9, 3, 64, 40
    seg = np.repeat([0, 1, 2], [13, 20, 7])
    pos = np.concatenate([np.arange(13), np.arange(20), np.arange(7)])
    pack = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])
    causal = np.tril(np.ones((n, n), bool))
    q, kc, vc, sl, kn, vn, _ = _inputs(7, 2, n, hq, hkv, d, n + 24, 1, jnp.float32, [0, 24])
    mask = jnp.asarray(np.stack([pack, causal]))
    ref = ta.tree_attention_reference(q, kc, vc, jnp.int32(0), sl, kn, vn, mask, sm_scale=0.125)
    for block_r, block_n, skip in ((16, 16, False), (32, 8, False), (64, 32, False),
                                   (16, 16, True), (32, 8, True), (16, 8, True)):
        out = _kernel(entry, q, kc, vc, jnp.int32(0), sl, kn, vn, mask, sm_scale=0.125,
                      block_r=block_r, block_k=16, block_n=block_n, interpret=True,
                      causal=True, skip_before=skip)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5, atol=2e-5)
    # A mask that lets an early query see a late key is outside the contract: the bound drops
    # that key, so the result differs (this is what the option promises callers to avoid).
    wide = mask.at[:, 0, n - 1].set(True)
    ref_w = ta.tree_attention_reference(q, kc, vc, jnp.int32(0), sl, kn, vn, wide,
                                        sm_scale=0.125)
    out_w = ta.tree_attention_pallas(q, kc, vc, jnp.int32(0), sl, kn, vn, wide, sm_scale=0.125,
                                     block_r=16, block_k=16, block_n=16, interpret=True,
                                     causal=True)
    assert np.abs(np.asarray(out_w) - np.asarray(ref_w))[:, 0].max() > 1e-3


def test_skip_before_leaves_rows_that_see_nothing_finite():
    """A pack's padding row may see no key at all; with skip_before every row block still runs
    at least one key block, so such rows stay finite (their output is dropped, but a NaN there
    would reach real rows through the values of a shared key block)."""
    hq, hkv, d, n = 4, 2, 64, 48
    seg = np.repeat([0, 1], [30, 18])
    pos = np.concatenate([np.arange(30), np.arange(18)])
    mask = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])
    mask[:8] = mask[40:] = False   # rows that see nothing, the first 8 before any key they'd see
    q, kc, vc, sl, kn, vn, _ = _inputs(3, 1, n, hq, hkv, d, n, 1, jnp.float32, [0])
    out = ta.tree_attention_pallas(q, kc, vc, jnp.int32(0), sl, kn, vn, jnp.asarray(mask[None]),
                                   sm_scale=0.125, block_r=16, block_k=16, block_n=16,
                                   interpret=True, causal=True, skip_before=True)
    assert np.isfinite(np.asarray(out)).all()
    ref = ta.tree_attention_reference(q, kc, vc, jnp.int32(0), sl, kn, vn,
                                      jnp.asarray(mask[None]), sm_scale=0.125)
    np.testing.assert_allclose(np.asarray(out)[:, 8:40], np.asarray(ref)[:, 8:40], rtol=2e-5,
                               atol=2e-5)


def test_prefill_config_marks_chunks_causal():
    from jaxspec.config import ModelConfig, layout_of
    cfg = ModelConfig("LlamaForCausalLM", 64, 32, 64, 2, 4, 2, 8)
    assert not layout_of(cfg).causal_chunks and cfg.for_prefill().layout.causal_chunks


def test_one_slot_long_prefix_fills_one_wave_of_two_programs_per_sm():
    """One slot of 8 KV heads of 128 at N = 1 over 8K+ keys: 2 programs per SM of a 132-SM
    GPU in one wave (32 splits at 8K, 33 at 32K); shorter caches, more slots, wide tiles and
    small heads keep the keys-per-split rule."""
    assert ta.default_config(1, 1, 32, 8, 128, 8192)[2] == 32
    assert ta.default_config(1, 1, 32, 8, 128, 32768)[2] == 33
    assert ta.default_config(1, 1, 32, 8, 128, 4096)[2] == 8
    assert ta.default_config(8, 1, 32, 8, 128, 8192)[2] == 16
    assert ta.default_config(1, 16, 32, 8, 128, 32768)[2] == 33
    assert ta.default_config(1, 1, 9, 3, 64, 8192)[2] == 22


# ------------------------------------------------------------------ sliding windows, soft-caps


def _dense_reference(q, kc, vc, layer, sl, kn, vn, mask, scale, window_start, softcap):
    """Numpy attention with every rule spelt out per (slot, query, head): cache rows t with
    window_start <= t < seq_len, new keys under the mask, scores soft-capped before masking."""
    q, kc, vc, kn, vn = (np.asarray(x, np.float64) for x in (q, kc, vc, kn, vn))
    b, n, hq, d = q.shape
    hkv = kc.shape[2]
    out = np.zeros(q.shape)
    for s in range(b):
        for i in range(n):
            rows = np.arange(int(window_start[s, i]), int(sl[s]))
            seen = np.flatnonzero(np.asarray(mask[s, i]))
            for h in range(hq):
                kh = h // (hq // hkv)
                keys = np.concatenate([kc[layer, s, kh, rows], kn[s, kh, seen]])
                vals = np.concatenate([vc[layer, s, kh, rows], vn[s, kh, seen]])
                sc = keys @ q[s, i, h] * scale
                sc = softcap * np.tanh(sc / softcap) if softcap else sc
                p = np.exp(sc - sc.max())
                out[s, i, h] = p @ vals / p.sum()
    return out


def _window_inputs(seed, b, n, hq, hkv, d, t, dtype, seq_lens, window):
    """Inputs of a tree at positions seq_len + depth, depth = n % 4 (nodes of a 4-deep tree),
    with each query's window start (positions > p - window) and the window in its mask."""
    q, kc, vc, sl, kn, vn, mask = _inputs(seed, b, n, hq, hkv, d, t, 2, dtype, seq_lens)
    pos = sl[:, None] + jnp.arange(n)[None] % 4
    start = jnp.maximum(pos - window + 1, 0).astype(jnp.int32)
    mask = mask & (pos[:, :, None] - pos[:, None, :] < window)
    return q, kc, vc, sl, kn, vn, mask, start


def test_reference_window_and_softcap_spelt_out():
    q, kc, vc, sl, kn, vn, mask, start = _window_inputs(11, 2, 6, 4, 2, 16, 40, jnp.float32,
                                                        [37, 9], window=5)
    for softcap in (None, 1.5):
        ref = ta.tree_attention_reference(q, kc, vc, jnp.int32(1), sl, kn, vn, mask,
                                          sm_scale=0.25, window_start=start, softcap=softcap)
        want = _dense_reference(q, kc, vc, 1, sl, kn, vn, mask, 0.25, np.asarray(start), softcap)
        np.testing.assert_allclose(np.asarray(ref), want, rtol=1e-5, atol=1e-5)
    # the window and the cap both change the result
    plain = ta.tree_attention_reference(q, kc, vc, jnp.int32(1), sl, kn, vn, mask, sm_scale=0.25)
    assert _rel_err(plain, ref) > 1e-2
    unwindowed = ta.tree_attention_reference(q, kc, vc, jnp.int32(1), sl, kn, vn, mask,
                                             sm_scale=0.25, softcap=1.5)
    assert _rel_err(unwindowed, ref) > 1e-2


# b, n, hq, hkv, d, t, seq_lens, window: decoding (one key, the vector step) and trees; GQA
# 2 and 4; head dims 64, 128 and 256; windows shorter than the tree, and than the prefix.
WINDOW_CASES = [
    (2, 1, 8, 2, 64, 96, [96, 20], 17),
    (2, 7, 8, 2, 128, 80, [80, 3], 3),
    (1, 12, 4, 1, 256, 48, [41], 9),
]


@pytest.mark.parametrize("entry", ["separate", "packed"])
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("case", WINDOW_CASES, ids=lambda c: f"n{c[1]}d{c[4]}w{c[7]}")
def test_kernel_window_and_softcap_match_reference(case, softcap, entry):
    b, n, hq, hkv, d, t, seq_lens, window = case
    q, kc, vc, sl, kn, vn, mask, start = _window_inputs(3, b, n, hq, hkv, d, t, jnp.float32,
                                                       seq_lens, window)
    scale = 1 / math.sqrt(d)
    layer = jnp.int32(1)
    ref = ta.tree_attention_reference(q, kc, vc, layer, sl, kn, vn, mask, sm_scale=scale,
                                      window_start=start, softcap=softcap)

    @jax.jit
    def both(q, kc, vc, sl, kn, vn, mask, start):
        return [_kernel(entry, q, kc, vc, layer, sl, kn, vn, mask, None, start, sm_scale=scale,
                        block_k=16, num_splits=splits, interpret=True, softcap=softcap)
                for splits in (1, 3)]

    for out in both(q, kc, vc, sl, kn, vn, mask, start):
        assert _rel_err(out, ref) < TOL[jnp.float32]


def test_kernel_reads_no_block_before_every_window():
    """A tile's prefix loop starts at the key block of its queries' earliest window start: rows
    before that block (NaN here) are never loaded, and the result is the reference's."""
    b, n, hq, hkv, d, t = 1, 4, 4, 2, 64, 64
    q, kc, vc, sl, kn, vn, mask = _inputs(2, b, n, hq, hkv, d, t, 1, jnp.float32, [60])
    start = jnp.asarray([[40, 41, 42, 43]], jnp.int32)
    ref = ta.tree_attention_reference(q, kc, vc, jnp.int32(0), sl, kn, vn, mask, sm_scale=0.125,
                                      window_start=start)
    before = (jnp.arange(t) < 32)[None, None, None, :, None]    # blocks of 16: 40 -> row 32
    kc_p, vc_p = jnp.where(before, jnp.nan, kc), jnp.where(before, jnp.nan, vc)
    for splits in (1, 2):
        out = ta.tree_attention_pallas(q, kc_p, vc_p, jnp.int32(0), sl, kn, vn, mask, None,
                                       start, sm_scale=0.125, block_k=16, num_splits=splits,
                                       interpret=True)
        assert np.isfinite(np.asarray(out)).all()
        assert _rel_err(out, ref) < TOL[jnp.float32]


def test_dispatch_passes_window_and_softcap_off_gpu():
    q, kc, vc, sl, kn, vn, mask, start = _window_inputs(4, 2, 3, 8, 2, 64, 24, jnp.float32,
                                                        [9, 20], window=6)
    want = ta.tree_attention_reference(q, kc, vc, jnp.int32(0), sl, kn, vn, mask,
                                       sm_scale=0.125, window_start=start, softcap=3.0)
    out = ta.tree_attention_packed(_pack(q, kn, vn), kc, vc, jnp.int32(0), sl, mask,
                                   num_heads=8, sm_scale=0.125, window_start=start, softcap=3.0)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))


def test_mosaic_takes_no_window_or_softcap():
    q, kc, vc, sl, kn, vn, mask, start = _window_inputs(4, 1, 16, 8, 2, 64, 128, jnp.bfloat16,
                                                        [100], window=6)
    with pytest.raises(ValueError, match="Mosaic prefix kernel takes no sliding window"):
        ta.tree_attention_pallas(q, kc, vc, jnp.int32(0), sl, kn, vn, mask, None, start,
                                 sm_scale=0.125, backend="mosaic", interpret=True)


def test_wide_heads_take_smaller_tiles():
    """Heads of 256 (Gemma): row tiles of at most 64 rows over 32-key blocks, two stages."""
    block_r, block_k, _, _, stages = ta.default_config(1, 16, 8, 1, 256, 4096)
    assert (block_r, block_k, stages) == (64, 32, 2)
    assert ta.default_config(1, 1, 4, 1, 256, 256)[1] == 32
    assert ta.default_config(1, 16, 8, 1, 128, 4096)[:2] == (128, 64)


@pytest.mark.skipif(not ta.on_gpu(), reason="the compiled kernel needs a GPU")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", [
    (4, 1, 8, 1, 256, 4096, [4096, 100, 3000, 1], 512),
    (2, 12, 8, 2, 128, 2048, [2000, 700], 256),
    (1, 64, 8, 4, 256, 1024, [900], 100),
    (1, 256, 4, 1, 256, 512, [0], 64),
    (8, 1, 16, 8, 256, 8192, [8192] * 8, None),
], ids=lambda c: f"b{c[0]}n{c[1]}d{c[4]}w{c[7]}")
def test_compiled_kernel_windows_softcaps_and_wide_heads(case, dtype):
    """On the GPU, the compiled kernel (its default tiles, heads of 256 included) through the
    dispatch, with a window and a soft-cap, against the reference."""
    b, n, hq, hkv, d, t, seq_lens, window = case
    q, kc, vc, sl, kn, vn, mask, start = _window_inputs(0, b, n, hq, hkv, d, t, dtype,
                                                       seq_lens, window or t + n)
    start = start if window else None
    for softcap in (None, 20.0):
        with jax.default_matmul_precision("highest"):   # no TF32 in the fp32 reference
            ref = ta.tree_attention_reference(q, kc, vc, jnp.int32(1), sl, kn, vn, mask,
                                              sm_scale=d ** -0.5, window_start=start,
                                              softcap=softcap)
        out = ta.tree_attention_packed(_pack(q, kn, vn), kc, vc, jnp.int32(1), sl, mask,
                                       num_heads=hq, sm_scale=d ** -0.5, window_start=start,
                                       softcap=softcap)
        assert np.isfinite(np.asarray(out, np.float32)).all()
        assert _rel_err(out, ref) < (1e-4 if dtype == jnp.float32 else 2e-2)
