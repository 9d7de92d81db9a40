"""Self-instruct prompts (the target writes the queries, then answers them): the chat template's
user-turn opening, reproducible draws, the filters, and `jaxspec train-eagle --self-instruct`."""
import functools
import json

import jax
import pytest

from jaxspec.config import ModelConfig
from jaxspec.models import llama
from jaxspec.train import data
from jaxspec.train.distill import query_prefix, self_instruct

CFG = ModelConfig(arch="LlamaForCausalLM", vocab_size=67, hidden_size=32, intermediate_size=48,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, eos_token_ids=(2,))
ALPHABET = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ.,?!0123"  # ids 3..64
SPECIAL = {"<u>": 65, "<a>": 66, "</s>": 2}


class _Template:
    """A chat template of its own tokens: <u>message</s><a> (generation prompt)."""
    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        text = "".join(f"<u>{m['content']}</s>" for m in messages)
        return text + ("<a>" if add_generation_prompt else "")


class CharTokenizer:
    hf = _Template()

    def encode(self, text, add_special_tokens=False):
        ids, i = [], 0
        while i < len(text):
            tag = next((t for t in SPECIAL if text.startswith(t, i)), None)
            if tag:
                ids.append(SPECIAL[tag])
                i += len(tag)
            else:
                ids.append(3 + ALPHABET.index(text[i]))
                i += 1
        return ids

    def decode(self, ids, skip_special_tokens=False):
        names = {v: k for k, v in SPECIAL.items()}
        return "".join(ALPHABET[i - 3] if 3 <= i < 3 + len(ALPHABET) else
                       ("" if skip_special_tokens else names.get(i, "")) for i in ids)

    def apply_chat_template(self, messages):
        return self.encode(self.hf.apply_chat_template(messages, add_generation_prompt=True))


@functools.lru_cache(maxsize=None)
def target():
    return llama.init_random_params(CFG, jax.random.PRNGKey(0), scale=0.3)


def draw(n=5, seed=0, **kw):
    kw = dict(max_query=40, batch=8, min_chars=4, progress=False) | kw
    return self_instruct(CFG, target(), CharTokenizer(), n, seed=seed, **kw)


def test_query_prefix_is_the_templates_opening_of_a_user_turn(smollm2_loaded):
    _, _, tok = smollm2_loaded
    prefix = query_prefix(tok)
    text = tok.decode(prefix)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>user\n")
    full = tok.apply_chat_template([{"role": "user", "content": "Write a haiku about rain."}])
    assert full[:len(prefix)] == prefix
    assert tok.decode(full[len(prefix):]).startswith("Write a haiku about rain.<|im_end|>")
    assert query_prefix(CharTokenizer()) == [65]


def test_self_instruct_is_reproducible_and_filtered():
    queries, prompts, counts = draw()
    assert 1 <= len(queries) <= 5
    assert counts["drawn"] == counts["kept"] + sum(
        counts[k] for k in ("unfinished", "short", "repeated", "long_prompt"))
    assert counts["kept"] == len(queries) and counts["unfinished"] > 0
    assert len({q.lower() for q in queries}) == len(queries)
    assert all(len(q) >= 4 and q == q.strip() for q in queries)
    tok = CharTokenizer()
    assert prompts == [tok.apply_chat_template([{"role": "user", "content": q}])
                       for q in queries]
    again_q, again_p, again_c = draw()
    # wall time is the one count that may differ between two identical draws
    assert (again_q, again_p) == (queries, prompts)
    assert {k: v for k, v in again_c.items() if k != "seconds"} == \
        {k: v for k, v in counts.items() if k != "seconds"}
    assert draw(seed=1)[0] != queries
    # a prompt cap below every rendered query drops them all, and says why
    _, none, c = draw(n=2, max_prompt_len=3, max_seconds=5)
    assert none == [] and c["long_prompt"] > 0 and c["kept"] == 0


@pytest.mark.parametrize("kw", [dict(n=0), dict(temperature=0.0), dict(top_p=1.5),
                                dict(max_query=0)])
def test_self_instruct_rejects_nonsense(kw):
    n = kw.pop("n", 3)
    with pytest.raises(ValueError, match="self_instruct needs"):
        self_instruct(CFG, target(), CharTokenizer(), n, **kw)


def test_cli_trains_on_self_instruct_queries(tmp_path, monkeypatch):
    import jaxspec.weights
    from jaxspec.train import cli

    monkeypatch.setattr(jaxspec.weights, "load_model",
                        lambda *a, **k: (CFG, target(), CharTokenizer()))
    out = tmp_path / "run"
    assert cli.main(["--out", str(out), "--self-instruct", "4", "--gen-batch", "8",
                     "--max-new", "12", "--steps", "2", "--batch-size", "2", "--seq-len", "64",
                     "--log-every", "1", "--warmup", "1", "--no-progress",
                     "--instruct-top-p", "1.0"]) == 0
    prompts, responses, meta = data.load_examples(out / "examples.npz")
    queries, expect, _ = self_instruct(CFG, target(), CharTokenizer(), 4, batch=8, top_p=1.0,
                                       progress=False)
    assert prompts == expect and len(responses) == 4
    assert meta["source"].startswith("self-instruct queries")
    assert all(1 <= len(r) <= 12 for r in responses)
    assert json.loads((out / "train_log.jsonl").read_text().splitlines()[-1])["step"] == 2
