"""The continuous-batching engine on tiny random models: requests arriving over time, aborts and
retracts give exactly each request's plain greedy output; streams equal the final outputs; stops
inside accepted chains; bad requests rejected without disturbing running ones; no compilation
after warm-up. Sampling through the engine: seeded sampled, penalized and logprob requests give
what the batch runners give, alone, in a busy engine and across retracts."""
import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from draft_models import agreeing_pair as _agreeing_pair
from reference_runner import CompileCounter, plain_step
from reference_runner import serve as reference_serve
from jaxspec.config import ModelConfig
from jaxspec.engine import Engine, EngineConfig, PlainBackend, SpecBackend
from jaxspec.engine.admission import AdmitArgs
from jaxspec.kv import init_cache
from jaxspec.sampling import FULL, LEAN, SamplingParams
from jaxspec.spec import SpecConfig

CFG = ModelConfig(arch="LlamaForCausalLM", vocab_size=128, hidden_size=64, intermediate_size=96,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
SLOTS = 4
MAX_MODEL_LEN = 56        # prompts 1..40 + max_tokens 1..12
CHUNK = 16                # prompts over 16 tokens are prefilled in chunks
SPEC = SpecConfig(3, 1, 4)
TREE = SpecConfig(3, 2, 4)   # a 2-wide draft: the chain's 4 tokens picked from a tree
PLAIN_STEPS = 3


@functools.lru_cache(maxsize=None)
def agreeing_pair():
    """A target whose next token depends mostly on the current one and a head that passes the
    token embedding through to the lm_head: the draft usually agrees, so chains are long."""
    return _agreeing_pair(CFG, scale=0.02, lm_head_scale=0.5)


def _plain_step(params, cfg, k, v, lens, tok):
    k, v, lens, logits = plain_step(params, cfg, k, v, lens, tok)
    return k, v, lens, jnp.argmax(logits, -1).astype(jnp.int32)


_REF = {}
_NEW = 12


def greedy_refs(prompts):
    """Plain greedy, one token at a time with a KV cache, all prompts as one batch (each slot
    feeds its prompt, then its own argmax); cached per prompt."""
    todo = list({tuple(p) for p in prompts if tuple(p) not in _REF})
    if not todo:
        return
    params = agreeing_pair()[0]
    lens_p = np.array([len(p) for p in todo])
    steps = int(lens_p.max()) + _NEW
    feed = np.zeros((len(todo), steps), np.int32)
    for i, p in enumerate(todo):
        feed[i, :len(p)] = p
    c = init_cache(CFG, len(todo), steps, jnp.float32)
    k, v, lens = c.k, c.v, c.lens
    outs = [[] for _ in todo]
    nxt = np.zeros(len(todo), np.int32)
    for t in range(steps):
        tok = np.where(t < lens_p, feed[:, t], nxt)
        k, v, lens, nxt = _plain_step(params, CFG, k, v, lens, jnp.asarray(tok, jnp.int32))
        nxt = np.asarray(nxt)
        for i in np.flatnonzero((t >= lens_p - 1) & (t < lens_p - 1 + _NEW)):
            outs[i].append(int(nxt[i]))
    for p, o in zip(todo, outs):
        _REF[p] = o


def greedy_ref(prompt):
    greedy_refs([prompt])
    return _REF[tuple(prompt)]


def expected(prompt, sp: SamplingParams, eos):
    ref = greedy_ref(prompt)[:sp.max_tokens]
    stops = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(eos))
    for i, t in enumerate(ref):
        if t in stops:
            return ref[:i + 1], "stop"
    return ref, "length"


def make_engine(kind, kv_budget=None, eos=(), detokenize=None, short_rows=None, **kw):
    """kind: 'plain', 'spec' or 'spec:K' (K cycles per device call); 'tree' and 'tree:K' draft
    TREE in place of the chain SPEC."""
    params, head = agreeing_pair()
    name, _, k = kind.partition(":")
    if name in ("spec", "tree"):
        spec, k = (SPEC if name == "spec" else TREE), int(k or 1)
        backend = SpecBackend(CFG, params, head, spec, SLOTS,
                              MAX_MODEL_LEN + 2 * spec.max_emit * k, cycles_per_call=k,
                              short_rows=short_rows)
    else:
        backend = PlainBackend(CFG, params, SLOTS, MAX_MODEL_LEN + 2 * PLAIN_STEPS,
                               n_steps=PLAIN_STEPS, short_rows=short_rows)
    decoder = kw.pop("stream_decoder", None)
    conf = EngineConfig(max_batch=SLOTS, max_model_len=MAX_MODEL_LEN, kv_budget=kv_budget,
                        prefill_chunk=CHUNK, **kw)
    return Engine(backend, conf, vocab_size=CFG.vocab_size, eos_ids=eos, detokenize=detokenize,
                  stream_decoder=decoder)


_COUNTER = CompileCounter()


def serve(engine, prompts, sps, arrive, abort_at):
    """`reference_runner.serve`, asserting that nothing compiles while it runs."""
    _COUNTER.on = True
    try:
        out = reference_serve(engine, prompts, sps, arrive, abort_at)
    finally:
        _COUNTER.on = False
    assert _COUNTER.n == 0, "compiled after warm-up"
    return out


def compiled_shapes(engine):
    """What the backend can run without compiling, and the calls that found no executable
    compiled ahead of time (each compiles through jit on a new shape): equal before and after
    serving when warm-up covered every shape."""
    be = engine.backend
    jitted = [*be._jitted["cycles"].values(), *be._jitted["admits"].values(),
              be._jitted["advance"]]
    return (sorted(be.programs.executables), be.jit_calls, [f._cache_size() for f in jitted])


@pytest.mark.parametrize("kind", ["spec", "plain", "spec:3"])
def test_requests_over_time_with_aborts_and_retracts(kind):
    rng = np.random.default_rng({"spec": 0, "plain": 1}.get(kind, 2))
    n = 120 if kind == "plain" else 200
    # A common token of the references serves as EOS, so many requests stop early.
    prompts = [[int(t) for t in rng.integers(0, CFG.vocab_size, rng.integers(1, 41))]
               for _ in range(n)]
    greedy_refs(prompts)
    counts = np.bincount([t for p in prompts for t in greedy_ref(p)], minlength=CFG.vocab_size)
    eos = (int(np.argsort(counts)[-3]),)
    sps = [SamplingParams(max_tokens=int(rng.integers(1, 13)), ignore_eos=bool(rng.random() < 0.3))
           for _ in range(n)]
    engine = make_engine(kind, kv_budget=110, eos=eos)
    engine.warmup()
    sizes = compiled_shapes(engine)
    arrive = np.sort(rng.integers(0, n // 2, n))          # step at which each request arrives
    abort_at = {i: int(arrive[i] + rng.integers(0, 8)) for i in rng.choice(n, n // 10, False)}
    ids, streams, finals = serve(engine, prompts, sps, arrive, abort_at)
    assert compiled_shapes(engine) == sizes
    if kind == "spec:3":      # 3 cycles per call, 1 while a single slot is active
        assert set(engine.stats.call_sizes) == {1, 3}
    assert engine.stats.retracts > 0 and engine.stats.prefill_chunks > n
    n_aborted = n_one = 0
    for i, rid in ids.items():
        r = engine.pop_finished(rid)
        assert streams.get(rid, []) == r.output and finals[rid] == r.finish_reason
        want, reason = expected(prompts[i], sps[i], eos)
        if r.finish_reason == "abort":
            assert i in abort_at and r.output == want[:len(r.output)]
            n_aborted += 1
            continue
        assert (r.output, r.finish_reason) == (want, reason), (i, r.retracts)
        n_one += sps[i].max_tokens == 1
    assert n_aborted > 0 and n_one > 0
    assert not engine.requests and not engine.scheduler.runs and not engine.finished_requests


def test_no_compilation_over_a_churn_of_requests_after_warmup():
    """After warm-up nothing compiles, whatever the traffic: prompts of 1 to 40 tokens (one to
    three chunks, packed and chunked admissions of every slot bucket) arriving while others
    run, aborts of waiting and running requests, retracts by a small KV budget and their
    resumes (sampling ones advance their keys), greedy and sampled requests (seeded or not,
    penalties, logprobs) in changing mixes, on a speculative engine drafting a 2-wide tree
    (topk 2) at 2 cycles a call (1 while a single slot runs). Greedy requests still give plain
    greedy's tokens, and every stream equals its final output."""
    rng = np.random.default_rng(11)
    n = 90
    prompts = [[int(t) for t in rng.integers(0, CFG.vocab_size, rng.integers(1, 41))]
               for _ in range(n)]
    greedy_refs(prompts)
    eos = (int(np.bincount([t for p in prompts for t in greedy_ref(p)],
                           minlength=CFG.vocab_size).argmax()),)

    def params(i):
        ignore = bool(rng.random() < 0.4)
        m = int(rng.integers(1, 13))
        if i % 3 == 0:        # greedy (LEAN while only such requests run)
            return SamplingParams(max_tokens=m, ignore_eos=ignore)
        return SamplingParams(
            temperature=float(rng.choice([0.0, 0.6, 1.2])), top_p=float(rng.choice([1.0, 0.9])),
            top_k=int(rng.choice([0, 8])), min_p=float(rng.choice([0.0, 0.05])),
            seed=[None, int(rng.integers(0, 1000))][int(rng.integers(0, 2))],
            repetition_penalty=float(rng.choice([1.0, 1.2])),
            presence_penalty=float(rng.choice([0.0, 0.3])),
            logprobs=[None, 0, 2][int(rng.integers(0, 3))], max_tokens=m, ignore_eos=ignore)

    sps = [params(i) for i in range(n)]
    engine = make_engine("tree:2", kv_budget=100, eos=eos)
    engine.warmup()
    sizes = compiled_shapes(engine)
    arrive = np.sort(rng.integers(0, n // 2, n))
    abort_at = {int(i): int(arrive[i] + rng.integers(0, 6)) for i in rng.choice(n, n // 8, False)}
    ids, streams, finals = serve(engine, prompts, sps, arrive, abort_at)
    assert compiled_shapes(engine) == sizes
    stats = engine.stats
    assert set(stats.call_sizes) == {1, 2} and stats.retracts > 0
    assert {(f, form) for _, _, f, form in stats.admit_shapes} == \
        {(f, form) for f in (LEAN, FULL) for form in ("chunk", "packed")}
    assert {a for a, _, _, form in stats.admit_shapes if form == "chunk"} == {1, 4}
    kinds = collections.Counter()
    for i, rid in ids.items():
        r = engine.pop_finished(rid)
        sp = sps[i]
        assert streams.get(rid, []) == r.output and finals[rid] == r.finish_reason
        sampled = sp.temperature > 0
        if r.finish_reason == "abort":
            assert i in abort_at
        elif sp.temperature == 0 and sp.repetition_penalty == 1 and sp.presence_penalty == 0:
            assert (r.output, r.finish_reason) == expected(prompts[i], sp, eos), (i, r.retracts)
        elif r.finish_reason == "length":
            assert len(r.output) == sp.max_tokens
        else:
            assert r.finish_reason == "stop" and r.output[-1] in eos and not sp.ignore_eos
        kinds[r.finish_reason == "abort", sampled, r.retracts > 0] += 1
    assert sum(v for (aborted, _, _), v in kinds.items() if aborted) > 0
    assert kinds[False, True, True] > 0 and kinds[False, False, True] > 0    # resumed
    assert not engine.requests and not engine.scheduler.runs and not engine.finished_requests


@pytest.mark.parametrize("kind", ["spec:3", "plain"])
def test_short_build_runs_while_every_slot_is_short(kind):
    """With short_rows, a call runs the build sized for short prefixes (`ModelConfig.live_rows`)
    exactly while every live slot stays within short_rows rows to the call's end; warm-up
    compiles both builds, nothing compiles after it, and outputs are plain greedy's."""
    engine = make_engine(kind, short_rows=48)
    engine.warmup()
    assert {k[-1] == "short" for k in engine.backend.programs.executables if k[0] == "cycle"} == \
        {True, False}
    sizes = compiled_shapes(engine)
    calls = []
    programs = engine.backend.programs
    run = programs.call
    programs.call = lambda key, *a: (calls.append(key), run(key, *a))[1]
    short_p, long_p = [5, 17, 42, 8], [int(t) for t in np.arange(46) * 7 % CFG.vocab_size]
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    greedy_refs([short_p, short_p[::-1], long_p])
    _COUNTER.on = True
    try:
        for prompts in ([short_p, short_p[::-1]], [short_p, long_p]):
            calls.clear()
            rids = [engine.add_request(p, sp) for p in prompts]
            list(engine.drain())
            for p, rid in zip(prompts, rids):
                assert engine.pop_finished(rid).output == greedy_ref(p)[:8]
            shorts = {k[-1] == "short" for k in calls if k[0] == "cycle"}
            # 4 + 8 tokens and the rows reserved for calls in flight (up to 3 x 12 at spec:3)
            # stay within 48 rows; 46 prompt rows and a call's emit do not
            assert shorts == ({True} if prompts[1] != long_p else {False})
    finally:
        _COUNTER.on = False
    assert _COUNTER.n == 0 and compiled_shapes(engine) == sizes


@pytest.mark.parametrize("kind", ["spec", "spec:3"])
def test_eos_and_max_tokens_inside_an_accepted_chain(kind):
    prompt = [5, 17, 42, 8, 99]
    ref = greedy_ref(prompt)
    eos = ref[7]
    first = ref.index(eos)
    engine = make_engine(kind, eos=(eos,))
    a = engine.add_request(prompt, SamplingParams(max_tokens=12))
    b = engine.add_request(prompt, SamplingParams(max_tokens=1))
    c = engine.add_request(prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    deltas = list(engine.drain())
    ra, rb, rc = (engine.pop_finished(x) for x in (a, b, c))
    assert (ra.output, ra.finish_reason) == (ref[:first + 1], "stop")
    assert (rb.output, rb.finish_reason) == (ref[:1], "length") and rb.accept_lens == []
    assert (rc.output, rc.finish_reason) == (ref[:3], "length")
    # the stops fell inside multi-token accepts, whose extra tokens were never streamed
    assert max(ra.accept_lens) > 1 and 1 + sum(x + 1 for x in rc.accept_lens) > 3
    for r in (ra, rb, rc):
        assert [t for d in deltas if d.request_id == r.request_id for t in d.token_ids] == r.output
        # accept lengths of exactly the cycles whose tokens it kept (not those that ran on
        # inside the call after it ended); the first token came from the admission
        if r.accept_lens:
            made = 1 + np.cumsum([x + 1 for x in r.accept_lens])
            assert made[-1] >= len(r.output) and (len(made) == 1 or made[-2] < len(r.output))


@pytest.mark.parametrize("kind,max_tokens,calls", [("plain", 7, 2), ("spec:3", 4, 1),
                                                    ("spec", 2, 1)])
def test_no_call_after_the_end_by_max_tokens_is_certain(kind, max_tokens, calls):
    """The host reads a call's tokens a step late. A slot whose calls in flight are sure to
    bring max_tokens (each active call brings >= min_emit tokens: plain n_steps, spec one per
    cycle) sits out further calls instead of running one more that is thrown away."""
    prompt = [5, 17, 42, 8, 99]
    engine = make_engine(kind)
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    rids = [engine.add_request(prompt, sp) for _ in range(2)]    # 2 active: full-size calls
    list(engine.drain())
    for rid in rids:
        r = engine.pop_finished(rid)
        assert (r.output, r.finish_reason) == (greedy_ref(prompt)[:max_tokens], "length")
    assert engine.stats.cycles == calls
    assert not engine.scheduler.live.any() and not engine.scheduler.rows.any()


def _serve(engine, prompts, sps, arrive):
    """Runs requests arriving at the given steps; (outputs by index, steps that admitted)."""
    ids, admitted_at, step = {}, [], 0
    while len(ids) < len(prompts) or engine.has_work():
        for i in np.flatnonzero(arrive == step):
            ids[int(i)] = engine.add_request(prompts[i], sps[i])
        before = engine.stats.prefill_chunks
        engine.step()
        if engine.stats.prefill_chunks > before:
            admitted_at.append(step)
        step += 1
        assert step < 2000
    return {i: engine.pop_finished(rid).output for i, rid in ids.items()}, admitted_at


def test_admit_interval_gathers_newcomers_and_keeps_outputs():
    rng = np.random.default_rng(5)
    n = 24
    prompts = [[int(t) for t in rng.integers(0, CFG.vocab_size, rng.integers(1, 20))]
               for _ in range(n)]
    sps = [SamplingParams(max_tokens=int(rng.integers(1, 10)), ignore_eos=True) for _ in range(n)]
    arrive = np.sort(rng.integers(0, 30, n))
    every, every_at = _serve(make_engine("spec"), prompts, sps, arrive)
    gathered_engine = make_engine("spec", admit_interval=3)
    gathered, gathered_at = _serve(gathered_engine, prompts, sps, arrive)
    for i in range(n):
        assert every[i] == gathered[i] == expected(prompts[i], sps[i], ())[0], i
    assert len(gathered_at) < len(every_at)
    shapes = gathered_engine.stats.admit_shapes       # what the device ran besides the cycles
    assert sum(shapes.values()) == gathered_engine.stats.prefill_chunks
    assert {(a, w, form) for a, w, _, form in shapes} <= set(gathered_engine.planner.forms())
    assert {f for _, _, f, _ in shapes} == {LEAN}
    with pytest.raises(ValueError, match="admit_interval"):
        make_engine("spec", admit_interval=0)


def _detok(ids):
    return "".join(chr(0x41 + t % 58) for t in ids)


def test_stop_strings_cut_text_and_stream_equals_final():
    engine = make_engine("spec", detokenize=_detok)
    prompts = [[3, 9, 27], [100, 1, 2, 3, 4], list(range(30, 60))]
    stops = []
    for p in prompts:
        text = _detok(greedy_ref(p))
        stops.append(text[5:7])
    ids = [engine.add_request(p, SamplingParams(max_tokens=12, stop=(s,)))
           for p, s in zip(prompts, stops)]
    text = {}
    for d in engine.drain():
        text[d.request_id] = text.get(d.request_id, "") + d.text
    for rid, p, s in zip(ids, prompts, stops):
        r = engine.pop_finished(rid)
        full = _detok(greedy_ref(p))
        cut = full.find(s)
        assert r.finish_reason == "stop" and r.text == full[:cut] == text[rid]
        assert r.output == greedy_ref(p)[:cut + len(s)]   # up to the token completing it


def test_unstreamed_requests_get_one_delta_and_one_decode():
    """stream=False (LLM.generate): no deltas while a request runs, one when it ends with all
    its tokens and text; it is decoded once, at its end, and stop strings still cut it at the
    right token. Streamed requests of the same engine get their running deltas as before."""
    calls = []

    def counting(ids):
        calls.append(list(ids))
        return _detok(ids)

    prompts = [[3, 9, 27], [100, 1, 2, 3, 4], list(range(30, 60))]
    stop = _detok(greedy_ref(prompts[2]))[6:8]
    sps = [SamplingParams(max_tokens=12, ignore_eos=True)] * 2 + \
        [SamplingParams(max_tokens=12, stop=(stop,))]
    for stream in (False, True):
        engine = make_engine("spec", detokenize=counting)
        calls.clear()
        ids = [engine.add_request(p, sp, stream=stream) for p, sp in zip(prompts[:2], sps[:2])]
        deltas = list(engine.drain())
        outs = [engine.pop_finished(rid) for rid in ids]
        for rid, p, r in zip(ids, prompts, outs):
            mine = [d for d in deltas if d.request_id == rid]
            assert r.output == greedy_ref(p)[:12] and r.text == _detok(r.output)
            assert "".join(d.text for d in mine) == r.text
            assert sum((d.token_ids for d in mine), []) == r.output
            assert mine[-1].finished and mine[-1].finish_reason == "length"
            assert len(mine) == 1 if not stream else len(mine) > 1
        if stream:
            assert len(calls) > 2 * len(deltas) // 2     # every step decodes each request
        else:
            assert sorted(calls) == sorted(r.output for r in outs)   # one decode each, at the end
    engine = make_engine("spec", detokenize=_detok)
    quiet = engine.add_request(prompts[2], sps[2], stream=False)
    loud = engine.add_request(prompts[0], sps[0])
    deltas = list(engine.drain())
    r = engine.pop_finished(quiet)
    full = _detok(greedy_ref(prompts[2]))
    mine = [d for d in deltas if d.request_id == quiet]
    assert r.finish_reason == "stop" and r.text == full[:full.find(stop)]
    assert len(mine) == 1 and mine[0].text == r.text and mine[0].token_ids == r.output
    assert len([d for d in deltas if d.request_id == loud]) > 1


def test_bad_requests_rejected_without_disturbing_running_ones():
    engine = make_engine("spec", kv_budget=55)
    good = [[7, 8, 9], list(range(20, 50))]
    ids = [engine.add_request(p, SamplingParams(max_tokens=10, ignore_eos=True)) for p in good]
    engine.step()
    engine.step()
    for prompt, sp, needle in [
            ([], None, "empty prompt"),
            ([1] * 50, SamplingParams(max_tokens=10), "exceeds the context"),
            ([1, 500], None, "out of range"),
            ([1] * 40, SamplingParams(max_tokens=12), "more than the budget")]:
        with pytest.raises(ValueError, match=needle):
            engine.add_request(prompt, sp)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([1, 2], request_id=ids[0])
    list(engine.drain())
    for rid, p in zip(ids, good):
        assert engine.pop_finished(rid).output == greedy_ref(p)[:10]


def chunk_part(slot_idx, tokens, n_valid, next_tok=None, adm=None):
    """The argument tuple of a one-replica first-chunk admission of rows (padding: slot SLOTS),
    greedy unless `adm` says otherwise."""
    a = len(slot_idx)
    return (np.asarray(slot_idx, np.int32), np.asarray(tokens, np.int32), np.zeros(a, np.int32),
            np.asarray(n_valid, np.int32),
            np.full(a, -1, np.int32) if next_tok is None else np.asarray(next_tok, np.int32),
            AdmitArgs.host(a, n_prompt=np.asarray(n_valid, np.int32)) if adm is None else adm)


def test_admission_equals_the_batch_prefill():
    """One chunk of admission into slot 2 == the whole batch's prefill of the same prompt (the
    reference runners' prefill: every slot's prompt in one admission)."""
    from jaxspec.engine.admission import batch_axes, take_slots
    from jaxspec.spec.cycle import init_state
    from reference_runner import prefill
    params, head = agreeing_pair()
    prompt = [5, 17, 42, 8, 99, 3]
    engine = make_engine("spec")
    rows = engine.backend.max_len
    state = init_state(CFG, SPEC, SLOTS, rows, jnp.float32)
    tokens = np.zeros((SLOTS, 16), np.int32)
    tokens[2, :6] = prompt
    lens = np.array([0, 0, 6, 0], np.int32)
    ref, root = prefill(CFG, SPEC, params, head, state, tokens, lens)
    got, first = engine.backend.admit(engine.state, "chunk", [chunk_part([2], tokens[2:3], [6])])
    assert int(first.tokens[0]) == int(root[2]) == greedy_ref(prompt)[0]
    axes = batch_axes(lambda b: init_state(CFG, SPEC, b, rows, jnp.float32), SLOTS)
    slot = np.array([2], np.int32)
    owned = lambda s: (s.target, s.draft_k, s.draft_v, s.root, s.seed)   # what admission writes
    for a, b in zip(jax.tree_util.tree_leaves(owned(take_slots(ref, axes, slot))),
                    jax.tree_util.tree_leaves(owned(take_slots(got, axes, slot)))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def live_engine(kind):
    """An engine whose slots 0 and 1 run requests (3 steps in), slots 2 and 3 free."""
    engine = make_engine(kind)
    for p in ([5, 17, 42, 8, 99, 3, 7], [3, 9, 27, 81]):
        engine.add_request(p, SamplingParams(max_tokens=30, ignore_eos=True))
    for _ in range(3):
        engine.step()
    return engine


def state_axes(kind, be):
    """Per state leaf (flattened): its batch axis and its row axis (-1 where it has none)."""
    from jaxspec.decode import init_plain_state
    from jaxspec.engine.admission import batch_axes
    from jaxspec.spec.cycle import init_state
    if kind == "spec":
        init = lambda b, t: init_state(CFG, SPEC, b, t, jnp.float32)     # noqa: E731
    else:
        init = lambda b, t: init_plain_state(CFG, b, t, jnp.float32)     # noqa: E731
    rows = jax.tree_util.tree_leaves(batch_axes(lambda t: init(SLOTS, t), be.max_len, "row"))
    axes = jax.tree_util.tree_leaves(batch_axes(lambda b: init(b, be.max_len), SLOTS))
    return axes, rows


@pytest.mark.parametrize("kind", ["spec", "plain"])
def test_admission_into_a_live_batch_touches_only_its_slots(kind):
    """An admission reads and writes the KV caches in place (never gathered): into a batch
    whose slots 0 and 1 run requests it leaves those slots untouched, and writes the admitted
    slots exactly as the same admission into an empty batch does (the chunk's rows, nothing
    past them); a padding row writes nothing."""
    engine = live_engine(kind)
    be = engine.backend
    snap = jax.tree_util.tree_map(np.array, engine.state)
    slot_idx = [3, 2, SLOTS]                                    # two slots and a padding row
    tokens = np.zeros((3, 16), np.int32)
    tokens[0, :6], tokens[1, :3] = [5, 17, 42, 8, 99, 3], [60, 61, 62]
    nv = np.array([6, 3, 0], np.int32)
    part = chunk_part(slot_idx, tokens, nv)
    live, f_live = be.admit(jax.tree_util.tree_map(jnp.asarray, snap), "chunk", [part])
    empty, f_empty = be.admit(be.init_state(), "chunk", [part])
    np.testing.assert_array_equal(np.asarray(f_live.tokens)[:2], np.asarray(f_empty.tokens)[:2])
    axes, rows = state_axes(kind, be)
    leaves = zip(jax.tree_util.tree_leaves(snap), jax.tree_util.tree_leaves(live),
                 jax.tree_util.tree_leaves(empty), axes, rows)
    n_kv = 0
    for before, g, f, ax, rax in leaves:
        g, f = np.asarray(g), np.asarray(f)
        if ax < 0:
            continue
        n_kv += rax >= 0
        for slot in range(SLOTS):
            take = lambda x: np.take(x, slot, axis=ax)          # noqa: E731
            if slot in (0, 1):                                  # live, not admitted: untouched
                np.testing.assert_array_equal(take(g), take(before))
            elif rax < 0:                                       # admitted: per-slot leaves
                np.testing.assert_allclose(take(g), take(f), atol=1e-6)
            else:                                               # admitted: the chunk's rows
                n = int(nv[slot_idx.index(slot)])
                r = rax - (rax > ax)
                np.testing.assert_allclose(np.take(take(g), range(n), axis=r),
                                           np.take(take(f), range(n), axis=r), atol=1e-6)
                assert np.abs(np.take(take(g), range(n), axis=r)).max() > 0
                rest = range(n, take(g).shape[r])
                np.testing.assert_array_equal(np.take(take(g), rest, axis=r),
                                              np.take(take(before), rest, axis=r))
    assert n_kv == (4 if kind == "spec" else 2)     # target k, v (+ draft k, v)


# ---------------------------------------------------------------- sampling through the engine

MIXED_PROMPTS = [[5, 17, 42, 8, 99], [3, 9, 27], [100, 1, 2, 3, 4], list(range(30, 60))]
MIXED_SPS = [
    SamplingParams(max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=12, logprobs=2),
    SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2,
                   max_tokens=12, logprobs=0),
    SamplingParams(temperature=1.1, top_k=20, min_p=0.02, seed=11, max_tokens=12,
                   repetition_penalty=1.2)]


def runner_refs(kind):
    """The static-batch reference runners (tests/reference_runner.py) on the mixed batch."""
    from reference_runner import PlainRunner, SpecRunner
    params, head = agreeing_pair()
    if kind == "spec":
        runner = SpecRunner(CFG, params, head, SPEC, max_slots=SLOTS,
                            max_len=MAX_MODEL_LEN + 2 * SPEC.max_emit)
    else:
        runner = PlainRunner(CFG, params, SLOTS, MAX_MODEL_LEN + 2 * PLAIN_STEPS,
                             decode_steps=PLAIN_STEPS)
    return runner.generate(MIXED_PROMPTS, MIXED_SPS)


def assert_logprobs_close(got, ref):
    assert got is not None and len(got) == len(ref)
    for g, r in zip(got, ref):
        assert set(g) == set(r), (g, r)
        np.testing.assert_allclose([g[k] for k in r], list(r.values()), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["spec", "plain"])
def test_sampling_penalties_logprobs_alone_busy_and_retracted(kind):
    """The mixed batch alone equals the batch runner (tokens and logprobs; the greedy row is
    plain greedy). In a busy engine with a tight KV budget (retracts), among unseeded sampled and
    greedy requests with changing parameters, the same requests give the same outputs, streams
    carry the same logprobs, and nothing compiles after warm-up."""
    refs = runner_refs(kind)
    assert refs[0].token_ids == greedy_ref(MIXED_PROMPTS[0])
    alone = make_engine(kind)
    ids = [alone.add_request(p, sp) for p, sp in zip(MIXED_PROMPTS, MIXED_SPS)]
    list(alone.drain())
    for rid, sp, ref in zip(ids, MIXED_SPS, refs):
        r = alone.pop_finished(rid)
        assert r.output == ref.token_ids
        if sp.logprobs is None:
            assert r.logprobs is None
        else:
            assert_logprobs_close(r.logprobs, ref.logprobs)
            assert all(len(d) <= sp.logprobs + 1 and t in d for t, d in zip(r.output, r.logprobs))

    rng = np.random.default_rng(5)
    busy = make_engine(kind, kv_budget=85)
    busy.warmup()
    sizes = compiled_shapes(busy)
    fillers = [([int(t) for t in rng.integers(0, CFG.vocab_size, rng.integers(1, 41))],
                SamplingParams(temperature=float(rng.choice([0.0, 0.7, 1.3])),
                               top_p=float(rng.choice([1.0, 0.8])), top_k=int(rng.choice([0, 5])),
                               presence_penalty=float(rng.choice([0.0, 0.4])),
                               logprobs=[None, 1][int(rng.integers(0, 2))],
                               max_tokens=int(rng.integers(4, 13)), ignore_eos=True))
               for _ in range(24)]
    tracked, streams, lps, step, ids = {}, {}, {}, 0, []
    _COUNTER.on = True
    try:
        while step < 8 or busy.has_work():
            if step < 8:
                for p, sp in fillers[3 * step:3 * step + 3]:
                    ids.append(busy.add_request(p, sp))
            if step in (1, 3, 4, 6):   # the tracked requests arrive after fillers: retracted first
                for j in {1: [3], 3: [1, 2], 4: [0], 6: [3, 1]}[step]:
                    rid = busy.add_request(MIXED_PROMPTS[j], MIXED_SPS[j])
                    tracked[rid] = j
            for d in busy.step():
                streams.setdefault(d.request_id, []).extend(d.token_ids)
                if d.logprobs is not None:
                    lps.setdefault(d.request_id, []).extend(d.logprobs)
            step += 1
            assert step < 2000
    finally:
        _COUNTER.on = False
    assert _COUNTER.n == 0, "compiled after warm-up"
    assert compiled_shapes(busy) == sizes
    retracted = 0
    for rid, j in tracked.items():
        r = busy.pop_finished(rid)
        retracted += r.retracts > 0
        assert r.output == refs[j].token_ids == streams[rid], (j, r.retracts)
        if MIXED_SPS[j].logprobs is not None:
            assert_logprobs_close(r.logprobs, refs[j].logprobs)
            assert lps[rid] == r.logprobs
    assert retracted > 0 and busy.stats.retracts > retracted
    outs = [busy.pop_finished(rid) for rid in ids]
    assert all(len(o.output) == o.sp.max_tokens for o in outs)
    assert len({tuple(o.output) for o in outs}) > len(outs) // 2   # unseeded rows differ


@pytest.mark.parametrize("skip", [True, False], ids=["skip_special", "keep_special"])
@pytest.mark.parametrize("stream", [False, True], ids=["windows", "stream_decoder"])
def test_incremental_detokenization_equals_full_decode(smollm2_gguf, stream, skip):
    """The engine's per-step text (only new tokens decoded: by windows of the output, or the
    tokenizer's incremental decoder) equals decoding the whole output, with multi-byte
    characters split across tokens held back until complete; also for random token ids, whose
    bytes need not form valid UTF-8, fed one or several at a time."""
    import random

    from jaxspec.engine.output import OutputProcessor
    from jaxspec.engine.request import Request
    from jaxspec.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(smollm2_gguf)
    out = OutputProcessor(tok.decode, tok.stream_decoder if stream else None)
    if stream:
        assert tok.stream_decoder() is not None      # SmolLM2's tokenizer takes the fast path

    def fresh():
        return Request(0, [], SamplingParams(skip_special_tokens=skip), frozenset(), ())

    def decode(ids):
        return tok.decode(ids, skip_special_tokens=skip)

    text = "Café — naïve 日本語 emoji 🎉🚀 and plain words, then «quotes» ok."
    ids = tok.encode(text, add_special_tokens=False)
    req = fresh()
    for t in ids:
        req.output.append(t)
        got = out.text_so_far(req)
        full = decode(req.output)
        assert full.startswith(got)            # never text the full decode does not have
        if not full.endswith("\ufffd"):
            assert got == full                 # and nothing held once the bytes are complete
    assert got == decode(ids) == text
    assert (req.decoder is not False) == stream
    rng = random.Random(0)
    for _ in range(40):
        req, n = fresh(), rng.randint(1, 30)
        ids = [rng.randrange(300 if rng.random() < 0.5 else tok.vocab_size) for _ in range(n)]
        while req.output != ids:
            req.output += ids[len(req.output):len(req.output) + rng.randint(1, 3)]
            assert decode(req.output).startswith(out.text_so_far(req))


@pytest.mark.parametrize("kind", ["spec", "plain", "spec:3"])
def test_retracted_sampling_request_resumes_its_key(kind):
    """A seeded sampling request retracted after several cycles is resumed with its key moved
    past the draws it made (the separate key-advance call), so its output equals the run
    without the retract."""
    sp = SamplingParams(temperature=1.0, seed=7, max_tokens=20, ignore_eos=True)
    prompt = [5, 17, 42, 8, 99]
    alone = make_engine(kind)
    a = alone.add_request(prompt, sp)
    list(alone.drain())
    want = alone.pop_finished(a).output

    engine = make_engine(kind)
    engine.add_request(list(range(30, 40)), SamplingParams(max_tokens=30, ignore_eos=True))
    rid = engine.add_request(prompt, sp)           # admitted last: the retract's victim
    for _ in range(max(2, 4 // int(kind.partition(":")[2] or 1))):  # spec:3: 3 cycles a step
        engine.step()
    sch = engine.scheduler
    budget, sch.kv_budget = sch.kv_budget, sch.need() - 1
    engine.step()                                  # retracts it, after several cycles
    req = engine.requests[rid]
    assert req.retracts == 1 and len(req.output) > 2     # its key had moved past the first draw
    sch.kv_budget = budget
    list(engine.drain())
    r = engine.pop_finished(rid)
    assert r.retracts == 1 and r.output == want
