"""Which data-parallel engine program fails to compile, one at a time.

Builds the engine backend of `bench_parallel`'s data-parallel rows (SmolLM2-135M shape, random
bf16 weights, 64 slots per device, spec preset or plain) over `parallel.DataParallel` on the
local devices (per-device programs through shard_map, or jax.pmap with --impl pmap), and
compiles the greedy programs its warm-up would (`Engine.programs`) serially, printing each name
before its compile, so a crash inside XLA names the program on the last line. --only picks
programs by index (see --list); --devices 1 builds the same per-device programs over one device.

    python bench/dp_compile_probe.py --mode chain --list
    python -X faulthandler bench/dp_compile_probe.py --mode chain --only 0,3
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_parallel import TINY, backend, random_pair  # noqa: E402
from bench.common import SMOLLM2_135M  # noqa: E402
from jaxspec.engine import Engine, EngineConfig  # noqa: E402
from jaxspec.parallel import DataParallel  # noqa: E402
from jaxspec.sampling import LEAN  # noqa: E402


def programs(eng):
    """(name, thunk returning a Lowered) of every greedy program the engine's warm-up
    compiles: cycles first, then admissions largest first."""
    out = []
    for call in eng.programs((LEAN,)):
        kw = call.keywords
        if "form" in kw:
            shape = kw["parts"][0][1].shape
            name = f"admit form={kw['form']} tokens={shape}"
        elif "size" in kw:
            name = f"cycle size {kw['size']}{' short' if kw['short'] else ''}"
        else:
            name = f"advance keys a={len(kw['slot_idx'])}"
        out.append((name, lambda call=call: call(eng.state, lower=True)[1]))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", default="chain", help="plain or a spec preset")
    ap.add_argument("--impl", default="shard_map", choices=("shard_map", "pmap"))
    ap.add_argument("--devices", type=int, default=0, help="devices (0: all local devices)")
    ap.add_argument("--slots", type=int, default=64, help="slots per device")
    ap.add_argument("--cycles-per-call", type=int, default=4)
    ap.add_argument("--only", default="", help="comma-separated program indices")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args(argv)
    cfg = TINY if args.tiny else SMOLLM2_135M
    cfg = cfg.with_layout(unroll_layers=jax.default_backend() == "gpu")
    devices = jax.local_devices()[:args.devices or None]
    dtype = jax.numpy.bfloat16 if jax.default_backend() == "gpu" else jax.numpy.float32
    p, d = random_pair(cfg, dtype)
    max_len = 320
    be = backend(cfg, p, d, args.mode, args.slots * len(devices), max_len,
                 args.cycles_per_call, DataParallel(devices, args.impl))
    conf = EngineConfig(max_batch=args.slots, max_model_len=max_len, prefill_chunk=128,
                        cycles_per_call=args.cycles_per_call)
    eng = Engine(be, conf, vocab_size=cfg.vocab_size)
    progs = programs(eng)
    pick = [int(i) for i in args.only.split(",") if i] or range(len(progs))
    for i in pick:
        name, lower = progs[i]
        if args.list:
            print(i, name)
            continue
        print(f"[{i}] {name}: lowering", flush=True)
        low = lower()
        t0 = time.perf_counter()
        print(f"[{i}] {name}: compiling", flush=True)
        low.compile()
        print(f"[{i}] {name}: ok {time.perf_counter() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
