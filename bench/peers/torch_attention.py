"""Peer yardstick for issue 4's table: PyTorch's fused attention kernels on the same work.

The tree kernel's prefix part is, per KV head, N * G query rows (token n, group head g) over
the slot's L cached keys. Folding the G query heads of a KV head into the query axis makes it
plain multi-head attention with Hkv heads: q [B, Hkv, N * G, D], k, v [B, Hkv, L, D], no mask.
That is what this times, through torch's SDPA backends (cuDNN, FlashAttention-2, memory
efficient), without the tree's N keys: a little less work than the kernel does. KV bytes read
and TFLOP/s as `bench_kernels` counts them; like it, each timed call reads another layer's
cache (`layers` copies, over 256 MB in all) so that the L2 does not hold it.

    python3 bench/peers/torch_attention.py [--shapes "B,N,L;..."] [--heads 32,8,128]
Writes $OUT/torch_attention.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import math
import os

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}
TABLE = ("1,1,8192;1,16,8192;1,64,8192;8,1,8192;8,16,8192;8,64,8192;64,1,8192;64,16,8192;"
         "64,64,8192;1,1,32768;1,16,32768;1,64,32768")


def time_backend(backend, q, ks, vs, iters=20):
    """Median us a call over `iters` samples of len(ks) calls, each on its own layer."""
    with sdpa_kernel([BACKENDS[backend]]):
        for i in range(2):
            sdpa(q, ks[i % len(ks)], vs[i % len(vs)])
        torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for k, v in zip(ks, vs):
                sdpa(q, k, v)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / len(ks))
    times.sort()
    return times[len(times) // 2]


def bench_shape(b, n, length, hq, hkv, d):
    rows = n * (hq // hkv)
    kv_bytes = 2 * b * hkv * length * d * 2
    layers = max(4, min(32, math.ceil(256e6 / kv_bytes)))
    gen = torch.Generator(device="cuda").manual_seed(b * 1000 + n)
    q = torch.randn(b, hkv, rows, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    ks = [torch.randn(b, hkv, length, d, device="cuda", dtype=torch.bfloat16, generator=gen)
          for _ in range(layers)]
    vs = [torch.randn_like(k) for k in ks]
    flops = 4 * b * hq * n * length * d
    row = dict(b=b, n=n, L=length, layers=layers, kv_bytes=kv_bytes)
    for name in BACKENDS:
        try:
            us = time_backend(name, q, ks, vs)
            row[name + "_us"] = us
            row[name + "_TBs"] = kv_bytes / us / 1e6
            row[name + "_TFLOPs"] = flops / us / 1e6
        except RuntimeError as e:   # a backend that does not take the shape
            row[name + "_us"] = None
            row[name + "_error"] = str(e).splitlines()[0][:200]
    del ks, vs
    torch.cuda.empty_cache()
    return row


def copy_bandwidth():
    x = torch.empty(1 << 29, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        y.copy_(x)
    end.record()
    end.synchronize()
    return 2 * x.nbytes * 20 / (start.elapsed_time(end) * 1e-3)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=TABLE)
    ap.add_argument("--heads", default="32,8,128", help="Hq,Hkv,D")
    a = ap.parse_args()
    hq, hkv, d = (int(x) for x in a.heads.split(","))
    out = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
               copy_TBs=copy_bandwidth() / 1e12, rows=[])
    print(f"{out['device']}, torch {out['torch']}, copy {out['copy_TBs']:.2f} TB/s")
    print("  B   N      L |  backend    us   % copy  TFLOP/s")
    for spec in a.shapes.split(";"):
        b, n, length = (int(x) for x in spec.split(","))
        row = bench_shape(b, n, length, hq, hkv, d)
        out["rows"].append(row)
        for name in BACKENDS:
            if row.get(name + "_us"):
                print(f"{b:3d} {n:3d} {length:6d} | {name:9s} {row[name + '_us']:8.1f} "
                      f"{100 * row[name + '_TBs'] / out['copy_TBs']:5.0f} "
                      f"{row[name + '_TFLOPs']:8.0f}", flush=True)
            else:
                print(f"{b:3d} {n:3d} {length:6d} | {name:9s} failed: "
                      f"{row.get(name + '_error', '')[:80]}", flush=True)
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "torch_attention.json"), "w") as f:
                json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
