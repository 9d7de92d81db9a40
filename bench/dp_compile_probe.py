"""Which data-parallel engine program fails to compile, one at a time.

Builds the engine backend of `bench_parallel`'s engine rows (SmolLM2-135M shape, random bf16
weights, 64 slots per device, spec preset or plain), made data parallel over the local devices
(parallel.dp_engine), and compiles its programs serially, printing each name before its
compile, so a crash inside XLA names the program on the last line. --only picks programs by
index (see --list); --devices 1 builds the same shard_map'ed programs over a one-device mesh.

    python bench/dp_compile_probe.py --mode chain --list
    python -X faulthandler bench/dp_compile_probe.py --mode chain --only 0,3
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_parallel import TINY, engine_backend, random_pair  # noqa: E402
from bench.common import SMOLLM2_135M  # noqa: E402
from jaxspec.engine import Engine  # noqa: E402
from jaxspec.parallel.dp_engine import data_parallel_backend  # noqa: E402
from jaxspec.sampling import LEAN  # noqa: E402


def programs(eng):
    """(name, thunk returning a Lowered) for the cycle sizes and the admission forms (LEAN)."""
    be, idle = eng.backend, np.zeros(eng.slots, bool)
    out = [(f"cycle size {k}",
            lambda k=k: be.cycle(eng.state, idle, LEAN, size=k, lower=True)[1])
           for k in be.sizes]
    for a, w, form in eng.admission_forms():
        out.append((f"admit a={a} w={w} form={form}",
                    lambda a=a, w=w, form=form: eng.padding_admission(a, w, form, LEAN)(
                        eng.state, lower=True)[1]))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", default="chain", help="plain or a spec preset")
    ap.add_argument("--devices", type=int, default=0, help="mesh size (0: all local devices)")
    ap.add_argument("--slots", type=int, default=64, help="slots per device")
    ap.add_argument("--cycles-per-call", type=int, default=4)
    ap.add_argument("--only", default="", help="comma-separated program indices")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args(argv)
    cfg = TINY if args.tiny else SMOLLM2_135M
    cfg = dataclasses.replace(cfg, unroll_layers=jax.default_backend() == "gpu")
    devices = jax.local_devices()[:args.devices or None]
    dtype = jax.numpy.bfloat16 if jax.default_backend() == "gpu" else jax.numpy.float32
    p, d = random_pair(cfg, dtype)
    slots, max_len = args.slots * len(devices), 320
    be = engine_backend(cfg, p, d, args.mode, slots, max_len, args.cycles_per_call)
    data_parallel_backend(be, devices)
    eng = Engine(be, max_model_len=max_len, vocab_size=cfg.vocab_size, chunk=128)
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
