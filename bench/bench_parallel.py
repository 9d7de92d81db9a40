"""Multi-GPU: data-parallel throughput scaling and tensor-parallel step time.

Data parallel (SmolLM2-135M shape, random bf16 weights and head, 64 slots per GPU): tokens/s of
one replica against two (DataParallelSpecRunner / DataParallelPlainRunner with replicas=1 and 2,
64 slots each: the same host loop, whose outputs the tests tie to SpecRunner / PlainRunner), end
to end through the runners (host loop included), and device-only (back-to-back cycles of
jit_cycle on one GPU against the pmapped cycle on two, no host read). Scaling = DP tokens/s /
single tokens/s; the goal is >= 1.9x for two replicas. Random weights cost what any others do:
a static-shape cycle costs the same whatever it accepts, and every replica runs the same number
of cycles.

Tensor parallel (Llama-3-8B shape, random bf16, model axis over all GPUs): per-step time of a
plain decode step and of a speculative cycle (chain and tree presets) at batch 1 and 64, against
the same on one GPU in the same run (the 8B model fits one H200; the point is the split).

    python bench/bench_parallel.py                 # GPU (2x H200): both parts
    python bench/bench_parallel.py --part dp       # or tp; --dp-impl engine: dp_engine only
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python bench/bench_parallel.py --tiny
                                                   # CPU: tiny shapes, checks the script runs
JSON goes to $OUT/bench_parallel.json when OUT is set.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import LLAMA3_8B, SMOLLM2_135M, device_name, median, write_json  # noqa: E402
from jaxspec.config import ModelConfig  # noqa: E402
from jaxspec.models import eagle, llama  # noqa: E402
from jaxspec.parallel import (DataParallelPlainRunner, DataParallelSpecRunner,  # noqa: E402
                              make_mesh, shard_draft_params, shard_params, shard_state)
from jaxspec.parallel.data_parallel import pmap_spec, replicate  # noqa: E402
from jaxspec.parallel.tensor_parallel import tp_cycle  # noqa: E402
from jaxspec.sampling import LEAN, SamplingParams  # noqa: E402
from jaxspec.spec import init_state, jit_cycle  # noqa: E402
from jaxspec.spec.config import resolve_spec  # noqa: E402
from jaxspec.xla_options import jit  # noqa: E402

TINY = ModelConfig(arch="LlamaForCausalLM", vocab_size=512, hidden_size=128,
                   intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32)


def random_pair(cfg: ModelConfig, dtype, seed=0):
    """Target and EAGLE-1 head, drawn on device in `dtype` (scale as in the shape benchmarks)."""
    init = jax.jit(lambda k: llama.init_random_params(cfg, k, dtype), backend=None)
    p = init(jax.random.PRNGKey(seed))
    d = jax.jit(lambda k: eagle.init_eagle_params(cfg, k, dtype))(jax.random.PRNGKey(seed + 1))
    return p, d


def prompts(n, length, vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=length).tolist() for _ in range(n)]


def timed_generate(run, reps):
    """Median seconds of run() over reps calls, after one warm-up call (compiles)."""
    run()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = run()
        ts.append(time.perf_counter() - t0)
    return median(ts), out


# -------------------------------------------------------------------------------- data parallel


def dp_end_to_end(cfg, p, d, args, replicas, preset):
    """tokens/s of one device vs `replicas` through the runners; equal outputs checked."""
    b = args.slots
    max_len = args.prompt_len + args.max_tokens + 64
    ps1 = prompts(b, args.prompt_len, cfg.vocab_size)
    psd = prompts(b * replicas, args.prompt_len, cfg.vocab_size)
    rows = []
    if preset == "plain":
        sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        one = DataParallelPlainRunner(cfg, p, b, max_len + 32, 1, decode_chunk=16)
        dp = DataParallelPlainRunner(cfg, p, b, max_len + 32, replicas, decode_chunk=16)
        t1, o1 = timed_generate(lambda: one.generate(ps1, [sp] * b, [set()] * b), args.reps)
        td, od = timed_generate(lambda: dp.generate(psd, [sp] * len(psd), [set()] * len(psd)),
                                args.reps)
        n1 = sum(len(g.token_ids) for g in o1)
        nd = sum(len(g.token_ids) for g in od)
        same = [g.token_ids for g in od[:b]] == [g.token_ids for g in o1]
    else:
        one = DataParallelSpecRunner(cfg, p, d, preset, slots=b, max_len=max_len, replicas=1)
        dp = DataParallelSpecRunner(cfg, p, d, preset, slots=b, max_len=max_len,
                                    replicas=replicas)
        t1, o1 = timed_generate(lambda: one.generate(ps1, [args.max_tokens] * b), args.reps)
        td, od = timed_generate(lambda: dp.generate(psd, [args.max_tokens] * len(psd)),
                                args.reps)
        n1 = sum(len(r.token_ids) for r in o1)
        nd = sum(len(r.token_ids) for r in od)
        same = [r.token_ids for r in od[:b]] == [r.token_ids for r in o1]
    rows.append(dict(part="dp", mode=preset, measure="end-to-end", replicas=replicas,
                     slots_per_replica=b, single_tok_s=n1 / t1, dp_tok_s=nd / td,
                     scaling=(nd / td) / (n1 / t1), first_replica_equals_single=same))
    return rows


def engine_backend(cfg, p, d, preset, slots, max_len, cycles_per_call):
    """The engine backend of the engine rows: plain at 16 steps per call, or the spec preset at
    cycles_per_call cycles, with rows for max_len plus what its calls may add."""
    from jaxspec.engine import PlainBackend, SpecBackend
    if preset == "plain":
        return PlainBackend(cfg, p, slots, max_len + 32, n_steps=16)
    k = cycles_per_call
    return SpecBackend(cfg, p, d, preset, slots, max_len + 2 * k * resolve_spec(preset).max_emit,
                       cycles_per_call=k)


def _engine(cfg, p, d, preset, slots, max_len, chunk, cycles_per_call, devices=None,
            packing=True):
    from jaxspec.engine import Engine
    from jaxspec.parallel.dp_engine import data_parallel_backend
    be = engine_backend(cfg, p, d, preset, slots, max_len, cycles_per_call)
    if devices:
        data_parallel_backend(be, devices)
    # every prompt has the same length: widths up to it, and greedy programs only, compile
    eng = Engine(be, max_model_len=max_len, vocab_size=cfg.vocab_size, chunk=max(16, chunk),
                 pack_first_chunks=packing)
    eng.warmup(variants=(LEAN,))
    return eng


def _drain(eng, ps, max_tokens):
    from jaxspec.engine import EngineStats
    eng.stats = EngineStats()       # the last drain's own figures (`_engine_stats`)
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    ids = [eng.add_request(x, sp) for x in ps]
    list(eng.drain())
    return [eng.pop_finished(i).output for i in ids]


def dp_engine_end_to_end(cfg, p, d, args, replicas, preset):
    """tokens/s of the continuous-batching engine on one device vs over `replicas`
    (parallel.dp_engine, b slots per device), host loop included; equal outputs checked."""
    b = args.slots
    max_len = args.prompt_len + args.max_tokens + 64
    # waves > 1: waves x the slots' requests, admitted as slots free up (continuous batching)
    ps1 = prompts(b * args.waves, args.prompt_len, cfg.vocab_size)
    psd = prompts(b * replicas * args.waves, args.prompt_len, cfg.vocab_size)
    kw = dict(chunk=args.prompt_len, cycles_per_call=args.cycles_per_call,
              packing=args.packing == "on")
    one = _engine(cfg, p, d, preset, b, max_len, **kw)
    dp = _engine(cfg, p, d, preset, b * replicas, max_len, devices=jax.local_devices()[:replicas],
                 **kw)
    t1, o1 = timed_generate(lambda: _drain(one, ps1, args.max_tokens), args.reps)
    td, od = timed_generate(lambda: _drain(dp, psd, args.max_tokens), args.reps)
    n1, nd = sum(map(len, o1)), sum(map(len, od))
    # calls that missed a warmed executable (each compiles once, in timed_generate's first run)
    misses = dict(single_jit_calls=one.backend.jit_calls, dp_jit_calls=dp.backend.jit_calls)
    return [dict(part="dp", mode=preset, measure="engine end-to-end", replicas=replicas,
                 slots_per_replica=b, single_tok_s=n1 / t1, dp_tok_s=nd / td,
                 scaling=(nd / td) / (n1 / t1), first_replica_equals_single=od[:len(o1)] == o1,
                 equal_requests=sum(a == c for a, c in zip(od, o1)), packing=args.packing,
                 requests=len(ps1),
                 single=_engine_stats(one, t1), dp=_engine_stats(dp, td), **misses)]


def dp_engine_calls(cfg, p, d, args, replicas, preset):
    """The engine backend's cycle calls back to back with no host read, each sample synced once:
    the device side of the engine rows, for one device (S slots), the data-parallel form over a
    one-device mesh (S slots: what the shard_map'ed program itself costs) and over `replicas`
    devices (replicas x S slots). Also the host's ms per call dispatch: through the jitted
    program, then (one device and two) as the engine dispatches after warm-up, the compiled
    executable, with and without starting the outputs' copies to the host (`Engine._prefetch`)."""
    from jaxspec.parallel.dp_engine import data_parallel_backend
    b = args.slots
    max_len = args.prompt_len + args.max_tokens + 64
    devs = jax.local_devices()
    forms = (("single", b, None), ("mesh1", b, devs[:1]), ("dp", b * replicas, devs[:replicas]))
    out, engine_like = {}, {}
    for label, slots, devices in forms:
        be = engine_backend(cfg, p, d, preset, slots, max_len, args.cycles_per_call)
        if devices is not None:
            data_parallel_backend(be, devices)
        mask = be.device_mask(np.ones((slots,), bool))
        size, state = be.call_size(slots), be.init_state()
        for short in ((False, True) if be.short_rows else (False,)):
            state, out[(label, short)] = _time_calls(be, state, mask, size, short, args)
            if label != "mesh1" and not short:   # as the engine calls it after warm-up
                key, low = be.cycle(state, mask, LEAN, size=size, short=short, lower=True)
                be.executables[key] = low.compile()
                for prefetch in (False, True):
                    state, got = _time_calls(be, state, mask, size, short, args, prefetch)
                    engine_like[(label, prefetch)] = got[1]
        del state, be
    rows = []
    for short in sorted({s for _, s in out}):
        (t1, d1), (tm, dm), (td, dd) = (out[(x, short)] for x in ("single", "mesh1", "dp"))
        more = {} if short else {f"{x}_compiled{'_prefetch' if pf else ''}_dispatch_ms": v
                                 for (x, pf), v in engine_like.items()}
        rows.append(dict(part="dp", mode=preset, measure="engine calls", replicas=replicas,
                         slots_per_replica=b, short=short, single_call_ms=t1,
                         mesh1_call_ms=tm, dp_call_ms=td, single_dispatch_ms=d1,
                         mesh1_dispatch_ms=dm, dp_dispatch_ms=dd, scaling=replicas * t1 / td,
                         **more))
    return rows


def _time_calls(be, state, mask, size, short, args, prefetch=False):
    """-> (state, (ms a call, median dispatch ms)) of args.cycles cycle calls back to back,
    synced once per sample (args.reps samples, after two untimed calls). prefetch: each call's
    token and accept outputs start their copies to the host, as the engine does."""
    for _ in range(2):     # compiles (through the jitted program)
        state, o = be.cycle(state, mask, LEAN, size=size, short=short)
    jax.block_until_ready(o.tokens)
    ts, ds = [], []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        for _ in range(args.cycles):
            t = time.perf_counter()
            state, o = be.cycle(state, mask, LEAN, size=size, short=short)
            if prefetch:
                for x in (o.tokens, getattr(o, "accept", None)):
                    if x is not None and hasattr(x, "copy_to_host_async"):
                        x.copy_to_host_async()
            ds.append(time.perf_counter() - t)
        jax.block_until_ready(o.tokens)
        ts.append((time.perf_counter() - t0) / args.cycles)
    return state, (1e3 * median(ts), 1e3 * median(ds))


def _engine_stats(eng, wall_s):
    """Where the last drain's time went (`EngineStats`): host, waiting on the device, in the
    admission and cycle dispatches, and the calls made."""
    st = eng.stats
    return dict(wall_s=wall_s, host_s=st.host_s, wait_s=st.wait_s, dispatch_s=st.dispatch_s,
                admit_dispatch_s=st.admit_dispatch_s, steps=len(st.step_s), cycles=st.cycles,
                prefill_chunks=st.prefill_chunks,
                admit_shapes={str(k): v for k, v in st.admit_shapes.items()})


def dp_device_only(cfg, p, d, args, replicas, preset):
    """Back-to-back cycles with no host read: the device side of the scaling."""
    spec = resolve_spec(preset)
    b, max_len = args.slots, args.prompt_len + args.cycles * spec.max_emit + 64
    dtype = p["embed"].dtype
    active1 = jnp.ones((b,), bool)
    cyc = jit_cycle(cfg, spec, features=LEAN)
    state = init_state(cfg, spec, b, max_len, dtype)
    state = _fill(state, args.prompt_len)
    for _ in range(2):
        state, out = cyc(p, d, _fill(state, args.prompt_len), active1)
    jax.block_until_ready(out)

    def run1(state):
        for _ in range(args.cycles):
            state, out = cyc(p, d, state, active1)
        jax.block_until_ready(out)
        return state

    devices = jax.local_devices()[:replicas]
    init, _, pcycs = pmap_spec(cfg, spec, tuple(devices), b, max_len, jnp.dtype(dtype))
    pcyc = pcycs[LEAN]      # greedy requests: the variant the runners pick
    pr, dr = replicate(p, devices), replicate(d, devices)
    pstate = _fill(init(np.zeros((replicas,), np.int32)), args.prompt_len)
    actd = np.ones((replicas, b), bool)
    for _ in range(2):
        pstate, out = pcyc(pr, dr, _fill(pstate, args.prompt_len), actd)
    jax.block_until_ready(out)

    def rund(state):
        for _ in range(args.cycles):
            state, out = pcyc(pr, dr, state, actd)
        jax.block_until_ready(out)
        return state

    t1s, tds = [], []
    for _ in range(args.reps):   # lengths grow by at most max_emit per cycle: max_len allows it
        state = _fill(state, args.prompt_len)
        t0 = time.perf_counter()
        state = run1(state)
        t1s.append(time.perf_counter() - t0)
        pstate = _fill(pstate, args.prompt_len)
        t0 = time.perf_counter()
        pstate = rund(pstate)
        tds.append(time.perf_counter() - t0)
    t1, td = median(t1s) / args.cycles, median(tds) / args.cycles
    return [dict(part="dp", mode=preset, measure="device cycles", replicas=replicas,
                 slots_per_replica=b, single_cycle_ms=1e3 * t1, dp_cycle_ms=1e3 * td,
                 scaling=replicas * t1 / td)]


def _fill(state, prompt_len):
    """Every slot holds a prompt_len prefix (its KV rows are whatever the cache holds). The new
    lengths keep the old ones' sharding: a different input sharding would recompile."""
    old = state.target.lens
    lens = jax.device_put(np.full(old.shape, prompt_len, np.int32), old.sharding)
    return state.replace(target=state.target.replace(lens=lens))


# ------------------------------------------------------------------------------ tensor parallel


def tp_step_times(cfg, args, model_parallel, save=lambda rows: None):
    """Per-step ms of plain decode and spec cycles, one device vs the model axis."""
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    p, d = random_pair(cfg, dtype)
    mesh = make_mesh(model_parallel)
    sp, sd = shard_params(p, cfg, mesh), shard_draft_params(d, cfg, mesh)
    rows = []
    for batch in args.tp_batches:
        for preset in ["plain"] + args.tp_spec:
            spec = resolve_spec("naive" if preset == "plain" else preset)
            max_len = args.prompt_len + args.cycles * spec.max_emit + 64
            times = {}
            for label, params, draft in (("single", p, d), ("tp", sp, sd)):
                state = init_state(cfg, spec, batch, max_len, dtype)
                if label == "tp":
                    state = shard_state(state, cfg, mesh)
                    cyc = tp_cycle(cfg, spec, mesh, state, greedy_only=True)
                else:
                    cyc = jit_cycle(cfg, spec, greedy_only=True)
                step = _plain_step(cfg, batch) if preset == "plain" else None
                times[label] = _time_steps(cyc, step, params, draft, state, args)
                del state
            rows.append(dict(part="tp", mode=preset, batch=batch, model_parallel=model_parallel,
                             single_ms=times["single"], tp_ms=times["tp"],
                             speedup=times["single"] / times["tp"]))
            save(rows)
            print(f"tp {preset:6s} batch {batch:3d}: 1 GPU {times['single']:.2f} ms, "
                  f"{model_parallel} GPUs {times['tp']:.2f} ms", flush=True)
    return rows


def _plain_step(cfg, batch):
    """One greedy decode step on the spec state's target cache (shardings follow the inputs)."""
    from pallas_kernels.kv_compact import kv_compact
    mask = jnp.ones((batch, 1, 1), bool)
    src = jnp.zeros((batch, 1), jnp.int32)
    one = jnp.ones((batch,), jnp.int32)

    def step(params, state):
        c = state.target
        h, kn, vn, _ = llama.forward(params, cfg, state.root[:, None], c.lens[:, None], c.k, c.v,
                                     c.lens, mask)
        k, v = kv_compact(c.k, c.v, kn, vn, c.lens, src, one)
        tok = jnp.argmax(llama.lm_head(params, cfg, h[:, 0]), -1).astype(jnp.int32)
        return state.replace(target=c.replace(k=k, v=v, lens=c.lens + 1), root=tok)

    return jit(step, donate_argnums=(1,))


def _time_steps(cyc, plain, params, draft, state, args):
    state = _fill(state, args.prompt_len)
    active = jnp.ones(state.root.shape, bool)
    call = (lambda s: plain(params, s)) if plain is not None else \
        (lambda s: cyc(params, draft, s, active)[0])
    for _ in range(2):   # the second call may compile again (output shardings chosen by GSPMD)
        state = call(_fill(state, args.prompt_len))
    jax.block_until_ready(state)
    ts = []
    for _ in range(args.reps):
        state = _fill(state, args.prompt_len)
        t0 = time.perf_counter()
        for _ in range(args.cycles):
            state = call(state)
        jax.block_until_ready(state)
        ts.append((time.perf_counter() - t0) / args.cycles)
    return 1e3 * median(ts)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", default="dp,tp")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU check)")
    ap.add_argument("--slots", type=int, default=64, help="slots per replica (data parallel)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--cycles", type=int, default=32, help="timed cycles per repeat")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dp-modes", default="plain,chain,tree")
    ap.add_argument("--cycles-per-call", type=int, default=4,
                    help="spec cycles per device call of the engine (LLM's default above batch 1)")
    ap.add_argument("--dp-impl", default="pmap,engine,device",
                    help="pmap (the lockstep runners), engine (parallel.dp_engine), calls (the "
                         "engine backends' calls back to back, no host read), device "
                         "(back-to-back pmapped cycles, no host)")
    ap.add_argument("--waves", type=int, default=1,
                    help="engine rows: waves x the slots' requests each (1: one batch drained)")
    ap.add_argument("--packing", default="on", choices=("on", "off"),
                    help="the engine rows' first chunks packed (Engine(pack_first_chunks=))")
    ap.add_argument("--tp-spec", default="chain,tree")
    ap.add_argument("--tp-batches", default="1,64")
    args = ap.parse_args(argv)
    args.tp_spec = [x for x in args.tp_spec.split(",") if x]
    args.tp_batches = [int(x) for x in args.tp_batches.split(",")]
    n = jax.local_device_count()
    if n < 2:
        sys.exit(f"needs at least 2 devices, found {n}")
    dp_cfg, tp_cfg = (TINY, TINY) if args.tiny else (SMOLLM2_135M, LLAMA3_8B)
    if args.tiny:
        args.slots, args.prompt_len, args.max_tokens = min(args.slots, 4), 16, 16
        args.cycles, args.reps, args.tp_batches = 4, 1, [2]
    dp_cfg = dataclasses.replace(dp_cfg, unroll_layers=jax.default_backend() == "gpu")
    tp_cfg = dataclasses.replace(tp_cfg, unroll_layers=jax.default_backend() == "gpu")
    rows = []

    def save(more=()):   # after every row, so a run cut short keeps what it measured
        write_json("bench_parallel.json", {"device": device_name(), "devices": n,
                                           "args": vars(args), "rows": rows + list(more)})
    if "dp" in args.part:
        dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
        p, d = random_pair(dp_cfg, dtype)
        for mode in args.dp_modes.split(","):
            if "pmap" in args.dp_impl:
                rows += dp_end_to_end(dp_cfg, p, d, args, 2, mode)
            if "engine" in args.dp_impl:
                rows += dp_engine_end_to_end(dp_cfg, p, d, args, 2, mode)
            if "calls" in args.dp_impl:
                rows += dp_engine_calls(dp_cfg, p, d, args, 2, mode)
            if mode != "plain" and "device" in args.dp_impl:
                rows += dp_device_only(dp_cfg, p, d, args, 2, mode)
            print(rows[-1], flush=True)
            save()
    if "tp" in args.part:
        rows += tp_step_times(tp_cfg, args, n, save)
    save()
    print(f"\n{device_name()} x{n}")
    for r in rows:
        if r["part"] == "dp" and r["measure"].endswith("end-to-end"):
            print(f"dp {r['mode']:6s} {r['measure']:18s} 1 GPU {r['single_tok_s']:9.0f} tok/s  "
                  f"{r['replicas']} GPUs {r['dp_tok_s']:9.0f} tok/s  scaling "
                  f"{r['scaling']:.2f}x  equal {r['first_replica_equals_single']}")
        elif r["part"] == "dp" and r["measure"] == "engine calls":
            print(f"dp {r['mode']:6s} calls{' short' if r['short'] else '      '}  1 GPU "
                  f"{r['single_call_ms']:6.2f} ms/call (dispatch {r['single_dispatch_ms']:.2f})  "
                  f"1-device mesh {r['mesh1_call_ms']:6.2f} ({r['mesh1_dispatch_ms']:.2f})  "
                  f"{r['replicas']} GPUs {r['dp_call_ms']:6.2f} ({r['dp_dispatch_ms']:.2f})  "
                  f"scaling {r['scaling']:.2f}x")
            if "single_compiled_dispatch_ms" in r:
                print("   dispatch ms, compiled / + prefetch: 1 GPU "
                      f"{r['single_compiled_dispatch_ms']:.2f} / "
                      f"{r['single_compiled_prefetch_dispatch_ms']:.2f}  {r['replicas']} GPUs "
                      f"{r['dp_compiled_dispatch_ms']:.2f} / "
                      f"{r['dp_compiled_prefetch_dispatch_ms']:.2f}")
        elif r["part"] == "dp":
            print(f"dp {r['mode']:6s} device      1 GPU {r['single_cycle_ms']:7.2f} ms/cycle  "
                  f"{r['replicas']} GPUs {r['dp_cycle_ms']:7.2f} ms/cycle  scaling "
                  f"{r['scaling']:.2f}x")
        else:
            print(f"tp {r['mode']:6s} batch {r['batch']:3d}   1 GPU {r['single_ms']:7.2f} ms  "
                  f"{r['model_parallel']} GPUs {r['tp_ms']:7.2f} ms  x{r['speedup']:.2f}")


if __name__ == "__main__":
    main()
