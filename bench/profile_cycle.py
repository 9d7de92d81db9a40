"""Where the device's time goes in an 8B-shaped decode step and speculative cycle (issues 2, 3, 4).

Traces `--calls` back-to-back calls of each program with jax.profiler (CUDA graphs kept on, so
the traced run is the timed one) and prints, per program, the device time per call by kernel name
and by kind (collectives, GEMMs, tree attention and its combine, KV compaction, top-k, other
fusions, copies),
next to the wall time per call of the same run. Kernel time under the wall time is launch gaps:
time the GPU sat between kernels.

    python3 -m bench.profile_cycle [--shapes "6,10,60;5,8,32"] [--calls 10] [--top 25]
                                   [--variant lean|full|cond]
    python3 -m bench.profile_cycle --shapes "" --batch 64 --prefix 512   # the decode step alone
    python3 -m bench.profile_cycle --attention     # the tree-attention kernel alone, small shapes
    python3 -m bench.profile_cycle --tiny          # CPU check of the script
Writes $OUT/profile_cycle.json.
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import os
import re
import tempfile
import time

from bench.common import add_kernel_default, apply_kernel_defaults
from jaxspec.benchmark import trace

# Kernel name -> kind, first match wins.
_KINDS = [("collective",
           r"nccl|all[-_]?reduce|all[-_]?gather|reduce[-_]?scatter|one[-_]?shot|collective"),
          ("tree_attention_combine", r"tree_attention_combine"),
          ("tree_attention", r"tree_attention"), ("kv_compact", r"kv_compact"),
          ("gemm", r"gemm|nvjet|xmma|cutlass|sm90|cublas|matmul|dot"),
          ("topk", r"topk|top_k|sort"), ("copy", r"memcpy|memset|copy"),
          ("reduce", r"reduce"), ("fusion", r"fusion")]


def kind_of(name: str) -> str:
    low = name.lower()
    return next((k for k, rx in _KINDS if re.search(rx, low)), "other")


def device_events(trace_dir: str):
    """[(name, start_us, dur_us)] of the GPU's kernels and copies in the newest trace."""
    return trace.gpu_spans(trace.load_trace(trace_dir))


def profile(fn, carry, calls: int):
    """Run fn(carry) -> carry `calls` times under the profiler; wall ms per call, device events."""
    import jax
    carry = fn(carry)
    jax.block_until_ready(carry)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            t0 = time.perf_counter()
            for _ in range(calls):
                carry = fn(carry)
            jax.block_until_ready(carry)
            wall = (time.perf_counter() - t0) / calls * 1e3
        ev = device_events(d)
    return wall, ev, carry


def table(label: str, wall: float, ev, calls: int, top: int) -> dict:
    by_name, cnt = collections.defaultdict(float), collections.Counter()
    for name, _, dur in ev:
        by_name[name] += dur / calls / 1e3
        cnt[name] += 1
    by_kind = collections.defaultdict(float)
    for name, ms in by_name.items():
        by_kind[kind_of(name)] += ms
    busy = sum(by_name.values())
    span = ((max(t + d for _, t, d in ev) - min(t for _, t, _ in ev)) / calls / 1e3) if ev else 0
    print(f"\n== {label}: wall {wall:.3f} ms/call, kernels {busy:.3f} ms/call, first-to-last "
          f"{span:.3f} ms/call, {len(ev) / calls:.0f} kernels/call")
    for k, ms in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"   {k:24} {ms:8.3f} ms")
    for name, ms in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]:
        print(f"     {name[:64]:64} {ms:8.4f} ms  x{cnt[name] / calls:g}")
    return {"label": label, "wall_ms": wall, "kernel_ms": busy, "span_ms": span,
            "kernels_per_call": len(ev) / calls, "by_kind": dict(by_kind),
            "by_name": {k: [v, cnt[k] / calls] for k, v in by_name.items()}}


def model_programs(a, out):
    import jax
    import jax.numpy as jnp
    from bench import bench_cycle as bc
    from bench.bench_cycle import VARIANTS
    from bench.common import LLAMA3_8B
    from jaxspec.spec import SpecConfig, jit_cycle
    cfg = bc.TINY if a.tiny else LLAMA3_8B
    cfg = cfg.with_layout(unroll_layers=jax.default_backend() == "gpu")
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    prefix = 128 if a.tiny else a.prefix
    max_len = prefix + 128
    key = jax.random.PRNGKey(0)
    params = bc.random_params(cfg, key, dtype)
    head = bc.random_head(cfg, jax.random.fold_in(key, 1), dtype)
    step = decode_step(cfg, params, prefix, max_len, a.batch)
    out.append(table(f"decode B={a.batch} L={prefix}", *profile(step[0], step[1], a.calls)[:2],
                     a.calls, a.top))
    active = jnp.ones((1,), bool)
    for s, k, t in a.shape_list:
        cyc = jit_cycle(cfg, SpecConfig(s, k, t), features=VARIANTS[a.variant], slots=1)
        st = bc.spec_state(cfg, SpecConfig(s, k, t), prefix, max_len, dtype, jax.random.PRNGKey(3))
        # Each call leaves lens where it was (KVCache reset inside): the prefix stays fixed.
        fn = _fixed_prefix(lambda st: cyc(params, head, st, active)[0], prefix)
        wall, ev, _ = profile(fn, st, a.calls)
        out.append(table(f"cycle {s},{k},{t} ({a.variant})", wall, ev, a.calls, a.top))


def _fixed_prefix(fn, prefix):
    from bench.bench_cycle import prefix_reset
    reset = prefix_reset(prefix)
    return lambda st: reset(fn(st))


def decode_step(cfg, params, prefix, max_len, batch=1):
    """bench_cycle's plain decode step (batch slots) with its carry, lens reset each call."""
    import functools
    import jax
    import jax.numpy as jnp
    from jaxspec.models import llama
    from jaxspec.xla_options import jit
    from pallas_kernels.kv_compact import kv_compact
    dt = params["embed"].dtype
    b = batch
    shape = (cfg.num_layers, b, cfg.num_kv_heads, max_len, cfg.head_dim)

    @functools.partial(jit, rows=b, donate_argnums=1)
    def step_fn(p, c):
        k, v, _, tok = c
        lens = jnp.full((b,), prefix, jnp.int32)
        h, kn, vn, _ = llama.forward(p, cfg, tok[:, None], lens[:, None], k, v, lens,
                                     jnp.ones((b, 1, 1), bool))
        k, v = kv_compact(k, v, kn, vn, lens, jnp.zeros((b, 1), jnp.int32),
                          jnp.ones((b,), jnp.int32))
        nxt = jnp.argmax(llama.lm_head(p, cfg, h[:, 0]), -1).astype(jnp.int32)
        return k, v, lens, nxt

    # Random caches, not zeros: the kernels read every live row either way, but zeros can run
    # faster than real data (METHOD.md).
    kc = jax.random.normal(jax.random.PRNGKey(9), shape, dt)
    carry = (kc, kc * 0.5, jnp.full((b,), prefix, jnp.int32), jnp.zeros((b,), jnp.int32))
    return functools.partial(step_fn, params), carry


def attention_programs(a, out):
    """32 chained calls of the tree-attention dispatch (one per layer), per shape."""
    import jax
    import jax.numpy as jnp
    from pallas_kernels import tree_attention as ta
    hq, hkv, d, layers = (4, 2, 64, 2) if a.tiny else (32, 8, 128, 32)
    dt = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    for b, n, l in a.attn_shapes:
        key = jax.random.PRNGKey(b * 1000 + n)
        ks = jax.random.split(key, 5)
        kc = jax.random.normal(ks[0], (layers, b, hkv, l, d), dt)
        vc = jax.random.normal(ks[1], (layers, b, hkv, l, d), dt)
        q = jax.random.normal(ks[2], (b, n, hq, d), dt)
        kn = jax.random.normal(ks[3], (b, hkv, n, d), dt)
        vn = jax.random.normal(ks[4], (b, hkv, n, d), dt)
        mask = jnp.tril(jnp.ones((n, n), bool))[None].repeat(b, 0)
        lens = jnp.full((b,), l - n, jnp.int32)

        @jax.jit
        def chain(q, kc, vc, kn, vn, mask, lens):
            # Caches are arguments, not closed-over constants (which would be copied into the
            # program: a 4 GB constant at L = 32K broke the compiler).
            for layer in range(layers):   # the output feeds the next call, as layers do
                q = ta.tree_attention(q, kc, vc, jnp.int32(layer), lens, kn, vn, mask,
                                      sm_scale=1 / math.sqrt(d))
            return q

        def fn(q, kc=kc, vc=vc, kn=kn, vn=vn, mask=mask, lens=lens):
            return chain(q, kc, vc, kn, vn, mask, lens)

        wall, ev, _ = profile(fn, q, a.calls)
        row = table(f"attention B={b} N={n} L={l} (x{layers} layers)", wall, ev, a.calls, a.top)
        kv_bytes = 2 * b * hkv * l * d * jnp.dtype(dt).itemsize * layers
        row["kv_GBps_wall"] = kv_bytes / (wall / 1e3) / 1e9
        print(f"   KV read at {row['kv_GBps_wall']:.0f} GB/s over the wall time")
        out.append(row)
        del kc, vc


def _shapes(s):
    return [tuple(int(x) for x in p.split(",")) for p in s.split(";") if p]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1, help="slots of the decode step")
    ap.add_argument("--shapes", default="3,1,4;6,10,60")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--attention", action="store_true", help="the attention kernel alone")
    ap.add_argument("--variant", default="lean", choices=("lean", "full", "cond"),
                    help="the cycle's compiled variant (bench_cycle.VARIANTS)")
    ap.add_argument("--gemm", default="auto",
                    help="GEMM backend the programs are compiled with (xla_options.GEMM_BACKENDS)")
    ap.add_argument("--attn-shapes", default="1,1,1024;1,1,8192;1,64,1024;1,10,1024;64,1,1024")
    add_kernel_default(ap)
    a = ap.parse_args(argv)
    apply_kernel_defaults(a)
    a.shape_list = _shapes(a.shapes)   # "" profiles the decode step alone
    a.attn_shapes = _shapes(a.attn_shapes)
    if a.tiny:
        a.attn_shapes = [(1, 1, 256), (2, 7, 128)]
    trace.keep_graphs_while_profiling()
    out: list = []
    if a.attention:
        attention_programs(a, out)
    else:
        from jaxspec.xla_options import gemm_backend
        with gemm_backend(a.gemm):
            model_programs(a, out)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "profile_cycle.json"), "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
