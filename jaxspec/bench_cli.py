"""`jaxspec-bench`: plain vs speculative decoding on a prompt set, side by side.

With no arguments: the default model and shipped draft head, a handful of MT-bench questions,
greedy, batch 1. Prints a table (tokens/s, mean accept length, speedup); --json writes it.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import List, Optional

from tqdm import tqdm


def _prompts(args):
    from jaxspec.datasets import load_jsonl_prompts, mt_bench
    if args.dataset == "mt-bench":
        return mt_bench(args.num_prompts)
    return load_jsonl_prompts(args.dataset, args.num_prompts)


def _run(llm, prompts, sp, batch, label):
    """Generates in groups of `batch`; returns (outputs, seconds)."""
    outs = []
    t0 = time.perf_counter()
    for i in tqdm(range(0, len(prompts), batch), desc=label, leave=False):
        outs += llm.generate([p["chat"] for p in prompts[i:i + batch]], sp)
    return outs, time.perf_counter() - t0


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="jaxspec-bench", description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default=None, help="draft head checkpoint (default: shipped head)")
    ap.add_argument("--dataset", default="mt-bench", help="mt-bench or a jsonl path")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--spec", default="chain", help="comma list of presets (naive,chain,tree)")
    ap.add_argument("--no-spec", action="store_true", help="plain decoding only")
    ap.add_argument("--json", default=None, help="write results to this file")
    args = ap.parse_args(argv)

    from jaxspec import LLM, SamplingParams
    prompts = _prompts(args)
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    plain = LLM(args.model, max_batch=args.batch_size, max_model_len=2048)
    _run(plain, prompts[:1], sp, args.batch_size, "warm-up")
    outs, secs = _run(plain, prompts, sp, args.batch_size, "plain")
    ntok = sum(len(o.token_ids) for o in outs)
    rows = [dict(mode="plain", tokens=ntok, seconds=secs, tokens_per_s=ntok / secs,
                 accept_len=None, speedup=1.0)]
    base_tps = ntok / secs
    if not args.no_spec:
        for preset in args.spec.split(","):
            llm = LLM(args.model, max_batch=args.batch_size, max_model_len=2048,
                      draft=args.draft, spec=preset)
            _run(llm, prompts[:1], sp, args.batch_size, "warm-up")
            souts, ssecs = _run(llm, prompts, sp, args.batch_size, preset)
            same = all(a.token_ids == b.token_ids for a, b in zip(outs, souts))
            stok = sum(len(o.token_ids) for o in souts)
            acc = [a + 1 for o in souts for a in o.accept_lens]
            rows.append(dict(mode=preset, tokens=stok, seconds=ssecs, tokens_per_s=stok / ssecs,
                             accept_len=sum(acc) / max(len(acc), 1),
                             speedup=(stok / ssecs) / base_tps, equals_plain=same))
    print(f"{'mode':8s} {'tokens':>7s} {'tok/s':>9s} {'accept':>7s} {'speedup':>8s}")
    for r in rows:
        acc = f"{r['accept_len']:.2f}" if r["accept_len"] is not None else "-"
        print(f"{r['mode']:8s} {r['tokens']:7d} {r['tokens_per_s']:9.1f} {acc:>7s} "
              f"{r['speedup']:7.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
