"""The fused few-row GEMMs (`pallas_kernels.skinny_matmul`) against XLA's ops, per layer.

For each weight shape of a layer (o, gate/up, down) and row count M, one jitted program runs
the op over L distinct weight matrices (more bytes than the L2 holds, as the layers of a
forward are), timed back to back:
  xla      the model's XLA form: r + x @ w (o, down); rms_norm, x @ w, silu(g) * u (gate/up)
  fused    the Pallas kernel at its default tiles, and `--sweep` tile settings
Prints us a layer, the weights' read rate, and each kernel's max error against the reference
on the device.

  python3 -m bench.bench_skinny_gemm [--shape llama3-8b] [--rows 1,32,60] [--sweep]
"""
from __future__ import annotations

import argparse
import itertools
import time

import jax
import jax.numpy as jnp

from bench.common import SHAPES, copy_bandwidth, device_name, timed, write_json
from pallas_kernels import skinny_matmul as sk


def _ops(cfg):
    """name -> (K, N, gate_up) of one layer's products."""
    h, f = cfg.hidden_size, cfg.intermediate_size
    return {"o": (cfg.q_size, h, False), "gate_up": (h, 2 * f, True), "down": (f, h, False)}


def _inputs(m, k, n, gate_up, layers, key):
    ks = jax.random.split(key, 4)
    x = jax.random.normal(ks[0], (m, k), jnp.bfloat16)
    ws = [(0.02 * jax.random.normal(kk, (k, n), jnp.float32)).astype(jnp.bfloat16)
          for kk in jax.random.split(ks[1], layers)]
    extra = ((1 + 0.1 * jax.random.normal(ks[2], (k,))).astype(jnp.bfloat16) if gate_up
             else jax.random.normal(ks[3], (m, n), jnp.bfloat16))
    return x, ws, extra


def _program(gate_up, kernel, eps=1e-5, **tiles):
    """A jitted fn(x, ws, extra) -> outputs of every layer."""
    if gate_up:
        one = ((lambda x, w, nw: sk.norm_gate_up_pallas(x, nw, w, eps=eps, **tiles)) if kernel
               else (lambda x, w, nw: sk.norm_gate_up_reference(x, nw, w, eps)))
    else:
        one = ((lambda x, w, r: sk.matmul_add_pallas(x, w, r, **tiles)) if kernel
               else (lambda x, w, r: sk.matmul_add_reference(x, w, r)))
    return jax.jit(lambda x, ws, extra: [one(x, w, extra) for w in ws])


def _time(fn, args, n=10, repeats=5):
    step = lambda _: fn(*args)
    ms, _ = timed(step, None, n, repeats)
    return ms


def _sweep_tiles(m):
    bm = max(16, sk._next_pow2(min(m, sk.MAX_ROWS)))
    for bn, bk, warps, stages in itertools.product((16, 32, 64, 128), (64, 128, 256, 512),
                                                   (4, 8), (3, 4, 6)):
        if bm * bk + bk * bn > 48 * 1024 or (warps == 8 and bn < 64):
            continue
        yield dict(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--rows", default="1,32,60")
    ap.add_argument("--ops", default="o,gate_up,down")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--sweep", action="store_true", help="time tile settings too")
    ap.add_argument("--sweep-seconds", type=float, default=60.0, help="budget per (op, M)")
    args = ap.parse_args()
    cfg = SHAPES[args.shape]
    bw = copy_bandwidth()
    print(f"# {device_name()} jax {jax.__version__}; copy {bw / 1e9:.0f} GB/s", flush=True)
    rows_out = []
    for op in args.ops.split(","):
        k, n, gate_up = _ops(cfg)[op]
        for m in map(int, args.rows.split(",")):
            x, ws, extra = _inputs(m, k, n, gate_up, args.layers, jax.random.PRNGKey(m))
            ref = _program(gate_up, False)(x, ws[:1], extra)[0]
            got = _program(gate_up, True)(x, ws[:1], extra)[0]
            err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - ref.astype(jnp.float32))))
            scale = float(jnp.max(jnp.abs(ref.astype(jnp.float32))))
            per = lambda ms: ms * 1e3 / args.layers
            xla = per(_time(_program(gate_up, False), (x, ws, extra)))
            fused = per(_time(_program(gate_up, True), (x, ws, extra)))
            floor = k * n * 2 / bw * 1e6
            best = (fused, "default")
            if args.sweep:
                t0 = time.perf_counter()
                for tiles in _sweep_tiles(m):
                    if time.perf_counter() - t0 > args.sweep_seconds:
                        break
                    try:
                        us = per(_time(_program(gate_up, True, **tiles), (x, ws, extra), 5, 3))
                    except Exception as e:  # a setting Triton cannot build: skip it
                        print(f"  skip {tiles}: {type(e).__name__}", flush=True)
                        continue
                    if us < best[0]:
                        best = (us, tiles)
            row = dict(op=op, m=m, k=k, n=n, xla_us=xla, fused_us=fused, floor_us=floor,
                       best_us=best[0], best=str(best[1]), max_err=err, ref_scale=scale)
            rows_out.append(row)
            print(f"{op:8s} M={m:3d} xla {xla:8.2f} us  fused {fused:8.2f} us  "
                  f"best {best[0]:8.2f} us {best[1]}  floor {floor:7.2f}  err {err:.3g}"
                  f"/{scale:.3g}", flush=True)
    write_json(f"skinny_gemm_{args.shape}.json", dict(copy_gbs=bw / 1e9, rows=rows_out))


if __name__ == "__main__":
    main()
