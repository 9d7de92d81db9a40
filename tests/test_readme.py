"""README.md's Python examples, run as written: every ```python block in order, in one namespace
(a block may use what an earlier one defined), on the real default model. Each must run, and
what it returns and prints must be sensible text: not empty, no special tokens, a valid finish
reason, speculative greedy text equal to plain greedy text."""
from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from jaxspec import SamplingParams

pytestmark = pytest.mark.real_weights

README = Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
# Chat-template markers such as <|im_end|>, whatever the tokenizer calls special.
MARKER = re.compile(r"<\|[^|<>]*\|>")


def python_blocks(text: str):
    return FENCE.findall(text)


@pytest.fixture(scope="module")
def readme():
    """(namespace, stdout of each block) after running the README's blocks in order."""
    blocks = python_blocks(README.read_text(encoding="utf-8"))
    assert len(blocks) >= 4, f"README.md: {len(blocks)} python blocks, the quickstart has 4"
    ns, printed = {"__name__": "readme"}, []
    for i, block in enumerate(blocks):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(block, f"README.md python block {i + 1}", "exec"), ns)
        printed.append(out.getvalue())
    return ns, printed


def check_text(text: str, specials, where: str):
    """Readable text: not empty, some letters, no special token."""
    assert text.strip(), f"{where}: empty text"
    assert re.search(r"[A-Za-z]{3}", text), f"{where}: no words in {text!r}"
    found = [s for s in specials if s in text] + MARKER.findall(text)
    assert not found, f"{where}: special tokens {found} in {text!r}"


def check_output(o, specials, max_tokens: int, where: str):
    check_text(o.text, specials, where)
    assert o.finish_reason in ("stop", "length"), f"{where}: finish_reason {o.finish_reason!r}"
    assert 0 < len(o.token_ids) <= max_tokens, where
    if o.finish_reason == "length":
        assert len(o.token_ids) == max_tokens, where


@pytest.fixture(scope="module")
def specials(readme):
    ns, _ = readme
    return [s for s in ns["llm"].tokenizer.hf.all_special_tokens if s]


def test_quickstart_chat(readme, specials):
    ns, printed = readme
    out, sp = ns["out"], ns["sp"]
    check_output(out, specials, sp.max_tokens, "llm.chat")
    assert out.text in printed[0]
    im_start = ns["llm"].tokenizer.hf.convert_tokens_to_ids("<|im_start|>")
    assert out.prompt_token_ids[0] == im_start, "chat() must apply the chat template"


def test_speculative_greedy_is_plain_greedy(readme, specials):
    ns, printed = readme
    out, fast = ns["out"], ns["fast"]
    check_output(fast, specials, ns["sp"].max_tokens, "spec_llm.chat")
    assert fast.token_ids == out.token_ids
    assert fast.text == out.text
    assert printed[1].splitlines()[0] == "True"
    # The first token comes from the prompt's admission; each cycle then emits its accepted
    # drafts plus a bonus token, the last one possibly cut by max_tokens or a stop.
    acc, steps = fast.accept_lens, ns["spec_llm"].spec.num_steps
    assert acc and all(0 <= a <= steps for a in acc), acc
    assert 1 + sum(a + 1 for a in acc[:-1]) < len(fast.token_ids) <= 1 + sum(a + 1 for a in acc)


def test_stream_abort(readme, specials):
    ns, printed = readme
    told, last = ns["told"], ns["d"]
    assert last.finished and last.finish_reason == "abort"
    assert len(told) > 80
    check_text(told, specials, "stream")
    assert told in printed[2]
    # greedy: what was streamed before the abort starts plain decoding's answer
    ref = ns["llm"].chat(ns["story"], SamplingParams(max_tokens=48))[0]
    assert ref.text.startswith(told), (told, ref.text)


def test_generate_takes_text_as_is(readme, specials):
    ns, _ = readme
    cont, tok = ns["cont"], ns["llm"].tokenizer
    check_output(cont, specials, 8, "llm.generate")
    assert tok.decode(cont.prompt_token_ids) == "The capital of France is"


def test_sampled_chats(readme, specials):
    ns, printed = readme
    outs, hot = ns["outs"], ns["hot"]
    assert [o.request_id for o in outs] == [0, 1]
    for o in outs:
        check_output(o, specials, hot.max_tokens, f"sampled chat {o.request_id}")
        assert o.text in printed[3]
