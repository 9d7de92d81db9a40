"""bench/bench_accept.py --turns 2: MT-bench's second turns after the first turns' answers, as
EAGLE's evaluation runs them."""
import pytest

from bench.bench_accept import follow_up, main, measure_acceptance, mt_bench_turns


def test_second_turns_run_after_the_first_and_figures_cover_both():
    from draft_models import agreeing_pair
    from jaxspec.config import ModelConfig

    cfg = ModelConfig(arch="LlamaForCausalLM", vocab_size=97, hidden_size=32,
                      intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8)
    params, head = agreeing_pair(cfg, scale=0.02, lm_head_scale=0.5)
    prompts = [[5, 17, 42, 8, 9], list(range(60, 72))]
    seen = []

    def second(results):
        seen.append([list(r.token_ids) for r in results])
        return [p + list(r.token_ids) + [7, 8] for p, r in zip(prompts, results)]

    got = measure_acceptance(cfg, params, head, prompts, ["chain"], max_new=20,
                             next_turns=[second])["chain"]
    first = measure_acceptance(cfg, params, head, prompts, ["chain"], max_new=20)["chain"]
    assert "turns" not in first
    # the second turn's prompts hold the first turn's own answers
    assert [len(a) for a in seen[0]] == [20, 20]
    later = measure_acceptance(cfg, params, head, [p + a + [7, 8] for p, a in
                                                   zip(prompts, seen[0])],
                               ["chain"], max_new=20)["chain"]
    t1, t2 = got["turns"]
    for turn, alone in ((t1, first), (t2, later)):
        assert turn == {k: alone[k] for k in ("tau", "cycles", "tokens")}
    assert got["cycles"] == t1["cycles"] + t2["cycles"] and got["tokens"] == 80
    assert got["tau"] == pytest.approx((t1["tau"] * t1["cycles"] + t2["tau"] * t2["cycles"])
                                       / got["cycles"])
    assert sum(got["accept_hist"]) == got["cycles"]


def test_follow_up_renders_the_first_exchange_and_the_next_question(smollm2_loaded):
    _, _, tok = smollm2_loaded
    turns = mt_bench_turns(n=2)
    assert len(turns) == 2 and all(len(t) == 2 for t in turns)
    firsts = [t[0] for t in turns]
    answer = tok.encode("Sure, here it is.", add_special_tokens=False)

    class R:        # an answer that ended: its EOS is not part of the assistant's message
        token_ids = answer + [tok.eos_token_ids[0]]

    got = follow_up(tok, firsts, [t[1] for t in turns])([R(), R()])
    for prompt, (q1, q2) in zip(got, turns):
        assert prompt == tok.apply_chat_template([
            {"role": "user", "content": q1},
            {"role": "assistant", "content": "Sure, here it is."},
            {"role": "user", "content": q2}])
        text = tok.decode(prompt)
        assert text.index(q1) < text.index("Sure, here it is.") < text.index(q2)
        assert text.endswith("<|im_start|>assistant\n")


def test_turns_with_agreement_is_refused_before_any_model_loads(capsys):
    with pytest.raises(SystemExit):
        main(["--turns", "2", "--agreement", "--model", "/nonexistent.gguf"])
    assert "--turns" in capsys.readouterr().err
