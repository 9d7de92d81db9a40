"""The public API on the real SmolLM2 weights: greedy equals HF transformers; bad input."""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import LLM, SamplingParams
from jaxspec.config import ConfigError

pytestmark = pytest.mark.real_weights


@pytest.fixture(scope="module")
def llm(smollm2_gguf):
    return LLM(str(smollm2_gguf), dtype=jnp.float32, max_batch=2, max_model_len=256)


def hf_greedy(model, prompt, n):
    """HF transformers greedy with its KV cache, EOS not special (generate()'s min_new_tokens
    would mask EOS and change the argmax)."""
    import torch
    out, ids, past = [], torch.tensor([prompt]), None
    with torch.no_grad():
        for _ in range(n):
            r = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = r.past_key_values
            out.append(int(r.logits[0, -1].argmax()))
            ids = torch.tensor([[out[-1]]])
    return out


def test_greedy_32_tokens_equal_hf_transformers(llm, hf_smollm2):
    model, _ = hf_smollm2
    chats = [[{"role": "user", "content": "What is the capital of France?"}],
             [{"role": "user", "content": "Write a haiku about the sea, please."}]]
    outs = llm.generate(chats, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    for out in outs:
        ref = hf_greedy(model, out.prompt_token_ids, 32)
        assert out.token_ids == ref
        assert out.finish_reason == "length"
        assert out.text == llm.tokenizer.decode(ref, skip_special_tokens=True)


def test_stops_at_eos_with_reason(llm):
    out = llm.generate([[{"role": "user", "content": "Say hi."}]],
                       SamplingParams(max_tokens=200))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] in llm.tokenizer.eos_token_ids
    assert out.metrics["ttft_s"] > 0 and out.metrics["latency_s"] >= out.metrics["ttft_s"]


def test_sampling_is_reproducible_and_varies(llm):
    sp = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=12, ignore_eos=True)
    a = llm.generate(["Once upon a time"] * 2, sp)
    assert all(len(o.token_ids) == 12 for o in a)
    assert a[0].token_ids != a[1].token_ids   # two slots draw different streams


def test_more_prompts_than_slots(llm):
    outs = llm.generate(["a", "b", "c"], SamplingParams(max_tokens=3, ignore_eos=True))
    assert [o.request_id for o in outs] == [0, 1, 2] and all(len(o.token_ids) == 3 for o in outs)


def test_mixed_prompts_are_encoded_in_batches_as_one_by_one(llm):
    """Texts and chats go to the tokenizer as one batch each: the ids equal encoding each
    prompt alone, in the prompts' order, with token-id prompts kept as given."""
    tok = llm.tokenizer
    chat = [{"role": "user", "content": "Name three prime numbers."}]
    texts = ["The quick brown fox", "  spaces and\nnew lines  ", "Ünïcödé ✓"]
    prompts = [texts[0], chat, [5, 6, 7], texts[1], [chat[0]] * 2, texts[2]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))
    want = [tok.encode(texts[0]), tok.apply_chat_template(chat), [5, 6, 7],
            tok.encode(texts[1]), tok.apply_chat_template([chat[0]] * 2), tok.encode(texts[2])]
    assert [o.prompt_token_ids for o in outs] == want
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]
    assert tok.apply_chat_templates([chat]) == [tok.apply_chat_template(chat)]
    assert tok.encode_batch([]) == []
    with pytest.raises(TypeError, match="a prompt is a string"):
        llm.generate(["fine", 3.5], SamplingParams(max_tokens=2))


@pytest.mark.parametrize("prompt,needle", [("", "empty prompt"), ([], "no prompts"),
                                           ([[10**9]], "out of range")])
def test_bad_prompts_rejected(llm, prompt, needle):
    with pytest.raises(ValueError, match=needle):
        llm.generate(prompt, SamplingParams(max_tokens=4))


def test_prompt_longer_than_context_rejected_before_any_work(llm):
    long = "hello " * 400
    with pytest.raises(ValueError, match="exceeds the context"):
        llm.generate(["fine", long], SamplingParams(max_tokens=4))
    # the instance still works afterwards
    out = llm.generate("fine", SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(out[0].token_ids) == 2


def test_generate_in_slices_equals_one_slice_and_a_late_bad_prompt_drops_only_its_own(llm):
    """Prompts past the first slice are encoded while the device runs the ones before: the
    outputs equal those of one slice. A bad prompt in a later slice raises, naming it, aborts
    the call's requests already started, and leaves a stream of another caller running."""
    prompts = ["Count to five:", [{"role": "user", "content": "Name a fruit."}], "The sky is",
               [5, 6, 7, 8], "Hello"]
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    whole = llm.generate(prompts, sp)
    conf = llm.engine_config
    assert conf.submit_slice == 64                # the default: max(64, max_batch)
    llm.engine_config = conf.replace(submit_slice=2)
    try:
        sliced = llm.generate(prompts, sp)
        assert [o.request_id for o in sliced] == list(range(len(prompts)))
        assert [(o.prompt_token_ids, o.token_ids) for o in sliced] == \
            [(o.prompt_token_ids, o.token_ids) for o in whole]
        other = llm.stream("Once upon a time", SamplingParams(max_tokens=4, ignore_eos=True))
        first = next(other)                                  # the other caller is running
        with pytest.raises(ValueError, match="request 4: prompt of .* exceeds the context"):
            llm.generate(prompts[:4] + ["hello " * 400], sp)
        others = [r.request_id for r in llm.engine.requests.values()]
        assert others == [first.request_id]                 # ours aborted and forgotten
        assert not llm.engine.finished_requests
        rest = [t for d in other for t in d.token_ids]
        alone = llm.generate("Once upon a time", SamplingParams(max_tokens=4, ignore_eos=True))
        assert first.token_ids + rest == alone[0].token_ids
    finally:
        llm.engine_config = conf
    with pytest.raises(TypeError, match="a prompt is a string"):     # before any work
        llm.generate(["fine"] * 70 + [3.5], sp)
    assert not llm.engine.requests


def test_a_stream_left_early_leaves_nothing_behind(llm):
    """A consumer that stops early aborts its requests; their final 'abort' deltas are dropped
    with them, so a later stream that reuses the request id gets only its own deltas."""
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    first = llm.stream("Once upon a time", sp, request_ids=["a"])
    next(first)
    first.close()                                       # the consumer leaves
    again = list(llm.stream("Once upon a time", sp, request_ids=["a"]))
    assert [d.finish_reason for d in again if d.finished] == ["length"]
    assert sum(len(d.token_ids) for d in again) == 6
    assert not llm._inbox and not llm.engine.requests and not llm.engine.finished_requests


def test_max_tokens_must_be_positive():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


@pytest.mark.parametrize("kw,needle", [
    ({"max_batch": 0}, "max_batch must be an int >= 1"),
    ({"admit_interval": 0}, "admit_interval must be an int >= 1"),
    ({"submit_slice": 0}, "submit_slice must be an int >= 1"),
    ({"width_growth": 1}, "width_growth must be an int >= 2"),
    ({"slot_growth": 1}, "slot_growth must be an int >= 2"),
    ({"prefill_chunk": 8}, "prefill_chunk must be an int >= 16"),
    ({"pack_rows": "odd"}, "pack_rows must be one of"),
    ({"packing": "yes"}, "packing must be a bool"),
    ({"pack_tokens": 0}, "pack_tokens must be an int >= 1"),
    ({"decode_steps": 0}, "decode_steps must be an int >= 1"),
    ({"layer_layout": "rolled"}, "layer_layout must be"),
    ({"draft_vocab": -1}, "draft_vocab must be an int >= 0"),
    ({"draft_vocab": 2.5}, "draft_vocab must be an int >= 0"),
    ({"prefill_packing": True}, "unknown option.* prefill_packing"),     # the old names
    ({"decode_chunk": 4}, "unknown option.* decode_chunk")])
def test_bad_engine_settings_rejected_before_loading(kw, needle):
    with pytest.raises(ConfigError, match=needle):
        LLM("no-such-file.gguf", **kw)       # the setting is named, not the missing file


def test_missing_model_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        LLM(str(tmp_path / "nope.gguf"))


def test_speculative_llm_equals_plain_greedy(smollm2_gguf, llm):
    import jax
    from jaxspec.models.eagle import init_eagle_params
    draft = init_eagle_params(llm.config, jax.random.PRNGKey(0))
    # A draft vocabulary of the shipped ranking's 4,096 most frequent tokens: the output stays
    # the target's.
    spec_llm = LLM(str(smollm2_gguf), dtype=jnp.float32, max_batch=2, max_model_len=256,
                   draft=draft, spec="chain", draft_vocab=4096)
    assert spec_llm.engine.backend.draft_params["draft_ids"].shape == (4096,)
    chats = [[{"role": "user", "content": "Name three colors."}], "The sky is"]
    sp = SamplingParams(max_tokens=24)
    plain = llm.generate(chats, sp)
    spec = spec_llm.generate(chats, sp)
    for a, b in zip(plain, spec):
        assert b.token_ids == a.token_ids and b.finish_reason == a.finish_reason
        assert b.accept_lens and sum(x + 1 for x in b.accept_lens) >= len(b.token_ids) - 1
    # Sampling, penalties, seeds and logprobs run speculatively too, in generate and stream.
    sp = SamplingParams(temperature=0.8, top_p=0.9, seed=5, repetition_penalty=1.1, logprobs=1,
                        max_tokens=8, ignore_eos=True)
    a, b = spec_llm.generate(["The sky is", "The sky is"], sp)
    assert a.token_ids == b.token_ids and len(a.logprobs) == 8
    deltas = list(spec_llm.stream(["The sky is"], sp))
    assert [t for d in deltas for t in d.token_ids] == a.token_ids
    got = [x for d in deltas for x in d.logprobs]
    assert [set(x) for x in got] == [set(x) for x in a.logprobs]
    np.testing.assert_allclose([v for x in got for v in x.values()],
                               [v for x in a.logprobs for v in x.values()], atol=1e-4)


def test_penalties_logprobs_and_seeds_in_generate_and_stream(llm):
    sp = SamplingParams(temperature=0.7, seed=3, presence_penalty=0.5, logprobs=2, max_tokens=10,
                        ignore_eos=True)
    out = llm.generate(["Once upon a time", "Once upon a time"], sp)
    assert out[0].token_ids == out[1].token_ids and len(out[0].logprobs) == 10
    assert all(t in d and len(d) <= 3 for t, d in zip(out[0].token_ids, out[0].logprobs))
    deltas = list(llm.stream("Once upon a time", sp))
    assert [t for d in deltas for t in d.token_ids] == out[0].token_ids
    assert "".join(d.text for d in deltas) == out[0].text
    # the last delta carries the whole request, as generate returns it
    assert [d.output is None for d in deltas] == [True] * (len(deltas) - 1) + [False]
    whole = deltas[-1].output
    assert whole.request_id == deltas[-1].request_id
    assert (whole.token_ids, whole.text, whole.finish_reason) == (
        out[0].token_ids, out[0].text, out[0].finish_reason)
    assert whole.logprobs == [lp for d in deltas for lp in d.logprobs]
    assert whole.prompt_token_ids == out[0].prompt_token_ids
