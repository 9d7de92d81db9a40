"""A serving benchmark against an OpenAI-compatible server at a URL (`jaxspec serve`, vLLM,
SGLang, ...), after vLLM's and SGLang's bench_serving, so one benchmark measures any of them.

Requests are streamed (server-sent events) from /v1/chat/completions (the server applies its chat
template) or /v1/completions (the last user message as raw text). They are sent at Poisson
arrivals of `request_rate` (inf: all at once), at most `max_concurrency` in flight when given.
Per request, from the moment it is sent: TTFT (to the first chunk with text), ITL (the gaps
between successive chunks with text; a server that sends several tokens a chunk has fewer, longer
gaps), TPOT ((end - first) / (tokens - 1)) and end-to-end latency; output tokens are the server's
usage count (stream_options.include_usage), else the chunks with text. A request that fails (a
non-200 answer, an error event, a broken connection) counts as failed, not as completed.
"""
from __future__ import annotations

import asyncio
import json
import math
import statistics
import time
from typing import List, Optional

import numpy as np

from jaxspec.benchmark.serving import metrics, poisson_arrivals

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


def served_model(url: str, timeout: float = 30.0) -> str:
    """The first model the server lists at /v1/models."""
    import httpx
    r = httpx.get(url.rstrip("/") + "/v1/models", timeout=timeout)
    r.raise_for_status()
    data = r.json().get("data") or []
    if not data:
        raise RuntimeError(f"{url}/v1/models lists no model")
    return data[0]["id"]


def request_body(chat: List[dict], endpoint: str, model: str, max_tokens: int,
                 temperature: float, top_p: float, ignore_eos: bool) -> dict:
    body = {"model": model, "max_tokens": max_tokens, "temperature": temperature,
            "top_p": top_p, "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    if endpoint == "chat":
        body["messages"] = chat
    else:
        body["prompt"] = next(m["content"] for m in reversed(chat) if m["role"] == "user")
    return body


def _piece(choice: dict) -> str:
    if "delta" in choice:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def _one(client, url: str, body: dict, rec: dict, t0: float):
    """Streams one request, filling rec: start, first, finish (seconds from t0), itl, tokens,
    reason, error."""
    rec["start"] = time.perf_counter() - t0
    chunks, last = 0, None
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                rec["error"] = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec["error"] = str(chunk["error"])[:300]
                    return
                if chunk.get("usage"):
                    rec["usage_tokens"] = chunk["usage"].get("completion_tokens")
                for choice in chunk.get("choices") or ():
                    rec["reason"] = choice.get("finish_reason") or rec["reason"]
                    if _piece(choice):
                        t = time.perf_counter() - t0
                        if last is None:
                            rec["first"] = t
                        else:
                            rec["itl"].append(t - last)
                        last, chunks = t, chunks + 1
    except Exception as e:      # a broken connection, a timeout: this request failed
        rec["error"] = f"{type(e).__name__}: {e}"[:300]
        return
    rec["finish"] = time.perf_counter() - t0
    rec["tokens"] = rec.pop("usage_tokens", None) or chunks


async def _run(url: str, bodies: List[dict], arrivals: List[float],
               max_concurrency: Optional[int], timeout: float, progress=None) -> List[dict]:
    import httpx
    limit = asyncio.Semaphore(max_concurrency or len(bodies))
    recs = [{"arrival": None, "start": None, "first": None, "finish": None, "tokens": 0,
             "reason": None, "itl": [], "error": None} for _ in bodies]
    connections = min(max_concurrency or len(bodies), len(bodies))
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        t0 = time.perf_counter()

        async def send(i):
            await asyncio.sleep(max(0.0, arrivals[i] - (time.perf_counter() - t0)))
            async with limit:
                await _one(client, url, bodies[i], recs[i], t0)
            if progress:
                progress()

        await asyncio.gather(*(send(i) for i in range(len(bodies))))
    for r in recs:   # latencies count from the send (a client-side wait is not the server's)
        r["arrival"] = r["start"]
    return recs


def _stats(xs: List[float], name: str) -> dict:
    out = {f"mean_{name}": statistics.fmean(xs) if xs else None}
    for q in (50, 90, 99):
        out[f"p{q}_{name}"] = float(np.percentile(xs, q)) if xs else None
    return out


def summarize(recs: List[dict], request_rate: float) -> dict:
    """serving.metrics of the completed requests (TTFT, TPOT, E2E, throughput) with ITL, failures
    and the concurrency actually reached."""
    ok = [r for r in recs if r["error"] is None and r["finish"] is not None]
    res = metrics(ok, request_rate, "url") if ok else {"completed": 0}
    res["requests"] = len(recs)
    res["failed"] = len(recs) - len(ok)
    res["errors"] = sorted({r["error"] for r in recs if r["error"]})[:5]
    res.update(_stats([g for r in ok for g in r["itl"]], "itl_s"))
    spans = [(r["start"], r["finish"]) for r in ok]
    res["peak_concurrency"] = max((sum(1 for a, b in spans if a <= t < b) for t, _ in spans),
                                  default=0)
    return res


def run(url: str, chats: List[List[dict]], *, endpoint: str = "chat", model: Optional[str] = None,
        max_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
        request_rate: float = math.inf, max_concurrency: Optional[int] = None, seed: int = 0,
        ignore_eos: bool = False, timeout: float = 600.0, progress=None) -> dict:
    """One serving run of chats against the server at url (its base, http://host:port)."""
    if endpoint not in ENDPOINTS:
        raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    base = url.rstrip("/")
    model = model or served_model(base)
    bodies = [request_body(c, endpoint, model, max_tokens, temperature, top_p, ignore_eos)
              for c in chats]
    arrivals = poisson_arrivals(len(chats), request_rate, seed)
    recs = asyncio.run(_run(base + ENDPOINTS[endpoint], bodies, arrivals, max_concurrency,
                            timeout, progress))
    res = summarize(recs, request_rate)
    res.update(url=base, endpoint=endpoint, model=model, max_concurrency=max_concurrency,
               max_tokens=max_tokens)
    res["per_request"] = [{k: r[k] for k in ("start", "first", "finish", "tokens", "reason",
                                             "error")} for r in recs]
    return res
