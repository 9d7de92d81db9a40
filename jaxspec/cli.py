"""Command line: `jaxspec generate|train-eagle ...` and `jaxspec-bench`."""
from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional


def _generate(args) -> int:
    from jaxspec import LLM
    llm = LLM(args.model, draft=args.draft, spec=args.spec, max_batch=1,
              max_model_len=args.max_model_len)
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    out = llm.generate(prompt, args.sampling)[0]
    print(out.text)
    info = {"tokens": len(out.token_ids), "finish_reason": out.finish_reason,
            **{k: round(v, 4) for k, v in out.metrics.items()}}
    if out.accept_lens:     # speculative: tokens per cycle, the bonus token included
        info["accept_len"] = round(sum(a + 1 for a in out.accept_lens) / len(out.accept_lens), 3)
    print(json.dumps(info), file=sys.stderr)
    return 0


def _sampling(ap, args):
    """SamplingParams of the options; an invalid value is an argparse error naming its flag."""
    from jaxspec import SamplingParams
    values = {"max_tokens": args.max_tokens, "temperature": args.temperature,
              "top_p": args.top_p}
    for name, value in values.items():
        try:
            SamplingParams(**{name: value})
        except ValueError as e:
            ap.error(f"argument --{name.replace('_', '-')}: {e}")
    return SamplingParams(**values)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="jaxspec", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate a reply to one prompt")
    g.add_argument("prompt")
    g.add_argument("--model", default=None, help="HF model dir or .gguf (default: SmolLM2-135M)")
    g.add_argument("--draft", default=None,
                   help="speculate with this EAGLE-1 or EAGLE-3 head checkpoint, or 'default' "
                        "(the shipped head of the default model) (default: plain decoding, "
                        "unless --spec is given)")
    g.add_argument("--spec", default=None,
                   help="the speculation tree: a preset (naive, chain, tree) or "
                        "STEPSxTOPKxTOKENS such as 4x8x32; alone, with the shipped head "
                        "(default with --draft: the tuned shape for one request)")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--max-model-len", type=int, default=2048)
    g.add_argument("--raw", dest="chat", action="store_false", help="no chat template")
    t = sub.add_parser("train-eagle", help="train an EAGLE draft head", add_help=False)
    t.add_argument("rest", nargs=argparse.REMAINDER)
    args, rest = ap.parse_known_args(argv)
    if args.cmd == "generate":
        if rest:
            g.error(f"unrecognized arguments: {' '.join(rest)}")
        if args.spec is not None:
            from jaxspec.config import ConfigError
            from jaxspec.spec.config import resolve_spec
            try:
                resolve_spec(args.spec)
            except ConfigError as e:
                g.error(f"argument --spec: {e}")
        args.sampling = _sampling(g, args)
        return _generate(args)
    from jaxspec.train.cli import main as train_main
    return train_main(rest + args.rest)


def bench_main(argv: Optional[List[str]] = None) -> int:
    from jaxspec.bench_cli import main as bench
    return bench(argv)


if __name__ == "__main__":
    sys.exit(main())
