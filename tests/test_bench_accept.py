"""bench/bench_accept.py: the loop split of tau (looping requests apart from the rest)."""
from types import SimpleNamespace as NS

import pytest

from bench.bench_accept import loop_split


def test_loop_split_keeps_looping_answers_out_of_tau_unlooped():
    loop = NS(token_ids=[4, 5] * 40, accept_lens=[3, 3, 3])        # a loop, long accepts
    text = NS(token_ids=list(range(60)), accept_lens=[0, 1, 2])     # no window repeats
    got = loop_split([loop, text, text])
    assert got["looping"] == pytest.approx(1 / 3)
    assert got["tau_unlooped"] == pytest.approx(2.0)                # (1 + 2 + 3) / 3, twice
    assert loop_split([loop]) == {"looping": 1.0, "tau_unlooped": None}
    assert loop_split([]) == {"looping": 0.0, "tau_unlooped": None}


def test_simulate_chain_walks_cycles():
    import numpy as np
    from bench.bench_accept import simulate_chain
    # prompt of 2, answer tokens 2..9 (T = 10); flags[k, t]: step k's draft at row t is right
    flags = np.zeros((3, 10), bool)
    flags[0, 1] = flags[1, 2] = True           # root 2: steps 0, 1 accepted, step 2 not
    # next root 2 + 2 + 1 = 5: step 0 reads row 4
    flags[0, 4] = flags[1, 5] = flags[2, 6] = True   # all three: root 9 = T - 1 ends the walk
    assert simulate_chain(flags, 2) == [2, 3]
    assert simulate_chain(np.zeros((3, 10), bool), 2) == [0] * 7


def test_agreement_simulation_equals_the_measured_chain():
    """The head's training passes, walked cycle by cycle over the chain's own answers, give the
    accept lengths the engine measured (fp32, a tiny target and a head built to agree)."""
    import jax
    from draft_models import agreeing_pair
    from bench.bench_accept import agreement_table, answers, chain_agreement, simulate_chain
    from jaxspec.config import ModelConfig

    cfg = ModelConfig(arch="LlamaForCausalLM", vocab_size=97, hidden_size=32,
                      intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8)
    params, head = agreeing_pair(cfg, scale=0.02, lm_head_scale=0.5)
    # a partly agreeing head: noise in its fc makes some drafts miss
    head = dict(head, fc=head["fc"] + 0.6 * jax.random.normal(jax.random.PRNGKey(9),
                                                               head["fc"].shape))
    prompts = [[5, 17, 42, 8, 9], [3] * 7 + [50, 7], list(range(60, 72))]
    res = answers(cfg, params, head, "chain", prompts, 40)
    seqs = [p + list(r.token_ids) for p, r in zip(prompts, res)]
    flags = chain_agreement(cfg, params, head, seqs, 3)
    accepts = [a for r in res for a in r.accept_lens]
    assert 0 < sum(accepts) < 3 * len(accepts)          # neither all rejected nor all accepted
    for p, r, f in zip(prompts, res, flags):
        assert simulate_chain(f, len(p)) == list(r.accept_lens)
    table = agreement_table(cfg, params, head, prompts, res, ["a", "b", "a"], 3)
    assert table["all"]["tau"] == pytest.approx(table["all"]["tau_simulated"])
    assert table["a"]["cycles"] + table["b"]["cycles"] == table["all"]["cycles"] == len(accepts)
    assert 0.0 < table["all"]["agreement"] < 1.0


def test_draft_vocab_cuts_the_head_to_the_rankings_first_k(tmp_path):
    """--draft-vocab K measures the head as LLM(draft_vocab=K) runs it: the ranking's first K
    ids and the target lm_head's columns for them; a cut head still drafts, and greedy output
    stays the target's."""
    import numpy as np
    from draft_models import agreeing_pair
    from bench.bench_accept import measure_acceptance
    from jaxspec.config import ConfigError, ModelConfig
    from jaxspec.spec import draft_vocab as dv

    cfg = ModelConfig(arch="LlamaForCausalLM", vocab_size=97, hidden_size=32,
                      intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8)
    params, head = agreeing_pair(cfg, scale=0.02, lm_head_scale=0.5)
    ranking = np.random.default_rng(0).permutation(cfg.vocab_size)
    dv.save_ranking(tmp_path / "r.safetensors", ranking)
    cut = dv.restrict_top(params, head, cfg, 40, tmp_path / "r.safetensors")
    assert np.array_equal(np.asarray(cut["draft_ids"]), ranking[:40])
    w = np.asarray(params["lm_head"] if "lm_head" in params else params["embed"].T)
    assert np.array_equal(np.asarray(cut["draft_lm_head"]), w[:, ranking[:40]])
    prompts = [[5, 17, 42, 8, 9], list(range(60, 72))]
    full = measure_acceptance(cfg, params, head, prompts, ["chain"], max_new=24)["chain"]
    some = measure_acceptance(cfg, params, cut, prompts, ["chain"], max_new=24)["chain"]
    assert some["tokens"] == full["tokens"] == 48
    # the agreeing head drafts the target's argmax; outside the 40 ids it cannot, so it misses
    assert 1.0 < some["tau"] < full["tau"]
    with pytest.raises(ConfigError, match="token ranking"):   # the shipped one ranks SmolLM2's
        dv.restrict_top(params, head, cfg, 40)


def test_draft_vocab_flag_is_checked_before_any_model_loads(capsys):
    from bench.bench_accept import main
    for argv in (["--draft-vocab", "-1"], ["--draft-vocab", "8", "--agreement"]):
        with pytest.raises(SystemExit):
            main(argv + ["--model", "/nonexistent.gguf"])
        assert "--draft-vocab" in capsys.readouterr().err
