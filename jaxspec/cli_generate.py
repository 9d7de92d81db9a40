"""`jaxspec generate PROMPT`: one reply, printed to stdout as it is generated; its figures
(tokens, finish reason, time, tokens/s, the mean accept length when speculating) as one JSON
line on stderr."""
from __future__ import annotations

import argparse
import json
import sys

from jaxspec.cli_options import (add_model_options, add_sampling_options, check_options,
                                 load_llm, stream_reply, writer)

MAX_TOKENS = 128


def add_arguments(p: argparse.ArgumentParser):
    p.add_argument("prompt", help="the prompt ('-': read it from stdin)")
    p.add_argument("--raw", dest="chat", action="store_false",
                   help="the prompt as it is, without the model's chat template")
    add_model_options(p)
    add_sampling_options(p, MAX_TOKENS)


def check(p: argparse.ArgumentParser, args: argparse.Namespace):
    check_options(p, args)
    if args.prompt == "-":
        args.prompt = sys.stdin.read().rstrip("\n")
    if not args.prompt.strip():
        p.error("argument prompt: empty")


def run(args: argparse.Namespace) -> int:
    llm = load_llm(args)
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    out = stream_reply(llm, prompt, args.sampling, writer(sys.stdout))
    print()
    info = {"tokens": len(out.token_ids), "finish_reason": out.finish_reason,
            **{k: round(v, 4) for k, v in out.metrics.items()}}
    if out.accept_lens:     # speculative: tokens per cycle, the bonus token included
        info["accept_len"] = round(sum(a + 1 for a in out.accept_lens) / len(out.accept_lens), 3)
    print(json.dumps(info), file=sys.stderr)
    return 0
