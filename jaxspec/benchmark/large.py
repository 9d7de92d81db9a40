"""Large-model mode: the cost of a speculative cycle at Llama-3-8B shape, random weights.

Random weights accept nothing meaningful, so no acceptance is measured here. What is measured:
the plain decode step and each config's cycle (batch 1, `prefix` committed tokens), and from
them the accept length a config needs to break even (cycle / step). Projected speedups use an
accept length that is either ASSUMED (--assume-accept) or REPLAYED from an earlier
`jaxspec-bench --json` run of a real head (--replay-accept), and are labelled so.

The timing code is bench/bench_cycle.py's (a source checkout), so the two never disagree.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Dict, List, Optional

import jaxspec
from jaxspec.config import ConfigError


def _bench_cycle():
    path = Path(jaxspec.__file__).resolve().parents[1] / "bench" / "bench_cycle.py"
    if not path.is_file():
        raise SystemExit("--mode cycle times the cycle with bench/bench_cycle.py, which comes "
                         f"with the source checkout (not found at {path})")
    spec = importlib.util.spec_from_file_location("jaxspec_bench_cycle", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def replayed_accept(path: str) -> Dict[str, float]:
    """mode label -> accept length at the smallest batch size of an earlier --json run."""
    res = json.loads(Path(path).read_text())
    rows = [r for r in res.get("rows", []) if r.get("accept_len") is not None]
    if not rows:
        raise SystemExit(f"--replay-accept {path}: no speculative rows with an accept length")
    b0 = min(r["batch"] for r in rows)
    return {r["mode"]: r["accept_len"] for r in rows if r["batch"] == b0}


def run(modes, shape: str = "llama3-8b", prefix: Optional[int] = None,
        assume: Optional[List[float]] = None, replay: Optional[str] = None,
        cycles: Optional[int] = None, repeats: Optional[int] = None, progress=None) -> dict:

    import jax
    import jax.numpy as jnp
    bc = _bench_cycle()
    tiny = shape == "tiny"
    cfg = {"tiny": bc.TINY, "llama3-8b": bc.LLAMA3_8B}[shape]
    cfg = cfg.with_layout(unroll_layers=jax.default_backend() == "gpu")
    dtype = jnp.float32 if tiny and jax.default_backend() == "cpu" else jnp.bfloat16
    prefix = prefix or (128 if tiny else 1024)
    if any((m.cycles_per_call or 1) > 1 for m in modes):
        raise ConfigError("cycle mode times one cycle per call: drop ':K' from --spec")
    n, reps = cycles or (5 if tiny else 30), repeats or (3 if tiny else 7)
    max_len = prefix + 128
    key = jax.random.PRNGKey(0)
    params = bc.random_params(cfg, key, dtype)
    head = bc.random_head(cfg, jax.random.fold_in(key, 1), dtype)
    decode = bc.plain_decode_ms(cfg, params, prefix, max_len, n, reps)
    replay_acc = replayed_accept(replay) if replay else {}
    rows = []
    for m in modes:
        ms = bc.cycle_ms(cfg, params, head, m.spec_at(1), prefix, max_len, n, reps)
        ratio = ms / decode
        proj = [{"accept_len": a, "source": "assumed", "projected_speedup": a / ratio}
                for a in (assume or [])]
        if m.label in replay_acc:
            a = replay_acc[m.label]
            proj.append({"accept_len": a, "source": f"replayed from {replay}",
                         "projected_speedup": a / ratio})
        rows.append({"mode": m.label, "spec": m.describe(1), "cycle_ms": ms,
                     "cycle_over_decode": ratio, "break_even_accept_len": ratio,
                     "projections": proj})
        if progress:
            progress(m.label)
    return {"shape": "llama3-8b-shape (random weights)" if not tiny else "tiny (random weights)",
            "dtype": jnp.dtype(dtype).name, "batch": 1, "prefix": prefix, "decode_ms": decode,
            "acceptance": "not measured: random weights (projections are assumed or replayed)",
            "rows": rows}
