"""Where the host waits when it dispatches a cycle (issue 6).

With asynchronous dispatch a call should return in tens of microseconds while the device still
works on the previous one. The engine measured the host's time inside the backend's cycle call
tracking the device time instead. This isolates which part of a call makes the host wait:

synthetic  f(state) -> state (+ outputs), ~1 ms of matmuls per call, state donated:
  donate        f(state) -> state
  +out          also returns a small fresh array, kept alive (as the engine keeps tokens)
  +np_arg       also takes a numpy [B] bool argument (the engine's `active` mask)
  +dev_arg      the same argument put on the device once, reused
  +prefetch     +np_arg, and copy_to_host_async() on the output (the engine's _prefetch)
  +put_arg      +np_arg, put on the device (jax.device_put) just before the call
  +pinned_arg   the argument in pinned host memory, moved to the device inside the program
  +pinned_put   the argument copied to pinned host memory, then put on the device
  +thread_put   the argument put on the device by a worker thread, one call ahead
  no_donate     +out without donation
engine     the SpecBackend / PlainBackend cycle on SmolLM2-shaped random weights:
  np_active     backend.cycle(state, numpy active) as Engine.step calls it
  dev_active    active put on the device once
  +prefetch     np_active and copy_to_host_async() on tokens / accept

Per row: the host's median time inside one call over back-to-back calls (never blocked between
them), the mean device time per call (n calls, one block at the end), and their ratio. A ratio
near 1 means the call waits for the device.
Usage: python -m bench.bench_dispatch [--calls 40] [--batches 1,64] [--modes chain,plain:16]
Run it once more with XLA_FLAGS=--xla_gpu_enable_command_buffer= to see CUDA graphs' part.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import device_name, write_json


def per_call(call, state, n):
    """(median host ms inside a call, mean device ms per call, state): n calls, one block."""
    state = call(state)[0]
    jax.block_until_ready(state)
    host, keep = [], []
    t0 = time.perf_counter()
    for _ in range(n):
        t = time.perf_counter()
        state, out = call(state)
        host.append(time.perf_counter() - t)
        keep.append(out)                   # outputs stay alive, as the engine's pending queue
        if len(keep) > 2:
            keep.pop(0)
    jax.block_until_ready(state)
    total = time.perf_counter() - t0
    return statistics.median(host) * 1e3, total / n * 1e3, state


def synthetic_rows(n):
    """~1 ms of device work in several kernels per call, state donated."""
    dim, batch = 4096, 64

    def work(x, w):
        for _ in range(4):
            x = jnp.tanh(x @ w)
        return x

    def f_state(s):
        return {"x": work(s["x"], s["w"]), "w": s["w"]}

    f_don = jax.jit(lambda s: (f_state(s), None), donate_argnums=0)
    f_out = jax.jit(lambda s: (f_state(s), s["x"][:batch, 0]), donate_argnums=0)
    f_arg = jax.jit(lambda s, a: (f_state(s), jnp.where(a, s["x"][:batch, 0], 0)),
                    donate_argnums=0)
    f_nod = jax.jit(lambda s: (f_state(s), s["x"][:batch, 0]))
    a_np = np.ones(batch, bool)
    a_dev = jnp.asarray(a_np)

    def prefetched(arg):
        def call(s):
            s, out = f_arg(s, arg)
            out.copy_to_host_async()
            return s, out
        return call

    cases = {"donate": f_don, "+out": f_out, "+np_arg": lambda s: f_arg(s, a_np),
             "+dev_arg": lambda s: f_arg(s, a_dev),
             "+put_arg": lambda s: f_arg(s, jax.device_put(a_np)),
             "+prefetch": prefetched(a_np), "+dev+prefetch": prefetched(a_dev),
             "no_donate": f_nod}
    pinned = _pinned_put(f_state, batch)
    if pinned is not None:
        cases["+pinned_arg"] = lambda s: pinned(s, a_np)
        cases["+pinned_put"] = _pinned_two_step(f_arg, a_np)
    cases["+thread_put"] = _thread_put(f_arg, a_np)
    rows = []
    for name, call in cases.items():
        state = {"x": jnp.ones((dim, dim), jnp.bfloat16) * 0.01,
                 "w": jnp.ones((dim, dim), jnp.bfloat16) * 0.01}
        host, dev, _ = per_call(call, state, n)
        rows.append(dict(kind="synthetic", case=name, host_ms=host, device_ms=dev))
    return rows


def _pinned_put(f_state, batch):
    """The argument staged in pinned host memory (a host copy), moved to the device inside the
    program; None where the platform has no pinned_host memory."""
    dev = jax.devices()[0]
    try:
        host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
        on_dev = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
    except Exception:        # noqa: BLE001  (no such memory kind here)
        return None

    @jax.jit
    def inner(s, a):
        a = jax.device_put(a, on_dev)
        return f_state(s), jnp.where(a, s["x"][:batch, 0], 0)
    inner = jax.jit(inner, donate_argnums=0)

    def call(s, a_np):
        return inner(s, jax.device_put(a_np, host))
    return call


def _pinned_two_step(f_arg, a_np):
    """The argument copied into pinned host memory, then put on the device (both outside the
    program): whether a transfer from pinned memory leaves the host free to run ahead."""
    dev = jax.devices()[0]
    host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    on_dev = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
    return lambda s: f_arg(s, jax.device_put(jax.device_put(a_np, host), on_dev))


def _thread_put(f_arg, a_np):
    """Each call's argument put on the device by a worker thread one call ahead: whatever the
    transfer waits for, it waits there instead of in the dispatching thread."""
    import concurrent.futures as cf
    pool = cf.ThreadPoolExecutor(1)
    nxt = [pool.submit(jax.device_put, a_np)]

    def call(s):
        arg = nxt[0].result()
        nxt[0] = pool.submit(jax.device_put, a_np)
        return f_arg(s, arg)
    return call


def engine_rows(modes, batches, n):
    from bench.bench_engine import load, make
    from jaxspec.sampling import LEAN, SamplingParams

    class A:
        model = head = None
        tiny = jax.default_backend() == "cpu"
    cfg, params, head, _ = load(A)
    rows = []
    for mode in modes:
        for b in batches:
            eng = make(cfg, params, head, mode, b, 512, None)
            eng.warmup()
            rng = np.random.default_rng(0)
            for _ in range(b):
                eng.add_request([int(t) for t in rng.integers(0, cfg.vocab_size, 64)],
                                SamplingParams(max_tokens=400, ignore_eos=True))
            for _ in range(10):
                eng.step()
            be = eng.backend
            a_np = np.ones(b, bool)
            a_dev = jnp.asarray(a_np)

            def prefetched(arg):
                def call(s):
                    s, out = be.cycle(s, arg, LEAN)
                    for x in (out.tokens, out.accept):
                        if x is not None:
                            x.copy_to_host_async()
                    return s, out
                return call

            cases = {"np_active": lambda s: be.cycle(s, a_np, LEAN),
                     "dev_active": lambda s: be.cycle(s, a_dev, LEAN),
                     "+prefetch": prefetched(a_np), "dev+prefetch": prefetched(a_dev)}
            state = eng.state
            for name, call in cases.items():
                host, dev, state = per_call(call, state, n)
                rows.append(dict(kind=f"{mode} b{b}", case=name, host_ms=host, device_ms=dev))
                print(rows[-1], flush=True)
            eng.state = state
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--modes", default="chain,plain:16")
    ap.add_argument("--skip-engine", action="store_true")
    args = ap.parse_args()
    rows = synthetic_rows(args.calls)
    for r in rows:
        print(r, flush=True)
    if not args.skip_engine:
        rows += engine_rows(args.modes.split(","), [int(b) for b in args.batches.split(",")],
                            args.calls)
    flags = os.environ.get("XLA_FLAGS", "")
    write_json("bench_dispatch.json", dict(device=device_name(), xla_flags=flags, rows=rows))
    print(f"\n{device_name()}  XLA_FLAGS={flags!r}")
    print(f"{'kind':14} {'case':11} {'host ms/call':>12} {'device ms/call':>14} {'ratio':>6}")
    for r in rows:
        print(f"{r['kind']:14} {r['case']:11} {r['host_ms']:>12.3f} {r['device_ms']:>14.3f} "
              f"{r['host_ms'] / r['device_ms']:>6.2f}")


if __name__ == "__main__":
    main()
