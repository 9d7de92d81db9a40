"""The HF transformers peers of jaxspec-bench: each one's tokens against a greedy loop that
recomputes the whole sequence every step (no cache), on a tiny random Llama on the CPU."""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxspec import bench_cli  # noqa: E402
from jaxspec.benchmark import peers  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128)
    return transformers.LlamaForCausalLM(cfg).eval()


def greedy_no_cache(model, ids, n, eos):
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([seq]), use_cache=False).logits[0, -1]
            seq.append(int(logits.argmax()))
            if seq[-1] in eos:
                break
    return seq[len(ids):]


PROMPTS = [[5, 9, 13], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [40, 41]]


@pytest.mark.parametrize("name", list(peers.PEERS))
def test_peer_tokens_are_greedy(tiny, name):
    # eos = a token the reference emits for the first prompt, so one output is cut at it
    first = greedy_no_cache(tiny, PROMPTS[0], 12, [])
    eos = [first[5]]
    r = peers.run_peer(tiny, name, PROMPTS, 12, eos)
    want = [greedy_no_cache(tiny, p, 12, eos) for p in PROMPTS]
    assert r["token_ids"] == want
    assert r["token_ids"][0][-1] == eos[0] and len(r["token_ids"][0]) <= 6
    assert r["tokens"] == sum(len(w) for w in want) and r["tokens_per_s"] > 0
    assert r["compiled"] is False        # transformers compiles the decode step only on GPUs


def test_unknown_peer_is_refused_before_any_run(capsys):
    with pytest.raises(SystemExit) as e:
        bench_cli.main(["--peers", "hf-static,hf-nope", "--quiet"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "argument --peers: unknown peer hf-nope" in err
