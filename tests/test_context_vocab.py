"""The context vocabulary (`spec.context_vocab`): its update against a list-based reference, the
draft's picks over the draft vocabulary and the context together against a masked full-vocab
top-k, exact greedy output with more accepts from the batch runner and the engine (chunked and
packed admissions, retracts), and no compilation after warm-up."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import test_engine as te
from test_spec_cycle import CFG, MAX_LEN, NEW, PROMPTS, agreeing_pair, reference_outputs
from jaxspec.build import _restrict_vocab
from jaxspec.config import ConfigError
from jaxspec.engine import Engine, EngineConfig, SpecBackend
from jaxspec.models import eagle, llama
from jaxspec.sampling import SamplingParams
from jaxspec.spec import SpecConfig
from jaxspec.spec import context_vocab as cv
from jaxspec.spec import draft as draft_lib
from jaxspec.spec import draft_vocab as dv
from jaxspec.spec.config import DraftConfig
from reference_runner import SpecRunner


def _reference_update(ctx, tokens, live, in_vocab, e):
    """ctx: a list per slot, oldest first."""
    out = []
    for c, row, lv in zip(ctx, tokens, live):
        c = list(c)
        for t, ok in zip(row, lv):
            if ok and 0 <= t < len(in_vocab) and not in_vocab[t] and t not in c:
                c.append(int(t))
        out.append(c[-e:])
    return out


def _as_array(ctx, e):
    return np.array([[-1] * (e - len(c)) + c for c in ctx], np.int32)


@pytest.mark.parametrize("r", [4, 40], ids=["pairwise", "sorted"])
def test_update_keeps_the_last_distinct_tokens_outside_the_vocabulary(r):
    rng = np.random.default_rng(r)
    v, e, b = 30, 6, 3
    in_vocab = rng.random(v) < 0.5
    ref = [[] for _ in range(b)]
    ctx = jnp.full((b, e), -1, jnp.int32)
    upd = jax.jit(cv.update)
    for _ in range(5):
        tokens = rng.integers(-1, v, (b, r)).astype(np.int32)     # -1: padding, never added
        live = rng.random((b, r)) < 0.8
        live[0] = False                                             # an idle slot keeps its own
        ref = _reference_update(ref, tokens, live, in_vocab, e)
        ctx = upd(ctx, jnp.asarray(tokens), jnp.asarray(live), jnp.asarray(in_vocab))
        np.testing.assert_array_equal(np.asarray(ctx), _as_array(ref, e))
    assert max(map(len, ref[1:])) == e, "the test never filled a context"
    assert cv.update(jnp.zeros((2, 0), jnp.int32), jnp.zeros((2, 3), jnp.int32),
                     jnp.ones((2, 3), bool), jnp.asarray(in_vocab)).shape == (2, 0)


@pytest.mark.parametrize("topk", [1, 4])
@pytest.mark.parametrize("rows", [(), (3,)], ids=["catch-up", "draft-step"])
def test_children_are_the_best_of_the_vocabulary_and_the_context(topk, rows):
    params = llama.init_random_params(CFG, jax.random.PRNGKey(0), scale=0.2)
    head = eagle.init_eagle_params(CFG, jax.random.PRNGKey(1), scale=0.2)
    rng = np.random.default_rng(5)
    perm = rng.permutation(CFG.vocab_size)
    ids, outside = perm[:40], perm[40:]
    h = dv.restrict(params, head, ids, context=5)
    b = 4
    hidden = jax.random.normal(jax.random.PRNGKey(2), (b,) + rows + (CFG.hidden_size,))
    full = eagle.logits(params, hidden)                                  # [B, .., V]
    # each slot's context: the best tokens outside the vocabulary of its first row, some of them
    best = np.argsort(-np.asarray(full).reshape(b, -1, CFG.vocab_size)[:, 0], axis=-1)
    best = [[t for t in row if t in set(outside.tolist())] for row in best]
    ctx = np.full((b, 5), -1, np.int32)
    ctx[0, 2:] = best[0][:3]
    ctx[1] = best[1][1:6]                # slot 2: empty (the vocabulary alone); slot 3: one id
    ctx[3, 4] = best[3][0]
    spec = SpecConfig(3, topk, 4 if topk == 1 else 8)
    tok, logp = draft_lib._children(params, h, hidden, spec, jnp.asarray(ctx))
    allowed = np.zeros((b, CFG.vocab_size), bool)
    allowed[:, ids[:-5]] = True                          # the last 5 of the 40 are the context's
    for s in range(b):
        allowed[s, ctx[s][ctx[s] >= 0]] = True
    allowed = allowed.reshape((b,) + (1,) * len(rows) + (CFG.vocab_size,))
    inside = jnp.where(allowed, full, -jnp.inf)
    want = jax.lax.top_k(inside, topk)[1]
    np.testing.assert_array_equal(np.asarray(tok), np.asarray(want))
    assert np.isin(np.asarray(tok)[1], np.concatenate([ids, ctx[1]])).all()
    if topk > 1:
        ref = jnp.take_along_axis(jax.nn.log_softmax(inside, -1), want, -1)
        np.testing.assert_allclose(np.asarray(logp), np.asarray(ref), rtol=1e-5, atol=1e-5)
    # The context's ids do win picks (else this test would not test them).
    assert np.isin(np.asarray(tok), outside).any()
    # A fresh slot's context is the ranking's last 5 of the 40: it drafts exactly what the
    # head cut to the 40 without a context drafts.
    fresh = cv.fresh(h, b)
    np.testing.assert_array_equal(np.asarray(fresh[0]), ids[35:][::-1])
    tok, logp = draft_lib._children(params, h, hidden, spec, fresh)
    tok0, logp0 = draft_lib._children(params, dv.restrict(params, head, ids), hidden, spec)
    np.testing.assert_array_equal(np.asarray(tok), np.asarray(tok0))
    np.testing.assert_allclose(np.asarray(logp), np.asarray(logp0), rtol=1e-6, atol=1e-6)


def test_restrict_with_a_context_and_bad_sizes():
    params, head = agreeing_pair()
    ids = np.arange(10)
    h = dv.restrict(params, head, ids, context=7)
    assert cv.size(h) == 7 and h["draft_in_vocab"].shape == (CFG.vocab_size,)
    assert int(h["draft_in_vocab"].sum()) == 3 and h["draft_lm_head"].shape[1] == 10
    assert cv.size(dv.restrict(params, head, ids)) == 0 and cv.size(head) == 0
    # every token already drafted: nothing for a context to add
    assert cv.size(dv.restrict(params, head, np.arange(CFG.vocab_size), context=7)) == 0
    for bad in (-1, 2.5, True, 10, 11):            # 10, 11: not smaller than the 10 drafted
        with pytest.raises(ConfigError, match="context vocabulary"):
            dv.restrict(params, head, ids, context=bad)
    # the state's context: [B, E], and never a zero-size array without one (jax drops the
    # sharding of those: a data-parallel engine's state would not match its programs)
    from jaxspec.spec.cycle import init_state
    assert init_state(CFG, SpecConfig(3, 1, 4), 2, 16, jnp.float32, h).seed.ctx.shape == (2, 7)
    assert init_state(CFG, SpecConfig(3, 1, 4), 2, 16, jnp.float32, head).seed.ctx.shape == (2, 1)


def _accepted(results):
    return sum(sum(r.accept_lens) for r in results)


@pytest.mark.parametrize("shape", [(3, 1, 4), (5, 4, 16)], ids=["chain", "tree"])
def test_runner_output_stays_exact_and_the_context_raises_acceptance(shape):
    params, head = agreeing_pair()
    half = np.random.default_rng(1).permutation(CFG.vocab_size)[:CFG.vocab_size // 2]
    acc = {}
    for e in (0, 16):
        runner = SpecRunner(CFG, params, dv.restrict(params, head, half, context=e),
                            SpecConfig(*shape), max_slots=4, max_len=MAX_LEN)
        out = runner.generate(PROMPTS, [NEW] * 3, eos_ids=())
        assert [r.token_ids for r in out] == reference_outputs("agreeing")
        acc[e] = _accepted(out)
    # Tokens outside the half come back in each answer: with a context they get drafted.
    assert acc[16] > 1.2 * acc[0], acc


def test_engine_chunks_packs_and_retracts_keep_the_context_exact():
    """Engine requests: prompts up to 40 tokens (chunks of 16, first chunks packed), retracts
    under a small KV budget; outputs equal plain greedy, no compilation after warm-up, and the
    context raises the accepted tokens over the same requests without one."""
    params, head = te.agreeing_pair()
    half = np.random.default_rng(3).permutation(te.CFG.vocab_size)[:te.CFG.vocab_size // 2]
    rng = np.random.default_rng(7)
    n = 24
    prompts = [[int(t) for t in rng.integers(0, te.CFG.vocab_size, rng.integers(1, 41))]
               for _ in range(n)]
    te.greedy_refs(prompts)
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    arrive = np.sort(rng.integers(0, n // 2, n))          # step at which each request arrives
    accepted = {}
    for e in (0, 8):
        h = dv.restrict(params, head, half, context=e)
        backend = SpecBackend(te.CFG, params, h, te.SPEC, te.SLOTS,
                              te.MAX_MODEL_LEN + 2 * te.SPEC.max_emit)
        conf = EngineConfig(max_batch=te.SLOTS, max_model_len=te.MAX_MODEL_LEN, kv_budget=110,
                            prefill_chunk=te.CHUNK)
        engine = Engine(backend, conf, vocab_size=te.CFG.vocab_size, eos_ids=())
        engine.warmup()
        sizes = _compiled(engine)
        ids, step = {}, 0
        te._COUNTER.on = True
        try:
            while len(ids) < n or engine.has_work():
                for i in np.flatnonzero(arrive == step):
                    ids[int(i)] = engine.add_request(prompts[i], sp)
                engine.step()
                step += 1
                assert step < 2000
        finally:
            te._COUNTER.on = False
        assert te._COUNTER.n == 0, "compiled after warm-up"
        assert _compiled(engine) == sizes
        assert engine.stats.prefill_chunks > n and engine.stats.retracts > 0
        assert any(form == "packed" for *_, form in engine.stats.admit_shapes)
        accepted[e] = 0
        for i, rid in ids.items():
            r = engine.pop_finished(rid)
            assert r.output == te.greedy_ref(prompts[i])[:12], i
            accepted[e] += sum(r.accept_lens)
    assert accepted[8] > accepted[0], accepted


def _compiled(engine):
    """What the backend runs without compiling, and its calls that found no executable."""
    be = engine.backend
    return sorted(be.programs.executables), be.jit_calls


def _restrict(head, dcfg, ranking=None, max_batch=1, sharded=False):
    """The vocabulary step of `build.load_draft` on the test target (a head not shipped)."""
    params, _ = agreeing_pair()
    dcfg = DraftConfig(**{**dcfg, "draft_vocab_ranking": None if ranking is None
                          else str(ranking)})
    return _restrict_vocab(head, CFG, params, dcfg, shipped=False, max_batch=max_batch,
                           sharded=sharded)


def test_llm_rejects_a_bad_context_size_and_a_context_without_a_cut():
    from jaxspec import LLM
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="draft_context_vocab"):
            LLM("/no/such/model.gguf", draft_context_vocab=bad)
    _, head = agreeing_pair()
    with pytest.raises(ConfigError, match="cut vocabulary"):
        _restrict(head, dict(draft_vocab=0, draft_context_vocab=16))
    assert _restrict(head, dict(draft_vocab=0, draft_context_vocab=0)) is head


def test_default_context_is_for_one_slot_on_a_gpu(tmp_path, monkeypatch):
    from jaxspec import defaults
    _, head = agreeing_pair()
    ranking = tmp_path / "ranking.safetensors"
    dv.save_ranking(ranking, np.random.default_rng(0).permutation(CFG.vocab_size))
    monkeypatch.setattr(defaults, "CONTEXT_VOCAB", 8)
    cut = dict(draft_vocab=40, draft_context_vocab=None)
    sizes = {}
    for backend in ("cpu", "gpu"):
        monkeypatch.setattr(defaults, "on_gpu", lambda b=backend: b == "gpu")
        for slots in (1, 2):
            sizes[backend, slots] = cv.size(_restrict(head, cut, ranking, max_batch=slots))
    assert sizes == {("cpu", 1): 0, ("cpu", 2): 0, ("gpu", 1): 8, ("gpu", 2): 0}
    # not under tensor parallelism
    assert cv.size(_restrict(head, cut, ranking, sharded=True)) == 0
    # no room in a cut of 8: none, not an error
    assert cv.size(_restrict(head, dict(draft_vocab=8), ranking)) == 0
    with pytest.raises(ConfigError, match="must be smaller than the draft vocabulary"):
        _restrict(head, dict(draft_vocab=8, draft_context_vocab=8), ranking)   # asked for
