"""Acceptance of a draft head: mean tokens per speculative cycle (accepted + bonus, "tau") on the
MT-bench questions (first turn, chat template, greedy), per speculation preset.

    python -m bench.bench_accept [--model M] [--head H.safetensors] [--presets chain tree]
        [--questions 80] [--max-new 256] [--out results.json]

--head defaults to the shipped head of the default model. tau depends only on the head and the
target (greedy, static shapes), not on the batch: all questions run as one batch.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Dict, List, Sequence

import numpy as np

def mt_bench_questions(path=None, n: int = 80) -> List[str]:
    """First turns of MT-bench: from `path` (a jsonl in the MT-bench layout) or the packaged copy."""
    if path is None:
        from jaxspec.datasets import mt_bench
        return [r["chat"][0]["content"] for r in mt_bench(limit=n)]
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [r["turns"][0] for r in rows[:n]]


def measure_acceptance(cfg, params, draft, prompts: Sequence[Sequence[int]], presets=("chain", "tree"),
                       max_new: int = 256, max_slots: int = 0, runners=None) -> Dict[str, dict]:
    """{preset: {tau, looping, tau_unlooped, cycles, tokens, wall_s, accept_hist}} with
    SpecRunner, greedy (looping, tau_unlooped: `loop_split`). presets:
    names or STEPSxTOPKxTOKENS (as jaxspec-bench --spec).

    runners: a dict kept by the caller to reuse compiled runners across heads of one shape."""
    from jaxspec.benchmark.runner import parse_specs
    from jaxspec.spec import SpecRunner

    out = {}
    slots = max_slots or len(prompts)
    longest = max(len(p) for p in prompts)
    for name, spec in ((m.label, m.spec) for m in parse_specs(",".join(presets))):
        max_len = _round_up(max(16, 1 << (longest - 1).bit_length()) + max_new + spec.num_steps + 2,
                            128)
        key = (name, slots, max_len)
        if runners is not None and key in runners:
            runner = runners[key]
            runner.draft_params = draft
        else:
            runner = SpecRunner(cfg, params, draft, spec, max_slots=slots, max_len=max_len)
            if runners is not None:
                runners[key] = runner
        t0 = time.perf_counter()
        res = runner.generate(prompts, [max_new] * len(prompts), tuple(cfg.eos_token_ids))
        wall = time.perf_counter() - t0
        acc = np.concatenate([np.asarray(r.accept_lens, np.int64) for r in res])
        out[name] = {"tau": float((acc + 1).mean()), **loop_split(res), "cycles": int(acc.size),
                     "tokens": int(sum(len(r.token_ids) for r in res)), "wall_s": round(wall, 2),
                     "accept_hist": np.bincount(acc, minlength=spec.num_steps + 1).tolist(),
                     "spec": [spec.num_steps, spec.topk, spec.num_draft_tokens]}
    return out


def loop_split(res) -> dict:
    """Of SpecRunner results (token_ids, accept_lens each): the share of requests whose answer
    loops (`runner.loops`) and tau over the others. A greedy answer stuck in a loop is easy to
    draft, so at long --max-new the plain tau says more about loops than about the head;
    tau_unlooped is the figure to compare heads by."""
    from jaxspec.benchmark.runner import loops
    looping = [loops(r.token_ids) for r in res]
    rest = [a + 1 for r, loop in zip(res, looping) if not loop for a in r.accept_lens]
    return {"looping": sum(looping) / len(res) if res else 0.0,
            "tau_unlooped": float(np.mean(rest)) if rest else None}


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def main(argv=None) -> int:
    import jax

    from jaxspec.loading.eagle_ckpt import load_default_head, load_draft
    from jaxspec.models import llama
    from jaxspec.weights import load_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--head", default=None, help="draft head: our .safetensors, or a public EAGLE-1/EAGLE-3 checkpoint "
                    "(default: the shipped head)")
    ap.add_argument("--presets", nargs="+", default=["chain", "tree"],
                    help="preset names or STEPSxTOPKxTOKENS, e.g. chain 5x1x6 4x2x8")
    ap.add_argument("--questions", type=int, default=80)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    cfg, params, tok = load_model(a.model)
    dtype = params["embed"].dtype
    draft = load_draft(a.head, cfg, dtype) if a.head else load_default_head(cfg, dtype)
    if jax.default_backend() == "gpu":
        params = llama.unstack_layers(params)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}])
               for q in mt_bench_questions(n=a.questions)]
    res = measure_acceptance(cfg, params, draft, prompts, a.presets, a.max_new)
    print(f"{'preset':8s} {'(S,K,N)':12s} {'tau':>6s} {'looping':>7s} {'tau, rest':>9s} "
          f"{'cycles':>7s} {'tokens':>7s} {'wall_s':>7s}")
    for name, r in res.items():
        rest = "-" if r["tau_unlooped"] is None else f"{r['tau_unlooped']:.3f}"
        print(f"{name:8s} {str(tuple(r['spec'])):12s} {r['tau']:6.3f} {r['looping']:7.0%} "
              f"{rest:>9s} {r['cycles']:7d} {r['tokens']:7d} {r['wall_s']:7.1f}")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
