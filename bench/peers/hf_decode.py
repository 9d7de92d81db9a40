"""Peer yardstick: HF transformers greedy decode with a static cache (optionally compiled).

Random weights of the same shape as bench/common.py's configs; batch 1; ms per new token.
Usage: python bench/peers/hf_decode.py --shape smollm2-135m [--compile] [--new 128]
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

HF_SHAPES = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         rope_theta=100000.0, tie_word_embeddings=True),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      rope_theta=500000.0),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=512)
    args = ap.parse_args()
    cfg = LlamaConfig(**HF_SHAPES[args.shape], max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    if args.compile:
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    ids = torch.randint(0, cfg.vocab_size, (1, args.prompt), device="cuda")
    kw = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False,
              cache_implementation="static", pad_token_id=0)
    with torch.inference_mode():
        for _ in range(2):
            model.generate(ids, **kw)
        torch.cuda.synchronize()
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            model.generate(ids, **kw)
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        # prefill cost measured separately and removed, so the figure is per decode step
        t0 = time.perf_counter()
        model.generate(ids, **{**kw, "max_new_tokens": 1, "min_new_tokens": 1})
        torch.cuda.synchronize()
        pre = time.perf_counter() - t0
    ms = (sorted(ts)[1] - pre) / (args.new - 1) * 1e3
    res = dict(peer="hf-transformers", shape=args.shape, compiled=args.compile, ms_per_token=ms)
    print(json.dumps(res))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"hf_{args.shape}_{int(args.compile)}.json"), "w") as f:
            json.dump(res, f)


if __name__ == "__main__":
    main()
