"""Prints each row of `jaxspec-bench --json` files: tokens/s of every pass, the speedup of the
lower speculative pass over the lower plain pass, and where each pass's time went (the engine's
host and wait seconds, and the time before, between and after its steps).

    python3 -m bench.pass_parts RUN.json [RUN2.json ...]
"""
from __future__ import annotations

import json
import sys


def rows_of(path: str):
    res = json.load(open(path))
    base = {}
    for r in res["rows"]:
        lowest = min(r["tokens_per_s_runs"])
        if r.get("mode") == "plain":
            base[r["batch"]] = lowest
        yield r, lowest / base[r["batch"]] if r["batch"] in base else None


def main(paths):
    for path in paths:
        print(path)
        for r, speedup in rows_of(path):
            runs = " / ".join(f"{x:,.0f}" for x in r["tokens_per_s_runs"])
            tau = f" tau {r['accept_len']:.3f}" if r.get("accept_len") else ""
            sp = f" {speedup:.3f}x" if speedup else ""
            print(f"  b{r['batch']} {r.get('mode')}: {runs}{sp}{tau}")
            for g in r.get("gc_runs", []):
                print("    pass {:.3f} s: host {:.3f}, wait {:.3f}, before {:.3f}, between {:.3f}, "
                      "after {:.3f}".format(*(g.get(k, float("nan")) for k in (
                          "pass_s", "host_s", "wait_s", "before_steps_s", "between_steps_s",
                          "after_steps_s"))))


if __name__ == "__main__":
    main(sys.argv[1:])
