"""Host-side profile of the engine in steady state: where the host's time per step goes.

Runs Engine.step() over SmolLM2-shaped random weights (as bench_engine), then traces `--steps`
steps with jax.profiler (perfetto trace; CUDA graphs kept on while profiling, so the run is the
one measured) and sums the host events by name: the runtime's own spans (argument handling,
executable launch, command-buffer updates, transfers) next to the engine's (step, dispatch,
absorb, admit), labeled with jax.profiler.TraceAnnotation.
With --admit A,W[,FORM] it traces --steps back-to-back admissions of one shape instead (A
requests, W tokens a row, FORM 'chunk' (default) or 'packed', one of `engine.planner.forms()`;
every row padding so the state is kept).
Both print the device's events too (kernels per name, summed over the GPU streams).
Usage: python -m bench.profile_engine [--mode chain] [--batch 1] [--steps 40] [--top 40]
           [--admit 4,128] [--model GGUF [--head FILE] [--stream]]
Writes $OUT/profile_<mode>_b<B>/ (the trace) and prints the tables.
"""
from __future__ import annotations

import argparse
import collections
import os

import jax
import numpy as np

from jaxspec.benchmark import trace
from jaxspec.sampling import SamplingParams


def summarize(trace_dir: str, top: int):
    """Sum of durations (ms) and counts per event name, per thread, from the perfetto json."""
    events = trace.load_trace(trace_dir)
    names = {(e.get("pid"), e.get("tid")): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    tot = collections.defaultdict(float)
    cnt = collections.Counter()
    for e in events:
        if e.get("ph") == "X":
            k = (names.get((e.get("pid"), e.get("tid")), str(e.get("tid"))), e["name"])
            tot[k] += e.get("dur", 0) / 1e3
            cnt[k] += 1
    rows = sorted(((k, v) for k, v in tot.items() if k[0].startswith("python")),
                  key=lambda kv: -kv[1])[:top]
    print(f"{'event (python thread)':70} {'ms':>9} {'count':>6}")
    for (thread, name), ms in rows:
        print(f"{name[:70]:70} {ms:>9.2f} {cnt[(thread, name)]:>6}")
    _device_table(events, top)
    _one_step(events, names)


def _device_table(events, top):
    """Device events (processes named after a GPU) summed per name: where the device's time goes."""
    gpu = trace.gpu_pids(events)
    tot, cnt = collections.defaultdict(float), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in gpu:
            tot[e["name"]] += e.get("dur", 0) / 1e3
            cnt[e["name"]] += 1
    if not tot:
        return
    print(f"\n{'device event':70} {'ms':>9} {'count':>6}   (all: {sum(tot.values()):.2f} ms)")
    for name, ms in sorted(tot.items(), key=lambda kv: -kv[1])[:top]:
        print(f"{name[:70]:70} {ms:>9.2f} {cnt[name]:>6}")


def _one_step(events, names, which=10, min_us=20):
    """The python thread's events inside one engine.step, in time order (>= min_us)."""
    py = [e for e in events if e.get("ph") == "X"
          and names.get((e.get("pid"), e.get("tid")), "").startswith("python")]
    steps = sorted((e for e in py if e["name"] == "engine.step"), key=lambda e: e["ts"])
    if len(steps) <= which:
        return
    s = steps[which]
    inner = sorted((e for e in py if s["ts"] <= e["ts"] <= s["ts"] + s["dur"]
                    and e.get("dur", 0) >= min_us), key=lambda e: e["ts"])
    print(f"\nstep {which}: {s['dur'] / 1e3:.3f} ms")
    for e in inner:
        print(f"  +{(e['ts'] - s['ts']) / 1e3:7.3f} ms {e['dur'] / 1e3:7.3f} ms  {e['name'][:70]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="chain")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--admit", default=None,
                    help="A,W[,FORM]: trace admissions of this shape only (FORM: chunk or "
                         "packed)")
    ap.add_argument("--model", default=None,
                    help="GGUF/HF model: real weights and its tokenizer, so the host also pays "
                         "for text as LLM does (default: random weights, no text)")
    ap.add_argument("--head", default=None, help="draft head file (with --model)")
    ap.add_argument("--stream", action="store_true",
                    help="with --model: requests stream their text (LLM.stream) instead of "
                         "getting it once at the end (LLM.generate)")
    args = ap.parse_args()
    trace.keep_graphs_while_profiling()
    from bench.bench_engine import load, make, padding_admission

    class A:
        model, head = args.model, args.head
        tiny = jax.default_backend() == "cpu" and args.model is None
    cfg, params, head, tok = load(A)
    eng = make(cfg, params, head, args.mode, args.batch, 2048, tok)
    eng.warmup()
    rng = np.random.default_rng(0)

    def top_up():
        while len(eng.requests) < args.batch:
            eng.add_request([int(t) for t in rng.integers(0, cfg.vocab_size, 64)],
                            SamplingParams(max_tokens=int(rng.integers(16, 129)), ignore_eos=True),
                            stream=args.stream)
    for _ in range(30):
        top_up()
        eng.step()
    out = os.path.join(os.environ.get("OUT", "."), f"profile_{args.mode}_b{args.batch}")
    if args.admit:
        a, w, *form = args.admit.split(",")
        a, w, form = int(a), int(w), form[0] if form else "chunk"
        if (a, w, form) not in eng.planner.forms():
            raise SystemExit(f"--admit {args.admit}: not one of this engine's admission shapes "
                             f"{eng.planner.forms()}")
        be = eng.backend
        parts = padding_admission(eng, a, w, form)
        with jax.profiler.trace(out, create_perfetto_trace=True):
            for _ in range(args.steps):
                with jax.profiler.TraceAnnotation("engine.admit"):
                    eng.state, _ = be.admit(eng.state, form, parts)
            jax.block_until_ready(eng.state)
        return summarize(out, args.top)
    with jax.profiler.trace(out, create_perfetto_trace=True):
        for _ in range(args.steps):
            top_up()
            with jax.profiler.TraceAnnotation("engine.step"):
                eng.step()
        jax.block_until_ready(eng.state)
    summarize(out, args.top)


if __name__ == "__main__":
    main()
