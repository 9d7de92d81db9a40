"""EAGLE-3 heads in the speculative cycle: the cached head equals the sequence form
(`jaxspec.train.eagle3.forward`) row by row; greedy speculative == plain greedy with a random and
with an agreeing head (chain and tree, prompts of different lengths); the drafted tree (tokens
and scores) equals a step-by-step reference built from the sequence form; public-layout
checkpoints written by `save_eagle3` load back exactly and are told apart from EAGLE-1 ones, bad
files name the tensor, and one runs through `LLM` (public layouts: test_eagle3_public.py)."""
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from draft_models import agreeing_eagle3_pair, candidate_paths as _cycle_paths
from jaxspec.config import ModelConfig
from jaxspec.kv import init_cache
from jaxspec.loading.common import WeightsError
from jaxspec.loading.eagle_ckpt import (load_draft, load_eagle3, load_eagle3_head, save_eagle3)
from jaxspec.models import eagle3, llama
from jaxspec.spec import SpecConfig, init_state, jit_cycle
from jaxspec.spec import draft as draft_lib
from jaxspec.train import eagle3 as eagle3_seq
from pallas_kernels.kv_compact import kv_compact
from reference_runner import SpecRunner, prefill

CFG = ModelConfig(arch="LlamaForCausalLM", vocab_size=331, hidden_size=64, intermediate_size=96,
                  num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16)
AUX = (0, 2, 3)
MAX_LEN = 160
PROMPTS = [[5, 17, 42, 8, 99], [3] * 11 + [250, 7], list(range(60, 80))]
NEW = 32


@functools.lru_cache(maxsize=None)
def random_pair():
    params = llama.init_random_params(CFG, jax.random.PRNGKey(0), scale=0.2)
    ids = np.sort(np.random.default_rng(1).choice(CFG.vocab_size, 200, replace=False))
    head = eagle3.init_eagle3_head(CFG, jax.random.PRNGKey(1), draft_ids=ids, aux_layers=AUX,
                                   scale=0.2)
    return params, head


@functools.lru_cache(maxsize=None)
def agreeing_pair():
    return agreeing_eagle3_pair(CFG, scale=0.02, lm_head_scale=0.5, aux_layers=AUX)


@functools.lru_cache(maxsize=None)
def position_pair():
    """The agreeing pair with the feature path switched on (a small hidden_norm, a random fc)
    and softer self-attention (q scaled down), so features and positions change the draft's
    outputs while accepts stay long enough for multi-row catch-ups."""
    params, head = agreeing_pair()
    p = head.params
    h = CFG.hidden_size
    p = dict(p, hidden_norm=0.05 * jnp.ones_like(p["hidden_norm"]),
             fc=0.05 * jax.random.normal(jax.random.PRNGKey(5), p["fc"].shape),
             layers=dict(p["layers"], wqkv=p["layers"]["wqkv"].at[0, :, :h].multiply(0.15)))
    return params, eagle3.Eagle3Head(p, head.config)


def _embed(params, head):
    return head.params.get("embed", params["embed"])


@functools.partial(jax.jit, static_argnames="cfg")
def _plain_next(params, cfg, toks, n):
    """toks [R] padded, n = live rows -> the target's argmax after row n - 1 (uncached)."""
    r = toks.shape[0]
    empty = init_cache(cfg, 1, 8, jnp.float32)
    hid, *_ = llama.forward(params, cfg, toks[None], jnp.arange(r)[None], empty.k, empty.v,
                            empty.lens, llama.causal_mask(1, r))
    return jnp.argmax(llama.lm_head(params, cfg, hid[0, n - 1]))


def plain_greedy(params, prompt, n):
    toks = np.zeros(128, np.int32)
    seq = list(prompt)
    out = []
    for _ in range(n):
        toks[:len(seq)] = seq
        t = int(_plain_next(params, CFG, jnp.asarray(toks), len(seq)))
        out.append(t)
        seq.append(t)
    return out


@functools.lru_cache(maxsize=None)
def reference_outputs(which):
    params = (random_pair() if which == "random" else agreeing_pair())[0]
    return [plain_greedy(params, p, NEW) for p in PROMPTS]


# ---------------------------------------------------------------- the cached head


@pytest.mark.parametrize("norm_before_residual,own_rope",
                         [(False, False), (True, False), (False, True)])
def test_cached_head_equals_sequence_forward(norm_before_residual, own_rope):
    """Two cached chunks (the second over the first's draft KV) == the causal sequence form (the
    one training runs), for target features (fc applied) and for the head's own output fed
    back (no fc); own_rope: a head whose RoPE is not the target's (a public head's theta and
    llama3 scaling), which both forms must take from the head."""
    from jaxspec.config import RopeScaling
    params, head = random_pair()
    rope = ({"rope_theta": CFG.rope_theta * 7,
             "rope_scaling": RopeScaling("llama3", 8.0, 1.0, 4.0, 4)} if own_rope else {})
    head = eagle3.Eagle3Head(head.params, eagle3.Eagle3Config(
        **{**head.config.as_dict(), "norm_before_residual": norm_before_residual, **rope}))
    hc = head.config
    b, t, r1 = 2, 11, 6
    keys = jax.random.split(jax.random.PRNGKey(9), 3)
    toks = jax.random.randint(keys[0], (b, t), 0, CFG.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(t)[None], (b, t)) + jnp.array([[0], [5]])
    for width in (3 * hc.hidden_size, hc.hidden_size):
        feats = jax.random.normal(keys[1], (b, t, width))
        ref_out, ref_logits = eagle3_seq.forward(head.params, hc.as_dict(), CFG,
                                                 _embed(params, head), toks, feats, pos)
        ck = jnp.zeros((1, b, hc.num_kv_heads, 32, hc.head_dim))
        cv = jnp.zeros_like(ck)
        outs = []
        for lo, hi in ((0, r1), (r1, t)):
            n = hi - lo
            base = jnp.full((b,), lo, jnp.int32)
            out, k, v = eagle3.forward(params, head, CFG, toks[:, lo:hi], feats[:, lo:hi],
                                       pos[:, lo:hi], ck, cv, base, llama.causal_mask(b, n))
            rows = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[None], (b, n))
            ck, cv = kv_compact(ck, cv, k, v, base, rows, jnp.full((b,), n, jnp.int32))
            outs.append(out)
        out = jnp.concatenate(outs, axis=1)
        np.testing.assert_allclose(out, ref_out, rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(eagle3.logits(head, out), ref_logits, rtol=2e-5, atol=2e-5)
    ids = eagle3.to_target(head, jnp.arange(hc.draft_vocab_size))
    np.testing.assert_array_equal(ids, eagle3_seq.draft_to_target(head.params["d2t"]))
    np.testing.assert_array_equal(ids, np.flatnonzero(np.asarray(head.params["t2d"])))


# ---------------------------------------------------------------- greedy spec == plain greedy


@pytest.mark.parametrize("which", ["random", "agreeing"])
@pytest.mark.parametrize("shape", [(3, 1, 4), (4, 3, 8)], ids=["chain", "tree"])
def test_greedy_spec_equals_plain_greedy(shape, which):
    params, head = random_pair() if which == "random" else agreeing_pair()
    spec = SpecConfig(*shape)
    runner = SpecRunner(CFG, params, head, spec, max_slots=3, max_len=MAX_LEN)
    res = runner.generate(PROMPTS, [NEW] * 3, eos_ids=())
    for r, ref in zip(res, reference_outputs(which)):
        assert r.token_ids == ref
        assert all(0 <= a <= spec.num_steps for a in r.accept_lens)
    mean_accept = np.mean([a for r in res for a in r.accept_lens])
    if which == "agreeing":
        assert mean_accept >= 0.7 * spec.num_steps, mean_accept
    # drafted tokens are target ids of the draft vocabulary only
    assert np.asarray(runner.state.seed.tokens).max() < CFG.vocab_size


def test_eagle3_head_checks():
    from jaxspec.config import ConfigError
    from jaxspec.engine import SpecBackend
    params, head = random_pair()
    with pytest.raises(ConfigError, match="draft vocabulary size 200"):
        SpecBackend(CFG, params, head, SpecConfig(2, 201, 4), 1, 32)
    bad = eagle3.Eagle3Head(head.params, eagle3.Eagle3Config(
        **{**head.config.as_dict(), "aux_layers": (0, 2, 4)}))
    with pytest.raises(ConfigError, match=r"reads target layers \[0, 2, 4\]"):
        SpecBackend(CFG, params, bad, "chain", 1, 32)


# ---------------------------------------------------------------- drafted tree vs reference


_REF_ROWS = 64


@functools.partial(jax.jit, static_argnames="cfg")
def _target_aux(params, cfg, toks):
    """toks [_REF_ROWS] -> the three captured target layers concatenated [_REF_ROWS, 3H]."""
    empty = init_cache(cfg, 1, 8, jnp.float32)
    _, _, _, cap = llama.forward(params, cfg, toks[None], jnp.arange(_REF_ROWS)[None], empty.k,
                                 empty.v, empty.lens, llama.causal_mask(1, _REF_ROWS), AUX)
    return jnp.concatenate(list(cap[:, 0]), axis=-1)


@functools.partial(jax.jit, static_argnames="hc")
def _seq_rows(head_params, hc, embed, feats, toks, pos):
    """The sequence form over rows (feats [R, H]: fc already applied, or a head output)."""
    return eagle3_seq.forward(head_params, hc.as_dict(), CFG, embed, toks[None], feats[None],
                              pos[None])


def _pad(x, n=_REF_ROWS):
    x = jnp.asarray(x)
    return jnp.concatenate([x, jnp.zeros((n - x.shape[0],) + x.shape[1:], x.dtype)])


def _reference_tree(params, head, seq, root, spec, tree_pos_offset=0):
    """Step by step with the sequence form, no cache: committed rows (fc(f_t), x_{t+1}) at
    position t (x_L = root); a depth-d node's row is (the head output of its parent's row, its
    token) at L + d - 1, after its ancestors' rows only (tree_pos_offset shifts the tree rows).
    Children: top-k of the draft's log-softmax over its vocabulary, mapped to target ids.
    Returns {token path: cumulative log-prob}."""
    n = len(seq)
    aux = _target_aux(params, CFG, _pad(jnp.asarray(seq, jnp.int32)))[:n]
    h0 = aux @ head.params["fc"]
    base_t = list(seq[1:]) + [root]
    embed = _embed(params, head)
    ids = eagle3_seq.draft_to_target(head.params["d2t"])

    def row(extra_f, extra_t):
        f = jnp.concatenate([h0] + [x[None] for x in extra_f], 0)
        t = jnp.asarray(base_t + list(extra_t), jnp.int32)
        r = t.shape[0]
        pos = np.arange(_REF_ROWS)
        pos[n:] += tree_pos_offset
        out, logits = _seq_rows(head.params, head.config, embed, _pad(f), _pad(t),
                                jnp.asarray(pos))
        return out[0, r - 1], logits[0, r - 1]

    def children(path, score, rows_f, rows_t):
        h, lg = row(rows_f, rows_t)
        logp = np.asarray(jax.nn.log_softmax(lg))
        top = np.argsort(-logp, kind="stable")[:spec.topk]
        return [(path + (int(ids[d]),), score + float(logp[d]), rows_f + [h],
                 rows_t + [int(ids[d])]) for d in top]

    out = {}
    frontier = children((), 0.0, [], [])
    out.update({c[0]: c[1] for c in frontier})
    for _ in range(1, spec.num_steps):
        kids = [k for fr in frontier for k in children(*fr)]
        out.update({c[0]: c[1] for c in kids})
        order = np.argsort(-np.array([c[1] for c in kids]), kind="stable")[:spec.topk]
        frontier = [kids[j] for j in order]
    return out


@pytest.mark.parametrize("shape", [(3, 3, 8), (4, 1, 5)], ids=["tree", "chain"])
def test_drafted_tree_matches_step_by_step_reference(shape):
    spec = SpecConfig(*shape)
    params, head = position_pair()
    prompts = [PROMPTS[0], PROMPTS[2]]
    b, p = 2, 32
    toks = np.zeros((b, p), np.int32)
    lens = np.array([len(x) for x in prompts], np.int32)
    for j, x in enumerate(prompts):
        toks[j, :len(x)] = x
    state = init_state(CFG, spec, b, 96, jnp.float32, head)
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
            ref = _reference_tree(params, head, seqs[j], roots[j], spec)
            assert set(got) == set(ref), (rnd, j)
            if spec.topk > 1:
                np.testing.assert_allclose([got[k] for k in ref], list(ref.values()),
                                           rtol=1e-4, atol=1e-4)
            if spec.topk > 1 and rnd == 0:
                bad = _reference_tree(params, head, seqs[j], roots[j], spec, tree_pos_offset=1)
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


# ---------------------------------------------------------------- checkpoints


def public_state_dict(head):
    from jaxspec.loading.eagle_ckpt import eagle3_state_dict
    return eagle3_state_dict(head)


def test_public_checkpoint_round_trip_and_detection(tmp_path):
    from safetensors.numpy import save_file

    params, head = agreeing_pair()
    path = save_eagle3(tmp_path / "h", head, CFG, dtype="float32")
    back = load_draft(path, CFG)
    assert isinstance(back, eagle3.Eagle3Head) and back.config == head.config
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(head)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # also through load_eagle3 (the params dict + head config)
    p, hc = load_eagle3(path, CFG)
    assert hc["draft_vocab_size"] == head.config.draft_vocab_size
    # no config.json: told by the tensor names, and refused (RoPE, norm epsilon and target
    # layers are not in the tensors)
    sd = public_state_dict(random_pair()[1])
    save_file(sd, str(tmp_path / "bare.safetensors"))
    with pytest.raises(WeightsError, match="bare.safetensors: an EAGLE-3 head needs its "
                                           "config.json beside it"):
        load_draft(tmp_path / "bare.safetensors", CFG)


@pytest.mark.parametrize("name,value,match", [
    ("midlayer.self_attn.k_proj.weight", np.zeros((64, 64), np.float32),
     "'midlayer.self_attn.k_proj.weight' has shape"),
    ("d2t", np.zeros(3, np.int64), "'d2t' has shape"),
    ("midlayer.hidden_norm.weight", None, "missing tensor 'midlayer.hidden_norm.weight'"),
])
def test_bad_eagle3_file_names_the_tensor(tmp_path, name, value, match):
    _, head = agreeing_pair()
    path = save_eagle3(tmp_path / "h", head, CFG, dtype="float32")
    from safetensors.numpy import load_file, save_file
    sd = dict(load_file(str(path / "model.safetensors")))
    if value is None:
        del sd[name]
    else:
        sd[name] = value
    save_file(sd, str(path / "model.safetensors"))
    with pytest.raises(WeightsError, match=match):
        load_draft(path, CFG)


def test_config_names_the_target_layers(tmp_path):
    _, head = random_pair()
    path = save_eagle3(tmp_path / "h", head, CFG, dtype="float32")
    cfg_json = json.loads((path / "config.json").read_text())
    assert cfg_json["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(AUX)
    cfg_json["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 2, 9]
    (path / "config.json").write_text(json.dumps(cfg_json))
    with pytest.raises(WeightsError, match=r"eagle_aux_hidden_state_layer_ids=\[1, 2, 9\]"):
        load_eagle3_head(path, CFG)


@pytest.mark.real_weights
def test_llm_runs_a_public_eagle3_checkpoint(smollm2_gguf, tmp_path):
    """A public-layout EAGLE-3 head for SmolLM2 (random weights, a 4096-token draft vocabulary)
    through LLM(draft=dir): greedy output equals plain greedy."""
    from jaxspec import LLM, SamplingParams
    from safetensors.numpy import save_file

    plain = LLM(str(smollm2_gguf), dtype=jnp.float32, max_batch=2, max_model_len=128)
    cfg = plain.config
    head = eagle3.init_eagle3_head(cfg, jax.random.PRNGKey(3), draft_ids=np.arange(0, 49152, 12),
                                   scale=0.05)
    sd = public_state_dict(head)
    d = tmp_path / "eagle3-smollm2"
    d.mkdir()
    save_file({"model." + k if k.startswith("midlayer") else k: v for k, v in sd.items()},
              str(d / "model.safetensors"))
    from jaxspec.loading.eagle_ckpt import eagle3_config_json
    conf = eagle3_config_json(head, cfg)
    del conf["eagle_config"]               # SpecForge's default layers: 1, 14, 26
    (d / "config.json").write_text(json.dumps(conf))
    spec_llm = LLM(str(smollm2_gguf), dtype=jnp.float32, max_batch=2, max_model_len=128,
                   draft=str(d), spec=SpecConfig(3, 2, 5))
    assert spec_llm.engine.backend.draft_params.config.aux_layers == (1, 14, 26)
    prompts = [[{"role": "user", "content": "Name three colors."}], "The sky is"]
    sp = SamplingParams(max_tokens=16)
    for a, b in zip(plain.generate(prompts, sp), spec_llm.generate(prompts, sp)):
        assert b.token_ids == a.token_ids
        assert b.accept_lens


# ---------------------------------------------------------------- lossless sampling


def test_sampling_with_a_reduced_draft_vocabulary_is_lossless(monkeypatch):
    """Tree speculative sampling reads no draft probabilities (verify.sample_accept), so a token
    outside the draft vocabulary (draft probability 0) is still emitted with the target's
    probability, through the residual or the bonus: the joint of the first three tokens equals
    plain sampling's (test_spec_sampling's G-test, its target, a 5-of-8 draft vocabulary)."""
    import test_spec_sampling as ts

    params, _ = ts.models()
    ids = np.array([0, 2, 3, 5, 6])
    head = eagle3.init_eagle3_head(ts.CFG, jax.random.PRNGKey(8), draft_ids=ids,
                                   aux_layers=(0, 0, 0), scale=0.5)
    monkeypatch.setattr(ts, "models", lambda: (params, head))
    samples, mean_accept = ts.spec_draws(ts.SPECS["tree"], draws=20_000)
    g, df, thr, impossible = ts.g_test(samples, ts.exact_joint())
    assert 0.1 < mean_accept, mean_accept
    assert np.isin(samples, ids, invert=True).mean() > 0.05   # out-of-vocabulary tokens emitted
    assert impossible == 0
    assert g < thr, f"G={g:.1f} > {thr:.1f} (df={df})"
