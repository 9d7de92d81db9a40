"""The all-reduce alone, two GPUs: XLA's (NCCL), XLA's own one-shot kernel (the `oneshot`
collective flag set) and the one-shot Pallas kernel (`pallas_kernels.allreduce_mgpu`), per
call, at the sizes a tensor-parallel step reduces.

One program runs --chain all-reduces in a row (a decode step of a 32-layer model under the
replicated_attention schedule has 32), each input the last sum plus the device's own part, so
every call waits on the one before as in a step; the same program with the sums replaced by
the add alone is the floor subtracted. Per call = (program - floor) / chain, median of repeats,
for each [rows, hidden] bf16 input (the kernel serves up to 64 KiB: 8 rows at hidden 4096; the
larger rows are psum's alone). Both are checked equal before timing.

    python bench/bench_allreduce.py                      # 2 GPUs: rows 1, 2, 4, 8, 64
    python bench/bench_allreduce.py --rows 1 --chain 64
JSON goes to $OUT/bench_allreduce.json when OUT is set.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import device_name, timed, write_json  # noqa: E402
from jaxspec.xla_options import COLLECTIVE_FLAGS  # noqa: E402
from pallas_kernels import allreduce_mgpu as ar  # noqa: E402

AXIS = "x"


def chain_program(mesh, reduce, chain, flags="default"):
    """xs [2, rows, H] (one part a device) -> the chained sums, [2, rows, H], compiled with the
    collective flag set `flags`."""
    def body(xs):
        y = xs[0]
        for i in range(chain):
            y = reduce(y + (i % 3) * xs[0])
        return y[None]
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS),
                                 check_vma=False), compiler_options=COLLECTIVE_FLAGS[flags])


def measure(mesh, rows, hidden, args):
    x = jax.random.normal(jax.random.key(rows), (2, rows, hidden), jnp.bfloat16)
    x = jax.device_put(x, jax.sharding.NamedSharding(mesh, P(AXIS)))
    psum = lambda y: jax.lax.psum(y, AXIS)      # noqa: E731
    programs = {"floor": chain_program(mesh, lambda y: y, args.chain),
                "psum": chain_program(mesh, psum, args.chain),
                "xla_oneshot": chain_program(mesh, psum, args.chain, "oneshot")}
    if ar.serves(x[0], 2) and not args.no_pallas:
        programs["oneshot"] = chain_program(mesh, lambda y: ar.oneshot(y, AXIS), args.chain)
    want = np.asarray(programs["psum"](x), np.float32)
    for name in ("xla_oneshot", "oneshot"):
        if name in programs and not np.array_equal(np.asarray(programs[name](x), np.float32),
                                                   want):
            raise SystemExit(f"rows {rows}: the {name} sums differ from psum's")
    # each call's input is the last call's output: back to back, as a step's layers are
    ms = {name: timed(lambda c, f=f: f(c), x, args.calls, args.repeats)[0]
          for name, f in programs.items()}
    row = dict(rows=rows, hidden=hidden, bytes=rows * hidden * 2, chain=args.chain,
               floor_ms=ms["floor"])
    for name in ("psum", "xla_oneshot", "oneshot"):
        if name in ms:
            row[f"{name}_ms"] = ms[name]
            row[f"{name}_us_per_call"] = (ms[name] - ms["floor"]) / args.chain * 1e3
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,64")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--chain", type=int, default=32, help="all-reduces a program")
    ap.add_argument("--calls", type=int, default=50, help="programs back to back a repeat")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-pallas", action="store_true", help="leave the Pallas kernel out")
    args = ap.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",") if r]
    if jax.local_device_count() < 2:
        sys.exit(f"needs 2 devices, found {jax.local_device_count()}")
    mesh = jax.sharding.Mesh(np.asarray(jax.local_devices()[:2]), (AXIS,))
    out = []
    for r in rows:
        out.append(measure(mesh, r, args.hidden, args))
        write_json("bench_allreduce.json", {"device": device_name(), "args": vars(args),
                                            "rows": out})
        row = out[-1]
        one = (f"  pallas {row['oneshot_us_per_call']:6.1f} us" if "oneshot_us_per_call" in row
               else "  pallas (does not serve)")
        print(f"rows {r:3d} ({row['bytes'] // 1024:4d} KiB): psum "
              f"{row['psum_us_per_call']:6.1f} us  xla one-shot "
              f"{row['xla_oneshot_us_per_call']:6.1f} us{one}  a call (floor "
              f"{row['floor_ms']:.3f} ms for {args.chain})", flush=True)


if __name__ == "__main__":
    main()
