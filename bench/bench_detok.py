"""Host cost of streaming text (issue 6): the engine's running text for B requests, each given
`--per-step` new tokens a step, decoded by windows of the output (two `decode` calls a request a
step) or by the tokenizer's incremental decoder (`Tokenizer.stream_decoder`). Host only: no
device, any machine; the text of both equals the full decode (checked at the end).

    python -m bench.bench_detok [--batch 64] [--steps 128] [--per-step 2] [--model GGUF]
"""
from __future__ import annotations

import argparse
import time

from jaxspec.engine.loop import Engine, Request
from jaxspec.tokenizer import Tokenizer
from jaxspec.weights import default_model_path

TEXT = ("Here is a short answer with numbers 1, 2 and 3, some code `x = f(y)`, accents (café, "
        "naïve), and a list:\n- first item\n- second item 日本語 🎉\n")


def run(tok, stream: bool, batch: int, steps: int, per_step: int) -> float:
    """Seconds a step for `batch` requests."""
    eng = Engine.__new__(Engine)
    eng.detokenize = tok.decode
    eng.stream_decoder = tok.stream_decoder if stream else None
    ids = tok.encode(TEXT * (steps * per_step // 20 + 1), add_special_tokens=False)
    reqs = []
    for b in range(batch):
        r = Request.__new__(Request)
        r.output, r.detok_text, r.prefix_offset, r.read_offset, r.decoder = [], "", 0, 0, None
        reqs.append(r)
    t0 = time.perf_counter()
    for s in range(steps):
        for b, r in enumerate(reqs):
            r.output += ids[s * per_step + b % 7: (s + 1) * per_step + b % 7][:per_step]
            eng._text_so_far(r)
    dt = (time.perf_counter() - t0) / steps
    for r in reqs:
        assert tok.decode(r.output).startswith(r.detok_text)
    return dt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--per-step", type=int, default=2, help="new tokens a request a step")
    a = ap.parse_args()
    tok = Tokenizer.from_gguf(a.model or default_model_path())
    print(f"batch {a.batch}, {a.per_step} new tokens a request a step, {a.steps} steps")
    for stream in (False, True, False, True):
        ms = run(tok, stream, a.batch, a.steps, a.per_step) * 1e3
        print(f"  {'stream decoder' if stream else 'decode windows':15s} {ms:7.3f} ms a step"
              f"  ({ms * 1e3 / a.batch:6.1f} us a request)")


if __name__ == "__main__":
    main()
