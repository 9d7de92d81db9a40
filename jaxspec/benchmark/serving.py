"""Serving-style run, after SGLang's bench_serving: requests arrive by a Poisson process at
`request_rate` (inf: all at once); throughput, TTFT, TPOT, end-to-end latency and percentiles
from per-request timestamps.

With `LLM.stream`, each request is submitted when it arrives and the engine keeps running the
ones already in flight (continuous batching). Timestamps are taken when the benchmark reads a
delta, as a client would see them. Without `stream`, the requests that have arrived are
submitted together to the blocking `generate` (arrival-ordered waves): a request that arrives
during a wave waits for it, and its TTFT counts that wait.
"""
from __future__ import annotations

import math
import statistics
import time
from typing import List, Optional

import numpy as np

# A `next()` on a request's stream that took longer than this ran an engine step; faster ones
# returned deltas already read by an earlier step.
_STEP_S = 2e-4


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> List[float]:
    """Arrival offsets in seconds: exponential gaps of mean 1/rate; all 0 for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    return list(np.cumsum(gaps) - gaps[0])


def _serve_stream(llm, chats, sp, arrivals, tag) -> List[dict]:
    recs = [{"arrival": a, "first": None, "finish": None, "tokens": 0, "reason": None}
            for a in arrivals]
    live = {}
    nxt = 0
    t0 = time.perf_counter()
    while nxt < len(chats) or live:
        now = time.perf_counter() - t0
        while nxt < len(chats) and arrivals[nxt] <= now:
            live[nxt] = llm.stream([chats[nxt]], sp, request_ids=[f"{tag}-{nxt}"])
            nxt += 1
        if not live:
            time.sleep(max(0.0, arrivals[nxt] - (time.perf_counter() - t0)))
            continue
        for i in list(live):
            while True:   # read what is already there, then one engine step
                ta = time.perf_counter()
                d = next(live[i], None)
                tb = time.perf_counter()
                r = recs[i]
                if d is None:
                    live.pop(i)
                    break
                if d.token_ids:
                    r["tokens"] += len(d.token_ids)
                    if r["first"] is None:
                        r["first"] = tb - t0
                if d.finished:
                    r["finish"], r["reason"] = tb - t0, d.finish_reason
                    live.pop(i)
                    break
                if tb - ta > _STEP_S:
                    break
    return recs


def _serve_waves(llm, chats, sp, arrivals) -> List[dict]:
    recs = [{"arrival": a, "first": None, "finish": None, "tokens": 0, "reason": None}
            for a in arrivals]
    nxt = 0
    t0 = time.perf_counter()
    while nxt < len(chats):
        now = time.perf_counter() - t0
        if arrivals[nxt] > now:
            time.sleep(arrivals[nxt] - now)
            now = time.perf_counter() - t0
        wave = []
        while nxt < len(chats) and arrivals[nxt] <= now:
            wave.append(nxt)
            nxt += 1
        sub = time.perf_counter() - t0
        outs = llm.generate([chats[i] for i in wave], sp)
        for i, o in zip(wave, outs):
            r = recs[i]
            r["tokens"], r["reason"] = len(o.token_ids), o.finish_reason
            r["first"] = sub + o.metrics["ttft_s"]
            r["finish"] = sub + o.metrics["latency_s"]
    return recs


def serve(llm, chats, sp, request_rate: float, seed: int = 0, tag: str = "bench",
          how: Optional[str] = None) -> dict:
    """One serving run; how: 'stream', 'waves' or None (stream when the API has it)."""
    how = how or ("stream" if hasattr(llm, "stream") else "waves")
    arrivals = poisson_arrivals(len(chats), request_rate, seed)
    if how == "stream":
        recs = _serve_stream(llm, chats, sp, arrivals, tag)
    else:
        recs = _serve_waves(llm, chats, sp, arrivals)
    return metrics(recs, request_rate, how)


def _pct(xs, q):
    return float(np.percentile(xs, q)) if xs else None


def metrics(recs: List[dict], request_rate: float, how: str) -> dict:
    done = [r for r in recs if r["finish"] is not None]
    ttft = [r["first"] - r["arrival"] for r in done if r["first"] is not None]
    tpot = [(r["finish"] - r["first"]) / (r["tokens"] - 1) for r in done
            if r["first"] is not None and r["tokens"] > 1]
    e2e = [r["finish"] - r["arrival"] for r in done]
    start = min(r["arrival"] for r in recs) if recs else 0.0
    duration = max((r["finish"] for r in done), default=start) - start
    out_tok = sum(r["tokens"] for r in done)
    res = {"how": how, "request_rate": request_rate if not math.isinf(request_rate) else "inf",
           "requests": len(recs), "completed": len(done), "duration_s": duration,
           "request_throughput": len(done) / duration if duration > 0 else 0.0,
           "output_throughput": out_tok / duration if duration > 0 else 0.0,
           "output_tokens": out_tok}
    for name, xs in (("ttft_s", ttft), ("tpot_s", tpot), ("e2e_s", e2e)):
        res[f"mean_{name}"] = statistics.fmean(xs) if xs else None
        for q in (50, 90, 99):
            res[f"p{q}_{name}"] = _pct(xs, q)
    return res
