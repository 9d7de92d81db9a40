"""Command line: `jaxspec generate|train-eagle ...` and `jaxspec-bench`."""
from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional


def _generate(args) -> int:
    from jaxspec import LLM, SamplingParams
    llm = LLM(args.model, max_batch=1, max_model_len=args.max_model_len)
    sp = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens)
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    out = llm.generate(prompt, sp)[0]
    print(out.text)
    print(json.dumps({"tokens": len(out.token_ids), "finish_reason": out.finish_reason,
                      **{k: round(v, 4) for k, v in out.metrics.items()}}), file=sys.stderr)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="jaxspec", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate a reply to one prompt")
    g.add_argument("prompt")
    g.add_argument("--model", default=None, help="HF model dir or .gguf (default: SmolLM2-135M)")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--max-model-len", type=int, default=2048)
    g.add_argument("--raw", dest="chat", action="store_false", help="no chat template")
    t = sub.add_parser("train-eagle", help="train an EAGLE draft head", add_help=False)
    t.add_argument("rest", nargs=argparse.REMAINDER)
    args, rest = ap.parse_known_args(argv)
    if args.cmd == "generate":
        return _generate(args)
    from jaxspec.train.cli import main as train_main
    return train_main(rest + args.rest)


def bench_main(argv: Optional[List[str]] = None) -> int:
    from jaxspec.bench_cli import main as bench
    return bench(argv)


if __name__ == "__main__":
    sys.exit(main())
