"""How busy a batch's slots are under the engine's admission rule, replayed from a benchmark run
(issue 8).

At batch 64 a speculative pass is device-bound, and its device time is calls x cycles a call,
whatever share of the slots has work in them. A slot freed in call c gets a newcomer at the first
admission from call c + 1 + lag: the host reads call c's tokens only after it has dispatched call
c + 1 (lag 1), and admits every `admit_interval` calls while slots run. This replays that rule on
a run's own requests (their decode steps or cycles, in submission order, from `jaxspec-bench
--json`) and prints the share of slot-cycles that did work (occupancy) and the calls it took,
for the run's setting, without the lag, with a refill every cycle (no lag, interval 1, one
cycle a call: what a refill inside the cycle program would reach), and over the requests
replayed --repeat times (a longer pass, whose end, where slots drain with nothing waiting,
weighs less).
Usage: python -m bench.occupancy RUN.json [--cycles-per-call 4] [--plain-steps 16] [--repeat 4]
"""
from __future__ import annotations

import argparse
import json
from typing import List, NamedTuple, Sequence

import numpy as np


class Occupancy(NamedTuple):
    share: float      # slot-cycles with work / (calls x cycles a call x slots)
    calls: int
    admissions: int


def simulate(lengths: Sequence[int], slots: int, per_call: int, interval: int = 1,
             lag: int = 1) -> Occupancy:
    """lengths: the cycles (or decode steps) each request runs, in arrival order; all waiting
    from the start. Each call runs per_call cycles on every slot with work; a request whose last
    cycle ran in call c frees its slot for the admissions from call c + 1 + lag on; admissions
    take the waiting requests into free slots, every `interval` calls while any slot is held
    (at once when none is)."""
    waiting: List[int] = list(lengths)[::-1]
    left = np.zeros(slots, np.int64)
    held = np.zeros(slots, bool)
    free_at = np.full(slots, -1, np.int64)       # call from which a finished slot is free
    since = calls = busy = admissions = 0
    while waiting or held.any():
        held &= ~((free_at >= 0) & (free_at <= calls))
        if not (waiting or held.any()):
            break
        if waiting and (not held.any() or since + 1 >= interval):
            since, took = 0, False
            for s in np.flatnonzero(~held):
                if not waiting:
                    break
                left[s], held[s], free_at[s], took = waiting.pop(), True, -1, True
            admissions += took
        elif waiting:
            since += 1
        ran = np.minimum(left, per_call) * held
        busy += int(ran.sum())
        done = held & (left > 0) & (left <= per_call)
        left -= ran
        free_at[done] = calls + 1 + lag
        calls += 1
    return Occupancy(busy / (calls * per_call * slots), calls, admissions)


def run_lengths(run: dict, requests: Sequence[dict]) -> List[int]:
    """Cycles (speculative) or decode steps (plain: every token after the admission's first)
    of each request of a `jaxspec-bench --json` row."""
    if run["mode"] == "plain":
        return [max(0, r["tokens"] - 1) for r in requests]
    return [len(r["accept_lens"]) for r in requests]


def report(path: str, cycles_per_call: int, plain_steps: int, repeat: int = 1):
    data = json.load(open(path))
    for run in data["rows"]:
        key = f"b{run['batch']}/{run['mode']}"
        if key not in data.get("requests", {}):
            continue
        lengths = run_lengths(run, data["requests"][key])
        k = plain_steps if run["mode"] == "plain" else cycles_per_call
        interval = run.get("admit_interval") or 1
        rows = [(f"as run (per call {k}, interval {interval}, lag 1)",
                 simulate(lengths, run["batch"], k, interval, 1)),
                ("no lag", simulate(lengths, run["batch"], k, interval, 0)),
                ("refill every cycle", simulate(lengths, run["batch"], 1, 1, 0))]
        if repeat > 1:   # a longer pass: the drain at its end weighs less
            rows.append((f"as run, the requests {repeat} times",
                         simulate(lengths * repeat, run["batch"], k, interval, 1)))
        print(f"{key}: {len(lengths)} requests, {sum(lengths)} request-cycles")
        for name, o in rows:
            print(f"  {name:38} occupancy {o.share:6.1%}  calls {o.calls:5}  "
                  f"admissions {o.admissions}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="jaxspec-bench --json files")
    ap.add_argument("--cycles-per-call", type=int, default=4)
    ap.add_argument("--plain-steps", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=4,
                    help="also replay the requests this many times over, as one longer pass")
    args = ap.parse_args()
    for path in args.runs:
        report(path, args.cycles_per_call, args.plain_steps, args.repeat)


if __name__ == "__main__":
    main()
