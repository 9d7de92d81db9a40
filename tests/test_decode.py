"""Cached decoding equals a full forward; chunked prefill (the admission program, two chunks)
equals one-shot prefill; plain greedy."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.config import ConfigError, ModelConfig, RopeScaling
from jaxspec.decode import decode_steps, init_plain_state
from jaxspec.engine.admission import AdmitArgs, jit_admissions
from jaxspec.kv import init_cache
from jaxspec.models import llama
from jaxspec.sampling import FULL, SamplingParams, SlotSampling, flat_params
from reference_runner import PlainRunner, prefill

CFG = ModelConfig(arch="LlamaForCausalLM", vocab_size=97, hidden_size=64, intermediate_size=96,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                  rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 64))


@pytest.fixture(scope="module")
def params():
    return llama.init_random_params(CFG, jax.random.PRNGKey(0), scale=0.2)


REF_LEN = 32


@jax.jit
def _full_logits_padded(params, tokens):
    cache = init_cache(CFG, 1, 8, jnp.float32)
    pos = jnp.arange(REF_LEN, dtype=jnp.int32)[None]
    h, *_ = llama.forward(params, CFG, tokens, pos, cache.k, cache.v, cache.lens,
                          llama.causal_mask(1, REF_LEN))
    return llama.lm_head(params, CFG, h)[0]


def full_logits(params, tokens):
    """No-cache reference: one causal forward over the whole sequence [1, S], S <= REF_LEN.

    Padded to one length so it compiles once; causal masking keeps rows < S independent of
    the padding."""
    s = tokens.shape[1]
    padded = jnp.zeros((1, REF_LEN), jnp.int32).at[:, :s].set(tokens)
    return _full_logits_padded(params, padded)[:s]


def test_cached_decode_equals_full_forward(params):
    toks = jax.random.randint(jax.random.PRNGKey(1), (1, 20), 0, CFG.vocab_size)
    ref = full_logits(params, toks)
    state = init_plain_state(CFG, 1, 64, jnp.float32)
    state, root = prefill(CFG, None, params, None, state, np.asarray(toks[:, :12]), [12])
    assert int(root[0]) == int(jnp.argmax(ref[11]))
    cache = state.target
    for t in range(12, 20):
        h, k, v, _ = llama.forward(params, CFG, toks[:, t:t + 1], cache.lens[:, None], cache.k,
                                   cache.v, cache.lens, jnp.ones((1, 1, 1), bool))
        np.testing.assert_allclose(llama.lm_head(params, CFG, h)[0, 0], ref[t], rtol=2e-4, atol=2e-4)
        from jaxspec.decode import _append
        cache = _append(cache, k, v, jnp.ones((1,), jnp.int32))
    assert int(cache.lens[0]) == 20


def _admit_chunks(params, toks, n_valid, cuts):
    """The plain admission program ("chunk" form) over a fresh 2-slot state, the prompts cut
    at columns `cuts`: -> (state, Emitted [2] of the last chunk). Every request asks for
    logprobs, so the last chunk's first token comes with its log-probabilities."""
    admit = jit_admissions(CFG, None, 2, 64, jnp.float32)[0][FULL, "chunk"]
    f, i = flat_params(SamplingParams(logprobs=5))
    adm = jax.tree_util.tree_map(jnp.asarray, AdmitArgs.host(
        2, n_prompt=n_valid, samp_f=np.tile(f, (2, 1)).astype(np.float32),
        samp_i=np.tile(i, (2, 1)).astype(np.int32)))
    state = init_plain_state(CFG, 2, 64, jnp.float32)
    edges = [0] + list(cuts) + [toks.shape[1]]
    for lo, hi in zip(edges, edges[1:]):
        chunk = np.zeros((2, 32), np.int32)    # one width: one program for every chunk
        chunk[:, :hi - lo] = toks[:, lo:hi]
        n = np.clip(n_valid - lo, 0, hi - lo).astype(np.int32)
        nxt = np.where(n_valid > hi, toks[:, min(hi, toks.shape[1] - 1)], -1).astype(np.int32)
        state, first = admit(params, None, state, jnp.arange(2, dtype=jnp.int32),
                             jnp.asarray(chunk), jnp.full(2, lo, jnp.int32), jnp.asarray(n),
                             jnp.asarray(nxt), adm, jnp.zeros(2, jnp.uint32))
    return state, first


def test_chunked_prefill_equals_one_shot(params):
    toks = np.asarray(jax.random.randint(jax.random.PRNGKey(2), (2, 24), 0, CFG.vocab_size))
    n_valid = np.array([24, 17], np.int32)
    one, e1 = _admit_chunks(params, toks, n_valid, ())
    two, e2 = _admit_chunks(params, toks, n_valid, (8,))
    np.testing.assert_array_equal(one.target.lens, n_valid)
    np.testing.assert_array_equal(one.target.lens, two.target.lens)
    # the first token and its log-probabilities, from the last prompt row's hidden state
    np.testing.assert_array_equal(e1.tokens, e2.tokens)
    np.testing.assert_array_equal(e1.top_ids, e2.top_ids)
    np.testing.assert_allclose(e1.top_logprobs, e2.top_logprobs, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(e1.logprob, e2.logprob, rtol=1e-4, atol=1e-4)
    # the slot state past the KV: root, keys, prompt tokens seen and output counts
    for a, b in zip(jax.tree_util.tree_leaves((one.root, one.rng, one.history)),
                    jax.tree_util.tree_leaves((two.root, two.rng, two.history))):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(one.root, e1.tokens)
    for b in range(2):
        n = n_valid[b]
        np.testing.assert_allclose(one.target.k[:, b, :, :n], two.target.k[:, b, :, :n],
                                   rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(one.target.v[:, b, :, :n], two.target.v[:, b, :, :n],
                                   rtol=1e-4, atol=1e-5)
        # rows past a slot's length stay untouched (zeros from init)
        assert not np.any(np.asarray(two.target.k[:, b, :, n:]))


def test_plain_runner_greedy_matches_full_forward_loop(params):
    prompts = [[5, 9, 2, 44, 7], [1, 2, 3], [60, 61, 62, 63, 64, 65, 66, 67, 68]]
    runner = PlainRunner(CFG, params, 4, 64, decode_steps=4)
    sps = [SamplingParams(max_tokens=10)] * 3
    gens = runner.generate(prompts, sps)
    for p, g in zip(prompts, gens):
        seq = list(p)
        for _ in range(10):
            seq.append(int(jnp.argmax(full_logits(params, jnp.asarray([seq]))[-1])))
        assert g.token_ids == seq[len(p):]
        assert g.finish_reason == "length"


def test_decode_does_not_recompile(params):
    cache = init_cache(CFG, 2, 64, jnp.float32)
    sp = SlotSampling.from_params([SamplingParams()], 2)
    tok = jnp.zeros((2,), jnp.int32)
    key = jax.random.PRNGKey(0)
    cache, out, key = decode_steps(params, CFG, cache, tok, sp, key, 2)
    before = decode_steps._cache_size()
    sp2 = SlotSampling.from_params([SamplingParams(temperature=0.7, top_p=0.9)], 2)
    cache, out, key = decode_steps(params, CFG, cache, out[:, -1], sp2, key, 2)
    assert decode_steps._cache_size() == before


def test_unrolled_layers_equal_scan(params):
    toks = jax.random.randint(jax.random.PRNGKey(7), (2, 6), 0, CFG.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (2, 6))
    cache = init_cache(CFG, 2, 16, jnp.float32)
    args = (toks, pos, cache.k, cache.v, cache.lens, llama.causal_mask(2, 6))
    ref = llama.forward(params, CFG, *args, capture_layers=(0, 1))
    for p, cfg in [(params, CFG.with_layout(unroll_layers=True)),
                   (llama.unstack_layers(params), CFG), (params, CFG.for_prefill(2))]:
        got = llama.forward(p, cfg, *args, capture_layers=(0, 1))
        for a, b in zip(ref, got):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=3e-5)  # fp32, other fusion order


def test_prefill_unroll_setting(monkeypatch):
    assert CFG.for_prefill().layout.scan_unroll == 1 and not CFG.for_prefill().layout.unroll_layers
    monkeypatch.setenv("JAXSPEC_PREFILL_UNROLL", "5")
    assert CFG.for_prefill().layout.scan_unroll == 5 and CFG.for_prefill(3).layout.scan_unroll == 3
    with pytest.raises(ConfigError, match="unroll"):
        CFG.for_prefill(0)


def _stacked_weight_slices(jaxpr, shapes):
    """Slices, inside jaxpr and its sub-jaxprs, of arrays shaped like a stacked layer weight."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("slice", "dynamic_slice", "squeeze", "gather") and \
                tuple(eqn.invars[0].aval.shape) in shapes:
            found.append(eqn.primitive.name)
        for v in eqn.params.values():
            inner = getattr(v, "jaxpr", None)
            if inner is not None:
                found += _stacked_weight_slices(getattr(inner, "jaxpr", inner), shapes)
    return found


def test_multi_step_decode_slices_weights_outside_the_loop(params, monkeypatch):
    """With the unrolled layout a multi-step decode must not slice the stacked weights inside
    its loop body (XLA copies such slices out every iteration on the GPU); greedy tokens equal
    the scan layout's."""
    import jaxspec.decode as decode_mod
    ucfg = CFG.with_layout(unroll_layers=True)
    shapes = {tuple(a.shape) for a in jax.tree_util.tree_leaves(params["layers"])}
    sp = SlotSampling.from_params([SamplingParams()] * 2, 2)
    toks = jnp.array([3, 5], jnp.int32)
    cache = init_cache(CFG, 2, 16, jnp.float32)

    def slices_in_loop():
        fresh = lambda *a: decode_steps.__wrapped__(*a)   # noqa: E731  (no cached trace)
        jaxpr = jax.make_jaxpr(fresh, static_argnums=(1, 6))(
            params, ucfg, cache, toks, sp, jax.random.PRNGKey(0), 4)
        loop = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
        assert len(loop) == 1
        return _stacked_weight_slices(loop[0].params["jaxpr"].jaxpr, shapes)

    assert slices_in_loop() == []
    with monkeypatch.context() as m:     # control: without the hoisting the check sees them
        m.setattr(decode_mod, "loop_params", lambda p, cfg, n: p)
        assert slices_in_loop()
    outs = [np.asarray(decode_steps(params, cfg, init_cache(CFG, 2, 16, jnp.float32), toks, sp,
                                    jax.random.PRNGKey(0), 4)[1]) for cfg in (CFG, ucfg)]
    np.testing.assert_array_equal(outs[0], outs[1])
