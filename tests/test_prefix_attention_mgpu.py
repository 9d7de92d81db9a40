"""The Mosaic GPU prefix kernel (Mosaic GPU's interpret mode on CPU: its warpgroups, TMA copies
and barriers simulated; the two matmuls by jnp there, wgmma on the device) against the jnp
references, alone and inside tree attention."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import prefix_attention_mgpu as pm
from pallas_kernels import tree_attention as ta

pytestmark = pytest.mark.skipif(pm.plgpu is None, reason="no Mosaic GPU in this jaxlib")


def _normals(key, *shapes):
    """One standard-normal bf16 array for each shape."""
    return [jax.random.normal(k, shape, jnp.bfloat16)
            for k, shape in zip(jax.random.split(key, len(shapes)), shapes)]


def _max_rel(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30)


# b, hkv, t, rows, seq_lens, splits, block_kv, steps, slots: one warpgroup (64 rows) and two
# (128); a ring of 2 and 3 slots wrapping several times; a slot with no prefix, one ending at the
# cache's last row, one with a single row; splits that end inside a block or get nothing; rows
# reading other slots of a larger cache.
CASES = [
    (1, 1, 512, 128, [512], 1, 64, 2, None),
    (2, 1, 512, 128, [0, 300], 3, 64, 3, None),
    (2, 2, 256, 64, [256, 1], 2, 64, 2, [2, 0]),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"r{c[3]}s{c[5]}k{c[7]}")
def test_partials_match_reference(case):
    """With two compute warpgroups (128 rows) a ring slot's keys are refilled before its values
    are free, with one both together (the interpreter checks that every barrier phase is
    seen)."""
    b, hkv, t, rows, seq_lens, splits, block_kv, steps, slots = case
    ks = jax.random.split(jax.random.key(rows + t), 3)
    cache_slots = b if slots is None else 3
    q = jax.random.normal(ks[0], (b, hkv, rows, 64), jnp.bfloat16)
    kc = jax.random.normal(ks[1], (2, cache_slots, hkv, t, 64), jnp.bfloat16)
    vc = jax.random.normal(ks[2], (2, cache_slots, hkv, t, 64), jnp.bfloat16)
    sl = jnp.asarray(seq_lens, jnp.int32)
    slots = None if slots is None else jnp.asarray(slots, jnp.int32)
    kw = dict(scale_log2=0.18, num_splits=splits, block_kv=block_kv)
    ref = pm.prefix_partials_reference(q, kc, vc, 1, sl, slots=slots, **kw)
    out = pm.prefix_partials_mgpu(q, kc, vc, jnp.int32(1), sl, slots, steps=steps,
                                  interpret=True, **kw)
    o, m, l = (np.asarray(x) for x in out)
    # m exact (the same max of the same f32 scores), l to f32 rounding, o to the bf16 rounding
    # of the probabilities fed to the second matmul.
    assert _max_rel(m, ref[1]) == 0.0
    assert _max_rel(l, ref[2]) < 1e-5
    assert _max_rel(o, ref[0]) < 5e-3
    # A split with no live keys contributes nothing to the merge: l = 0, o = 0.
    empty = np.asarray(ref[2]) == 0
    assert (l[empty] == 0).all() and (o[empty] == 0).all()


def test_row_tiles_side_by_side_match_reference():
    """The row tiles as the grid's last axis (launched side by side): three row tiles of one
    warpgroup over two splits give the reference's partials."""
    ks = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(ks[0], (1, 1, 192, 64), jnp.bfloat16)
    kc = jax.random.normal(ks[1], (1, 1, 1, 256, 64), jnp.bfloat16)
    vc = jax.random.normal(ks[2], (1, 1, 1, 256, 64), jnp.bfloat16)
    sl = jnp.asarray([200], jnp.int32)
    kw = dict(scale_log2=0.18, num_splits=2, block_kv=64)
    ref = pm.prefix_partials_reference(q, kc, vc, 0, sl, **kw)
    o, m, l = pm.prefix_partials_mgpu(q, kc, vc, jnp.int32(0), sl, steps=2, interpret=True,
                                      **kw)
    assert _max_rel(m, ref[1]) == 0.0
    assert _max_rel(o, ref[0]) < 5e-3 and _max_rel(l, ref[2]) < 1e-5


@pytest.mark.parametrize("entry, splits, block_r, n", [
    ("separate", 2, None, 7), ("packed", 2, None, 7), ("separate", 3, None, 7),
    ("separate", 1, None, 7), ("separate", 1, None, 16), ("separate", 2, None, 48),
    ("packed", 3, None, 48), ("separate", 2, None, 65), ("packed", 2, 16, 65),
    ("separate", 1, 128, 65), ("separate", 3, None, 65)])
def test_tree_attention_by_mosaic_matches_reference(entry, splits, block_r, n):
    """The whole backend="mosaic" path. Up to 64 tree tokens the Mosaic kernel attends to them
    too, their keys and values after the query rows, under the mask as a bias: with 1 split as
    one more key block of split 0, writing the output itself; with more (a short prefix, SMs
    idle) as a split of its own, the combine merging the partials (7 tokens x 4 heads: 28 rows
    padded to a warpgroup's 64; 48 tokens: three row tiles of one warpgroup). Two warpgroups
    run on the device only: through this entry Mosaic GPU's interpreter hangs now and then on
    them on a 2-core CPU, in a barrier wait. Past 64 tokens the Triton kernel adds
    the tree part beside the Mosaic prefix: merging 1-2 splits itself (row tiles of 16, and of
    128 past the partials' rows, masked) or before the combine (3); there two query heads a KV
    head (130 rows: three row tiles of one warpgroup)."""
    b, hq, hkv, d, t = 2, 8 if n <= 64 else 4, 2, 64, 256
    q, kc, vc, kn, vn = _normals(jax.random.key(5), (b, n, hq, d), (2, b, hkv, t, d),
                                 (2, b, hkv, t, d), (b, hkv, n, d), (b, hkv, n, d))
    mask = jax.random.bernoulli(jax.random.key(6), 0.5, (b, n, n)) | jnp.eye(n, dtype=bool)
    sl = jnp.asarray([t, 70], jnp.int32)
    scale = 1 / math.sqrt(d)
    ref = ta.tree_attention_reference(q, kc, vc, jnp.int32(1), sl, kn, vn, mask, sm_scale=scale)
    kw = dict(sm_scale=scale, interpret=True, backend="mosaic", num_splits=splits,
              block_r=block_r)
    if entry == "packed":
        qkv = jnp.concatenate([q, kn.transpose(0, 2, 1, 3), vn.transpose(0, 2, 1, 3)], 2)
        out = ta.tree_attention_packed_pallas(qkv, kc, vc, jnp.int32(1), sl, mask,
                                              num_heads=hq, **kw)
    else:
        out = ta.tree_attention_pallas(q, kc, vc, jnp.int32(1), sl, kn, vn, mask, **kw)
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-2
    # The mask is what the tree part reads: every row seeing every key is another answer.
    full = ta.tree_attention_reference(q, kc, vc, jnp.int32(1), sl, kn, vn,
                                       jnp.ones_like(mask), sm_scale=scale)
    assert np.linalg.norm(out - np.asarray(full, np.float64)) / np.linalg.norm(ref) > 5e-2


@pytest.mark.parametrize("n, inside", [(64, True), (65, False)])
def test_trees_past_64_tokens_keep_the_triton_tree_part(n, inside):
    """Which kernels the Mosaic path launches (traced, not run): up to 64 tree tokens the
    Mosaic kernel alone; past that, beside it the Triton kernel's tree part and merge."""
    q = jax.ShapeDtypeStruct((8, n, 32, 128), jnp.bfloat16)
    kc = jax.ShapeDtypeStruct((1, 8, 8, 1024, 128), jnp.bfloat16)
    kn = jax.ShapeDtypeStruct((8, 8, n, 128), jnp.bfloat16)
    jaxpr = str(jax.make_jaxpr(lambda q, kc, kn, sl, m: ta.tree_attention_pallas(
        q, kc, kc, jnp.int32(0), sl, kn, kn, m, sm_scale=0.1, backend="mosaic", num_splits=1))(
        q, kc, kn, jax.ShapeDtypeStruct((8,), jnp.int32),
        jax.ShapeDtypeStruct((8, n, n), jnp.bool_)))
    assert ("tree_attention_merge" in jaxpr) != inside


def _mosaic_kwarg_seen(monkeypatch, name, n, hq, t, **tuning):
    """The value of `prefix_partials_mgpu`'s keyword `name` that the default rules pass, with
    `tuning`, for one slot's N-token tree over a T-row cache (Hkv 8 at Hq 32, else 3; D 128).
    Traced, not run."""
    seen = []
    real = pm.prefix_partials_mgpu

    def spy(*a, **kw):
        seen.append(kw[name])
        return real(*a, **kw)

    monkeypatch.setattr(pm, "prefix_partials_mgpu", spy)
    hkv = 8 if hq == 32 else 3
    q = jax.ShapeDtypeStruct((1, n, hq, 128), jnp.bfloat16)
    kc = jax.ShapeDtypeStruct((1, 1, hkv, t, 128), jnp.bfloat16)
    kn = jax.ShapeDtypeStruct((1, hkv, n, 128), jnp.bfloat16)
    jax.make_jaxpr(lambda q, kc, kn, sl, m: ta.tree_attention_pallas(
        q, kc, kc, jnp.int32(0), sl, kn, kn, m, sm_scale=0.1, backend="mosaic", **tuning))(
        q, kc, kn, jax.ShapeDtypeStruct((1,), jnp.int32),
        jax.ShapeDtypeStruct((1, n, n), jnp.bool_))
    (value,) = seen
    return value


@pytest.mark.parametrize("n, t, splits, own", [(16, 1024, 4, True), (16, 8192, 16, False),
                                           (16, 1024, 1, False), (65, 1024, 4, False)])
def test_tree_split_as_the_rule_says(monkeypatch, n, t, splits, own):
    """The tree's block goes to a split of its own where `tree_split_pays` (batch 1 over 1K),
    not over 8K (every SM busy), nor with one split; past 64 tokens the tree is not there."""
    assert _mosaic_kwarg_seen(monkeypatch, "tree_split", n, 32, t, num_splits=splits) == own


def test_tree_of_mosaic_rows_with_an_empty_prefix():
    """A slot with no prefix at all (seq_len 0): its rows see only tree keys, through the bias;
    one split writes the normalised rows."""
    b, n, hq, hkv, d, t = 2, 5, 8, 2, 64, 128
    ks = jax.random.split(jax.random.key(9), 6)
    q = jax.random.normal(ks[0], (b, n, hq, d), jnp.bfloat16)
    kc = jax.random.normal(ks[1], (1, b, hkv, t, d), jnp.bfloat16)
    kn = jax.random.normal(ks[3], (b, hkv, n, d), jnp.bfloat16)
    vn = jax.random.normal(ks[4], (b, hkv, n, d), jnp.bfloat16)
    mask = jnp.tril(jnp.ones((n, n), bool))[None].repeat(b, 0)
    sl = jnp.asarray([0, 3], jnp.int32)
    scale = 1 / math.sqrt(d)
    ref = ta.tree_attention_reference(q, kc, kc, jnp.int32(0), sl, kn, vn, mask, sm_scale=scale)
    out = ta.tree_attention_pallas(q, kc, kc, jnp.int32(0), sl, kn, vn, mask, sm_scale=scale,
                                   interpret=True, backend="mosaic", num_splits=1)
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(out).all()
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-2


def test_bad_shapes_and_scale_are_refused():
    q = jnp.zeros((1, 1, 64, 64), jnp.bfloat16)
    kc = jnp.zeros((1, 1, 1, 100, 64), jnp.bfloat16)   # 100 rows: not whole 64-key blocks
    with pytest.raises(ValueError, match="cache length 100"):
        pm.prefix_partials_mgpu(q, kc, kc, jnp.int32(0), jnp.ones((1,), jnp.int32),
                                scale_log2=0.1, num_splits=1, block_kv=64, interpret=True)
    kc = jnp.zeros((1, 1, 1, 128, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="must be positive"):
        pm.prefix_partials_mgpu(q, kc, kc, jnp.int32(0), jnp.ones((1,), jnp.int32),
                                scale_log2=-0.1, num_splits=1, block_kv=64, interpret=True)


@pytest.mark.parametrize("b, rows, length, splits", [
    (1, 64, 8192, 16), (8, 64, 8192, 2), (64, 64, 8192, 1), (1, 256, 8192, 8),
    (8, 256, 32768, 1), (1, 192, 8192, 5), (1, 256, 4096, 8)])
def test_default_splits_fill_whole_waves(b, rows, length, splits):
    """The fewest splits whose CTAs fill 90% of 132 SMs and 90% of their last wave, each
    keeping 4 key blocks (the H200's measured best at these shapes, thirty-seventh set); 192
    rows run in 3 one-warpgroup row tiles, 24 CTAs a split at 8 KV heads. Only splits that
    hold keys count: at batch 1 over 8K, 15 splits of 5 blocks leave 2 empty. Batch 1 with
    256 rows over 4K fills a wave at 8 splits of 4 blocks, so it keeps them (16 of 2 lost)."""
    assert pm.default_splits(b, 8, rows, length, 128) == splits


@pytest.mark.parametrize("b, hkv, rows, length, splits", [
    (1, 8, 64, 2048, 8), (1, 8, 128, 2048, 8), (1, 8, 256, 2048, 8), (2, 8, 64, 1024, 4),
    (2, 8, 128, 1024, 4), (4, 8, 64, 1024, 4), (8, 3, 128, 1024, 4), (8, 3, 128, 2048, 4),
    (2, 8, 192, 1024, 2), (1, 8, 192, 512, 2)])
def test_short_prefixes_split_in_two_block_splits_within_a_wave(b, hkv, rows, length, splits):
    """Where 4-block splits leave SMs idle, 2-block splits up to one wave (the forty-fourth
    set's kernel times: 6-18% faster at the first seven shapes). SmolLM2's batch 8 over 2K
    (24 CTAs a split) keeps 4: 6 splits would be 144 CTAs, past one wave, and 8 lost there;
    5 splits of 4 blocks hold no more keys than 4. Three row tiles at batch 2 over 1K keep 2
    splits (96 CTAs), as 3 would be 144. (One row tile at batch 1 over 512-1K takes splits of
    one block: test_backend_rule.)"""
    chosen = pm.default_splits(b, hkv, rows, length, 128)
    assert chosen == splits
    busy = pm.grid_ctas(b, hkv, rows, pm.active_splits(length, chosen, 128))
    assert busy <= pm.NUM_SMS
    assert length // chosen >= 2 * 128


@pytest.mark.parametrize("length, splits, block", [(8192, 15, 128), (8192, 16, 128),
                                                   (1000, 3, 128), (0, 4, 128), (300, 8, 64)])
def test_active_splits_match_the_kernels_cut(length, splits, block):
    """`active_splits` counts the splits `_bounds` gives keys to, for every split index."""
    busy = sum(int(pm._bounds(jnp.int32(length), s, splits, block)[3]) > 0
               for s in range(splits))
    assert pm.active_splits(length, splits, block) == busy


@pytest.mark.parametrize("b, rows, length, splits, pays", [
    (1, 64, 8192, 16, False), (1, 256, 8192, 8, False), (1, 64, 1024, 4, True),
    (1, 256, 1024, 4, True), (2, 64, 1024, 4, True), (8, 64, 8192, 2, False),
    (8, 256, 1024, 1, False), (4, 64, 1024, 4, False), (2, 64, 128, 2, True)])
def test_tree_split_where_idle_sms_take_the_tree(b, rows, length, splits, pays):
    """The tree's block gets a split of its own where the SMs the prefix's CTAs leave idle take
    all of the tree's CTAs at once: batch 1 over 1K (32 prefix CTAs at 64 rows, 64 at 256: two
    row tiles), batch 2 (64), a one-block prefix that only split 0 reads; not batch 1 over 8K
    (128 CTAs, 4 SMs idle for 8 or 16 tree CTAs: slower on the H200), nor batch 8 over 8K or
    batch 4 over 1K (128), nor one split (no combine to merge a second)."""
    assert pm.tree_split_pays(b, 8, rows, length, splits, 128) == pays


def _tree_inputs(seed, b, hkv, t, rows, d, nt):
    """q rows with the tree's nt keys and values after them [B, Hkv, rows + 2 nt, D], a
    one-layer cache, the tree's keys alone, and a bias [B, rows, nt] (every row sees key 0)."""
    q, kc, vc, kn, vn = _normals(jax.random.key(seed), (b, hkv, rows, d), (1, b, hkv, t, d),
                                 (1, b, hkv, t, d), (b, hkv, nt, d), (b, hkv, nt, d))
    seen = jax.random.bernoulli(jax.random.key(seed + 1), 0.5, (b, rows, nt))
    seen = seen.at[:, :, 0].set(True)
    bias = jnp.where(seen, 0.0, ta.MASK_VALUE).astype(jnp.bfloat16)
    return jnp.concatenate([q, kn, vn], axis=2), q, kc, vc, kn, vn, seen, bias


def test_tree_split_leaves_the_prefix_splits_to_the_prefix():
    """With tree_split the kernel's first S splits are the prefix's alone (the reference's
    partials, split 0 included) and split S holds the tree's keys only, under the bias: its
    row sums are those of the tree's block by jnp."""
    b, hkv, t, rows, d, nt, splits = 1, 1, 256, 64, 64, 64, 2
    rows_kv, q, kc, vc, kn, vn, seen, bias = _tree_inputs(11, b, hkv, t, rows, d, nt)
    sl = jnp.asarray([200], jnp.int32)
    kw = dict(scale_log2=0.18, num_splits=splits, block_kv=64)
    o, m, l = (np.asarray(x) for x in pm.prefix_partials_mgpu(
        rows_kv, kc, vc, jnp.int32(0), sl, None, bias, steps=2, tree_split=True,
        interpret=True, **kw))
    assert o.shape == (b * hkv, splits + 1, rows, d)
    ref = pm.prefix_partials_reference(q, kc, vc, 0, sl, **kw)
    assert _max_rel(m[:, :splits], ref[1]) == 0.0 and _max_rel(l[:, :splits], ref[2]) < 1e-5
    assert _max_rel(o[:, :splits], ref[0]) < 5e-3
    s = jnp.einsum("rd,nd->rn", q[0, 0].astype(jnp.float32), kn[0, 0].astype(jnp.float32))
    s = jnp.where(seen[0], s * kw["scale_log2"], -jnp.inf)
    tree_m = s.max(-1)
    tree_l = jnp.exp2(s - tree_m[:, None]).sum(-1)
    assert _max_rel(m[0, splits], tree_m) < 1e-6 and _max_rel(l[0, splits], tree_l) < 1e-3
    with pytest.raises(ValueError, match="the bias"):
        pm.prefix_partials_mgpu(rows_kv, kc, vc, jnp.int32(0), sl, None, bias[:, :32],
                                interpret=True, **kw)


@pytest.mark.parametrize("splits", [1, 2])
def test_tree_block_in_split_zero(splits):
    """Without tree_split the tree's block is one more key block of split 0: before its prefix
    blocks where the prefix is split (the partials, merged, give the attention over prefix and
    tree), after them with one split (the rows come out normalised)."""
    b, hkv, t, rows, d, nt = 2, 1, 256, 64, 64, 64
    rows_kv, q, kc, vc, kn, vn, seen, bias = _tree_inputs(13, b, hkv, t, rows, d, nt)
    sl = jnp.asarray([200, 70], jnp.int32)
    scale_log2 = 0.18
    out = pm.prefix_partials_mgpu(rows_kv, kc, vc, jnp.int32(0), sl, None, bias, steps=2,
                                  scale_log2=scale_log2, num_splits=splits, block_kv=64,
                                  interpret=True)
    if splits == 1:
        got = np.asarray(out, np.float64)                                  # [B * Hkv, R, D]
    else:
        o, m, l = (np.asarray(x, np.float64) for x in out)                 # [BH, S, R(, D)]
        w = np.exp2(m - m.max(axis=1, keepdims=True))
        got = (w[..., None] * o).sum(1) / (w * l).sum(1)[..., None]
    f32 = jnp.float32
    keys = jnp.concatenate([kc[0].astype(f32), kn.astype(f32)], axis=2)    # [B, Hkv, T + NT, D]
    vals = jnp.concatenate([vc[0].astype(f32), vn.astype(f32)], axis=2)
    prefix = jnp.broadcast_to(jnp.arange(t)[None, None, :] < sl[:, None, None], (b, rows, t))
    live = jnp.concatenate([prefix, seen], axis=2)                         # [B, R, T + NT]
    s = jnp.einsum("bhrd,bhkd->bhrk", q.astype(f32), keys) * scale_log2
    s = jnp.where(live[:, None], s, -jnp.inf)
    p = jnp.exp2(s - s.max(-1, keepdims=True))
    ref = jnp.einsum("bhrk,bhkd->bhrd", p / p.sum(-1, keepdims=True), vals)
    ref = np.asarray(ref, np.float64).reshape(b * hkv, rows, d)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-2
