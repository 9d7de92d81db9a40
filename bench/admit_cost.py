"""What one admission costs the device, by shape: its fixed part and its part per prompt token
(issue 8).

At batch 64 the engine admits waiting requests only every few calls (`admit_interval`), because
each admission is a program of ~740 kernels whatever it carries; slots freed in between idle.
Whether admitting more often can pay depends on that fixed cost, so this times every admission
program the engine compiles (`engine.planner.forms()`: packed first chunks of T tokens, later
chunks of 1-64 slots), each on padding rows back to back (the state is kept), in the given
modes, and fits ms = fixed + per_token x T over the packed forms.
Usage: python -m bench.admit_cost [--modes 3x2x4:4,plain:16] [--batch 64] [--calls 20]
Random SmolLM2-shaped weights (an admission's cost does not depend on the values).
"""
from __future__ import annotations

import argparse

import jax
import numpy as np

from bench.bench_engine import device_ms_per_admit, load, make
from bench.common import device_name, write_json
from jaxspec import compile_cache
from jaxspec.sampling import LEAN


def admission_costs(engine, calls: int) -> list:
    """[(form, requests, tokens a row, ms)] for every admission program of the engine, LEAN."""
    rows = []
    for a, w, form in engine.planner.forms():
        ms = device_ms_per_admit(engine, a, w, LEAN, form, calls)
        rows.append((form, a, w, ms))
    return rows


def fit(rows, max_tokens: int = 1024) -> tuple:
    """Least squares ms = fixed + per_token x T over the packed forms of at most max_tokens
    (MT-bench's packs; longer ones add rows) -> (fixed, per_token)."""
    packed = [(w, m) for form, _, w, m in rows if form == "packed" and w <= max_tokens]
    t, ms = np.array(packed, float).T
    per_token, fixed = np.polyfit(t, ms, 1)
    return float(fixed), float(per_token)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default="3x2x4:4,plain:16")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--tiny", action="store_true", help="tiny config, CPU smoke run")
    args = ap.parse_args()
    compile_cache.enable()
    cfg, params, head, tok = load(argparse.Namespace(tiny=args.tiny, model=None, head=None))
    out = {"device": device_name(), "batch": args.batch, "modes": {}}
    for mode in args.modes.split(","):
        engine = make(cfg, params, head, mode, args.batch, args.max_model_len, tok)
        rows = admission_costs(engine, args.calls)
        fixed, per_token = fit(rows)
        print(f"{mode}, batch {args.batch}: ms a call (LEAN, rows of padding)")
        for form, a, w, ms in rows:
            kind = "packed" if form == "packed" else "later chunk"
            print(f"  {kind:12} {a:>3} requests x {w:>5} tokens  {ms:7.3f}")
        print(f"  packed fit (<= 1024 tokens): {fixed:.3f} ms fixed + {per_token * 1e3:.3f} us "
              f"a token")
        out["modes"][mode] = dict(rows=[list(r) for r in rows], fixed_ms=fixed,
                                  per_token_ms=per_token)
        del engine
        jax.clear_caches()
    write_json("admit_cost", out)


if __name__ == "__main__":
    main()
