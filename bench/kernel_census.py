"""Kernels per layer: what XLA launches for one SmolLM2-shaped layer in each serving program.

At 135M parameters every program is launch-bound (a decode step is ~10x its bytes floor), so the
number of kernels per layer sets the step time and the host's CUDA-graph launch time. This
compiles the engine's programs (random weights, warm-up as the engine does it) for 1 and 2
layers, counts the kernel-launching instructions of the optimized HLO (fusions, custom calls:
GEMMs, Pallas kernels, and the unfused copies/sorts/scatters), and prints the difference (= one
layer) by the source line each kernel came from, for the program named by --show.
Admission programs run prompt chunks through a lax.scan (`ModelConfig.for_prefill`): their
layers are one loop body, counted once, so their "per layer" figure is not a per-layer count
(a one-layer scan is even inlined by XLA, which makes it negative).
Usage: python -m bench.kernel_census [--mode chain] [--batch 1] [--show cycle] [--cycle-only]
       [--list]
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np

from bench.bench_engine import make
from bench.common import SMOLLM2_135M, write_json
from jaxspec.models import eagle, llama
from jaxspec.sampling import LEAN

# Instructions that never launch a kernel.
_FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "call",
         "conditional", "while", "after-all", "partition-id", "replica-id", "opt-barrier",
         "copy-start", "copy-done", "send", "recv", "send-done", "recv-done", "add-dependency"}
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (\S+(?:\{[^}]*\})?|\([^=]*?\)) "
                    r"([\w\-]+)\((.*)$")


def _frames(hlo: str):
    """stack_frame_id -> "file:line function" of the innermost frame (the HLO's frame tables)."""
    tables, section = {"FileNames": {}, "FunctionNames": {}, "FileLocations": {},
                       "StackFrames": {}}, None
    for line in hlo.splitlines():
        if line in tables:
            section = line
        elif not line.strip() or line.startswith(("%", "ENTRY", "HloModule")):
            section = None if not line.strip() else section
        elif section:
            idx, _, val = line.partition(" ")
            tables[section][idx] = val.strip('"')
    out = {}
    for fid, val in tables["StackFrames"].items():
        loc = tables["FileLocations"].get(re.search(r"file_location_id=(\d+)", val).group(1), "")
        f = re.search(r"file_name_id=(\d+) function_name_id=(\d+) line=(\d+)", loc)
        if f:
            name = tables["FileNames"].get(f.group(1), "?").rsplit("/", 1)[-1]
            out[fid] = f"{name}:{f.group(3)} {tables['FunctionNames'].get(f.group(2), '?')}"
    return out


def _computations(hlo: str):
    """{computation name: [instruction lines]} and the ENTRY computation's name."""
    comps, entry, cur = {}, None, None
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if head and not line.startswith(" "):
            cur = head.group(2)
            comps[cur] = []
            entry = cur if head.group(1) else entry
        elif line.startswith("}"):
            cur = None
        elif cur is not None:
            comps[cur].append(line)
    return comps, entry


def kernels(hlo: str):
    """[(name, opcode, kind or custom-call target, source file:line function)] of the kernel-
    launching instructions: those of the computations that run on their own (the entry, the
    command buffers it calls, loop bodies), not the bodies of fusions or reductions."""
    comps, entry = _computations(hlo)
    frames = _frames(hlo)
    run, todo = set(), [entry]
    while todo:                  # follow call/while/conditional, not fusion/reduction bodies
        name = todo.pop()
        if name in run or name not in comps:
            continue
        run.add(name)
        for line in comps[name]:
            if re.search(r" (call|while|conditional)\(", line):
                todo += re.findall(r"(?:to_apply|body|condition|branch_computations=\{|, )"
                                   r"=?%([\w.\-]+)", line)
    out = []
    for name in run:
        for line in comps[name]:
            m = _INSTR.match(line)
            if not m or m.group(3) in _FREE:
                continue
            iname, op, rest = m.group(1), m.group(3), m.group(4)
            kind = re.search(r"kind=(\w+)", rest)
            target = re.search(r'custom_call_target="([^"]+)"', rest)
            src = re.search(r"stack_frame_id=(\d+)", rest)
            detail = (kind.group(1) if kind else "") + (target.group(1) if target else "")
            out.append((iname, op, detail, frames.get(src.group(1), "?") if src else "?"))
    return out


def census(mode: str, batch: int, layers: int, cycle_only: bool = False):
    """{program key: kernels} of the engine's compiled programs for a SmolLM2 of `layers`;
    cycle_only: the LEAN cycle programs alone (no admissions: seconds, not minutes)."""
    gpu = jax.default_backend() == "gpu"
    dtype = jnp.bfloat16 if gpu else jnp.float32
    cfg = dataclasses.replace(SMOLLM2_135M, num_layers=layers).with_layout(unroll_layers=gpu)
    params = llama.init_random_params(cfg, jax.random.PRNGKey(0), dtype=dtype)
    head = jax.tree_util.tree_map(lambda x: x.astype(dtype),
                                  eagle.init_eagle_params(cfg, jax.random.PRNGKey(1)))
    engine = make(cfg, params, head, mode, batch, 1024, None)
    if cycle_only:
        be, active = engine.backend, np.ones(batch, bool)
        lowered = [be.cycle(engine.state, active, LEAN, size=n, lower=True) for n in be.sizes]
        return {key: kernels(low.compile().as_text()) for key, low in lowered}
    engine.warmup()
    return {key: kernels(exe.as_text()) for key, exe in engine.backend.executables.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="chain")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--show", default="cycle",
                    help="program whose 1-layer kernels to list: the first key whose text "
                         "contains this")
    ap.add_argument("--cycle-only", action="store_true",
                    help="compile only the LEAN cycle programs")
    ap.add_argument("--list", action="store_true",
                    help="also print every kernel of the shown program (1 layer)")
    args = ap.parse_args()
    one, two = (census(args.mode, args.batch, n, args.cycle_only) for n in (1, 2))
    rows = []
    for key in sorted(one, key=str):
        per_layer = len(two.get(key, ())) - len(one[key])
        full = len(one[key]) + (SMOLLM2_135M.num_layers - 1) * per_layer
        rows.append(dict(program=str(key), kernels_1_layer=len(one[key]), per_layer=per_layer,
                         all_layers=full))
        print(f"{str(key):60s} 1 layer {len(one[key]):4d}  per layer {per_layer:3d}  "
              f"{SMOLLM2_135M.num_layers} layers ~{full}")
    for key in sorted(one, key=str):
        if args.show in str(key):
            per = collections.Counter(k[1:] for k in two.get(key, ()))
            per.subtract(k[1:] for k in one[key])
            print(f"\n{key}: one layer's kernels (2 layers minus 1), by opcode, kind, source:")
            for (op, d, src), n in sorted(per.items(), key=lambda kv: kv[0][2]):
                if n:
                    print(f"  {n:+3d} {op:14s} {d:28s} {src}")
            print(f"\n{key}: the other kernels (1 layer), by source:")
            rest = collections.Counter(k[3] for k in one[key])
            print("  " + ", ".join(f"{s} x{n}" for s, n in sorted(rest.items())))
            if args.list:
                print(f"\n{key}: every kernel (1 layer):")
                for name, op, detail, src in one[key]:
                    print(f"  {name:40s} {op:14s} {detail:28s} {src}")
            break
    write_json("kernel_census", dict(mode=args.mode, batch=args.batch, rows=rows))


if __name__ == "__main__":
    main()
