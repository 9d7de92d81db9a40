"""EAGLE-3 training: the draft vocabulary, the training-time-test passes equal chained inference
drafts, a few steps lower the loss on a tiny model, and the saved head (public layout) loads back
exactly and runs in the speculative cycle."""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.loading.eagle_ckpt import load_draft, save_eagle3
from jaxspec.models import eagle3, llama
from jaxspec.train import eagle3 as e3
from jaxspec.train.loop import Batches, Eagle3Objective, TrainConfig, train

CFG = ModelConfig(arch="LlamaForCausalLM", vocab_size=67, hidden_size=32, intermediate_size=48,
                  num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8)
AUX = (0, 1, 3)
T = 24


@functools.lru_cache(maxsize=None)
def target():
    return llama.init_random_params(CFG, jax.random.PRNGKey(0), scale=0.3)


def corpus(n=32, seed=0):
    """Sequences from a Markov chain over 40 of the 67 tokens, so a head can learn them."""
    rng = np.random.default_rng(seed)
    nxt = rng.integers(0, 40, size=CFG.vocab_size)
    toks = np.zeros((n, T), np.int32)
    toks[:, 0] = rng.integers(0, 40, n)
    for t in range(1, T):
        flip = rng.random(n) < 0.1
        toks[:, t] = np.where(flip, rng.integers(0, 40, n), nxt[toks[:, t - 1]])
    mask = np.zeros((n, T), np.uint8)
    mask[:, 6:] = 1
    return toks, mask


def test_draft_vocab_is_the_most_frequent_drafted_tokens():
    toks = np.array([[1, 2, 2, 3, 3, 3, 9, 9, 9, 9]])
    mask = np.array([[0, 1, 1, 1, 1, 1, 0, 0, 0, 0]])
    # drafted: 3 (x3), 2 (x2); then by count anywhere: 9 (x4), 1
    np.testing.assert_array_equal(e3.build_draft_vocab(toks, mask, 12, 3), [2, 3, 9])
    np.testing.assert_array_equal(e3.build_draft_vocab(toks, mask, 12, 5), [0, 1, 2, 3, 9])


def test_training_passes_equal_chained_drafts():
    """Pass 0 = the sequence form; pass k's row t = the k-th chained draft step at position t
    (the sequence form over the true-feature rows 0..t-k, then the chain of own outputs)."""
    params = target()
    toks, _ = corpus(2)
    toks = jnp.asarray(toks)
    head = e3.init_train_head(params, CFG, jax.random.PRNGKey(2), np.arange(0, 67, 2), AUX,
                              scale=0.2)
    hc = head.config.as_dict()
    aux, _ = e3.target_features(params, CFG, AUX, toks)
    outs = [o for o in e3.forward_ttt(head.params, hc, CFG, params["embed"], toks, aux, 3,
                                      lambda k, o: o)]
    pos = jnp.broadcast_to(jnp.arange(T - 1)[None], (2, T - 1))
    ref0, _ = e3.forward(head.params, hc, CFG, params["embed"], toks[:, 1:], aux[:, :-1], pos)
    np.testing.assert_allclose(outs[0], ref0, rtol=1e-5, atol=1e-5)
    h0 = aux[:, :-1] @ head.params["fc"]
    for t in (4, T - 2):
        for k in (1, 2):
            c = t - k + 1                      # true-feature rows 0..t-k
            chain = [ref0[:, t - k]]           # pass 0's output at row t - k
            for j in range(1, k):              # pass j's output at row t - k + j
                feats = jnp.concatenate([h0[:, :c]] + [x[:, None] for x in chain], 1)
                out, _ = e3.forward(head.params, hc, CFG, params["embed"],
                                    toks[:, 1:c + j + 1], feats, pos[:, :c + j])
                chain.append(out[:, -1])
            feats = jnp.concatenate([h0[:, :c]] + [x[:, None] for x in chain], 1)
            out, _ = e3.forward(head.params, hc, CFG, params["embed"], toks[:, 1:t + 2], feats,
                                pos[:, :t + 1])
            np.testing.assert_allclose(out[:, -1], outs[k][:, t], rtol=1e-4, atol=1e-4)


def _objective(toks, mask):
    ids = e3.build_draft_vocab(toks, mask, CFG.vocab_size, 48)
    head = e3.init_train_head(target(), CFG, jax.random.PRNGKey(1), ids, AUX)
    return Eagle3Objective(head)


def test_trimmed_batches_keep_the_eagle3_loss():
    """A length-grouped batch cut to its longest row (Batches(trim=)) gives the loss and the
    chained-pass accuracies of the uncut rows."""
    toks, mask = corpus(24, seed=2)
    lens = np.random.default_rng(2).integers(9, T + 1, len(toks))
    keep = np.arange(T)[None] < lens[:, None]
    toks, mask = np.where(keep, toks, 0), np.where(keep, mask, 0)
    obj = _objective(toks, mask)
    cut = Batches(toks, mask, 4, seed=0, feature_fn=obj.features, trim=8, group=2)
    key = jax.random.PRNGKey(0)
    widths = set()
    for step in range(cut.per_epoch):
        tk, ft, mk = cut.get(step, target(), CFG)
        widths.add(tk.shape[1])
        uncut = jnp.asarray(toks[cut.indices(step)])
        want = obj.loss(obj.init, target(), CFG, uncut, obj.features(target(), CFG, uncut),
                        jnp.asarray(mask[cut.indices(step)]), key, ttt_steps=3)
        got = obj.loss(obj.init, target(), CFG, tk, ft, mk, key, ttt_steps=3)
        np.testing.assert_allclose(got[0], want[0], rtol=2e-5)
        np.testing.assert_allclose(got[1]["acc_2"], want[1]["acc_2"], rtol=1e-6)
    assert min(widths) < T
    # the GPU script's features of all rows at once, chunk by chunk into buffers
    from bench.train_gpu import precompute_features
    aux, normed = precompute_features(target(), CFG, toks, 5, obj.features)
    want = obj.features(target(), CFG, jnp.asarray(toks))
    np.testing.assert_allclose(aux, want[0], rtol=1e-4, atol=1e-4)     # other batch sizes
    np.testing.assert_allclose(normed, want[1], rtol=1e-4, atol=1e-4)


def test_training_lowers_loss_and_the_head_round_trips(tmp_path):
    toks, mask = corpus(48)
    obj = _objective(toks, mask)
    tc = TrainConfig(steps=30, batch_size=8, lr=1e-2, warmup_steps=5, log_every=5,
                     ckpt_every=100, noise=0.0, ttt_steps=3)
    batches = Batches(toks, mask, 8, seed=0, feature_fn=obj.features)
    draft, recs = train(target(), CFG, batches, tc, tmp_path / "run", progress=False,
                        objective=obj)
    losses = [r["loss"] for r in recs]
    assert losses[-1] < 0.7 * losses[0], losses
    assert recs[-1]["acc"] > recs[0]["acc"] and "acc_2" in recs[-1]
    assert 0 < recs[-1]["vocab_cover"] <= 1
    head = obj.head(draft)
    path = save_eagle3(tmp_path / "head", head, CFG, dtype="float32", meta={"steps": 30})
    back = load_draft(path, CFG)
    assert isinstance(back, eagle3.Eagle3Head) and back.config == head.config
    assert back.config.aux_layers == AUX
    flat = lambda h: jax.tree_util.tree_flatten_with_path(h.params)[0]  # noqa: E731
    for (ka, a), (kb, b) in zip(flat(back), flat(head)):
        assert ka == kb
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # bf16 on disk: loads back as the bf16 rounding of the trained head
    path = save_eagle3(tmp_path / "bf16", head, CFG)
    back16 = load_draft(path, CFG, dtype=jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(back16.params["fc"]),
                                  np.asarray(head.params["fc"].astype(jnp.bfloat16)))
    # and drafts in the cycle: greedy speculative == plain greedy on a corpus prompt
    from reference_runner import SpecRunner

    from jaxspec.spec import SpecConfig
    prompt = [int(x) for x in toks[0, :10]]
    runner = SpecRunner(CFG, target(), back, SpecConfig(3, 1, 4), max_slots=1, max_len=64)
    spec_out = runner.generate([prompt], [12])[0]
    assert spec_out.token_ids == plain_greedy(prompt, 12)


def plain_greedy(prompt, n):
    """Uncached reference: the target's argmax after the sequence, one token at a time."""
    from jaxspec.kv import init_cache
    params, seq = target(), list(prompt)
    empty = init_cache(CFG, 1, 8, jnp.float32)
    for _ in range(n):
        x = jnp.asarray(seq, jnp.int32)[None]
        hid, *_ = llama.forward(params, CFG, x, jnp.arange(len(seq))[None], empty.k, empty.v,
                                empty.lens, llama.causal_mask(1, len(seq)))
        seq.append(int(jnp.argmax(llama.lm_head(params, CFG, hid[0, -1]))))
    return seq[len(prompt):]
