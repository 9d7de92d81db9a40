"""The host's work in `LLM.generate` outside the engine's steps, for a batch of chats (issue 8).

Before the first device call, generate renders every chat through the chat template, encodes
them as one batch, checks each fits and adds each to the engine; the device idles meanwhile.
This times those parts on the default or given model (no device work is queued), and the
decoding of N finished outputs of T tokens (done in the engine's steps as requests finish).

    python3 -m bench.bench_host_parts [--model PATH] [--requests 384] [--tokens 128]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from jaxspec import datasets
from jaxspec.llm import LLM
from jaxspec.sampling import SamplingParams


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--requests", type=int, default=384)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args()
    llm = LLM(args.model, max_batch=64, max_model_len=2048)
    chats = [q["chat"] for q in datasets.mt_bench()]
    chats = (chats * (args.requests // len(chats) + 1))[:args.requests]
    sp = SamplingParams(max_tokens=args.tokens, temperature=0.0)
    tok = llm.tokenizer
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        texts = [tok.render_chat(c) for c in chats]
        t1 = time.perf_counter()
        tok.encode_batch(texts, add_special_tokens=False)
        t2 = time.perf_counter()
        encoded, sps = llm._normalize(chats, sp)          # render + encode + checks, as run
        t3 = time.perf_counter()
        rids = llm._submit(encoded, sps, stream=False)
        t4 = time.perf_counter()
        llm.engine.drop(rids)                              # nothing ran: drop them again
        print(f"render {1e3 * (t1 - t0):.1f} ms, encode_batch {1e3 * (t2 - t1):.1f} ms, "
              f"generate's encoding {1e3 * (t3 - t2):.1f} ms, submit {1e3 * (t4 - t3):.1f} ms",
              flush=True)
    outs = np.random.default_rng(0).integers(100, llm.config.vocab_size,
                                             (args.requests, args.tokens))
    t0 = time.perf_counter()
    for o in outs:
        tok.decode(o.tolist())
    print(f"decode {args.requests} x {args.tokens} tokens: {1e3 * (time.perf_counter() - t0):.1f} ms")


if __name__ == "__main__":
    main()
