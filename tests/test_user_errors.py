"""A newcomer's mistakes: every wrong-typed input is an error that names the argument and what it
takes, raised before any work, and the same LLM generates afterwards; a value that would be
adjusted is warned about. Special tokens are left out of the text by default (skip_special_tokens,
as HF and vLLM), in the final text, the stream and the stop-string checks alike."""
import warnings

import pytest

from jaxspec import LLM, SamplingParams
from jaxspec.config import ConfigError
from jaxspec.engine import EngineConfig

# A tiny chat model: byte-level tokens for printable ASCII and newline, and many special tokens
# (the end-of-turn markers and 60 others), so a random model's greedy output mixes both.
_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [f"<|x{i}|>" for i in range(60)]
_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
             "{{ message['content'] }}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_CONTEXT = 512


def _write_tiny_chat_model(d):
    """config.json, model.safetensors (random weights) and tokenizer files of a tiny Llama."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from draft_models import write_tiny_llama
    from jaxspec.tokenizer import _bytes_to_unicode

    spell = _bytes_to_unicode()
    chars = [spell[b] for b in [10] + list(range(32, 127))]
    raw = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _SPECIAL])
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, chat_template=_TEMPLATE,
                                  eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                  clean_up_tokenization_spaces=False)
    tok.save_pretrained(d)
    return write_tiny_llama(d, len(tok), _CONTEXT, tok.bos_token_id, tok.eos_token_id)


@pytest.fixture(scope="module")
def tiny_chat_dir(tmp_path_factory):
    return _write_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="module")
def llm(tiny_chat_dir):
    return LLM(str(tiny_chat_dir), max_batch=2, max_model_len=128)


def _still_generates(llm):
    out = llm.generate("hi", SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].token_ids) == 3
    assert not llm.engine.requests and not llm.engine.finished_requests and not llm._inbox


@pytest.mark.parametrize("call,error,match", [
    (lambda m: m.generate(123), TypeError,
     r"prompts must be one prompt or a list of them: a prompt is a string, a chat .* or a "
     r"list of token ids; got int 123"),
    (lambda m: m.generate({"role": "user", "content": "hi"}), TypeError,
     r"a prompt is a string.*got one message \(a dict\): a chat is a list of them"),
    (lambda m: m.generate([{"role": "user"}]), ValueError,
     r"chat, message 0: no 'content' \(a message is a dict with 'role' and 'content' strings\)"),
    (lambda m: m.generate(["hi", [{"role": "user", "content": "a"}, {"content": "b"}]]),
     ValueError, r"request 1: chat, message 1: no 'role'"),
    (lambda m: m.generate([{"role": "user", "content": 5}]), TypeError,
     r"message 0: 'content' must be a string, got int"),
    (lambda m: m.generate(["fine", 3.5]), TypeError,
     r"request 1: a prompt is a string.*got float 3.5"),
    (lambda m: m.generate([[1, "2"]]), TypeError, r"a prompt is a string.*got a list of int, str"),
    (lambda m: m.generate("hi", 0.5), TypeError,
     r"sampling_params must be a SamplingParams or a list of them .*got float"),
    (lambda m: m.generate(["a", "b"], [SamplingParams(), {"max_tokens": 3}]), TypeError,
     r"sampling_params must be a SamplingParams .*got dict"),
    (lambda m: m.chat([{"role": "user"}]), ValueError, r"chat, message 0: no 'content'"),
    (lambda m: m.chat({"role": "user", "content": "hi"}), TypeError,
     r"messages: a conversation is a list of .* got one message \(a dict\)"),
    (lambda m: m.chat("hi"), TypeError, r"messages must be a conversation .* got str 'hi'"),
    (lambda m: m.chat(7), TypeError, r"messages must be a conversation .* got int 7"),
    (lambda m: m.chat([[{"role": "user", "content": "a"}], {"role": "user", "content": "b"}]),
     TypeError, r"chat 1: a conversation is a list of messages, got one message \(a dict\)"),
    (lambda m: m.stream({"role": "user", "content": "hi"}), TypeError, r"got one message"),
], ids=["int", "bare message", "no content", "no role", "content not str", "float in list",
        "str in ids", "sampling float", "sampling dict", "chat no content", "chat bare message",
        "chat str", "chat int", "chat list with a bare message", "stream bare message"])
def test_wrong_input_is_named_and_the_llm_still_generates(llm, call, error, match):
    with pytest.raises(error, match=match):
        call(llm)
    _still_generates(llm)


def test_tokenizer_checks_messages_and_names_a_refusing_template(llm):
    tok = llm.tokenizer
    with pytest.raises(ValueError, match="chat, message 0: no 'content'"):
        tok.apply_chat_template([{"role": "user"}])
    with pytest.raises(ValueError, match="a conversation needs at least one message"):
        tok.render_chat([])
    strict = "{{ raise_exception('roles must alternate') }}"
    old, tok.hf.chat_template = tok.hf.chat_template, strict
    try:
        with pytest.raises(ValueError, match="chat template refused .*roles must alternate"):
            llm.chat([{"role": "user", "content": "hi"}])
    finally:
        tok.hf.chat_template = old
    _still_generates(llm)


@pytest.mark.parametrize("kwargs,match", [
    ({"temperature": "0.5"}, r"temperature must be a number, got '0.5' \(str\)"),
    ({"temperature": None}, r"temperature must be a number, got None"),
    ({"top_p": [0.9]}, r"top_p must be a number, got \[0.9\] \(list\)"),
    ({"repetition_penalty": True}, r"repetition_penalty must be a number, got True \(bool\)"),
    ({"max_tokens": "16"}, r"max_tokens must be an integer, got '16' \(str\)"),
    ({"top_k": None}, r"top_k must be an integer, got None"),
    ({"seed": "7"}, r"seed must be an integer or None, got '7' \(str\)"),
    ({"logprobs": "2"}, r"logprobs must be an integer or None, got '2'"),
    ({"ignore_eos": "no"}, r"ignore_eos must be True or False, got 'no' \(str\)"),
    ({"skip_special_tokens": 0}, r"skip_special_tokens must be True or False, got 0 \(int\)"),
    ({"stop": 5}, r"stop must be a string or a list of strings, got 5 \(int\)"),
    ({"stop_token_ids": 2}, r"stop_token_ids must be a list of token ids, got 2 \(int\)"),
])
def test_wrong_typed_sampling_params_are_named(llm, kwargs, match):
    with pytest.raises(TypeError, match=match):
        SamplingParams(**kwargs)
    _still_generates(llm)


def test_bad_dtype_is_named_before_any_file_is_read(llm, tiny_chat_dir):
    for dtype in ("float13", "int8", 5):
        with pytest.raises(ConfigError, match=r"dtype must be one of float32, bfloat16, "
                                              r"float16, float64 .*got " + repr(dtype)):
            LLM("no-such-file.gguf", dtype=dtype)
    with pytest.raises(ConfigError, match="dtype must be one of .*got 'float13'"):
        LLM(str(tiny_chat_dir), dtype="float13")
    _still_generates(llm)


def test_max_model_len_past_the_model_is_capped_with_a_warning(tiny_chat_dir):
    with pytest.warns(UserWarning, match=rf"max_model_len=10000000 is past this model's limit "
                                         rf"of {_CONTEXT} tokens.*using max_model_len={_CONTEXT}"):
        capped = LLM(str(tiny_chat_dir), max_batch=1, max_model_len=10**7)
    assert capped.max_model_len == _CONTEXT
    _still_generates(capped)
    # within the limit, or left to the default: nothing to warn about
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        conf = EngineConfig(max_model_len=_CONTEXT).resolved(slots=1, speculative=False,
                                                              model_limit=_CONTEXT)
        assert conf.max_model_len == _CONTEXT
        assert EngineConfig().resolved(slots=1, speculative=False,
                                       model_limit=64).max_model_len == 64


def _special_ids(tok):
    return {tok.hf.convert_tokens_to_ids(t) for t in _SPECIAL}


def test_special_tokens_are_left_out_of_the_text_by_default(llm):
    """Greedy output of the random model mixes special and plain tokens: the text, and the
    stream's, leave the special ones out by default and keep them with
    skip_special_tokens=False; token_ids keep them either way."""
    tok, special = llm.tokenizer, _special_ids(llm.tokenizer)
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    chat = [{"role": "user", "content": "What is 2+2?"}]
    out = llm.chat(chat, sp)[0]
    ids = out.token_ids
    assert special & set(ids) and set(ids) - special        # both kinds were generated
    assert out.text == tok.decode(ids, skip_special_tokens=True)
    assert not any(s in out.text for s in _SPECIAL)
    raw = llm.chat(chat, SamplingParams(max_tokens=24, ignore_eos=True,
                                        skip_special_tokens=False))[0]
    assert raw.token_ids == ids and raw.text == tok.decode(ids)
    assert any(s in raw.text for s in _SPECIAL)
    for skip, want in ((True, out.text), (False, raw.text)):
        deltas = list(llm.stream([chat], SamplingParams(max_tokens=24, ignore_eos=True,
                                                        skip_special_tokens=skip)))
        assert [t for d in deltas for t in d.token_ids] == ids
        assert "".join(d.text for d in deltas) == want


def test_stop_strings_are_found_in_the_visible_text(llm):
    """A stop string that the text shows only once the special tokens are left out (its two
    characters on either side of one) stops the request; with them kept it is not there."""
    tok, special = llm.tokenizer, _special_ids(llm.tokenizer)
    prompt = [{"role": "user", "content": "What is 2+2?"}]
    ids = llm.chat(prompt, SamplingParams(max_tokens=24, ignore_eos=True))[0].token_ids
    i = next(i for i in range(1, len(ids) - 1) if ids[i] in special
             and ids[i - 1] not in special and ids[i + 1] not in special)
    stop = tok.decode(ids[i - 1:i + 2], skip_special_tokens=True)
    assert len(stop) == 2
    visible = tok.decode(ids, skip_special_tokens=True)
    raw = tok.decode(ids)
    out = llm.chat(prompt, SamplingParams(max_tokens=24, ignore_eos=True, stop=stop))[0]
    assert out.finish_reason == "stop" and out.text == visible[:visible.find(stop)]
    kept = llm.chat(prompt, SamplingParams(max_tokens=24, ignore_eos=True, stop=stop,
                                           skip_special_tokens=False))[0]
    cut = raw.find(stop)
    assert kept.text == (raw[:cut] if cut >= 0 else raw)
    assert len(kept.token_ids) > len(out.token_ids)


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("stream", [False, True], ids=["windows", "stream_decoder"])
def test_incremental_text_is_a_prefix_of_the_visible_text(llm, stream, skip):
    """The engine's running text, by windows of the output or the tokenizer's incremental
    decoder, is always a prefix of decode(output, skip_special_tokens) and equals it once its
    bytes are complete, over random ids with special tokens among them."""
    import random

    from jaxspec.engine.output import OutputProcessor
    from jaxspec.engine.request import Request
    tok = llm.tokenizer
    out = OutputProcessor(tok.decode, tok.stream_decoder if stream else None)
    rng = random.Random(0)
    for _ in range(30):
        req = Request(0, [], SamplingParams(skip_special_tokens=skip), frozenset(), ())
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 30))]
        while req.output != ids:
            req.output += ids[len(req.output):len(req.output) + rng.randint(1, 3)]
            got, full = out.text_so_far(req), tok.decode(req.output, skip_special_tokens=skip)
            assert full.startswith(got)
        assert got == full
        assert (req.decoder is not False) == stream


@pytest.mark.real_weights
def test_smollm2_end_of_turn_left_out_and_the_shipped_head_directory_loads(smollm2_gguf):
    """LLM.chat on SmolLM2 with its shipped head given as a directory (head.safetensors,
    token_ranking.safetensors, README.md): the answer's text has no <|im_end|>, its token_ids
    end with it."""
    import jax
    import jax.numpy as jnp

    from jaxspec.loading.eagle_ckpt import DEFAULT_HEAD_DIR, DEFAULT_HEAD_FILE, load_draft
    spec_llm = LLM(str(smollm2_gguf), draft=str(DEFAULT_HEAD_DIR), spec="chain",
                   dtype=jnp.float32, max_batch=1, max_model_len=256)
    as_dir = load_draft(DEFAULT_HEAD_DIR, spec_llm.config, jnp.float32)
    as_file = load_draft(DEFAULT_HEAD_DIR / DEFAULT_HEAD_FILE, spec_llm.config, jnp.float32)
    assert jax.tree_util.tree_all(jax.tree.map(lambda a, b: bool((a == b).all()), as_dir,
                                               as_file))
    chat = [{"role": "user", "content": "What is 2+2?"}]
    out = spec_llm.chat(chat, SamplingParams(max_tokens=48))[0]
    tok = spec_llm.tokenizer
    end = tok.hf.convert_tokens_to_ids("<|im_end|>")
    assert out.finish_reason == "stop" and out.token_ids[-1] == end
    assert out.text and "<|im_end|>" not in out.text
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
    raw = spec_llm.chat(chat, SamplingParams(max_tokens=48, skip_special_tokens=False))[0]
    assert raw.token_ids == out.token_ids and raw.text == out.text + "<|im_end|>"


def test_the_package_exports_its_config_classes():
    """What the README and error messages name as `jaxspec.X` is importable from `jaxspec`."""
    import jaxspec
    from jaxspec.engine.config import EngineConfig
    from jaxspec.spec.config import DraftConfig, SpecConfig
    assert (jaxspec.EngineConfig, jaxspec.DraftConfig, jaxspec.SpecConfig) == (
        EngineConfig, DraftConfig, SpecConfig)
    assert set(jaxspec.__all__) >= {"LLM", "SamplingParams", "EngineConfig", "DraftConfig",
                                    "SpecConfig", "RequestOutput"}
    with pytest.raises(AttributeError, match="no attribute 'Engine'"):
        jaxspec.Engine


def test_llm_slots_default_to_what_the_device_pays_for(tiny_chat_dir, monkeypatch):
    """A CPU computes every slot, held or not: LLM() there has one, unless asked; a GPU's
    default is MAX_BATCH (a step reads the weights once for all slots)."""
    from jaxspec import defaults
    one = LLM(str(tiny_chat_dir), max_model_len=64)
    assert one.max_batch == one.engine.backend.slots == 1
    out = one.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4,
                                                                       ignore_eos=True))
    assert len(out[0].token_ids) == 4
    assert LLM(str(tiny_chat_dir), max_batch=3, max_model_len=64).max_batch == 3
    assert LLM(str(tiny_chat_dir), engine=EngineConfig(max_model_len=64)).max_batch == \
        EngineConfig().max_batch        # an EngineConfig given whole is taken as it is
    monkeypatch.setattr(defaults, "on_gpu", lambda: True)
    assert defaults.max_batch() == defaults.MAX_BATCH == 8
