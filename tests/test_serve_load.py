"""A load test of `jaxspec serve` on loopback, bounded in count and time: 200 concurrent
streaming requests of mixed lengths over both endpoints, 20% of them disconnected mid-stream and
10% invalid. Every valid request that stays connected completes with exactly its offline greedy
output (LLM.generate / LLM.chat), every invalid one gets a 400, every disconnected one is
aborted, the running and waiting gauges return to zero with the engine empty, and the server
answers afterwards."""
import asyncio
import json
import random

import httpx

from serve_helpers import metric, served, tiny_chat_dir, tiny_llm, wait_idle  # noqa: F401
from jaxspec import SamplingParams
from jaxspec.serve.app import build_app

NAME = "tiny"
N, N_INVALID, N_LEAVE = 200, 20, 40
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing "
         "matches near old rivers").split()
INVALID = [{"temperature": -1}, {"n": 3}, {"bogus_field": 1}, {"max_tokens": 100_000},
           {"top_p": 1.5}, {"stop": [""]}, {"seed": "7"}, {"presence_penalty": 9}]
TIMEOUT_S = 150


def _requests():
    """The 200 requests: (kind, endpoint, body); kinds 'valid', 'leave' (disconnects after its
    first tokens) and 'invalid', shuffled."""
    rng = random.Random(0)
    kinds = ["invalid"] * N_INVALID + ["leave"] * N_LEAVE + ["valid"] * (N - N_INVALID - N_LEAVE)
    rng.shuffle(kinds)
    out = []
    for i, kind in enumerate(kinds):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 50)))
        chat = i % 2 == 0
        body = {"model": NAME, "stream": True, "temperature": 0, "return_token_ids": True,
                "max_tokens": rng.choice([1, 2, 5, 12, 17, 33, 48])}
        body.update({"messages": [{"role": "user", "content": text}]} if chat else
                    {"prompt": text})
        if i % 3 == 0:
            body["stream_options"] = {"include_usage": True}
        if kind == "leave":
            body.update(max_tokens=120, ignore_eos=True)
        if kind == "invalid":
            body.update(INVALID[i % len(INVALID)])
        out.append((kind, "/v1/chat/completions" if chat else "/v1/completions", body))
    return out


async def _one(client, url, kind, path, body):
    """Runs one request; returns (status, error body) for a refusal, else a record of the
    stream: text, token ids, finish reason, usage, whether [DONE] came."""
    async with client.stream("POST", url + path, json=body) as r:
        if r.status_code != 200:
            return {"status": r.status_code, "error": json.loads(await r.aread())}
        rec = {"status": 200, "text": "", "tokens": [], "reason": None, "usage": None,
               "done": False}
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                rec["done"] = True
                break
            chunk = json.loads(line[6:])
            rec["usage"] = chunk.get("usage") or rec["usage"]
            for ch in chunk["choices"]:
                rec["text"] += ch["delta"].get("content", "") if "delta" in ch else ch["text"]
                rec["tokens"] += ch["token_ids"]
                rec["reason"] = ch["finish_reason"] or rec["reason"]
            if kind == "leave" and rec["tokens"]:
                return rec          # leaving the block closes the connection mid-stream
        return rec


async def _all(url, reqs):
    limits = httpx.Limits(max_connections=N + 10, max_keepalive_connections=N + 10)
    async with httpx.AsyncClient(timeout=TIMEOUT_S, limits=limits) as client:
        return await asyncio.wait_for(
            asyncio.gather(*(_one(client, url, *r) for r in reqs)), TIMEOUT_S)


def test_200_concurrent_streams_with_disconnects_and_invalid_ones(tiny_llm):
    reqs = _requests()
    valid = [i for i, (kind, _, _) in enumerate(reqs) if kind == "valid"]
    sps = {i: SamplingParams(max_tokens=reqs[i][2]["max_tokens"]) for i in valid}
    texts = [i for i in valid if "prompt" in reqs[i][2]]
    chats = [i for i in valid if "messages" in reqs[i][2]]
    ref = dict(zip(texts, tiny_llm.generate([reqs[i][2]["prompt"] for i in texts],
                                            [sps[i] for i in texts])))
    ref.update(zip(chats, tiny_llm.chat([reqs[i][2]["messages"] for i in chats],
                                        [sps[i] for i in chats])))
    with served(build_app(tiny_llm, served_model_name=NAME, max_queue=256)) as url:
        got = asyncio.run(_all(url, reqs))
        for i, ((kind, _, body), rec) in enumerate(zip(reqs, got)):
            if kind == "invalid":
                assert rec["status"] == 400, (body, rec)
                assert set(rec["error"]["error"]) == {"message", "type", "param", "code"}
                continue
            assert rec["status"] == 200, (body, rec)
            if kind == "leave":
                assert rec["tokens"] and not rec["done"]
                continue
            r = ref[i]
            assert rec["done"] and rec["tokens"] == r.token_ids, (i, body)
            assert rec["text"] == r.text and rec["reason"] == r.finish_reason
            if "stream_options" in body:
                assert rec["usage"] == {"prompt_tokens": len(r.prompt_token_ids),
                                        "completion_tokens": len(r.token_ids),
                                        "total_tokens": len(r.prompt_token_ids)
                                        + len(r.token_ids)}
        wait_idle(url, tiny_llm)
        assert metric(url, "jaxspec_request_success_total", finish_reason="abort") == N_LEAVE
        assert metric(url, "jaxspec_requests_rejected_total", reason="invalid") == N_INVALID
        finished = sum(metric(url, "jaxspec_request_success_total", finish_reason=reason)
                       for reason in ("stop", "length"))
        assert finished == len(valid)
        # the server still answers, with the same output as before
        i = texts[0]
        r = httpx.post(url + "/v1/completions", timeout=60,
                       json={**reqs[i][2], "stream": False, "stream_options": None})
        assert r.json()["choices"][0]["text"] == ref[i].text
        assert httpx.get(url + "/health").status_code == 200
