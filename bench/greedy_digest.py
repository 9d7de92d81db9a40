"""One digest of greedy outputs per mode: a check that a change to the engine leaves every
greedy output as it was.

The fixed set: the first turns of the 16 MT-bench prompts in bench/mtbench16.jsonl, as chats
(through the model's chat template), 64 new tokens each, temperature 0, fp32, on the default
model (SmolLM2-135M-Instruct; speculative modes with the shipped EAGLE-1 head). Each mode
prints its name, the first 16 hex digits of the sha256 of its 16 outputs' token ids (a JSON
list of lists), the total token count, and whether the ids equal plain's exactly (if not, how
many of the 16 requests differ). Run it before and after a change and compare the digests;
every speculative and parallel mode should also equal plain.

Data parallel runs over 2 fake CPU devices, tensor parallel over 3 (SmolLM2-135M has 3 kv
heads, and each device holds whole kv heads, so 2 is refused); XLA_FLAGS is set below, before
jax is imported. A mode that raises is reported on its line and the others still run.

    JAX_PLATFORMS=cpu python bench/greedy_digest.py [--modes plain,chain,tp3-chain] [--json PATH]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=3").strip()

import jax.numpy as jnp  # noqa: E402

from jaxspec import LLM, SamplingParams  # noqa: E402

PROMPTS = Path(__file__).with_name("mtbench16.jsonl")
MAX_TOKENS = 64
SPEC = dict(draft="default")

# mode -> LLM keyword arguments (besides dtype)
MODES = {
    "plain": dict(max_batch=16),
    "naive": dict(max_batch=16, spec="naive", **SPEC),
    "chain": dict(max_batch=16, spec="chain", **SPEC),
    "tree": dict(max_batch=16, spec="tree", **SPEC),
    "4x8x32": dict(max_batch=16, spec="4x8x32", **SPEC),
    "dp2-plain": dict(max_batch=8, data_parallel=2),
    "dp2-chain": dict(max_batch=8, data_parallel=2, spec="chain", **SPEC),
    "dp2-pmap-plain": dict(max_batch=8, data_parallel=2, data_parallel_impl="pmap"),
    "dp2-pmap-chain": dict(max_batch=8, data_parallel=2, data_parallel_impl="pmap",
                           spec="chain", **SPEC),
    "tp3-plain": dict(max_batch=16, tensor_parallel=3),
    "tp3-chain": dict(max_batch=16, tensor_parallel=3, spec="chain", **SPEC),
}


def chats() -> list:
    with open(PROMPTS) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [[{"role": "user", "content": r["turns"][0]}] for r in rows]


def run_mode(kwargs: dict, prompts: list) -> list:
    llm = LLM(dtype=jnp.float32, **kwargs)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    return [list(map(int, o.token_ids)) for o in outs]


def digest(ids: list) -> str:
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default=",".join(MODES),
                    help=f"comma-separated subset of: {', '.join(MODES)}")
    ap.add_argument("--json", help="write the digests (and token ids) here")
    args = ap.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        sys.exit(f"unknown modes {unknown}; choose from {', '.join(MODES)}")
    modes.sort(key=lambda m: m != "plain")   # plain first: the others compare against it

    prompts = chats()
    print(f"{len(prompts)} prompts, {MAX_TOKENS} new tokens, greedy, fp32", flush=True)
    results, plain = {}, None
    for mode in modes:
        t0 = time.perf_counter()
        try:
            ids = run_mode(MODES[mode], prompts)
        except Exception as e:  # reported, so that one broken mode does not hide the rest
            secs = time.perf_counter() - t0
            results[mode] = dict(error=f"{type(e).__name__}: {e}", seconds=round(secs, 1))
            print(f"{mode:10s} FAILED {type(e).__name__}: {e} ({secs:.0f} s)", flush=True)
            continue
        secs = time.perf_counter() - t0
        if mode == "plain":
            plain = ids
        if plain is None:
            same = "plain not run"
        else:
            differ = sum(a != b for a, b in zip(ids, plain)) + abs(len(ids) - len(plain))
            same = "== plain" if differ == 0 else f"!= plain ({differ}/{len(ids)} requests differ)"
        results[mode] = dict(sha256_16=digest(ids), tokens=sum(map(len, ids)), same=same,
                             seconds=round(secs, 1), token_ids=ids)
        print(f"{mode:10s} {digest(ids)} tokens={sum(map(len, ids)):5d} {same:36s} "
              f"({secs:.0f} s)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
