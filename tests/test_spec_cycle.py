"""The speculative cycle: greedy speculative output == plain greedy, token for token; draft
positions against a step-by-step reference; the topk == 1 path forms no vocab softmax; the
catch-up's dead-row skip changes nothing; a second cycle call does not recompile."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from reference_runner import plain_greedy as reference_plain_greedy
from draft_models import agreeing_pair as _agreeing_pair, candidate_paths as _cycle_paths
from jaxspec.config import ModelConfig
from jaxspec.engine.admission import AdmitArgs, jit_admissions
from jaxspec.kv import init_cache
from jaxspec.models import eagle, llama
from jaxspec.sampling import FULL, LEAN
from jaxspec.spec import SpecConfig, init_state, jit_cycle
from jaxspec.spec import draft as draft_lib
from reference_runner import SpecRunner, prefill

# vocab 331 appears in no other dimension, so the jaxpr test can spot vocab-sized arrays.
CFG = ModelConfig(arch="LlamaForCausalLM", vocab_size=331, hidden_size=64, intermediate_size=96,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
MAX_LEN = 192
PROMPTS = [[5, 17, 42, 8, 99], [3] * 11 + [250, 7], list(range(60, 80))]
NEW = 64
SPECS = [(1, 1, 2), (3, 1, 4), (5, 4, 16), (6, 8, 32), (6, 10, 60)]


@functools.lru_cache(maxsize=None)
def target_params():
    return llama.init_random_params(CFG, jax.random.PRNGKey(0), scale=0.2)


@functools.lru_cache(maxsize=None)
def random_head():
    return eagle.init_eagle_params(CFG, jax.random.PRNGKey(1), scale=0.2)


@functools.lru_cache(maxsize=None)
def agreeing_pair():
    """A target whose next token depends mostly on the current one (large embeddings, small
    layers, unit final norm) and a head whose fc passes the token embedding straight through to
    the lm_head: the draft usually predicts the target's next token, so accepts are long."""
    return _agreeing_pair(CFG, scale=0.02, lm_head_scale=0.5)


def plain_greedy(params, cfg, prompt, n, max_len=MAX_LEN):
    """Reference: one token at a time through llama.forward with a KV cache."""
    return reference_plain_greedy(params, cfg, prompt, n, max_len)


@functools.lru_cache(maxsize=None)
def reference_outputs(which):
    params = target_params() if which == "random" else agreeing_pair()[0]
    return [plain_greedy(params, CFG, p, NEW) for p in PROMPTS]


@pytest.fixture(scope="module", autouse=True)
def _own_cycle_programs():
    """Runners of other files (cut and context vocabularies: other head shapes) share the
    lru-cached jitted cycles; the compile counts below are this file's own."""
    from jaxspec.spec.cycle import jit_cycle
    jit_cycle.cache_clear()


@pytest.mark.parametrize("which", ["random", "agreeing"])
@pytest.mark.parametrize("shape", SPECS, ids=lambda s: "s%d_k%d_n%d" % s)
def test_greedy_spec_equals_plain_greedy(shape, which):
    params, head = (target_params(), random_head()) if which == "random" else agreeing_pair()
    spec = SpecConfig(*shape)
    runner = SpecRunner(CFG, params, head, spec, max_slots=4, max_len=MAX_LEN)
    res = runner.generate(PROMPTS, [NEW] * 3, eos_ids=())
    for r, ref in zip(res, reference_outputs(which)):
        assert r.token_ids == ref
        assert r.finish_reason == "length"
        assert all(0 <= a <= spec.num_steps for a in r.accept_lens)
        # every cycle emits accept_len + 1 tokens; the first token comes from the prefill
        assert 1 + sum(a + 1 for a in r.accept_lens) >= NEW
    mean_accept = np.mean([a for r in res for a in r.accept_lens])
    if which == "agreeing":
        assert mean_accept >= 0.7 * spec.num_steps, mean_accept
    assert runner._cycle._cache_size() == 1   # random and agreeing share it: same shapes


def test_a_wider_head_is_exact_and_drafts_as_before():
    """A head whose MLP is wider than the target's (eagle.widen_mlp, --mlp-width): the cycle
    takes its width from the params, stays exact, and accepts as the head it came from."""
    params, head = agreeing_pair()
    wide = eagle.widen_mlp(head, 3 * CFG.intermediate_size, jax.random.PRNGKey(7))
    spec = SpecConfig(3, 1, 4)
    out = {}
    for name, h in (("head", head), ("wide", wide)):
        runner = SpecRunner(CFG, params, h, spec, max_slots=4, max_len=MAX_LEN)
        out[name] = runner.generate(PROMPTS, [NEW] * 3, eos_ids=())
    for r, ref in zip(out["wide"], reference_outputs("agreeing")):
        assert r.token_ids == ref
    np.testing.assert_allclose(np.mean([a for r in out["wide"] for a in r.accept_lens]),
                               np.mean([a for r in out["head"] for a in r.accept_lens]), rtol=0.05)


def test_eos_and_max_tokens_inside_an_accepted_chain():
    params, head = agreeing_pair()
    ref = reference_outputs("agreeing")[0]
    # the greedy test's runner shape (its programs compiled there): accepted paths of up to 5
    runner = SpecRunner(CFG, params, head, SpecConfig(5, 4, 16), max_slots=4, max_len=MAX_LEN)
    eos = ref[9]
    first = ref.index(eos)
    res = runner.generate([PROMPTS[0], PROMPTS[0]], [40, 5], eos_ids=(eos,))
    assert res[0].token_ids == ref[:first + 1] and res[0].finish_reason == "stop"
    assert res[1].token_ids == ref[:min(5, first + 1)]
    assert res[1].finish_reason == ("stop" if first < 5 else "length")
    assert max(res[0].accept_lens) > 1   # the EOS sat inside a multi-token accept


# ---------------------------------------------------------------- draft positions


_REF_ROWS = 64  # references run padded to one length (causal: padding never reaches a row)


@functools.partial(jax.jit, static_argnames="cfg")
def _committed_features(params, cfg, toks):
    """toks [_REF_ROWS] -> post-norm target features of every row, uncached."""
    empty = init_cache(cfg, 1, 8, jnp.float32)
    hid, *_ = llama.forward(params, cfg, toks[None], jnp.arange(_REF_ROWS)[None], empty.k,
                            empty.v, empty.lens, llama.causal_mask(1, _REF_ROWS))
    return llama.final_norm(params, cfg, hid)[0]


@functools.partial(jax.jit, static_argnames="cfg")
def _draft_rows(params, head, cfg, feats, toks, pos):
    """Uncached draft over rows (feats[r], toks[r]) at pos[r], causal: hidden of every row."""
    empty = jnp.zeros((1, 1, cfg.num_kv_heads, 8, cfg.head_dim), feats.dtype)
    hid, _, _ = eagle.forward(params, head, cfg, toks[None], feats[None], pos[None], empty, empty,
                              jnp.zeros((1,), jnp.int32), llama.causal_mask(1, _REF_ROWS))
    return hid[0]


def _pad(x, n=_REF_ROWS):
    x = jnp.asarray(x)
    return jnp.concatenate([x, jnp.zeros((n - x.shape[0],) + x.shape[1:], x.dtype)])


def _reference_tree(params, head, cfg, seq, root, spec, tree_pos_offset=0):
    """Step by step, EAGLE's convention, no cache: committed rows (f_t, x_{t+1}) at position t
    (x_L = root); a depth-d node's row is (draft hidden of its parent's row, its token) at
    L + d - 1, and it sees only its ancestors' rows. tree_pos_offset shifts the tree rows (1 =
    the off-by-one SGLang shipped). Returns {token path: cumulative log-prob} for every drafted
    candidate, frontier chosen as the K best of K*K children."""
    n_base = len(seq)
    feats = _committed_features(params, cfg, _pad(jnp.asarray(seq, jnp.int32)))[:n_base]
    base_t = jnp.asarray(list(seq[1:]) + [root], jnp.int32)

    def row_hidden(extra_f, extra_t):
        f = jnp.concatenate([feats] + [x[None] for x in extra_f], 0)
        t = jnp.concatenate([base_t, jnp.asarray(extra_t, jnp.int32)])
        r = t.shape[0]
        pos = np.arange(_REF_ROWS)
        pos[n_base:] += tree_pos_offset
        return _draft_rows(params, head, cfg, _pad(f), _pad(t), jnp.asarray(pos))[r - 1]

    def children(h, path, score, rows_f, rows_t):
        logp = np.asarray(jax.nn.log_softmax(eagle.logits(params, h)))
        top = np.argsort(-logp, kind="stable")[:spec.topk]
        return [(path + (int(t),), score + float(logp[t]), rows_f + [h], rows_t + [int(t)])
                for t in top]

    out = {}
    frontier = children(row_hidden([], []), (), 0.0, [], [])
    out.update({c[0]: c[1] for c in frontier})
    for _ in range(1, spec.num_steps):
        kids = []
        for path, score, rows_f, rows_t in frontier:
            kids += children(row_hidden(rows_f, rows_t), path, score, rows_f, rows_t)
        out.update({c[0]: c[1] for c in kids})
        order = np.argsort(-np.array([c[1] for c in kids]), kind="stable")[:spec.topk]
        frontier = [kids[j] for j in order]
    return out


def _position_pair():
    """Agreeing target and head, with attention switched back on in the head: accepts stay long
    (so the catch-up runs several rows) while positions change the draft's outputs."""
    params, head = agreeing_pair()
    lay = dict(head["layers"], wo=0.01 * jax.random.normal(jax.random.PRNGKey(5),
                                                          head["layers"]["wo"].shape),
               wqkv=0.3 * jax.random.normal(jax.random.PRNGKey(6), head["layers"]["wqkv"].shape))
    return params, dict(head, layers=lay)


@pytest.mark.parametrize("shape", [(4, 3, 10), (4, 1, 5)], ids=["tree", "chain"])
def test_draft_positions_match_step_by_step_reference(shape):
    spec = SpecConfig(*shape)
    params, head = _position_pair()
    prompts = [PROMPTS[0], PROMPTS[2]]
    b, p = 2, 32
    toks = np.zeros((b, p), np.int32)
    lens = np.array([len(x) for x in prompts], np.int32)
    for j, x in enumerate(prompts):
        toks[j, :len(x)] = x
    state = init_state(CFG, spec, b, 96, jnp.float32)
    state, root = prefill(CFG, spec, params, head, state, toks, lens)
    draft = jax.jit(functools.partial(draft_lib.draft_tree, cfg=CFG, spec=spec))
    seqs = [list(x) for x in prompts]
    roots = [int(r) for r in np.asarray(root)]
    cyc = jit_cycle(CFG, spec)
    accepted = 0
    for rnd in range(3):  # after the prefill, then after two cycles (catch-up over accepts)
        cands = draft(params, head, draft_k=state.draft_k, draft_v=state.draft_v,
                      lens=state.target.lens, seed=state.seed)
        for j in range(b):
            got = _cycle_paths(cands, j)
            ref = _reference_tree(params, head, CFG, seqs[j], roots[j], spec)
            assert set(got) == set(ref), (rnd, j)
            if spec.topk > 1:
                np.testing.assert_allclose([got[k] for k in ref], list(ref.values()),
                                           rtol=1e-4, atol=1e-4)
                bad = _reference_tree(params, head, CFG, seqs[j], roots[j], spec,
                                      tree_pos_offset=1)
                diff = [abs(got[k] - bad[k]) for k in bad if k in got]
                assert set(bad) != set(got) or max(diff) > 1e-3, "test cannot see positions"
        state, out = cyc(params, head, state, jnp.ones((b,), bool))
        toks_out, acc = np.asarray(out.tokens), np.asarray(out.accept_len)
        accepted += int(acc.sum())
        for j in range(b):
            emitted = [int(t) for t in toks_out[j, :acc[j] + 1]]
            seqs[j] = seqs[j] + [roots[j]] + emitted[:-1]
            roots[j] = emitted[-1]
    assert accepted >= 4  # the catch-up ran over several rows


# ---------------------------------------------------------------- topk == 1: no vocab softmax

_SOFTMAX_PRIMS = {"exp", "exp2", "log", "log1p", "logistic"}


def _vocab_transcendentals(jaxpr, vocab):
    """Primitives among exp/log (what softmax, log_softmax and logsumexp lower to) applied to an
    array with a vocab-sized axis, searched through nested jaxprs (pjit, scan, cond, ...)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _SOFTMAX_PRIMS and any(
                vocab in getattr(v.aval, "shape", ()) for v in eqn.invars):
            found.append(eqn.primitive.name)
        for p in eqn.params.values():
            for sub in (p if isinstance(p, (list, tuple)) else [p]):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += _vocab_transcendentals(inner, vocab)
    return found


def _cycle_jaxpr(spec):
    state = init_state(CFG, spec, 2, 64, jnp.float32)
    f = functools.partial(jax.jit(functools.partial(
        __import__("jaxspec.spec.cycle", fromlist=["cycle"]).cycle, cfg=CFG, spec=spec,
        greedy_only=True)))
    return jax.make_jaxpr(f)(target_params(), random_head(), state, jnp.ones((2,), bool))


def _prefill_jaxpr(spec):
    """The admission program's LEAN variant (every request greedy, no penalty, no logprobs)."""
    state = init_state(CFG, spec, 2, 64, jnp.float32)
    admit = jit_admissions(CFG, spec, 2, 64, jnp.float32)[0][LEAN, "chunk"]
    adm = jax.tree_util.tree_map(jnp.asarray, AdmitArgs.host(2, n_prompt=np.array([5, 16])))
    return jax.make_jaxpr(admit)(target_params(), random_head(), state,
                                 jnp.arange(2, dtype=jnp.int32), jnp.zeros((2, 16), jnp.int32),
                                 jnp.zeros(2, jnp.int32), jnp.array([5, 16], jnp.int32),
                                 jnp.full(2, -1, jnp.int32), adm, jnp.zeros(2, jnp.uint32))


@pytest.mark.parametrize("shape", [(1, 1, 2), (3, 1, 4)], ids=["naive", "chain"])
def test_topk1_cycle_has_no_vocab_softmax(shape):
    spec = SpecConfig(*shape)
    # The whole cycle (draft steps, greedy verify, catch-up) and the admission (target and
    # draft prefill).
    assert _vocab_transcendentals(_cycle_jaxpr(spec).jaxpr, CFG.vocab_size) == []
    assert _vocab_transcendentals(_prefill_jaxpr(spec).jaxpr, CFG.vocab_size) == []
    # The check can see a softmax: with the argmax path off, the draft forms one per step.
    slow = SpecConfig(*shape, argmax_topk1=False)
    assert len(_vocab_transcendentals(_cycle_jaxpr(slow).jaxpr, CFG.vocab_size)) >= shape[0]


# ---------------------------------------------------------------- catch-up dead-row skip


def test_catch_up_dead_row_skip_matches_full_computation():
    params, head = _position_pair()
    b, r, t = 3, 7, 64
    key = jax.random.split(jax.random.PRNGKey(11), 5)
    dk = jax.random.normal(key[0], (1, b, CFG.num_kv_heads, t, CFG.head_dim))
    dv = jax.random.normal(key[1], (1, b, CFG.num_kv_heads, t, CFG.head_dim))
    base = jnp.array([9, 20, 3], jnp.int32)
    feats = jax.random.normal(key[2], (b, r, CFG.hidden_size))
    toks = jax.random.randint(key[3], (b, r), 0, CFG.vocab_size)
    n_live = jnp.array([7, 1, 4], jnp.int32)
    outs = {}
    for skip in (True, False):
        spec = SpecConfig(3, 4, 8, skip_dead_rows=skip)
        f = jax.jit(functools.partial(draft_lib.catch_up, cfg=CFG, spec=spec))
        outs[skip] = f(params, head, draft_k=dk, draft_v=dv, base=base, features=feats,
                       tokens=toks, n_live=n_live)
    (k1, v1, s1), (k0, v0, s0) = outs[True], outs[False]
    np.testing.assert_allclose(k1, k0, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(v1, v0, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(s1.tokens, s0.tokens)
    np.testing.assert_allclose(s1.logp, s0.logp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s1.hidden, s0.hidden, rtol=1e-5, atol=1e-5)
    # rows outside base .. base + n_live are untouched
    for j in range(b):
        lo, hi = int(base[j]), int(base[j] + n_live[j])
        np.testing.assert_array_equal(k1[:, j, :, :lo], dk[:, j, :, :lo])
        np.testing.assert_array_equal(k1[:, j, :, hi:], dk[:, j, :, hi:])


def test_cycle_with_and_without_dead_row_skip_seeds_the_same_next_draft():
    params, head = _position_pair()
    res = {}
    for skip in (True, False):   # skip=True: the greedy test's 5x4x16 runner, compiled there
        spec = SpecConfig(5, 4, 16, skip_dead_rows=skip)
        runner = SpecRunner(CFG, params, head, spec, max_slots=4, max_len=MAX_LEN)
        out = runner.generate(PROMPTS, [24] * 3)
        # slot 3 never held a request: its seed is whatever the initial state left there
        res[skip] = ([r.token_ids for r in out], [r.accept_lens for r in out],
                     np.asarray(runner.state.seed.tokens)[:3],
                     np.asarray(runner.state.seed.logp)[:3])
    assert res[True][0] == res[False][0] and res[True][1] == res[False][1]
    np.testing.assert_array_equal(res[True][2], res[False][2])
    np.testing.assert_allclose(res[True][3], res[False][3], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- no recompilation


def test_second_cycle_call_does_not_recompile():
    # the engine's FULL cycle on the 3-slot state of the cycles-per-call tests below (they
    # reuse its compilation)
    spec = SpecConfig(3, 1, 4)
    params, head, active, fresh = _three_slots(spec)
    cyc = jit_cycle(CFG, spec, features=FULL)
    state, _ = cyc(params, head, fresh(), active)
    compiled = cyc._cache_size()
    assert compiled >= 1
    # new values everywhere: other lengths, other roots, slots idle, other params
    params2 = jax.tree_util.tree_map(lambda x: x * 1.01, params)
    with jax.log_compiles():
        state, out = cyc(params2, head, state, jnp.array([True, False, False]))
        state, out = cyc(params, head, state, jnp.array([False, True, True]))
    jax.block_until_ready(out)
    assert cyc._cache_size() == compiled
    assert int(out.accept_len[0]) == 0 and (np.asarray(out.tokens[0]) == -1).all()
    assert (np.asarray(out.tokens[1]) >= 0).any()


def _three_slots(spec):
    """The agreeing pair with prompts of 5, 16 and 9 tokens in 3 slots, the third idle:
    (params, head, active, a function returning a freshly prefilled state)."""
    params, head = agreeing_pair()
    tokens = jnp.asarray(np.arange(48).reshape(3, 16) % 97)
    lens = jnp.array([5, 16, 9], jnp.int32)

    def fresh():
        return prefill(CFG, spec, params, head, init_state(CFG, spec, 3, 96, jnp.float32),
                       tokens, lens)[0]

    return params, head, jnp.array([True, True, False]), fresh


@pytest.mark.parametrize("loop", [False, True])
def test_cycles_per_call_equal_separate_cycles(loop):
    """Three cycles in one program, unrolled or as a loop, give the state and the tokens of
    three calls: each slot's emitted tokens in order, first, -1 after; accept lengths per
    cycle; an idle slot emits nothing. (FULL: as the engine compiles several cycles a call.)"""
    spec = SpecConfig(3, 1, 4)
    params, head, active, fresh = _three_slots(spec)
    state = fresh()
    one = jit_cycle(CFG, spec, features=FULL)
    ref_toks, ref_acc = [], []
    for _ in range(3):
        state, out = one(params, head, state, active)
        ref_toks.append(np.asarray(out.tokens))                     # [B, S+1]
        ref_acc.append(np.asarray(out.accept_len))
    state3, out3 = jit_cycle(CFG, spec, features=FULL, n_cycles=3, loop=loop)(
        params, head, fresh(), active)
    toks = np.asarray(out3.tokens)
    assert toks.shape == (3, 12) and out3.accept_len.shape == (3, 3)
    np.testing.assert_array_equal(np.asarray(out3.accept_len), np.stack(ref_acc, 1))
    assert max(np.asarray(out3.accept_len)[:2].ravel()) > 0       # chains were accepted
    for b in range(3):
        want = [int(t) for c in range(3) for t in ref_toks[c][b] if t >= 0]
        assert toks[b].tolist() == want + [-1] * (12 - len(want)), b
    assert (toks[2] == -1).all()
    for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(state3)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_cycles_loop_from_64_slots():
    """Several cycles a call run as a loop from LOOP_MIN_SLOTS slots and unrolled below (the
    measured choice in `cycles`): a scan of n_cycles iterations at the program's top level."""
    from jaxspec.spec.cycle import LOOP_MIN_SLOTS
    spec = SpecConfig(3, 1, 4)
    params, head = agreeing_pair()
    loops = {}
    for slots in (4, LOOP_MIN_SLOTS):
        state = jax.eval_shape(lambda: init_state(CFG, spec, slots, 32, jnp.float32))
        active = jax.ShapeDtypeStruct((slots,), jnp.bool_)
        cyc = jit_cycle(CFG, spec, n_cycles=3, slots=slots)
        eqns = cyc.trace(params, head, state, active).jaxpr.jaxpr.eqns
        loops[slots] = [e for e in eqns if e.primitive.name == "scan" and e.params["length"] == 3]
    assert not loops[4] and len(loops[LOOP_MIN_SLOTS]) == 1


@pytest.mark.parametrize("loop", [False, True])
def test_lean_cycles_skip_keys_counts_and_logprobs_and_emit_the_same(loop):
    """The LEAN variant (every slot greedy, no penalty, no logprobs) emits what FULL emits, over
    several cycles a call, but leaves the keys and token counts as they were and returns empty
    logprob arrays; FULL advances every active slot's key and counts its tokens. (3 cycles a
    call: FULL's programs are the cycles-per-call test's.)"""
    spec = SpecConfig(3, 1, 4)
    params, head, active, fresh = _three_slots(spec)
    out, states = {}, {}
    for name, f in (("lean", LEAN), ("full", FULL)):
        st = fresh()
        before = (np.asarray(st.rng), np.asarray(st.history.counts))
        cyc = jit_cycle(CFG, spec, features=f, n_cycles=3, loop=loop)
        states[name], out[name] = cyc(params, head, st, active)
        states[name + "_before"] = before
    np.testing.assert_array_equal(np.asarray(out["lean"].tokens), np.asarray(out["full"].tokens))
    np.testing.assert_array_equal(np.asarray(out["lean"].accept_len),
                                  np.asarray(out["full"].accept_len))
    assert out["lean"].logprob.shape == (3, 0) and out["full"].logprob.shape == (3, 12)
    rng0, counts0 = states["lean_before"]
    np.testing.assert_array_equal(np.asarray(states["lean"].rng), rng0)
    np.testing.assert_array_equal(np.asarray(states["lean"].history.counts), counts0)
    full_rng = np.asarray(states["full"].rng)
    assert (full_rng[:2] != rng0[:2]).any(axis=1).all() and (full_rng[2] == rng0[2]).all()
    emitted = int((np.asarray(out["full"].tokens) >= 0).sum())
    assert int(np.asarray(states["full"].history.counts).sum()) - int(counts0.sum()) == emitted
    for key in ("target", "draft_k", "root", "seed"):      # everything else is the same
        for a, b in zip(jax.tree_util.tree_leaves(getattr(states["lean"], key)),
                        jax.tree_util.tree_leaves(getattr(states["full"], key))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---------------------------------------------------------------- real weights


@pytest.mark.real_weights
def test_smollm2_greedy_spec_equals_plain_greedy():
    weights = pytest.importorskip("jaxspec.weights")
    try:
        cfg, params = weights.load_params(None, jnp.float32)
    except FileNotFoundError as e:
        pytest.skip(f"SmolLM2 GGUF not available: {e}")
    head = eagle.init_eagle_params(cfg, jax.random.PRNGKey(0), scale=0.02)
    prompts = [[1, 9690, 198, 2683, 359, 253, 5356, 2], [1, 4093, 314, 260, 3575, 282]]
    n = 20
    refs = [plain_greedy(params, cfg, p, n, max_len=64) for p in prompts]
    runner = SpecRunner(cfg, params, head, SpecConfig(3, 2, 5), max_slots=2, max_len=64)
    res = runner.generate(prompts, [n, n])
    assert [r.token_ids for r in res] == refs


def test_what_does_not_fit_is_rejected():
    from jaxspec.config import ConfigError
    from jaxspec.engine import Engine, EngineConfig, SpecBackend
    from jaxspec.sampling import SamplingParams
    # 32 rows a slot, 2 x 4 of them the chain's slack past a request's end: 24 tokens
    backend = SpecBackend(CFG, target_params(), random_head(), "chain", 2, 32)
    engine = Engine(backend, EngineConfig(max_batch=2), vocab_size=CFG.vocab_size)
    assert engine.max_model_len == 24
    with pytest.raises(ValueError, match="exceeds the context of 24 tokens"):
        engine.add_request([1] * 10, SamplingParams(max_tokens=20))
    with pytest.raises(ConfigError, match="exceeds the vocabulary"):
        SpecBackend(CFG, target_params(), random_head(), SpecConfig(2, 400, 4), 1, 32)
