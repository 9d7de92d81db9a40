"""Accept length of speculative sampling at temperature 1 against greedy, with the shipped head.

    python -m bench.bench_sampling_accept [--presets chain tree] [--questions 16] [--max-new 128]

Lossless tree speculative sampling accepts a drafted token with the target's probability of it,
so tau (tokens per cycle) at temperature 1 is expected below greedy's. Uses the shipped EAGLE-1
head of the default model when it loads, else a random head (with a warning: tau is then
meaningless beyond a smoke test). The answers come from the engine (`bench_accept.answers`),
every question at once, request i seeded with i. Runs on GPU or CPU.
"""
from __future__ import annotations

import argparse
import json
import warnings

import jax
import numpy as np


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--presets", nargs="+", default=["chain", "tree"])
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 1.0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from bench.bench_accept import answers, mt_bench_questions
    from jaxspec.models import eagle
    from jaxspec.sampling import SamplingParams
    from jaxspec.spec import resolve_spec
    from jaxspec.weights import load_model

    cfg, params, tok = load_model(args.model)
    try:
        from jaxspec.loading.eagle_ckpt import load_default_head
        head = load_default_head(cfg, dtype=params["embed"].dtype)
    except Exception as e:  # no shipped head for this model / not present
        warnings.warn(f"no shipped head ({e}); using a random head: tau is not meaningful")
        head = eagle.init_eagle_params(cfg, jax.random.PRNGKey(0))
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}])
               for q in mt_bench_questions(n=args.questions)]
    out, engines = {}, {}
    for name in args.presets:
        spec = resolve_spec(name)
        for t in args.temperatures:
            sps = [SamplingParams(temperature=t, max_tokens=args.max_new, seed=i)
                   for i in range(len(prompts))]
            res = answers(cfg, params, head, spec, prompts, args.max_new, runners=engines,
                          sampling=sps)
            acc = np.concatenate([np.asarray(r.accept_lens, np.int64) for r in res])
            out[f"{name}@T={t}"] = {"tau": float((acc + 1).mean()), "cycles": int(acc.size)}
            print(name, f"T={t}", out[f"{name}@T={t}"], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
