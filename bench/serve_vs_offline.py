"""Serving throughput against offline generate on the same prompts, back to back in one process.

Offline: `LLM.chat(prompts)` with every prompt submitted at once (max_batch slots busy).
Served: `jaxspec serve`'s app over the same LLM on a loopback port, driven by `jaxspec-bench
--url` in a separate process (so the client's work does not share this process's interpreter)
at --concurrency requests in flight, streaming chat completions. Both greedy with the same
max_tokens, so both generate the same tokens (checked). Passes alternate (offline, served) after
one warm-up pass of each; the figure is the median over passes of served / offline tokens/s.

    python -m bench.serve_vs_offline --num-prompts 32 --max-tokens 64 --concurrency 8
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def offline(llm, chats, sp) -> tuple:
    t0 = time.perf_counter()
    outs = llm.chat(chats, sp)
    secs = time.perf_counter() - t0
    return sum(len(o.token_ids) for o in outs) / secs, [len(o.token_ids) for o in outs]


def served(url, args) -> tuple:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        cmd = [sys.executable, "-m", "jaxspec.bench_cli", "--url", url, "--num-prompts",
               str(args.num_prompts), "--max-tokens", str(args.max_tokens),
               "--max-concurrency", str(args.concurrency), "--dataset", args.dataset,
               "--json", out, "--quiet"]
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        row = json.load(open(out))["serving"][0]
    if row["failed"]:
        raise SystemExit(f"served requests failed: {row['errors']}")
    return row["output_throughput"], [r["tokens"] for r in row["per_request"]], row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--spec", default=None)
    ap.add_argument("--dataset", default="mt-bench")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--passes", type=int, default=3)
    args = ap.parse_args(argv)

    from jaxspec import LLM, SamplingParams
    from jaxspec.benchmark import prompts as P
    from jaxspec.serve.app import build_app
    from jaxspec.serve.server import ThreadedServer

    llm = LLM(args.model, draft=args.draft, spec=args.spec, max_batch=args.max_batch,
              max_model_len=args.max_model_len)
    chats = [p["chat"] for p in P.load_prompts(args.dataset, args.num_prompts)]
    sp = SamplingParams(max_tokens=args.max_tokens)
    rates = {"offline": [], "served": []}
    for i in range(args.passes + 1):            # pass 0 warms both paths up (compiles)
        llm_rate, want = offline(llm, chats, sp)
        # the server's engine thread owns the engine while it runs: one server per pass
        server = ThreadedServer(build_app(llm, served_model_name="bench"), log_level="error")
        server.start()
        try:
            srv_rate, got, row = served(server.url, args)
        finally:
            server.stop()
        if got != want:
            raise SystemExit("served outputs differ from offline ones in length")
        print(f"pass {i}{' (warm-up)' if i == 0 else ''}: offline {llm_rate:.1f} tok/s, "
              f"served {srv_rate:.1f} tok/s ({srv_rate / llm_rate:.1%}); served TTFT p50 "
              f"{row['p50_ttft_s'] * 1e3:.0f} ms, ITL p50 {row['p50_itl_s'] * 1e3:.0f} ms",
              flush=True)
        if i:
            rates["offline"].append(llm_rate)
            rates["served"].append(srv_rate)
    ratio = statistics.median(s / o for s, o in zip(rates["served"], rates["offline"]))
    print(json.dumps({"prompts": len(chats), "max_tokens": args.max_tokens,
                      "concurrency": args.concurrency, "max_batch": args.max_batch,
                      "offline_tok_s": rates["offline"], "served_tok_s": rates["served"],
                      "served_over_offline_median": round(ratio, 4)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
