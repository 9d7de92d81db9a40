"""`jaxspec serve` on the real SmolLM2 weights over loopback, plain and speculative, through the
official `openai` client and raw httpx: completions and chat, whole and streamed, equal token for
token to offline LLM.generate / LLM.chat (greedy, and seeded sampling with penalties, filters,
stop strings and logprobs); the SSE framing; the speculative counters equal the offline accept
lengths of the same requests."""
import asyncio
import json

import httpx
import jax.numpy as jnp
import numpy as np
import openai
import pytest

from serve_helpers import metric, served
from jaxspec import LLM, SamplingParams
from jaxspec.serve.app import build_app
from jaxspec.serve.responses import MIN_LOGPROB

pytestmark = pytest.mark.real_weights

NAME = "smollm2"
GREEDY = SamplingParams(max_tokens=16)
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
CHATS = [[{"role": "user", "content": "Name three colors."}],
         [{"role": "system", "content": "You answer in one word."},
          {"role": "user", "content": "What is the opposite of hot?"}]]
# seeded sampling through every filter and penalty, with logprobs and a stop string
SAMPLED = dict(temperature=0.8, top_p=0.9, top_k=40, min_p=0.02, seed=11, presence_penalty=0.3,
               frequency_penalty=0.2, repetition_penalty=1.1, max_tokens=24, stop=["\n\n"])


@pytest.fixture(scope="module", params=["plain", "spec"])
def case(request, smollm2_gguf):
    """(url, llm, greedy references of PROMPTS and CHATS) of a server over the plain model or
    the model with its shipped EAGLE head; references computed offline before serving."""
    # test_llm's shapes: in the suite its programs are in the compilation cache already
    draft = dict(draft="default", spec="chain", draft_vocab=4096) if request.param == "spec" \
        else {}
    llm = LLM(str(smollm2_gguf), dtype=jnp.float32, max_batch=2, max_model_len=256, **draft)
    refs = llm.generate(PROMPTS, GREEDY), llm.chat(CHATS, GREEDY)
    with served(build_app(llm, served_model_name=NAME)) as url:
        yield url, llm, refs


def _client(url):
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


async def _completion(client, stream: bool, **kw):
    """(text, token ids, finish reason, usage) of one completion, streamed or not."""
    extra = {"extra_body": {"return_token_ids": True}}
    if not stream:
        r = await client.completions.create(model=NAME, **kw, **extra)
        c = r.choices[0]
        return c.text, c.token_ids, c.finish_reason, r.usage.model_dump(exclude_none=True)
    text, ids, reason, usage = "", [], None, None
    s = await client.completions.create(model=NAME, stream=True,
                                        stream_options={"include_usage": True}, **kw, **extra)
    async for chunk in s:
        for c in chunk.choices:
            text, ids, reason = text + c.text, ids + c.token_ids, c.finish_reason or reason
        usage = chunk.usage.model_dump(exclude_none=True) if chunk.usage else usage
    return text, ids, reason, usage


async def _chat(client, stream: bool, **kw):
    extra = {"extra_body": {"return_token_ids": True}}
    if not stream:
        r = await client.chat.completions.create(model=NAME, **kw, **extra)
        c = r.choices[0]
        return c.message.content, c.token_ids, c.finish_reason, r.usage.model_dump(
            exclude_none=True)
    text, ids, reason, usage = "", [], None, None
    s = await client.chat.completions.create(model=NAME, stream=True,
                                             stream_options={"include_usage": True}, **kw,
                                             **extra)
    async for chunk in s:
        for c in chunk.choices:
            text += c.delta.content or ""
            ids, reason = ids + c.token_ids, c.finish_reason or reason
        usage = chunk.usage.model_dump(exclude_none=True) if chunk.usage else usage
    return text, ids, reason, usage


def _expected(ref):
    n, m = len(ref.prompt_token_ids), len(ref.token_ids)
    return (ref.text, ref.token_ids, ref.finish_reason,
            {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m})


def test_completions_and_chat_whole_and_streamed_equal_offline_greedy(case):
    url, llm, (text_refs, chat_refs) = case

    async def run():
        client = _client(url)
        jobs = [_completion(client, s, prompt=p, max_tokens=16, temperature=0)
                for p in PROMPTS for s in (False, True)]
        jobs += [_chat(client, s, messages=m, max_tokens=16, temperature=0)
                 for m in CHATS for s in (False, True)]
        return await asyncio.gather(*jobs)      # all at once: they share the engine's batch

    got = asyncio.run(run())
    want = [_expected(r) for r in text_refs for _ in range(2)]
    want += [_expected(r) for r in chat_refs for _ in range(2)]
    assert got == want


def test_sse_framing(case):
    url = case[0]
    body = {"model": NAME, "messages": CHATS[0], "max_tokens": 8, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_raw()).decode()
    assert raw.endswith("\n\n")
    events = raw.split("\n\n")[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def _clamped(x):
    return max(x, MIN_LOGPROB)       # JSON's stand-in for -inf


@pytest.mark.parametrize("case", ["plain"], indirect=True)   # the mapping is the server's
def test_sampling_fields_stops_and_logprobs_equal_offline(case):
    url, llm = case[:2]
    sp = SamplingParams(**SAMPLED, logprobs=2)
    ref_text = llm.generate(PROMPTS[0], sp)[0]
    ref_chat = llm.chat(CHATS[0], sp)[0]
    fields = dict(SAMPLED)
    top_k, min_p, rep = (fields.pop(k) for k in ("top_k", "min_p", "repetition_penalty"))
    extra = {"top_k": top_k, "min_p": min_p, "repetition_penalty": rep, "return_token_ids": True}
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    r = client.completions.create(model=NAME, prompt=PROMPTS[0], logprobs=2, extra_body=extra,
                                  **fields).choices[0]
    assert r.token_ids == ref_text.token_ids and r.text == ref_text.text
    assert r.finish_reason == ref_text.finish_reason
    np.testing.assert_allclose(r.logprobs.token_logprobs,
                               [_clamped(lp[t]) for t, lp in zip(ref_text.token_ids,
                                                                 ref_text.logprobs)],
                               atol=1e-4)
    assert [len(d) for d in r.logprobs.top_logprobs] == [len(d) for d in ref_text.logprobs]
    s = client.chat.completions.create(model=NAME, messages=CHATS[0], logprobs=True,
                                       top_logprobs=2, stream=True, extra_body=extra, **fields)
    ids, lps, text = [], [], ""
    for chunk in s:
        for c in chunk.choices:
            ids += c.token_ids
            text += c.delta.content or ""
            lps += c.logprobs.content if c.logprobs else []
    assert ids == ref_chat.token_ids and text == ref_chat.text
    want = [sorted(map(_clamped, d.values()), reverse=True)[:2] for d in ref_chat.logprobs]
    np.testing.assert_allclose([[t.logprob for t in e.top_logprobs] for e in lps], want,
                               atol=1e-4)
    np.testing.assert_allclose([e.logprob for e in lps],
                               [_clamped(d[t]) for t, d in zip(ref_chat.token_ids,
                                                               ref_chat.logprobs)],
                               atol=1e-4)


@pytest.mark.parametrize("case", ["plain"], indirect=True)
def test_refusals_reach_the_openai_client_as_errors(case):
    client = openai.OpenAI(base_url=case[0] + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="n=1") as e:
        client.completions.create(model=NAME, prompt="hi", n=2)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4o", messages=CHATS[0])
    assert [m.id for m in client.models.list()] == [NAME]


@pytest.mark.parametrize("case", ["spec"], indirect=True)
def test_accept_length_counters_equal_the_offline_accept_lengths(case):
    url, llm, (text_refs, chat_refs) = case
    before = [metric(url, f"jaxspec_spec_decode_{k}_total")
              for k in ("cycles", "accepted_tokens", "emitted_tokens")]
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    for p in PROMPTS:
        client.completions.create(model=NAME, prompt=p, max_tokens=16, temperature=0)
    for m in CHATS:
        client.chat.completions.create(model=NAME, messages=m, max_tokens=16, temperature=0)
    after = [metric(url, f"jaxspec_spec_decode_{k}_total")
             for k in ("cycles", "accepted_tokens", "emitted_tokens")]
    accepts = [r.accept_lens or [] for r in text_refs + chat_refs]
    cycles, accepted = sum(map(len, accepts)), sum(map(sum, accepts))
    assert cycles > 0
    assert [a - b for a, b in zip(after, before)] == [cycles, accepted, cycles + accepted]
