"""Logprobs of every emitted token (and the top alternatives), speculative or plain, equal what
plain decoding reports when scoring the same sequence; penalties and stop strings on the host."""
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.decode import init_plain_state, sample_steps
from jaxspec.sampling import (SamplingParams, SlotSampling, TokenCounts, apply_stop_strings,
                              logprob_dicts, slot_keys)
from jaxspec.spec import SpecConfig
from reference_runner import PlainRunner, SpecRunner, prefill

T = importlib.import_module("test_spec_sampling")
CFG, models = T.CFG, T.models


def plain_scores(prompt, tokens, sp):
    """Plain decoding, teacher-forced over `tokens`: the logprob dicts it reports. The prompt
    but its last token is prefilled; the decode steps then run from the last prompt token, so
    every scored token (the first included) comes from a decode step, not from an admission."""
    params, _ = models()
    state = init_plain_state(CFG, 1, 64, jnp.float32)
    toks = np.zeros((1, 16), np.int32)      # one width for every prompt: one program
    toks[0, :len(prompt) - 1] = prompt[:-1]
    state, _ = prefill(CFG, None, params, None, state, toks, [len(prompt) - 1])
    slot = SlotSampling.from_params([sp], 1)
    hist = TokenCounts.from_prompts(jnp.asarray([prompt]), jnp.asarray([len(prompt)]), CFG.vocab_size)
    keys = slot_keys([sp], 1, jax.random.PRNGKey(0))
    _, _, _, em = sample_steps(params, CFG, state.target, jnp.asarray(prompt[-1:], jnp.int32),
                               slot, hist, keys, jnp.asarray([tokens], jnp.int32),
                               n_steps=len(tokens))
    return logprob_dicts(*(np.asarray(x)[0] for x in em), sp.logprobs)


def assert_same(got, ref):
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        assert set(g) == set(r), (g, r)
        np.testing.assert_allclose([g[k] for k in r], list(r.values()), rtol=1e-4, atol=1e-4)


SPS = [SamplingParams(temperature=0.9, top_p=0.9, repetition_penalty=1.2, frequency_penalty=0.3,
                      presence_penalty=0.1, max_tokens=16, seed=7, logprobs=3),
       SamplingParams(max_tokens=16, logprobs=2, presence_penalty=0.5),
       SamplingParams(temperature=1.2, top_k=4, min_p=0.05, max_tokens=16, seed=1, logprobs=0)]
PROMPTS = [[3, 1, 4, 1, 5], [7, 7, 2], [0, 6, 1, 2]]


@pytest.mark.parametrize("shape", [(3, 1, 4), (3, 2, 6)], ids=["chain", "tree"])
def test_spec_logprobs_equal_plain_scoring(shape):
    params, head = models()
    runner = SpecRunner(CFG, params, head, SpecConfig(*shape), max_slots=4, max_len=64)
    res = runner.generate(PROMPTS, SPS)
    assert sum(map(sum, (r.accept_lens for r in res))) > 3   # accepted tokens are covered
    for p, sp, r in zip(PROMPTS, SPS, res):
        assert len(r.logprobs) == len(r.token_ids) == 16
        assert all(len(d) <= sp.logprobs + 1 and r.token_ids[i] in d
                   for i, d in enumerate(r.logprobs))
        assert_same(r.logprobs, plain_scores(p, r.token_ids, sp))


def test_plain_runner_logprobs_equal_plain_scoring():
    params, _ = models()
    runner = PlainRunner(CFG, params, 4, 64, decode_steps=4)
    gens = runner.generate(PROMPTS, SPS)
    for p, sp, g in zip(PROMPTS, SPS, gens):
        assert_same(g.logprobs, plain_scores(p, g.token_ids, sp))


def test_greedy_logprob_is_the_max():
    params, head = models()
    runner = SpecRunner(CFG, params, head, SpecConfig(3, 2, 6), max_slots=4, max_len=64)
    r = runner.generate([PROMPTS[1]], [SPS[1]])[0]
    for t, d in zip(r.token_ids, r.logprobs):
        assert d[t] == max(d.values())


def test_stop_strings():
    assert apply_stop_strings("hello world. bye", ["."]) == ("hello world", True)
    assert apply_stop_strings("abcabc", ["ca", "bc"]) == ("a", True)
    assert apply_stop_strings("abc", ["x"]) == ("abc", False)


def test_runner_stop_strings_cut_the_text():
    params, head = models()
    runner = SpecRunner(CFG, params, head, SpecConfig(3, 1, 4), max_slots=2, max_len=64)
    detok = lambda ids: "".join("abcdefgh"[i] for i in ids)
    full = runner.generate([PROMPTS[0]], [SamplingParams(max_tokens=12)])[0]
    text = detok(full.token_ids)
    stop = text[4:6]
    r = runner.generate([PROMPTS[0]], [SamplingParams(max_tokens=12, stop=(stop,))],
                        detokenize=detok)[0]
    assert r.finish_reason == "stop" and r.text == text[:text.find(stop)]
    assert r.token_ids == full.token_ids[:len(r.token_ids)] and stop in detok(r.token_ids)
