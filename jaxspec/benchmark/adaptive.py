"""Adaptive speculation: per batch size, the config (or plain decoding) with the highest
expected tokens/s, from costs measured on a few probe prompts.

    plain:  1 / step_s                      tokens per second per slot
    spec:   accept_len / cycle_s            accept_len = mean accepted + 1 (the bonus token)

step_s and cycle_s come from each request's decode time (latency - TTFT) over its decode steps
or cycles, with every slot busy (the probe fills the batch and ignores EOS), so they are the
costs at that batch size. Speculation is chosen only where it beats plain decoding by `margin`.
"""
from __future__ import annotations

import dataclasses
import statistics
from typing import Dict, List, Optional

PROBE_TOKENS = 33     # 1 from prefill + 32 decoded: whole plain decode chunks of 16


def probe_chats(prompts, batch: int, n: int = 0) -> list:
    """`max(batch, n)` chats, the first prompts repeated to fill the batch."""
    k = max(batch, n)
    return [prompts[i % len(prompts)]["chat"] for i in range(k)]


def probe(llm, chats, sp, spec: bool, tokens: Optional[int] = None) -> dict:
    """Cost per decode step (plain) or cycle (spec) and accept length at this batch size."""
    sp = dataclasses.replace(sp, max_tokens=tokens or PROBE_TOKENS, ignore_eos=True)
    outs = llm.generate(chats, sp)
    per = []
    taus = []
    for o in outs:
        decode_s = o.metrics["latency_s"] - o.metrics["ttft_s"]
        steps = len(o.accept_lens or []) if spec else len(o.token_ids) - 1
        if steps > 0 and decode_s > 0:
            per.append(decode_s / steps)
        taus += [a + 1 for a in (o.accept_lens or [])]
    cost = statistics.median(per) if per else float("nan")
    tau = statistics.fmean(taus) if spec and taus else 1.0
    return {"cost_s": cost, "accept_len": tau, "tokens_per_s_per_slot": tau / cost}


def choose(probes: Dict[str, dict], margin: float = 0.0) -> dict:
    """probes: mode label -> probe(); 'plain' must be there. The choice and its expectation."""
    base = probes["plain"]["tokens_per_s_per_slot"]
    best, best_rate = "plain", base
    for label, p in probes.items():
        if label != "plain" and p["tokens_per_s_per_slot"] > best_rate * (1 + margin):
            best, best_rate = label, p["tokens_per_s_per_slot"]
    return {"choice": best, "expected_speedup": best_rate / base, "speculate": best != "plain",
            "probes": probes}


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
