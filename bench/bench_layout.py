"""How layer weights should be laid out for decode on the GPU, and what a jit call costs.

1. Layer loop over Llama-3-8B-shaped matmuls at batch 1 (the weight-bound part of decode):
   per-layer leaves unrolled / stacked with static slices unrolled / stacked under lax.scan,
   against weight bytes / copy bandwidth.
2. Host cost of dispatching a jitted call with many leaves vs few (async, no sync).
3. Kernels per decode step in the compiled HLO of jaxspec's decode (SmolLM2 shape).
Usage: python -m bench.bench_layout
"""
from __future__ import annotations

import re
import time

import jax
import jax.numpy as jnp

from bench.common import LLAMA3_8B, SMOLLM2_135M, copy_bandwidth, median


def _bench(f, *args, reps=20):
    out = f(*args)
    jax.block_until_ready(out)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return median(ts)


def layer_loop(cfg, bw):
    h, f, qkv, L = cfg.hidden_size, cfg.intermediate_size, cfg.q_size + 2 * cfg.kv_size, cfg.num_layers
    key = jax.random.PRNGKey(0)
    dt = jnp.bfloat16
    stacked = {n: jax.random.normal(key, (L,) + s, dt) * 0.01 for n, s in
               {"wqkv": (h, qkv), "wo": (cfg.q_size, h), "wgu": (h, 2 * f), "wd": (f, h)}.items()}
    per_layer = [{n: a[i] for n, a in stacked.items()} for i in range(L)]
    x = jax.random.normal(key, (1, h), dt)

    def body(x, p):
        y = (x @ p["wqkv"])[:, :cfg.q_size]
        x = x + y @ p["wo"]
        g, u = jnp.split(x @ p["wgu"], 2, axis=-1)
        return x + (jax.nn.silu(g) * u) @ p["wd"]

    @jax.jit
    def unrolled_leaves(ps, x):
        for p in ps:
            x = body(x, p)
        return x

    @jax.jit
    def unrolled_static(st, x):
        for i in range(L):
            x = body(x, {n: a[i] for n, a in st.items()})
        return x

    @jax.jit
    def scanned(st, x):
        return jax.lax.scan(lambda x, p: (body(x, p), None), x, st)[0]

    nbytes = sum(a.size * 2 for a in stacked.values())
    floor = nbytes / bw
    res = {}
    for name, f, arg in [("per-layer leaves, unrolled", unrolled_leaves, per_layer),
                         ("stacked, static slices", unrolled_static, stacked),
                         ("stacked, lax.scan", scanned, stacked)]:
        t = _bench(f, arg, x)
        hlo = f.lower(arg, x).compile().as_text()
        copies = len(re.findall(r"= \S+ (?:copy|dynamic-slice|slice)\(", hlo))
        res[name] = (t, t / floor, copies)
    return floor, res


def dispatch_cost(n_leaves, reps=200):
    leaves = [jnp.full((4,), i, jnp.float32) for i in range(n_leaves)]
    f = jax.jit(lambda ls: ls[0] + ls[-1])
    jax.block_until_ready(f(leaves))
    t0 = time.perf_counter()
    for _ in range(reps):
        out = f(leaves)
    host = (time.perf_counter() - t0) / reps
    jax.block_until_ready(out)
    return host


def decode_kernel_count():
    from bench.bench_decode import use_reference_kernels
    use_reference_kernels()
    from jaxspec.decode import decode_steps
    from jaxspec.kv import init_cache
    from jaxspec.models import llama
    from jaxspec.sampling import SamplingParams, SlotSampling
    cfg = SMOLLM2_135M
    p = llama.unstack_layers(llama.init_random_params(cfg, jax.random.PRNGKey(0), dtype=jnp.bfloat16))
    cache = init_cache(cfg, 1, 1024, jnp.bfloat16)
    sp = SlotSampling.from_params([SamplingParams()], 1)
    hlo = decode_steps.lower(p, cfg, cache, jnp.zeros((1,), jnp.int32), sp, jax.random.PRNGKey(0),
                             1).compile().as_text()
    entry = hlo[hlo.find("ENTRY"):]
    body = hlo  # kernels live in the while body when n_steps > 0; count launches in all comps
    kinds = {k: len(re.findall(pat, body)) for k, pat in
             [("fusion", r"= \S+ fusion\("), ("custom-call", r"custom-call\("),
              ("triton", r"__triton"), ("gemm", r"cublas")]}
    return kinds, len(entry)


def main():
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    floor, res = layer_loop(LLAMA3_8B, bw)
    print(f"\n8B layer matmuls, batch 1: floor {floor * 1e3:.3f} ms")
    for name, (t, r, c) in res.items():
        print(f"  {name:28s} {t * 1e3:8.3f} ms  {r:5.2f}x floor  slice/copy ops in HLO: {c}")
    print("\njit dispatch (async, host time per call):")
    for n in (1, 10, 100, 300):
        print(f"  {n:4d} leaves  {dispatch_cost(n) * 1e6:8.1f} us")
    kinds, _ = decode_kernel_count()
    print(f"\nSmolLM2 decode step HLO ops: {kinds} (30 layers)")


if __name__ == "__main__":
    main()
