"""Lossless tree speculative sampling: the joint distribution of the first three emitted tokens
equals plain sampling's exact distribution (enumerated over a small vocabulary), for a chain and a
tree, with temperature, top-p and all three penalties; a deliberately wrong sampler is rejected
by the same test; greedy rows of a mixed batch stay exact.

The statistical test: N draws (one per slot, each slot with its own seed) give a histogram over
the V^3 sequences; the G statistic 2 * sum O ln(O / E) against the exact expectations E (cells
with E < 5 pooled) is compared with the chi-square quantile at p = 1e-3 for its degrees of
freedom. A correct sampler fails with probability 1e-3; the wrong sampler must exceed the
threshold by far, which shows the test has the power to see a biased sampler.
"""
import dataclasses
import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from draft_models import agreeing_pair as _agreeing_pair
from jaxspec.config import ModelConfig
from jaxspec.kv import init_cache
from jaxspec.models import llama
from jaxspec.sampling import SamplingParams
from jaxspec.spec import SpecConfig, init_state, jit_cycle
from jaxspec.spec import verify
from reference_runner import PlainRunner, SpecRunner, prefill

V = 8
CFG = ModelConfig(arch="LlamaForCausalLM", vocab_size=V, hidden_size=32, intermediate_size=48,
                  num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)
PROMPT = [3, 1, 4, 1, 5]
SP = SamplingParams(temperature=1.0, top_p=0.92, repetition_penalty=1.3, frequency_penalty=0.4,
                    presence_penalty=0.2, max_tokens=3)
cycle_lib = importlib.import_module("jaxspec.spec.cycle")  # the module (the package exports the function)

DRAWS = 40_000
BATCH = 4_000
P_VALUE = 1e-3
SPECS = {"chain": SpecConfig(3, 1, 4), "tree": SpecConfig(3, 2, 6)}


@functools.lru_cache(maxsize=None)
def models():
    """A target whose next token depends mostly on the current one (large embeddings, small
    layers) and a head that passes the token embedding to the lm_head: the draft often proposes
    likely tokens, so cycles both accept and reject."""
    return _agreeing_pair(CFG, scale=0.05, lm_head_scale=0.3)


# ---------------------------------------------------------------- exact plain distribution


def np_penalized(logits, prompt, out, sp):
    x = np.array(logits, np.float64)
    counts = np.bincount(np.asarray(out, np.int64), minlength=V)
    for t in set(prompt) | set(out):
        x[t] = x[t] / sp.repetition_penalty if x[t] > 0 else x[t] * sp.repetition_penalty
    return x - counts * sp.frequency_penalty - (counts > 0) * sp.presence_penalty


def np_processed(logits, sp):
    """temperature then top-p (top-k and min-p are off in SP), in float64."""
    z = logits / sp.temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    cum = np.cumsum(p[order])
    n = max(int(np.sum(cum - p[order] < sp.top_p)), 1)
    # the test must not hinge on float rounding at the top-p boundary
    assert np.min(np.abs(cum - sp.top_p)) > 1e-4
    q = np.zeros_like(p)
    q[order[:n]] = p[order[:n]]
    return q / q.sum()


@functools.lru_cache(maxsize=None)
def exact_joint():
    """[V, V, V]: P(t1, t2, t3) under plain sampling, from full uncached forwards of
    prompt + (t1, t2) for every pair."""
    params, _ = models()
    pairs = np.array([(a, b) for a in range(V) for b in range(V)], np.int32)
    seqs = np.concatenate([np.tile(PROMPT, (len(pairs), 1)), pairs], 1).astype(np.int32)
    n, s = seqs.shape
    empty = init_cache(CFG, n, 8, jnp.float32)
    hid, *_ = llama.forward(params, CFG, jnp.asarray(seqs), jnp.broadcast_to(jnp.arange(s), (n, s)),
                            empty.k, empty.v, empty.lens, llama.causal_mask(n, s))
    logits = np.asarray(llama.lm_head(params, CFG, hid), np.float64)       # [V*V, s, V]
    p = len(PROMPT)
    joint = np.zeros((V, V, V))
    q1 = np_processed(np_penalized(logits[0, p - 1], PROMPT, [], SP), SP)
    for i, (a, b) in enumerate(pairs):
        q2 = np_processed(np_penalized(logits[i, p], PROMPT, [a], SP), SP)
        q3 = np_processed(np_penalized(logits[i, p + 1], PROMPT, [a, b], SP), SP)
        joint[a, b] = q1[a] * q2[b] * q3
    return joint


# ---------------------------------------------------------------- speculative draws


def spec_draws(spec: SpecConfig, cycle_fn=None, draws: int = DRAWS, batch: int = BATCH):
    """[draws, 3] first three emitted tokens, one slot per draw (seed = draw index), and the
    mean accept length of the first cycle. One executable, called draws / batch times."""
    params, head = models()
    cycle_fn = cycle_fn or jit_cycle(CFG, spec)
    toks = jnp.asarray(np.tile(PROMPT + [0] * 3, (batch, 1)), jnp.int32)
    lens = jnp.full((batch,), len(PROMPT), jnp.int32)
    active = jnp.ones((batch,), bool)
    outs, accepts = [], []
    for start in range(0, draws, batch):
        sps = [dataclasses.replace(SP, seed=start + i) for i in range(batch)]
        state = init_state(CFG, spec, batch, 32, jnp.float32)
        state, root = prefill(CFG, spec, params, head, state, toks, lens, sampling=sps)
        state, c1 = cycle_fn(params, head, state, active)
        state, c2 = cycle_fn(params, head, state, active)
        root, t1, a1, t2 = (np.asarray(x) for x in (root, c1.tokens, c1.accept_len, c2.tokens))
        outs.append(np.stack([root, t1[:, 0], np.where(a1 >= 1, t1[:, 1], t2[:, 0])], 1))
        accepts.append(a1)
    return np.concatenate(outs), float(np.concatenate(accepts).mean())


def g_test(samples, joint):
    """-> (G, df, threshold, observed count in zero-probability cells)."""
    n = len(samples)
    obs = np.bincount(samples[:, 0] * V * V + samples[:, 1] * V + samples[:, 2],
                      minlength=V ** 3).astype(np.float64)
    exp = joint.reshape(-1) * n
    impossible = float(obs[exp == 0].sum())
    big = exp >= 5
    o = np.append(obs[big], obs[~big & (exp > 0)].sum())
    e = np.append(exp[big], exp[~big & (exp > 0)].sum())
    keep = e > 0
    o, e = o[keep], e[keep]
    g = 2.0 * float(np.sum(np.where(o > 0, o * np.log(np.maximum(o, 1) / e), 0.0)))
    df = len(o) - 1
    return g, df, float(stats.chi2.ppf(1 - P_VALUE, df)), impossible


def test_exact_joint_is_a_distribution():
    j = exact_joint()
    assert abs(j.sum() - 1) < 1e-9
    # top-p and the penalties matter: some sequences are impossible, many are not
    assert 0 < np.sum(j == 0) < j.size - 50


@pytest.mark.parametrize("name", ["chain", "tree"])
def test_spec_sampling_joint_equals_plain(name):
    samples, mean_accept = spec_draws(SPECS[name])
    g, df, thr, impossible = g_test(samples, exact_joint())
    print(f"{name}: G={g:.1f} df={df} threshold(p={P_VALUE})={thr:.1f} "
          f"mean accept (cycle 1)={mean_accept:.2f}")
    # both branches of the walk are exercised: drafts get accepted and rejected
    assert 0.2 < mean_accept < SPECS[name].num_steps - 0.2, mean_accept
    assert impossible == 0, "emitted a sequence the processed target gives probability 0"
    assert g < thr, f"G={g:.1f} > {thr:.1f} (df={df}, p={P_VALUE})"


def _no_residual_accept(tree, logq, coins, bonus_keys, num_steps):
    """WRONG on purpose: the walk of `sample_accept`, but the bonus drawn from the stopping node's
    full distribution q_c instead of the residual (the rejected children are not removed)."""
    acc = verify.sample_accept(tree, logq, coins, bonus_keys, num_steps)
    cur = jnp.take_along_axis(acc.path, acc.accept_len[:, None], axis=1)
    lq = jnp.take_along_axis(logq, cur[:, :, None], axis=1)[:, 0]
    bonus = jax.vmap(jax.random.categorical)(bonus_keys, lq).astype(jnp.int32)
    return verify.Accept(acc.accept_len, acc.path, bonus)


@pytest.mark.parametrize("name", ["tree"])
def test_the_g_test_rejects_a_sampler_without_residual(name, monkeypatch):
    spec = SPECS[name]
    monkeypatch.setattr(cycle_lib, "sample_accept", _no_residual_accept)
    wrong = jax.jit(functools.partial(cycle_lib.cycle, cfg=CFG, spec=spec), donate_argnums=(2,))
    samples, _ = spec_draws(spec, wrong, draws=DRAWS // 2)
    g, df, thr, _ = g_test(samples, exact_joint())
    print(f"{name}, no residual: G={g:.1f} df={df} threshold(p={P_VALUE})={thr:.1f}")
    assert g > 3 * thr, (g, thr)


# ---------------------------------------------------------------- mixed batch


def test_mixed_batch_keeps_greedy_rows_exact():
    params, head = models()
    spec = SPECS["tree"]
    prompts = [PROMPT, [7, 7, 2], [0, 6, 1, 2], PROMPT]
    greedy = SamplingParams(max_tokens=20, ignore_eos=True)
    greedy_pen = SamplingParams(max_tokens=20, repetition_penalty=1.5, frequency_penalty=0.3,
                                presence_penalty=0.5)
    sampled = SamplingParams(temperature=1.0, top_p=0.95, frequency_penalty=0.5, max_tokens=20,
                             seed=3)
    mixed = [greedy, sampled, greedy_pen, sampled]
    runner = SpecRunner(CFG, params, head, spec, max_slots=4, max_len=64)
    res = runner.generate(prompts, mixed)
    plain = PlainRunner(CFG, params, 4, 64, decode_steps=4)
    ref = plain.generate(prompts, [greedy, greedy, greedy_pen, greedy])
    assert res[0].token_ids == ref[0].token_ids
    assert res[2].token_ids == ref[2].token_ids   # penalties on every tree row, greedy
    assert ref[2].token_ids != plain.generate([prompts[2]], [greedy])[0].token_ids
    assert all(len(r.token_ids) == 20 for r in res)
    # another batch, parameters moved to other slots: no recompilation, greedy still exact,
    # and the seeded request draws the same stream from another slot
    compiled = runner._cycle._cache_size()
    res2 = runner.generate([prompts[1], prompts[0], prompts[2], prompts[3]],
                           [sampled, greedy, greedy_pen, sampled])
    assert res2[0].token_ids == res[1].token_ids
    assert res2[1].token_ids == ref[0].token_ids
    assert runner._cycle._cache_size() == compiled
