"""Packed first chunks (the "packed" admission form, `engine.admission`): the same state as the
padded "chunk" form, only the admitted slots' chunk rows written, the host's packing
(`engine.prefill_plan`), and engines with and without it giving the same outputs."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.config import ConfigError
from jaxspec.engine.admission import AdmitArgs, PackLayout
from jaxspec.engine.prefill_plan import build_pack
from jaxspec.sampling import SamplingParams, flat_params
from test_engine import CFG, CHUNK, SLOTS, expected, live_engine, make_engine, state_axes

POISON = 7.0


def test_build_pack():
    tokens, lay = build_pack([[11, 12, 13], [21], [31, 32]], [0, 1, 0], rows=2, width=6, a=4)
    np.testing.assert_array_equal(tokens, [[11, 12, 13, 31, 32, 0], [21, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(lay.seg, [[0, 0, 0, 2, 2, 4], [1, 4, 4, 4, 4, 4]])
    np.testing.assert_array_equal(lay.pos, [[0, 1, 2, 0, 1, 5], [0, 1, 2, 3, 4, 5]])
    np.testing.assert_array_equal(lay.last, [2, 6, 4, 0])
    m = np.asarray(PackLayout(*map(jnp.asarray, lay)).mask)
    assert m[0, 2, :3].all() and not m[0, 2, 3:].any()        # request 0: causal over its own
    assert m[0, 4].tolist() == [False] * 3 + [True, True, False]
    assert m[1, 0].tolist() == [True] + [False] * 5 and m[1, 5, 1:].all()   # padding: its own
    with pytest.raises(ValueError, match="cannot take"):
        build_pack([[1] * 4, [2] * 3], [0, 0], rows=1, width=6, a=2)


@pytest.mark.parametrize("kind", ["spec", "plain"])
def test_packed_first_chunks_equal_the_padded_ones(kind):
    """Three requests (one ends its prompt, one has more chunks to come, one is resumed with
    output tokens to count) and a padding request, packed into one row: the same state as the
    padded first-chunk form. Live slots stay untouched; of the admitted slots (their KV rows
    poisoned first) exactly the chunk's rows are written."""
    engine = live_engine(kind)
    be = engine.backend
    axes, rows = state_axes(kind, be)
    snap = jax.tree_util.tree_map(np.array, engine.state)
    leaves, treedef = jax.tree_util.tree_flatten(snap)
    for x, ax, rax in zip(leaves, axes, rows):
        if rax >= 0:
            for slot in (2, 3):
                idx = [slice(None)] * x.ndim
                idx[ax] = slot
                x[tuple(idx)] = POISON
    snap = jax.tree_util.tree_unflatten(treedef, leaves)
    slot_idx = np.array([3, 2, SLOTS, SLOTS], np.int32)        # two slots, two padding rows
    chunks = [[5, 17, 42, 8, 99, 3], [60, 61, 62], []]
    nv = np.array([6, 3, 0, 0], np.int32)
    nxt = np.array([-1, 63, -1, -1], np.int32)                 # slot 2: a chunk follows
    sp = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, max_tokens=5)
    f, i = flat_params(sp)
    adm = AdmitArgs.host(4, samp_f=np.tile(f, (4, 1)), samp_i=np.tile(i, (4, 1)),
                         n_prompt=np.array([4, 2, 1, 1], np.int32))  # later tokens: output
    padded = np.zeros((4, 16), np.int32)
    for r, c in enumerate(chunks):
        padded[r, :len(c)] = c
    packed, lay = build_pack(chunks[:2], [0, 0], 1, 16, 4)
    dev = lambda: jax.tree_util.tree_map(jnp.asarray, snap)     # noqa: E731
    want, f_want = be.admit(dev(), "chunk", [(slot_idx, padded, np.zeros(4, np.int32), nv, nxt,
                                              adm)])
    got, f_got = be.admit(dev(), "packed", [(slot_idx, packed, lay, nv, nxt, adm)])
    for name in f_got._fields:
        np.testing.assert_allclose(np.asarray(getattr(f_got, name))[:2],
                                   np.asarray(getattr(f_want, name))[:2], atol=1e-5)
    assert int(f_got.tokens[0]) >= 0 and int(f_got.tokens[1]) == -1
    n_kv = 0
    for before, g, w, ax, rax in zip(jax.tree_util.tree_leaves(snap),
                                     jax.tree_util.tree_leaves(got),
                                     jax.tree_util.tree_leaves(want), axes, rows):
        g, w = np.asarray(g), np.asarray(w)
        if rax < 0:                       # per-slot leaves: equal (floats to rounding)
            np.testing.assert_allclose(g, w, atol=1e-5)
            continue
        n_kv += 1
        r = rax - (rax > ax)
        for slot in range(SLOTS):
            take = lambda x: np.take(x, slot, axis=ax)             # noqa: E731
            if slot in (0, 1):                                  # live, not admitted: untouched
                np.testing.assert_array_equal(take(g), take(before))
                continue
            n = int(nv[list(slot_idx).index(slot)])
            rows_g = np.take(take(g), range(n), axis=r)
            np.testing.assert_allclose(rows_g, np.take(take(w), range(n), axis=r), atol=1e-5)
            assert not np.any(rows_g == POISON)
            rest = np.take(take(g), range(n, take(g).shape[r]), axis=r)
            assert np.all(rest == POISON)                       # nothing past the chunk
    assert n_kv == (4 if kind == "spec" else 2)


def test_packs_fill_rows_first_fit():
    # chunk 16, packs of 4 .. 32 tokens in one row, then 2 or 4 rows of 32 (4 slots, 2 chunks
    # a row at least)
    plan = make_engine("plain", pack_tokens=32, min_chunk=4).planner
    assert plan.pack_sizes == [4, 8, 16, 32, 64]
    assert [plan.pack_shape(t) for t in (8, 32, 64)] == [(1, 8), (1, 32), (2, 32)]
    assert sorted(f for f in plan.forms() if f[2] == "packed") == \
        [(1, 4, "packed"), (2, 8, "packed"), (4, 16, "packed"), (4, 32, "packed"),
         (4, 64, "packed")]                                   # at most the 4 slots
    row = lambda n: (0, 0, list(range(n)), {})                               # noqa: E731
    packs = lambda ns: [([len(r[2]) for r in p], rows, used)               # noqa: E731
                        for p, rows, used in plan._packs([row(n) for n in ns])]
    assert packs([16, 10, 3]) == [([16, 10, 3], [0, 0, 0], 1)]
    assert packs([20, 30, 3]) == [([20, 30, 3], [0, 0, 1], 2)]      # first chunks: 16 + 16
    assert packs([16] * 4 + [2]) == [([16] * 4, [0, 0, 1, 1], 2), ([2], [0], 1)]   # 4 a pack
    plan = make_engine("plain", pack_tokens=16).planner                  # one chunk a row
    assert plan.pack_sizes == [16, 32, 64] and plan.pack_shape(64) == (4, 16)
    assert packs([9, 9, 9]) == [([9, 9, 9], [0, 1, 2], 3)]
    with pytest.raises(ConfigError, match="pack_tokens"):
        make_engine("plain", pack_tokens=8)
    # at most pack_max_tokens a pack (one row of 32 here): more first chunks take more packs
    plan = make_engine("plain", pack_tokens=32, min_chunk=4, pack_max_tokens=48).planner
    assert plan.pack_sizes == [4, 8, 16, 32]
    assert packs([16] * 3 + [2]) == [([16, 16], [0, 0], 1), ([16, 2], [0, 0], 1)]
    assert make_engine("plain", pack_tokens=16, pack_max_tokens=64).planner.pack_sizes == \
        [16, 32, 64]
    with pytest.raises(ConfigError, match="pack_max_tokens"):
        make_engine("plain", pack_tokens=32, pack_max_tokens=16)


@pytest.mark.parametrize("kind", ["spec", "plain"])
def test_engines_with_and_without_packing_give_the_same_outputs(kind):
    """Mixed lengths (some longer than a chunk), greedy and seeded sampling, arriving in groups:
    packed and padded first chunks give the same tokens, and the packs ran."""
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(0, CFG.vocab_size, n)]
               for n in (20, 35, 17, 12, 3, 9, 1, 5)]   # 4 first chunks: 2 pack rows
    sps = [SamplingParams(max_tokens=8, ignore_eos=True) if i % 3 else
           SamplingParams(temperature=0.8, seed=i, max_tokens=8, ignore_eos=True)
           for i in range(len(prompts))]
    outs = {}
    for pack in (True, False):
        engine = make_engine(kind, packing=pack)
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts, sps)]
        list(engine.drain())
        outs[pack] = [engine.pop_finished(i).output for i in ids]
        forms = {s[3] for s in engine.stats.admit_shapes}
        # later chunks run in the chunk form either way; first chunks packed or padded
        assert forms == ({"packed", "chunk"} if pack else {"chunk"})
        if pack:                                            # a pack of two rows ran
            assert any(engine.planner.pack_shape(s[1])[0] == 2
                       for s in engine.stats.admit_shapes if s[3] == "packed")
    assert outs[True] == outs[False]
    for p, sp, out in zip(prompts, sps, outs[True]):
        if sp.temperature == 0:
            assert out == expected(p, sp, ())[0]


@pytest.mark.parametrize("kind", ["spec", "plain"])
def test_fine_row_counts_pack_three_rows_alike(kind):
    """pack_rows='fine' adds 3-row packs (2, 3, 4 rows at one first chunk a row and 4 slots):
    three long first chunks run as one 3-row pack and give the padded form's tokens."""
    engine = make_engine(kind, pack_tokens=CHUNK, pack_rows="fine")
    assert engine.planner.pack_sizes[-3:] == [2 * CHUNK, 3 * CHUNK, 4 * CHUNK]
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(0, CFG.vocab_size, n)]
               for n in (CHUNK - 1, CHUNK // 2 + 2, CHUNK)]
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    outs = {}
    for rows in ("fine", None):
        engine = (make_engine(kind, pack_tokens=CHUNK, pack_rows=rows) if rows else
                  make_engine(kind, packing=False))
        ids = [engine.add_request(p, sp) for p in prompts]
        list(engine.drain())
        outs[rows] = [engine.pop_finished(i).output for i in ids]
        if rows:
            assert [engine.planner.pack_shape(s[1])[0] for s in engine.stats.admit_shapes
                    if s[3] == "packed"] == [3]
    assert outs["fine"] == outs[None] == [expected(p, sp, ())[0] for p in prompts]
    with pytest.raises(ConfigError, match="pack_rows must be one of"):
        make_engine(kind, pack_rows="halves")


def padding_call(engine, a, w, form, features):
    """call(state, lower=False) of an admission of shape (a, w) whose rows are all padding."""
    parts = engine.planner.padding(a, w, form).parts
    return lambda state, lower=False: engine.backend.admit(state, form, parts,
                                                           features=features, lower=lower)


def test_packed_form_adds_no_device_loop():
    """The packed program's loops are the padded form's (the layer scans): a loop on device
    values makes the GPU host wait each trip (the request lookup is a compare, no search)."""
    from jaxspec.sampling import LEAN
    engine = make_engine("spec")
    count = lambda a, w, form: padding_call(engine, a, w, form, LEAN)(  # noqa: E731
        engine.state, lower=True)[1].as_text().count("stablehlo.while")
    assert count(2, 32, "packed") == count(4, 64, "packed") == count(4, 16, "chunk") > 0


def test_padding_admission_keeps_the_state():
    """A padding admission (every row dropped; warm-up runs them on accelerators) leaves the
    state as it was, call after call, in both forms."""
    from jaxspec.sampling import LEAN
    engine = make_engine("spec")
    before = [np.asarray(x) for x in jax.tree_util.tree_leaves(engine.state)]
    for form in ("packed", "chunk"):
        call = padding_call(engine, 2, 32, form, LEAN)
        for _ in range(2):
            engine.state = call(engine.state)[0]
        for a, b in zip(jax.tree_util.tree_leaves(engine.state), before):
            np.testing.assert_array_equal(np.asarray(a), b)


def test_packed_first_chunks_keep_the_eagle3_seed():
    """An EAGLE-3 head (features of three target layers, its own draft vocabulary): packed and
    padded first chunks write the same target and draft K/V rows and the same draft seed."""
    from jaxspec.engine import SpecBackend
    from jaxspec.models import eagle3
    from test_engine import MAX_MODEL_LEN, SPEC, agreeing_pair
    params = agreeing_pair()[0]
    ids = np.sort(np.random.default_rng(1).choice(CFG.vocab_size, 96, replace=False))
    head = eagle3.init_eagle3_head(CFG, jax.random.PRNGKey(1), draft_ids=ids, scale=0.2)
    be = SpecBackend(CFG, params, head, SPEC, SLOTS, MAX_MODEL_LEN + 2 * SPEC.max_emit)
    chunks = [[5, 17, 42, 8, 99, 3, 7], [60, 61, 62, 63]]
    slot_idx = np.array([1, 3, SLOTS], np.int32)
    nv = np.array([7, 4, 0], np.int32)
    nxt = np.full(3, -1, np.int32)
    padded = np.zeros((3, 16), np.int32)
    for r, c in enumerate(chunks):
        padded[r, :len(c)] = c
    adm = AdmitArgs.host(3)
    want, f_want = be.admit(be.init_state(), "chunk",
                            [(slot_idx, padded, np.zeros(3, np.int32), nv, nxt, adm)])
    packed, lay = build_pack(chunks, [0, 0], 1, 16, 3)
    got, f_got = be.admit(be.init_state(), "packed", [(slot_idx, packed, lay, nv, nxt, adm)])
    np.testing.assert_array_equal(np.asarray(f_got.tokens)[:2], np.asarray(f_want.tokens)[:2])
    for slot, n in ((1, 7), (3, 4)):
        for name in ("draft_k", "draft_v"):
            np.testing.assert_allclose(np.asarray(getattr(got, name))[:, slot, :, :n],
                                       np.asarray(getattr(want, name))[:, slot, :, :n],
                                       atol=1e-5)
        np.testing.assert_allclose(np.asarray(got.target.k)[:, slot, :, :n],
                                   np.asarray(want.target.k)[:, slot, :, :n], atol=1e-5)
        np.testing.assert_array_equal(np.asarray(got.seed.tokens)[slot],
                                      np.asarray(want.seed.tokens)[slot])
        for name in ("logp", "hidden"):
            np.testing.assert_allclose(np.asarray(getattr(got.seed, name))[slot],
                                       np.asarray(getattr(want.seed, name))[slot], atol=1e-5)
    assert np.abs(np.asarray(got.draft_k)[:, 1, :, :7]).max() > 0
