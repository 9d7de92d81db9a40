"""EAGLE-1 head training: the training forward equals the inference draft forward (alignment),
a few steps lower the loss, a resumed run equals an uninterrupted one, head files round-trip
exactly, and the data helpers (truncated ShareGPT JSON, packing, ragged .npz)."""
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.config import ModelConfig
from jaxspec.kv import init_cache
from jaxspec.loading.common import WeightsError
from jaxspec.loading.eagle_ckpt import load_head, read_head_meta, save_head
from jaxspec.models import eagle, llama
from jaxspec.train import data
from jaxspec.train.loop import Batches, TrainConfig, init_head, train
from jaxspec.train.loss import draft_forward, draft_forward_ttt, eagle1_loss, target_features

CFG = ModelConfig(arch="LlamaForCausalLM", vocab_size=67, hidden_size=32, intermediate_size=48,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
T = 24


@functools.lru_cache(maxsize=None)
def target():
    return llama.init_random_params(CFG, jax.random.PRNGKey(0), scale=0.3)


def corpus(n=32, seed=0):
    """Sequences from a simple Markov chain, so a head can learn them."""
    rng = np.random.default_rng(seed)
    nxt = rng.integers(0, CFG.vocab_size, size=CFG.vocab_size)
    toks = np.zeros((n, T), np.int32)
    toks[:, 0] = rng.integers(0, CFG.vocab_size, n)
    for t in range(1, T):
        flip = rng.random(n) < 0.1
        toks[:, t] = np.where(flip, rng.integers(0, CFG.vocab_size, n), nxt[toks[:, t - 1]])
    mask = np.zeros((n, T), np.uint8)
    mask[:, 6:] = 1
    return toks, mask


def test_training_forward_matches_inference_draft():
    """Row t of the training forward = the inference head on (f_t, x_{t+1}) at position t."""
    params = target()
    head = eagle.init_eagle_params(CFG, jax.random.PRNGKey(3), scale=0.2)
    toks = jnp.asarray(corpus(2)[0])
    feats = target_features(params, CFG, toks)
    ref_feats = llama.final_norm(params, CFG, llama.forward(
        params, CFG, toks, jnp.broadcast_to(jnp.arange(T)[None], (2, T)),
        *_empty_cache(2), jnp.zeros((2,), jnp.int32), llama.causal_mask(2, T))[0])
    np.testing.assert_allclose(feats, ref_feats, rtol=1e-6, atol=1e-6)
    train_out = draft_forward(params, head, CFG, toks, feats)               # [2, T-1, H]
    n = T - 1
    pos = jnp.broadcast_to(jnp.arange(n)[None], (2, n))
    k, v = _empty_cache(2, layers=1)
    inf_out, _, _ = eagle.forward(params, head, CFG, toks[:, 1:], feats[:, :-1], pos, k, v,
                                  jnp.zeros((2,), jnp.int32), llama.causal_mask(2, n))
    np.testing.assert_allclose(train_out, inf_out, rtol=2e-5, atol=2e-5)


def test_multi_step_passes_match_chained_inference_drafts():
    """Pass k's row t of the training-time test = the k-th chained draft step at position t:
    the head over the committed true-feature rows < t - k + 1 plus its chain of own predictions."""
    params = target()
    head = eagle.init_eagle_params(CFG, jax.random.PRNGKey(4), scale=0.2)
    toks = jnp.asarray(corpus(2)[0])
    feats = target_features(params, CFG, toks)
    preds = draft_forward_ttt(params, head, CFG, toks, feats, 3)            # [3, 2, T-1, H]
    np.testing.assert_allclose(preds[0], draft_forward(params, head, CFG, toks, feats),
                               rtol=1e-5, atol=1e-5)
    k_cache, v_cache = _empty_cache(2, layers=1)
    zeros = jnp.zeros((2,), jnp.int32)
    for t in (5, T - 2):
        # Committed draft KV: true-feature rows 0..t-3 (pass 0).
        c = t - 2
        pos = jnp.broadcast_to(jnp.arange(c)[None], (2, c))
        _, k0, v0 = eagle.forward(params, head, CFG, toks[:, 1:c + 1], feats[:, :c], pos,
                                  k_cache, v_cache, zeros, llama.causal_mask(2, c))
        kc = k_cache.at[:, :, :, :c].set(k0)
        vc = v_cache.at[:, :, :, :c].set(v0)
        # Chain: (x_{t-1}, f_{t-2}) true, then (x_t, pred of f_{t-1}), (x_{t+1}, pred of f_t).
        lens = jnp.full((2,), c, jnp.int32)
        h1, _, _ = eagle.forward(params, head, CFG, toks[:, t - 1:t], feats[:, t - 2:t - 1],
                                 lens[:, None], kc, vc, lens, jnp.ones((2, 1, 1), bool))
        f1 = h1[:, 0]                                                       # f_{t-1} predicted
        np.testing.assert_allclose(f1, preds[0][:, t - 2], rtol=1e-4, atol=2e-4)
        # Step 2 sees the committed rows, which by now include the true row c (f_{t-2}, x_{t-1}).
        _, k1, v1 = eagle.forward(params, head, CFG, toks[:, t - 1:t], feats[:, t - 2:t - 1],
                                  lens[:, None], kc, vc, lens, jnp.ones((2, 1, 1), bool))
        kc2 = kc.at[:, :, :, c:c + 1].set(k1)
        vc2 = vc.at[:, :, :, c:c + 1].set(v1)
        lens2 = lens + 1
        h2, _, _ = eagle.forward(params, head, CFG, toks[:, t:t + 1], f1[:, None],
                                 lens2[:, None], kc2, vc2, lens2, jnp.ones((2, 1, 1), bool))
        np.testing.assert_allclose(h2[:, 0], preds[1][:, t - 1], rtol=1e-4, atol=2e-4)
        # Step 3: the step-2 row and its own row as new keys, tree (chain) mask.
        f2 = h2[:, 0]
        h3, _, _ = eagle.forward(params, head, CFG, toks[:, t:t + 2],
                                 jnp.stack([f1, f2], axis=1), lens2[:, None] + jnp.arange(2)[None],
                                 kc2, vc2, lens2, llama.causal_mask(2, 2))
        np.testing.assert_allclose(h3[:, 1], preds[2][:, t], rtol=1e-4, atol=2e-4)


def _empty_cache(b, layers=None):
    c = init_cache(CFG, b, 64, jnp.float32)
    if layers is not None:
        return c.k[:layers], c.v[:layers]
    return c.k, c.v


def test_loss_weights_and_mask():
    params = target()
    toks, mask = corpus(4)
    toks = jnp.asarray(toks)
    feats = target_features(params, CFG, toks)
    head = init_head(CFG, jax.random.PRNGKey(1))
    key = jax.random.PRNGKey(0)
    loss, m = eagle1_loss(head, params, CFG, toks, feats, jnp.asarray(mask), key)
    np.testing.assert_allclose(loss, m["vloss"] + 0.1 * m["ploss"], rtol=1e-6)
    # Other weights (--feature-weight / --token-weight) scale the same two terms.
    loss2, m2 = eagle1_loss(head, params, CFG, toks, feats, jnp.asarray(mask), key,
                            feature_weight=0.5, token_weight=1.0)
    np.testing.assert_allclose(loss2, 0.5 * m["vloss"] + m["ploss"], rtol=1e-6)
    assert float(m2["ploss"]) == float(m["ploss"]) and float(m2["vloss"]) == float(m["vloss"])
    # Rows outside the mask do not count: scrambling their tokens changes nothing.
    toks2 = toks.at[:, :3].set(0)
    mask2 = np.zeros_like(mask)
    mask2[:, 8:] = 1
    a = eagle1_loss(head, params, CFG, toks, feats, jnp.asarray(mask2), key)[0]
    b = eagle1_loss(head, params, CFG, toks2, feats, jnp.asarray(mask2), key)[0]
    np.testing.assert_allclose(a, b, rtol=1e-6)


def test_target_temperature_sharpens_the_token_target():
    """target_temperature=T: the token term is the cross-entropy against softmax(target logits
    / T). T = 1 is the default loss bit for bit; T -> 0 is the hard-label cross-entropy against
    the target's top-1 (computed here from the draft forward directly); acc does not move."""
    params = target()
    toks, mask = corpus(4)
    toks, mask = jnp.asarray(toks), jnp.asarray(mask)
    feats = target_features(params, CFG, toks)
    head = init_head(CFG, jax.random.PRNGKey(1))
    key = jax.random.PRNGKey(0)
    base = eagle1_loss(head, params, CFG, toks, feats, mask, key)[1]
    same = eagle1_loss(head, params, CFG, toks, feats, mask, key, target_temperature=1.0)[1]
    assert float(same["ploss"]) == float(base["ploss"])
    cold = eagle1_loss(head, params, CFG, toks, feats, mask, key, target_temperature=1e-4)[1]
    d_logits = llama.project_logits(params, draft_forward_ttt(params, head, CFG, toks, feats,
                                                              1)[0])
    top = jnp.argmax(llama.project_logits(params, feats[:, 1:]), -1)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(d_logits, -1), top[..., None], -1)[..., 0]
    m = mask[:, 1:].astype(jnp.float32)
    np.testing.assert_allclose(cold["ploss"], (nll * m).sum() / m.sum(), rtol=1e-4)
    assert abs(float(cold["ploss"]) - float(base["ploss"])) > 1e-3
    assert float(cold["acc"]) == float(base["acc"]) and float(cold["vloss"]) == float(base["vloss"])


def ragged(n=40, seed=1):
    """corpus rows cut to random lengths (the rest right padding, out of the loss mask)."""
    toks, mask = corpus(n, seed)
    lens = np.random.default_rng(seed).integers(8, T + 1, n)
    cols = np.arange(T)[None]
    return np.where(cols < lens[:, None], toks, 0), np.where(cols < lens[:, None], mask, 0)


def test_trimmed_batches_cover_each_row_once_and_keep_the_loss():
    toks, mask = ragged()
    full = Batches(toks, mask, 4, seed=0)
    cut = Batches(toks, mask, 4, seed=0, trim=8, group=3)
    seen, widths = [], set()
    for step in range(cut.per_epoch):
        idx = cut.indices(step)
        w = cut.width(idx)
        widths.add(w)
        assert w % 8 == 0 or w == T
        assert cut.lengths[idx].max() <= w < cut.lengths[idx].max() + 8
        seen += idx.tolist()
    assert sorted(seen) == sorted(full._order(0).ravel().tolist())    # same rows, once each
    assert len(widths) > 1 and min(widths) < T
    assert not np.array_equal(cut.indices(0), cut.indices(cut.per_epoch))   # next epoch
    head = eagle.init_eagle_params(CFG, jax.random.PRNGKey(3), scale=0.2)
    key = jax.random.PRNGKey(0)
    for step in range(3):
        tk, ft, mk = cut.get(step, target(), CFG)
        idx = cut.indices(step)
        uncut = jnp.asarray(toks[idx])
        want = eagle1_loss(head, target(), CFG, uncut, target_features(target(), CFG, uncut),
                           jnp.asarray(mask[idx]), key, ttt_steps=2)
        got = eagle1_loss(head, target(), CFG, tk, ft, mk, key, ttt_steps=2)
        np.testing.assert_allclose(got[0], want[0], rtol=2e-5)
        np.testing.assert_allclose(got[1]["acc_1"], want[1]["acc_1"], rtol=1e-6)


def _run(tmp, steps, **kw):
    toks, mask = corpus(48)
    tc = TrainConfig(steps=steps, batch_size=8, lr=1e-2, warmup_steps=5, log_every=5,
                     ckpt_every=10, noise=0.2, **kw)
    return train(target(), CFG, Batches(toks, mask, 8, seed=0), tc, tmp, progress=False)


def test_training_lowers_loss(tmp_path):
    draft, recs = _run(tmp_path / "full", 40)
    losses = [r["loss"] for r in recs]
    assert losses[-1] < 0.8 * losses[0], losses
    assert recs[-1]["acc"] > recs[0]["acc"]
    assert (tmp_path / "full" / "loss.png").stat().st_size > 1000


def test_training_continues_from_a_head_file(tmp_path):
    """--init-head: a saved head is the starting point (fp32 master weights), e.g. to fine-tune
    it with chained passes; a random start is far behind it."""
    from jaxspec.train.cli import initial_head
    trained, recs = _run(tmp_path / "a", 30)
    path = save_head(tmp_path / "h.safetensors", jax.tree_util.tree_map(np.asarray, trained))
    start = initial_head(str(path), CFG)
    for a, b in zip(jax.tree_util.tree_leaves(trained), jax.tree_util.tree_leaves(start)):
        assert b.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    toks, mask = corpus(48)
    tc = TrainConfig(steps=5, batch_size=8, lr=1e-3, warmup_steps=1, log_every=5,
                     ckpt_every=10, ttt_steps=2)
    _, tuned = train(target(), CFG, Batches(toks, mask, 8, seed=0), tc, tmp_path / "b",
                     draft=start, progress=False)
    assert tuned[0]["loss"] < 0.8 * recs[0]["loss"] and tuned[0]["acc"] > recs[0]["acc"]
    assert initial_head(None, CFG) is None
    with pytest.raises(ValueError, match="EAGLE-1"):
        initial_head(str(path), CFG, "eagle3")

    # --mlp-width: the trained head widened starts at the trained head's loss (same function),
    # and training the wider head lowers it further; a random head of that width is far behind
    wide = initial_head(str(path), CFG, mlp_width=96)
    assert eagle.mlp_width(wide) == 96
    tk = jnp.asarray(toks[:8])
    loss = lambda d: eagle1_loss(d, target(), CFG, tk, target_features(target(), CFG, tk),
                                 jnp.asarray(mask[:8]), jax.random.PRNGKey(0))[0]
    before = loss(wide)                       # (train donates the head it starts from)
    np.testing.assert_allclose(before, loss(initial_head(str(path), CFG)), rtol=1e-5)
    tc = TrainConfig(steps=20, batch_size=8, lr=3e-3, warmup_steps=1, log_every=5, ckpt_every=50)
    wide_tuned, _ = train(target(), CFG, Batches(toks, mask, 8, seed=0), tc, tmp_path / "c",
                          draft=wide, progress=False)
    assert loss(wide_tuned) < before
    assert eagle.mlp_width(initial_head(None, CFG, mlp_width=96)) == 96
    with pytest.raises(ValueError, match="mlp-width"):
        initial_head(None, CFG, mlp_width=0)


def test_token_weight_reaches_the_step_and_raises_agreement(tmp_path):
    """TrainConfig(token_weight=) is the loss the step descends: the same start, data and steps
    with the token term alone (feature_weight 0) end at a lower token loss than with the
    feature term alone (token_weight 0), and the logged loss is the weighted sum."""
    toks, mask = corpus(48)
    start = init_head(CFG, jax.random.PRNGKey(1))
    ends = {}
    for fw, tw in ((1.0, 0.0), (0.0, 1.0)):
        tc = TrainConfig(steps=20, batch_size=8, lr=3e-3, warmup_steps=1, log_every=20,
                         ckpt_every=50, feature_weight=fw, token_weight=tw, noise=0.0)
        head = jax.tree_util.tree_map(jnp.array, start)   # train donates its start
        _, recs = train(target(), CFG, Batches(toks, mask, 8, seed=0), tc, tmp_path / f"{tw}",
                        draft=head, progress=False)
        last = recs[-1]
        np.testing.assert_allclose(last["loss"], fw * last["vloss"] + tw * last["ploss"],
                                   rtol=1e-5)
        ends[tw] = last
    assert ends[1.0]["ploss"] < ends[0.0]["ploss"]


def test_loss_weight_checks():
    from jaxspec.train.cli import check_loss_weights, main
    check_loss_weights(1.0, 0.1)
    check_loss_weights(0.0, 1.0)
    for fw, tw, match in ((1.0, -0.1, "token-weight"), (float("nan"), 0.1, "feature-weight"),
                          (0.0, 0.0, "both 0")):
        with pytest.raises(ValueError, match=match):
            check_loss_weights(fw, tw)
    with pytest.raises(ValueError, match="EAGLE-3"):
        check_loss_weights(1.0, 1.0, "eagle3")
    check_loss_weights(1.0, 1.0, target_temperature=0.5)
    for temp in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="target-temperature"):
            check_loss_weights(1.0, 1.0, target_temperature=temp)
    with pytest.raises(ValueError, match="EAGLE-3"):
        check_loss_weights(1.0, 0.1, "eagle3", target_temperature=0.5)
    with pytest.raises(SystemExit):          # argparse's error, before any model is loaded
        main(["--out", "unused", "--token-weight", "-1"])
    with pytest.raises(SystemExit):
        main(["--out", "unused", "--target-temperature", "0"])


def test_resume_mid_run_equals_uninterrupted(tmp_path):
    full, _ = _run(tmp_path / "a", 20)
    # Interrupt after the step-10 checkpoint: drop the later checkpoint, as if killed there.
    import shutil
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "ckpt" / "20")
    resumed, recs = _run(tmp_path / "b", 20)
    assert [r["step"] for r in recs] == [5, 10, 15, 20]
    jax.tree_util.tree_map(np.testing.assert_array_equal, full, resumed)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_head_file_round_trip(tmp_path, dtype):
    head = jax.tree_util.tree_map(lambda a: a.astype(dtype),
                                  init_head(CFG, jax.random.PRNGKey(5)))
    path = save_head(tmp_path / "h.safetensors", jax.tree_util.tree_map(np.asarray, head),
                     {"steps": 3})
    back = load_head(path, CFG)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(head)
    for a, b in zip(jax.tree_util.tree_leaves(head), jax.tree_util.tree_leaves(back)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert read_head_meta(path) == {"steps": 3, "mlp_width": CFG.intermediate_size}


def test_head_file_wrong_shape_names_tensor(tmp_path):
    head = jax.tree_util.tree_map(np.asarray, init_head(CFG, jax.random.PRNGKey(5)))
    head["layers"]["w_down"] = head["layers"]["w_down"][:, :-1]
    path = save_head(tmp_path / "bad.safetensors", head)
    with pytest.raises(WeightsError, match="layers.w_down"):
        load_head(path, CFG)


def test_default_head_refuses_other_targets():
    from jaxspec.loading.eagle_ckpt import load_default_head
    with pytest.raises(ValueError, match="SmolLM2"):
        load_default_head(CFG)


def test_sharegpt_reader_stops_at_truncation(tmp_path):
    convs = [{"id": str(i), "conversations": [{"from": "human", "value": f"question {i} ?"},
                                              {"from": "gpt", "value": f"answer number {i}"}]}
             for i in range(3)]
    text = json.dumps(convs, indent=1)
    cut = text[:text.rindex("answer number 2") + 5]       # the last record is cut mid-string
    (tmp_path / "d.json").write_text(cut)
    got = list(data.first_turns(data.iter_sharegpt(tmp_path / "d.json")))
    assert got == [("question 0 ?", "answer number 0"), ("question 1 ?", "answer number 1")]


def test_pack_and_examples_file(tmp_path):
    prompts, responses = [[1, 2, 3], [4, 5]], [[6, 7, 2], [8] * 10]
    toks, mask = data.pack(prompts, responses, seq_len=8)
    np.testing.assert_array_equal(toks[0], [1, 2, 3, 6, 7, 2, 0, 0])
    np.testing.assert_array_equal(mask[0], [0, 0, 0, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(mask[1], [0, 0, 1, 1, 1, 1, 1, 1])
    path = data.save_examples(tmp_path / "ex.npz", prompts, responses, source="test")
    p2, r2, meta = data.load_examples(path)
    assert (p2, r2, meta) == (prompts, responses, {"source": "test"})


def test_cli_trains_exports_and_resumes(tmp_path, monkeypatch):
    import jaxspec.weights
    from jaxspec.train import cli

    monkeypatch.setattr(jaxspec.weights, "load_model", lambda *a, **k: (CFG, target(), None))
    toks, _ = corpus(12)
    prompts = [t[:6].tolist() for t in toks]
    responses = [t[6:].tolist() for t in toks]
    data.save_examples(tmp_path / "ex.npz", prompts, responses, source="markov")
    argv = ["--out", str(tmp_path / "run"), "--data", str(tmp_path / "ex.npz"), "--steps", "6",
            "--batch-size", "4", "--seq-len", str(T), "--log-every", "2", "--ckpt-every", "3",
            "--warmup", "2", "--no-progress", "--save-dtype", "float32"]
    assert cli.main(argv) == 0
    out = tmp_path / "run"
    head = load_head(out / "head.safetensors", CFG)
    assert read_head_meta(out / "head.safetensors")["steps"] == 6
    assert (out / "loss.png").is_file()
    assert [json.loads(x)["step"] for x in (out / "train_log.jsonl").read_text().splitlines()] == [2, 4, 6]
    # The same command again finds the finished checkpoint: no more steps, the same head.
    assert cli.main(argv) == 0
    again = load_head(out / "head.safetensors", CFG)
    jax.tree_util.tree_map(np.testing.assert_array_equal, head, again)
