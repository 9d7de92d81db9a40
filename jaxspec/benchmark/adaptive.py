"""Adaptive speculation: per batch size, the config (or plain decoding) with the highest
tokens/s on a short run of the workload itself, timed with each config after its warm-up.

A probe runs `probe_chats` (the first max(3 x batch, 8) prompts of the run, each once) at the
run's sampling parameters and max_tokens, EOS included, and times the whole of it: prefill,
admission and the batch's ramp-down count as they count in the timed run. A probe of decode
steps alone (every slot busy, EOS ignored) misses them, and they decide the question where
prompts are long: there speculation can lose to plain decoding end to end while its cycles
alone beat plain steps. The decode-only figures are kept in each probe as well (cost per step
or cycle, accept length) for the record.
Speculation is chosen only where it beats plain decoding by `margin`.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Dict, List, Optional

MIN_PROBE_REQUESTS = 8
PROBE_BATCHES = 3     # requests per probe: this many batches' worth


def probe_chats(prompts, batch: int) -> list:
    """The first max(PROBE_BATCHES x batch, MIN_PROBE_REQUESTS) chats of the run, each once
    while there are enough; with fewer prompts than that, they repeat to fill one batch."""
    k = max(PROBE_BATCHES * batch, MIN_PROBE_REQUESTS)
    if len(prompts) < k:
        k = max(len(prompts), batch)
    return [prompts[i % len(prompts)]["chat"] for i in range(k)]


def probe(llm, chats, sp, spec: bool, tokens: Optional[int] = None) -> dict:
    """Tokens/s of `chats` run through llm.generate at `sp` (max_tokens: `tokens` if given),
    with the decode-only cost per step (plain) or cycle (spec) and the accept length."""
    if tokens:
        sp = dataclasses.replace(sp, max_tokens=tokens)
    t0 = time.perf_counter()
    outs = llm.generate(chats, sp)
    secs = time.perf_counter() - t0
    ntok = sum(len(o.token_ids) for o in outs)
    per, taus = [], []
    for o in outs:
        decode_s = o.metrics["latency_s"] - o.metrics["ttft_s"]
        steps = len(o.accept_lens or []) if spec else len(o.token_ids) - 1
        if steps > 0 and decode_s > 0:
            per.append(decode_s / steps)
        taus += [a + 1 for a in (o.accept_lens or [])]
    return {"tokens_per_s": ntok / secs if secs > 0 else 0.0, "requests": len(chats),
            "tokens": ntok, "seconds": secs,
            "decode_cost_s": statistics.median(per) if per else float("nan"),
            "accept_len": statistics.fmean(taus) if spec and taus else 1.0}


def choose(probes: Dict[str, dict], margin: float = 0.0) -> dict:
    """probes: mode label -> probe(); 'plain' must be there. The choice and its expectation."""
    base = probes["plain"]["tokens_per_s"]
    best, best_rate = "plain", base
    for label, p in probes.items():
        if label != "plain" and p["tokens_per_s"] > best_rate * (1 + margin):
            best, best_rate = label, p["tokens_per_s"]
    return {"choice": best, "expected_speedup": best_rate / base if base else 1.0,
            "speculate": best != "plain", "probes": probes}


def attach_measured(decisions: Dict[int, dict], rows: List[dict]) -> List[dict]:
    """The measured figures of each batch size's choice, next to what the probe expected."""
    out = []
    for b, d in sorted(decisions.items()):
        chosen: Optional[dict] = next((r for r in rows if r["batch"] == b
                                       and r["mode"] == d["choice"]), None)
        out.append({"batch": b, **d,
                    "measured_tokens_per_s": chosen["tokens_per_s"] if chosen else None,
                    "measured_speedup": chosen.get("speedup") if chosen else None})
    return out
