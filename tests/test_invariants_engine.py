"""Engine invariants against plain decoding.

A tree shape (topk > 1) served with admissions while other requests run, aborts and retracts
(a small KV budget) gives each request plain greedy decoding's output. The naive preset (1, 1,
2: SGLang's "Naive EAGLE") through EOS, abort, max_tokens=1, logprobs and penalties gives what
plain decoding gives with the same SamplingParams: the same tokens, the same logprobs (fp32
tolerance), the same penalized greedy tokens.

Engines are built only by `make_engine` and driven only by `Driver` (add_request, abort, step
and the deltas they return), so a new engine constructor changes only those."""
import functools

import jax.numpy as jnp
import numpy as np
import pytest

from reference_runner import plain_step
from draft_models import agreeing_pair as _agreeing_pair
from jaxspec.config import ModelConfig
from jaxspec.kv import init_cache
from jaxspec.sampling import SamplingParams
from jaxspec.spec import SpecConfig

CFG = ModelConfig(arch="LlamaForCausalLM", vocab_size=331, hidden_size=64, intermediate_size=96,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
SLOTS = 4
MAX_MODEL_LEN = 40
CHUNK = 16                # prompts over 16 tokens are prefilled in chunks
TREE = SpecConfig(3, 2, 6)
NAIVE = "naive"


def make_engine(cfg, params, draft, spec, *, slots, max_model_len, kv_budget=None, eos_ids=()):
    """A continuous-batching speculative engine, one cycle a device call, admitting at once:
    add_request(prompt, sp) -> id, abort(id), step() -> deltas (request_id, token_ids,
    finished, finish_reason, logprobs)."""
    from jaxspec.engine import Engine, EngineConfig, SpecBackend
    from jaxspec.spec.config import resolve_spec
    emit = resolve_spec(spec).max_emit
    backend = SpecBackend(cfg, params, draft, spec, slots, max_model_len + 2 * emit)
    conf = EngineConfig(max_batch=slots, max_model_len=max_model_len, kv_budget=kv_budget,
                        prefill_chunk=CHUNK, admit_interval=1, cycles_per_call=1)
    return Engine(backend, conf, vocab_size=cfg.vocab_size, eos_ids=eos_ids)


def retracts(engine) -> int:
    """Requests the engine retracted (sent back to the queue to free KV rows) so far."""
    return engine.stats.retracts


class Driver:
    """Drives an engine through add_request, abort and step only, and collects each request's
    streamed tokens, finish reason and logprobs from the deltas, under the caller's keys."""

    def __init__(self, engine):
        self.engine, self.ids, self.got, self.abort_after = engine, {}, {}, {}
        self.widest = 0                        # the most tokens one delta carried

    def add(self, key, prompt, sp, abort_after=None):
        """abort_after: abort the request once that many of its tokens have streamed."""
        self.ids[key] = self.engine.add_request(prompt, sp)
        self.got[key] = ([], None, None)
        if abort_after is not None:
            self.abort_after[key] = abort_after

    def abort(self, key):
        self.engine.abort(self.ids[key])

    def tokens(self, key):
        return self.got[key][0]

    def finished(self, key):
        return self.got[key][1] is not None

    def step(self):
        key_of = {rid: k for k, rid in self.ids.items()}
        for d in self.engine.step():
            key = key_of[d.request_id]
            toks, reason, lps = self.got[key]
            assert reason is None, "a delta after the final one"
            self.widest = max(self.widest, len(d.token_ids))
            if d.logprobs is not None:
                lps = (lps or []) + list(d.logprobs)
            self.got[key] = (toks + list(d.token_ids), d.finish_reason if d.finished else None,
                             lps)
        for key, n in list(self.abort_after.items()):
            if len(self.tokens(key)) >= n:
                del self.abort_after[key]
                if not self.finished(key):
                    self.abort(key)

    def finish(self, max_steps=500):
        """Steps until every request has finished: {key: (tokens, finish_reason, logprob dicts
        or None)}."""
        for _ in range(max_steps):
            if all(self.finished(k) for k in self.got):
                return self.got
            self.step()
        raise AssertionError(f"unfinished after {max_steps} steps: {self.got}")


@functools.lru_cache(maxsize=None)
def agreeing_pair():
    """Layers of weight 0.06 over 331 tokens: the target's greedy output depends on its context
    (a continuation from the prompt and the last output token, the rest of the output left out,
    mostly differs from the true one), so an engine that loses or misplaces KV rows changes the
    output; the draft still accepts about 2.4 of the tree's 3 steps."""
    return _agreeing_pair(CFG, scale=0.06, lm_head_scale=1.0)


def _plain_step(params, cfg, k, v, lens, tok):
    k, v, lens, logits = plain_step(params, cfg, k, v, lens, tok)
    return k, v, lens, logits[0]


def _penalized(logits, prompt, out, sp):
    """vLLM's penalties (sampling.SamplingParams): repetition over prompt and output tokens,
    frequency and presence over the output's counts."""
    x = np.array(logits, np.float64)
    count = np.bincount(np.asarray(out, int), minlength=len(x))
    seen = count > 0
    seen[list(prompt)] = True
    rep = sp.repetition_penalty
    x = np.where(seen, np.where(x > 0, x / rep, x * rep), x)
    return x - count * sp.frequency_penalty - (count > 0) * sp.presence_penalty


@functools.lru_cache(maxsize=None)
def plain_decode(prompt, sp=SamplingParams(max_tokens=12, ignore_eos=True), eos_ids=()):
    """Plain greedy decoding of one request, one token at a time through llama.forward with a
    KV cache, penalties and logprobs computed here in float64 from the fp32 logits:
    (tokens, finish_reason, per token {token: logprob} with sp.logprobs alternatives, or
    None)."""
    assert sp.greedy
    params = agreeing_pair()[0]
    c = init_cache(CFG, 1, MAX_MODEL_LEN + 8, jnp.float32)
    k, v, lens = c.k, c.v, c.lens
    for t in prompt:
        k, v, lens, logits = _plain_step(params, CFG, k, v, lens, jnp.array([t], jnp.int32))
    stops = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(eos_ids))
    out, lps = [], []
    while True:
        x = _penalized(np.asarray(logits), prompt, out, sp)
        tok = int(np.argmax(x))
        lp = x - x.max() - np.log(np.sum(np.exp(x - x.max())))
        top = np.argsort(-lp, kind="stable")[:sp.logprobs or 0]
        lps.append({**{int(i): float(lp[i]) for i in top}, tok: float(lp[tok])})
        out.append(tok)
        if tok in stops:
            reason = "stop"
            break
        if len(out) == sp.max_tokens:
            reason = "length"
            break
        k, v, lens, logits = _plain_step(params, CFG, k, v, lens, jnp.array([tok], jnp.int32))
    return out, reason, (lps if sp.logprobs is not None else None)


def plain_greedy(prompt, n):
    return plain_decode(tuple(prompt))[0][:n]


def assert_logprobs_close(got, want):
    assert got is not None and len(got) == len(want)
    for g, w in zip(got, want):
        assert set(g) == set(w), (g, w)
        np.testing.assert_allclose([g[t] for t in w], list(w.values()), rtol=1e-4, atol=1e-4)


def test_tree_engine_with_admissions_aborts_and_retracts_equals_plain_greedy():
    """A topk > 1 tree (3 steps, top-2, 6 nodes) in a 4-slot engine whose KV budget cannot hold
    two long requests to their end: the later one is retracted after several tokens and resumed.
    Then requests arrive while others run, one is aborted while running, one while waiting,
    some stop at an EOS. Each finished request's output is plain greedy's up to max_tokens or
    the EOS; an aborted one's is a prefix of it."""
    params, head = agreeing_pair()
    rng = np.random.default_rng(3)
    n = 12
    prompts = [[int(t) for t in rng.integers(0, CFG.vocab_size, size)]
               for size in [4, 3] + rng.integers(1, 21, n - 2).tolist()]
    sps = [SamplingParams(max_tokens=24, ignore_eos=True) for _ in range(2)] + [
        SamplingParams(max_tokens=12, ignore_eos=True) for _ in range(2)] + [
        SamplingParams(max_tokens=int(rng.integers(1, 13)), ignore_eos=i % 3 == 0)
        for i in range(4, n)]
    refs = [plain_decode(tuple(p), SamplingParams(max_tokens=sp.max_tokens, ignore_eos=True))[0]
            for p, sp in zip(prompts, sps)]
    # EOS: the commonest token after the first in what the requests that stop at it generate
    counts = np.bincount([t for r, sp in zip(refs, sps) if not sp.ignore_eos
                          for t in r[1:sp.max_tokens]], minlength=CFG.vocab_size)
    eos = int(np.argmax(counts))
    # 4 + 3 prompt rows and 2 x 4 rows a cycle fit in 40; two whole outputs of 24 do not, so
    # the later request is retracted when both have several tokens, with many still to come
    engine = make_engine(CFG, params, head, TREE, slots=SLOTS, max_model_len=MAX_MODEL_LEN,
                         kv_budget=40, eos_ids=(eos,))
    drv = Driver(engine)
    drv.add(0, prompts[0], sps[0])
    drv.add(1, prompts[1], sps[1])
    for _ in range(20):
        before = [len(drv.tokens(0)), len(drv.tokens(1))]
        drv.step()
        if retracts(engine):
            break
    assert retracts(engine) == 1, "no retract"
    assert min(before) >= 2, before              # the victim had streamed tokens
    for i in range(2, n):
        drv.add(i, prompts[i], sps[i], abort_after=2 if i == 2 else None)
        if i == 3:
            drv.abort(3)                       # still waiting: admission runs in step()
        if i % 2:
            drv.step()
    got = drv.finish()
    stopped = 0
    for i in range(n):
        toks, reason, _ = got[i]
        want = refs[i][:sps[i].max_tokens]
        if not sps[i].ignore_eos and eos in want:
            want = want[:want.index(eos) + 1]
        if i in (2, 3):
            assert reason == "abort" and toks == want[:len(toks)], i
            continue
        assert toks == want, i
        assert reason == ("stop" if want[-1] == eos and not sps[i].ignore_eos else "length"), i
        stopped += reason == "stop"
    assert stopped > 0
    assert len(got[2][0]) >= 2 and got[3][0] == []
    assert drv.widest >= 3                     # a cycle accepted two drafted tokens


@pytest.fixture(scope="module")
def naive_cases():
    """The naive preset's requests in one engine (4 slots, 7 requests: three wait at first) and
    plain decoding's results for the same SamplingParams."""
    params, head = agreeing_pair()
    # p[4]: plain greedy repeats 13, 278 (prompt tokens) and loops, so each penalty alone
    # changes its output
    p = [[5, 17, 42, 8, 99], [3, 9, 27], list(range(30, 50)), [100, 1, 2, 3, 4],
         [5, 17, 42, 8, 99, 13, 278], [64, 2], [26, 72, 283, 220]]
    ref0 = plain_decode(tuple(p[0]))[0]
    eos = ref0[4]
    pen = dict(repetition_penalty=1.4, frequency_penalty=0.6, presence_penalty=0.5)
    cases = {
        "eos": (p[0], SamplingParams(max_tokens=12)),
        "abort": (p[1], SamplingParams(max_tokens=12, ignore_eos=True)),
        "one": (p[2], SamplingParams(max_tokens=1)),
        "logprobs": (p[3], SamplingParams(max_tokens=10, ignore_eos=True, logprobs=3)),
        "penalties": (p[4], SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2, **pen)),
        # the output's counts alone (no repetition penalty). Plain greedy gives 10, 106, 54,
        # 145, 192, 145, ..: its first repeat is of a token an earlier cycle emitted, so the
        # penalties act only through the counts carried from cycle to cycle
        "counts": (p[6], SamplingParams(max_tokens=12, ignore_eos=True, frequency_penalty=0.6,
                                        presence_penalty=0.5)),
        "waiting_abort": (p[5], SamplingParams(max_tokens=8, ignore_eos=True)),
    }
    engine = make_engine(CFG, params, head, NAIVE, slots=SLOTS, max_model_len=MAX_MODEL_LEN,
                         eos_ids=(eos,))
    drv = Driver(engine)
    for key, (prompt, sp) in cases.items():
        drv.add(key, prompt, sp, abort_after=3 if key == "abort" else None)
    drv.abort("waiting_abort")                 # admission runs in step(): still waiting
    got = drv.finish()
    want = {k: plain_decode(tuple(pr), sp, (eos,)) for k, (pr, sp) in cases.items()}
    return cases, got, want, eos


def test_naive_eos_and_max_tokens_one_equal_plain(naive_cases):
    cases, got, want, eos = naive_cases
    toks, reason, _ = got["eos"]
    assert (toks, reason) == want["eos"][:2] and reason == "stop" and toks[-1] == eos
    assert len(toks) == 5
    assert got["one"][:2] == want["one"][:2] == (want["one"][0][:1], "length")
    assert len(got["one"][0]) == 1


def test_naive_abort_keeps_a_prefix_of_plain(naive_cases):
    cases, got, want, _ = naive_cases
    toks, reason, _ = got["abort"]
    assert reason == "abort" and 0 < len(toks) < cases["abort"][1].max_tokens
    assert toks == want["abort"][0][:len(toks)]
    assert got["waiting_abort"][:2] == ([], "abort")


def test_naive_logprobs_equal_plain(naive_cases):
    _, got, want, _ = naive_cases
    toks, reason, lps = got["logprobs"]
    assert (toks, reason) == want["logprobs"][:2]
    assert_logprobs_close(lps, want["logprobs"][2])
    assert all(len(d) == 3 for d in lps)      # greedy: the token is among the best 3
    assert got["eos"][2] is None


def test_naive_penalties_give_plain_penalized_greedy(naive_cases):
    cases, got, want, _ = naive_cases
    toks, reason, lps = got["penalties"]
    assert (toks, reason) == want["penalties"][:2]
    assert_logprobs_close(lps, want["penalties"][2])
    # the penalties change the greedy output, so the comparison sees them
    prompt = tuple(cases["penalties"][0])
    assert toks != plain_greedy(prompt, len(toks))


def test_naive_frequency_and_presence_penalties_give_plain_penalized_greedy(naive_cases):
    """Penalties of the output's token counts alone: the counts must include every emitted
    token (bonus and accepted) from the cycles before."""
    cases, got, want, _ = naive_cases
    toks, reason, lps = got["counts"]
    assert (toks, reason, lps) == want["counts"] and lps is None
    assert toks != plain_greedy(tuple(cases["counts"][0]), len(toks))
