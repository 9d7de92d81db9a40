"""A smaller draft vocabulary (`spec.draft_vocab`): the ranking, its file, the restricted head's
picks against the full head's over the same tokens, and exact greedy output."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_spec_cycle import CFG, MAX_LEN, NEW, PROMPTS, agreeing_pair, reference_outputs
from jaxspec.config import ConfigError
from jaxspec.loading.common import WeightsError
from jaxspec.models import eagle, eagle3, llama
from jaxspec.spec import SpecConfig
from jaxspec.spec import draft as draft_lib
from jaxspec.spec import draft_vocab as dv
from reference_runner import SpecRunner


def test_rank_tokens_orders_by_count_then_id():
    ids = dv.rank_tokens([np.array([3, 3, 1, 5]), np.array([[5, 3], [0, 1]])], 7)
    # counts: 3 x3, 1 x2, 5 x2, 0 x1, then the unseen 2, 4, 6 by id
    assert ids.tolist() == [3, 1, 5, 0, 2, 4, 6] and ids.dtype == np.int32
    with pytest.raises(ValueError, match=r"\[0, 7\)"):
        dv.rank_tokens([np.array([7])], 7)


def test_ranking_file_round_trip_and_bad_files(tmp_path):
    from safetensors.numpy import save_file
    good = tmp_path / "r.safetensors"
    dv.save_ranking(good, np.array([4, 0, 2], np.int64))
    assert dv.load_ranking(good, 5).tolist() == [4, 0, 2]
    with pytest.raises(FileNotFoundError, match="nope"):
        dv.load_ranking(tmp_path / "nope.safetensors", 5)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(good.read_bytes()[:-5])
    cases = {"cut": (None, "readable"), "key": ({"order": np.arange(3, dtype=np.int32)}, "'ids'"),
             "dtype": ({"ids": np.arange(3, dtype=np.float32)}, "int32"),
             "range": ({"ids": np.array([0, 5], np.int32)}, r"\[0, 5\)"),
             "repeat": ({"ids": np.array([1, 1], np.int32)}, "repeats")}
    for name, (tensors, needle) in cases.items():
        path = cut if tensors is None else tmp_path / f"{name}.safetensors"
        if tensors is not None:
            save_file(tensors, str(path))
        with pytest.raises(WeightsError, match=needle):
            dv.load_ranking(path, 5)


def _setup(k: int, seed: int = 0):
    params = llama.init_random_params(CFG, jax.random.PRNGKey(0), scale=0.2)
    head = eagle.init_eagle_params(CFG, jax.random.PRNGKey(1), scale=0.2)
    ids = np.random.default_rng(seed).permutation(CFG.vocab_size)[:k]
    hidden = jax.random.normal(jax.random.PRNGKey(2), (3, CFG.hidden_size))
    return params, head, ids, hidden


@pytest.mark.parametrize("topk", [1, 4])
def test_restricted_picks_are_the_full_heads_best_inside_the_vocabulary(topk):
    params, head, ids, hidden = _setup(100)
    spec = SpecConfig(3, topk, 4 if topk == 1 else 8)
    tok, logp = draft_lib._children(params, dv.restrict(params, head, ids), hidden, spec)
    full = eagle.logits(params, hidden)                                   # [3, V]
    inside = jnp.full_like(full, -jnp.inf).at[:, ids].set(full[:, ids])
    want = jax.lax.top_k(inside, topk)[1]
    np.testing.assert_array_equal(np.asarray(tok), np.asarray(want))
    assert np.isin(np.asarray(tok), ids).all()
    if topk > 1:   # log-probabilities of the draft distribution over the K tokens
        ref = jnp.take_along_axis(jax.nn.log_softmax(inside, -1), want, -1)
        np.testing.assert_allclose(np.asarray(logp), np.asarray(ref), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(3, 1, 4), (5, 4, 16)], ids=["chain", "tree"])
def test_greedy_output_stays_exact_and_a_full_permuted_vocabulary_drafts_the_same(shape):
    params, head = agreeing_pair()
    spec = SpecConfig(*shape)
    perm = np.random.default_rng(1).permutation(CFG.vocab_size)
    out = {}
    for name, h in (("full", head), ("perm", dv.restrict(params, head, perm)),
                    ("half", dv.restrict(params, head, perm[:CFG.vocab_size // 2]))):
        runner = SpecRunner(CFG, params, h, spec, max_slots=4, max_len=MAX_LEN)
        out[name] = runner.generate(PROMPTS, [NEW] * 3, eos_ids=())
        for r, ref in zip(out[name], reference_outputs("agreeing")):
            assert r.token_ids == ref
    # All V tokens in another order: the same drafts, so the same accept lengths.
    assert [r.accept_lens for r in out["perm"]] == [r.accept_lens for r in out["full"]]
    # Half of them: tokens outside are never drafted, so fewer accepts.
    accepted = {k: sum(map(sum, (r.accept_lens for r in v))) for k, v in out.items()}
    assert accepted["half"] < accepted["full"], accepted


def test_bad_restrictions_are_rejected():
    params, head, ids, _ = _setup(3)
    with pytest.raises(ConfigError, match="distinct"):
        dv.restrict(params, head, np.array([1, 1]))
    with pytest.raises(ConfigError, match="distinct"):
        dv.restrict(params, head, np.array([CFG.vocab_size]))
    e3 = eagle3.init_eagle3_head(CFG, jax.random.PRNGKey(4))
    with pytest.raises(ConfigError, match="EAGLE-3"):
        dv.restrict(params, e3, ids)
    with pytest.raises(ConfigError, match="topk=4 exceeds the head's draft vocabulary of 3"):
        draft_lib.check_head(CFG, SpecConfig(2, 4, 6), dv.restrict(params, head, ids))
    assert dv.restricted_size(dv.restrict(params, head, ids)) == 3
    assert dv.restricted_size(head) is None


def test_default_falls_back_to_the_whole_vocabulary_without_a_ranking(tmp_path, monkeypatch):
    """A head installed without its ranking file (JAXSPEC_DRAFT_HEAD elsewhere): the default
    drafts every token; an explicit draft_vocab names the missing file. (The vocabulary step
    of `build.load_draft`, for the shipped head.)"""
    import dataclasses

    from jaxspec.build import _restrict_vocab
    from jaxspec.config import ModelConfig
    from jaxspec.loading.eagle_ckpt import DEFAULT_TARGET_SHAPE
    from jaxspec.spec.config import DraftConfig
    monkeypatch.setenv("JAXSPEC_DRAFT_HEAD", str(tmp_path / "head.safetensors"))
    cfg = dataclasses.replace(CFG, **DEFAULT_TARGET_SHAPE)
    assert isinstance(cfg, ModelConfig)
    head = {"fc": np.zeros(2)}

    def restrict(dcfg):
        return _restrict_vocab(head, cfg, {}, dcfg, shipped=True, max_batch=1, sharded=False)

    assert restrict(DraftConfig(draft_context_vocab=0)) is head
    with pytest.raises(FileNotFoundError, match="token_ranking"):
        restrict(DraftConfig(draft_vocab=1024, draft_context_vocab=0))


def test_bench_rows_record_the_vocabulary_drafted():
    from types import SimpleNamespace

    from jaxspec.benchmark.runner import draft_vocab_of
    params, head, ids, _ = _setup(7)
    of = lambda d: draft_vocab_of(SimpleNamespace(engine=SimpleNamespace(  # noqa: E731
        backend=SimpleNamespace(draft_params=d))))
    assert of(dv.restrict(params, head, ids)) == 7 and of(head) == 0
    assert of(None) is None and draft_vocab_of(SimpleNamespace(engine=None)) is None
