"""Multi-GPU: data-parallel throughput scaling and tensor-parallel step time, through the engine.

Data parallel (SmolLM2-135M shape, random bf16 weights and head, 64 slots per GPU): the engine
on one device against the engine over two (`build_engine(data_parallel=2,
data_parallel_impl=...)`: the backend built over `parallel.DataParallel`, whose programs run per
device through shard_map or jax.pmap; the tests tie both to one device's greedy outputs).
  pmap, engine   tokens/s end to end (host loop included), the per-device programs through
                 jax.pmap ("pmap") or a shard_map ("engine"; "shard_map" says the same)
  calls          the backends' cycle calls back to back with no host read, one device against a
                 one-device mesh and two devices (shard_map), and two devices through pmap, with
                 the host's dispatch time per call
  device         the cycle's compiled executable called back to back (no engine, no host read):
                 one device against two through each implementation
Scaling = DP tokens/s / single tokens/s (or per-call time); the goal is >= 1.9x for two
replicas. Random weights cost what any others do: a static-shape cycle costs the same whatever it
accepts, and every replica runs the same number of cycles.

Tensor parallel (Llama-3-8B shape, random bf16, model axis over all GPUs): per-call time of a
plain decode step and of a speculative cycle (chain and tree presets) at batch 1 and 64, the
backend over one device against over `parallel.TensorParallel`, for each schedule of
--tp-schedules (`megatron`: two all-reduces a layer; `replicated_attention`: one, the attention
whole on every device; `:replicate` keeps the embedding whole too, no all-reduce at its lookup;
a third field `:oneshot` takes that one all-reduce through the Pallas one-shot kernel,
`pallas_kernels.allreduce_mgpu`, where it serves)
and each XLA collective flag set of --tp-flags (`xla_options.COLLECTIVE_FLAGS`, built into the
programs, so one process compares them); each ratio is against the one-device time measured in
the same process. --profile prints each TP step's collectives (optimized HLO) and, with OUT set,
writes the HLO and a jax.profiler trace and prints each GPU's device time a step by kernel kind
(collectives, GEMMs, attention, ...; the 8B model fits one H200; the point is the split).

    python bench/bench_parallel.py                 # GPU (2x H200): both parts
    python bench/bench_parallel.py --part dp       # or tp; --dp-impl engine: shard_map only
    python bench/bench_parallel.py --part tp --tp-spec chain --tp-schedules \
        megatron,replicated_attention:replicate --tp-flags default,cmdbuf_sync --profile
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python bench/bench_parallel.py --tiny
                                                   # CPU: tiny shapes, checks the script runs
JSON goes to $OUT/bench_parallel.json when OUT is set.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import LLAMA3_8B, SMOLLM2_135M, device_name, median, write_json  # noqa: E402
from jaxspec.build import build_engine  # noqa: E402
from jaxspec.config import ConfigError, ModelConfig  # noqa: E402
from jaxspec.engine import EngineConfig, EngineStats, PlainBackend, SpecBackend  # noqa: E402
from jaxspec.models import eagle, llama  # noqa: E402
from jaxspec.parallel import DataParallel, OneDevice, TensorParallel, make_mesh  # noqa: E402
from jaxspec.parallel.tensor_parallel import (ALLREDUCES, SCHEDULES,  # noqa: E402
                                              check_allreduce, count_collectives)
from jaxspec.sampling import LEAN, SamplingParams  # noqa: E402
from jaxspec.spec.config import resolve_spec  # noqa: E402
from jaxspec.xla_options import COLLECTIVE_FLAGS, collective_flags  # noqa: E402

TINY = ModelConfig(arch="LlamaForCausalLM", vocab_size=512, hidden_size=128,
                   intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32)
PLAIN_STEPS = 16       # plain decode steps per engine call in the data-parallel rows


def random_pair(cfg: ModelConfig, dtype, seed=0):
    """Target and EAGLE-1 head, drawn on device in `dtype` (scale as in the shape benchmarks)."""
    p = jax.jit(lambda k: llama.init_random_params(cfg, k, dtype))(jax.random.PRNGKey(seed))
    d = jax.jit(lambda k: eagle.init_eagle_params(cfg, k, dtype))(jax.random.PRNGKey(seed + 1))
    return p, d


def prompts(n, length, vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=length).tolist() for _ in range(n)]


def timed_generate(run, reps):
    """Median seconds of run() over reps calls, after one untimed call (it runs what warm-up
    did not compile, if anything)."""
    run()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = run()
        ts.append(time.perf_counter() - t0)
    return median(ts), out


def dp_impls(args):
    """The data-parallel implementations --dp-impl names for the end-to-end rows."""
    names = set(args.dp_impl.split(","))
    return [impl for impl, keys in (("shard_map", {"engine", "shard_map"}), ("pmap", {"pmap"}))
            if names & keys]


# -------------------------------------------------------------------------------- data parallel


def backend(cfg, p, d, preset, slots, max_len, cycles_per_call, placement=None):
    """The engine backend of the data-parallel rows: plain at PLAIN_STEPS steps per call, or the
    spec preset at cycles_per_call cycles, with rows for max_len plus what its calls may add."""
    if preset == "plain":
        return PlainBackend(cfg, p, slots, max_len + 2 * PLAIN_STEPS, n_steps=PLAIN_STEPS,
                            placement=placement)
    k = cycles_per_call
    return SpecBackend(cfg, p, d, preset, slots, max_len + 2 * k * resolve_spec(preset).max_emit,
                       cycles_per_call=k, placement=placement)


def _engine(cfg, p, d, preset, per, max_len, chunk, cycles_per_call, replicas=1,
            impl="shard_map", packing=True):
    """An engine of `per` slots a device over `replicas` devices, warmed up for greedy
    requests; every prompt has the same length, so few programs compile."""
    econf = EngineConfig(max_batch=per, max_model_len=max_len, prefill_chunk=max(16, chunk),
                         packing=packing, cycles_per_call=cycles_per_call,
                         decode_steps=PLAIN_STEPS)
    spec = dict(draft=d, spec=preset) if preset != "plain" else {}
    eng = build_engine(cfg, p, econf, data_parallel=replicas, data_parallel_impl=impl, **spec)
    eng.warmup(variants=(LEAN,))
    return eng


def _drain(eng, ps, max_tokens):
    eng.stats = EngineStats()       # the last drain's own figures (`_engine_stats`)
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    ids = [eng.add_request(x, sp) for x in ps]
    list(eng.drain())
    return [eng.pop_finished(i).output for i in ids]


def dp_end_to_end(cfg, p, d, args, replicas, preset, impl, one=None):
    """tokens/s of the engine on one device vs over `replicas` (b slots each, per-device
    programs through `impl`), host loop included; equal outputs checked. one: the one-device
    engine, when an earlier row built it. -> (rows, one)."""
    b = args.slots
    max_len = args.prompt_len + args.max_tokens + 64
    # waves > 1: waves x the slots' requests, admitted as slots free up (continuous batching)
    ps1 = prompts(b * args.waves, args.prompt_len, cfg.vocab_size)
    psd = prompts(b * replicas * args.waves, args.prompt_len, cfg.vocab_size)
    kw = dict(chunk=args.prompt_len, cycles_per_call=args.cycles_per_call,
              packing=args.packing == "on")
    one = one or _engine(cfg, p, d, preset, b, max_len, **kw)
    dp = _engine(cfg, p, d, preset, b, max_len, replicas=replicas, impl=impl, **kw)
    t1, o1 = timed_generate(lambda: _drain(one, ps1, args.max_tokens), args.reps)
    td, od = timed_generate(lambda: _drain(dp, psd, args.max_tokens), args.reps)
    n1, nd = sum(map(len, o1)), sum(map(len, od))
    # calls that missed a warmed executable (each compiles once, in timed_generate's first run)
    misses = dict(single_jit_calls=one.backend.jit_calls, dp_jit_calls=dp.backend.jit_calls)
    row = dict(part="dp", mode=preset, measure="engine end-to-end", impl=impl,
               replicas=replicas, slots_per_replica=b, single_tok_s=n1 / t1, dp_tok_s=nd / td,
               scaling=(nd / td) / (n1 / t1), first_replica_equals_single=od[:len(o1)] == o1,
               equal_requests=sum(a == c for a, c in zip(od, o1)), packing=args.packing,
               requests=len(ps1), single=_engine_stats(one, t1), dp=_engine_stats(dp, td),
               **misses)
    return [row], one


def _fill(state, prompt_len):
    """Every slot holds a prompt_len prefix (its KV rows are whatever the cache holds). The new
    lengths keep the old ones' sharding: a different input sharding would recompile."""
    old = state.target.lens
    lens = jax.device_put(np.full(old.shape, prompt_len, np.int32), old.sharding)
    return state.replace(target=state.target.replace(lens=lens))


def dp_engine_calls(cfg, p, d, args, replicas, preset):
    """The backend's cycle calls back to back with no host read, each sample synced once: the
    device side of the engine rows, for one device (S slots), the data-parallel form over a
    one-device mesh (S slots: what the shard_map'ed program itself costs), over `replicas`
    devices (replicas x S slots) and the same through pmap. Also the host's ms per call
    dispatch: through the jitted program, then (one device, shard_map and pmap) as the engine
    dispatches after warm-up, the compiled executable, with and without starting the outputs'
    copies to the host (`Engine._prefetch`)."""
    b = args.slots
    max_len = args.prompt_len + args.max_tokens + 64
    devs = jax.local_devices()
    forms = (("single", b, None), ("mesh1", b, DataParallel(devs[:1])),
             ("dp", b * replicas, DataParallel(devs[:replicas])),
             ("pmap", b * replicas, DataParallel(devs[:replicas], "pmap")))
    out, engine_like = {}, {}
    for label, slots, placement in forms:
        be = backend(cfg, p, d, preset, slots, max_len, args.cycles_per_call, placement)
        state = be.init_state()
        mask = be.placement.put_mask(np.ones((slots,), bool))
        size = be.call_size(slots)
        for short in ((False, True) if be.short_rows else (False,)):
            state, out[(label, short)] = _time_calls(be, state, mask, size, short, args)
            if label != "mesh1" and not short:   # as the engine calls it after warm-up
                key, low = be.cycle(state, mask, LEAN, size=size, short=short, lower=True)
                be.programs.add(key, low.compile())
                for prefetch in (False, True):
                    state, got = _time_calls(be, state, mask, size, short, args, prefetch)
                    engine_like[(label, prefetch)] = got[1]
        del state, be
    rows = []
    for short in sorted({s for _, s in out}):
        (t1, d1), (tm, dm), (td, dd), (tp, dp) = (out[(x, short)]
                                                  for x in ("single", "mesh1", "dp", "pmap"))
        more = {} if short else {f"{x}_compiled{'_prefetch' if pf else ''}_dispatch_ms": v
                                 for (x, pf), v in engine_like.items()}
        rows.append(dict(part="dp", mode=preset, measure="engine calls", replicas=replicas,
                         slots_per_replica=b, short=short, single_call_ms=t1,
                         mesh1_call_ms=tm, dp_call_ms=td, pmap_call_ms=tp,
                         single_dispatch_ms=d1, mesh1_dispatch_ms=dm, dp_dispatch_ms=dd,
                         pmap_dispatch_ms=dp, scaling=replicas * t1 / td,
                         pmap_scaling=replicas * t1 / tp, **more))
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
                for x in (o.tokens, o.accept):
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


def compiled_cycle(be, state, mask, size=1):
    """The backend's LEAN cycle of `size` as a compiled executable, and its arguments after the
    state: call(state) -> state."""
    _, low = be.cycle(state, mask, LEAN, size=size, lower=True)
    exe, weights = low.compile(), be.weights
    return lambda s: exe(*weights, s, mask)[0]


def time_back_to_back(call, state, args, fill):
    """ms per call of args.cycles calls of call(state) -> state back to back, no host read
    (median of args.reps samples after two untimed calls; fill(state) before each sample)."""
    for _ in range(2):
        state = call(fill(state))
    jax.block_until_ready(state)
    ts = []
    for _ in range(args.reps):    # lengths grow by at most max_emit per call: rows allow it
        state = fill(state)
        t0 = time.perf_counter()
        for _ in range(args.cycles):
            state = call(state)
        jax.block_until_ready(state)
        ts.append((time.perf_counter() - t0) / args.cycles)
    return state, 1e3 * median(ts)


def dp_device_only(cfg, p, d, args, replicas, preset):
    """One cycle a call, the compiled executable called back to back with no host read: the
    device side of the scaling, one device against `replicas` through shard_map and pmap."""
    spec = resolve_spec(preset)
    b = args.slots
    max_len = args.prompt_len + args.cycles * spec.max_emit + 64
    devs = jax.local_devices()[:replicas]
    fill = lambda s: _fill(s, args.prompt_len)      # noqa: E731
    times = {}
    for label, slots, placement in (("single", b, None),
                                    ("shard_map", b * replicas, DataParallel(devs)),
                                    ("pmap", b * replicas, DataParallel(devs, "pmap"))):
        be = backend(cfg, p, d, preset, slots, max_len, 1, placement)
        state = be.init_state()
        mask = be.placement.put_mask(np.ones((slots,), bool))
        state, times[label] = time_back_to_back(compiled_cycle(be, state, mask), state, args,
                                                fill)
        del state, be
    t1 = times["single"]
    return [dict(part="dp", mode=preset, measure="device cycles", replicas=replicas,
                 slots_per_replica=b, single_cycle_ms=t1, dp_cycle_ms=times["shard_map"],
                 pmap_cycle_ms=times["pmap"], scaling=replicas * t1 / times["shard_map"],
                 pmap_scaling=replicas * t1 / times["pmap"])]


# ------------------------------------------------------------------------------ tensor parallel


def tp_configs(args):
    """[(label, schedule, vocab, allreduce)] from --tp-schedules: SCHEDULE[:VOCAB[:ALLREDUCE]]
    each (a bad item is a ValueError naming it)."""
    out = []
    for item in args.tp_schedules:
        schedule, vocab, allreduce = (item.split(":") + ["", ""])[:3]
        vocab, allreduce = vocab or "auto", allreduce or "xla"
        if (item.count(":") > 2 or schedule not in SCHEDULES
                or vocab not in ("auto", "shard", "replicate")):
            raise ValueError(
                f"--tp-schedules: {item!r} is not SCHEDULE[:VOCAB[:ALLREDUCE]] with SCHEDULE one "
                f"of {', '.join(SCHEDULES)}, VOCAB auto, shard or replicate and ALLREDUCE one of "
                f"{', '.join(ALLREDUCES)}")
        try:
            check_allreduce(schedule, allreduce)
        except ConfigError as e:
            raise ValueError(f"--tp-schedules: {item!r}: {e}") from None
        out.append((item, schedule, vocab, allreduce))
    return out


def tp_backend(cfg, p, d, preset, batch, args, placement):
    """One decode step a call (plain) or one spec cycle a call, greedy, over `placement`."""
    if preset == "plain":
        return PlainBackend(cfg, p, batch, args.prompt_len + args.cycles + 64, n_steps=1,
                            placement=placement)
    emit = resolve_spec(preset).max_emit
    return SpecBackend(cfg, p, d, preset, batch, args.prompt_len + args.cycles * emit + 64,
                       placement=placement)


def tp_profile(exe, call, state, label):
    """The compiled step's collectives (optimized HLO); with OUT set, its HLO text under
    $OUT/tp_hlo/, a jax.profiler trace of TRACED steps under $OUT/tp_trace/LABEL, each GPU's
    device time a step by kernel kind (`tp_device_time`) and the host's launches
    (`host_launches`). -> (state, {"collectives", "device_ms", "host_launches"})."""
    hlo = exe.as_text()
    counts = {k: v for k, v in count_collectives(hlo).items() if v}
    print(f"   collectives {label}: {counts} in the step (a layer loop counts once unless "
          "unrolled)", flush=True)
    device_ms, launches = [], {}
    out = os.environ.get("OUT")
    if out:
        Path(out, "tp_hlo").mkdir(parents=True, exist_ok=True)
        Path(out, "tp_hlo", f"{label}.txt").write_text(hlo)
        state = call(state)
        jax.block_until_ready(state)
        trace_dir = str(Path(out, "tp_trace", label))
        with jax.profiler.trace(trace_dir):
            t0 = time.perf_counter()
            for _ in range(TRACED):
                state = call(state)
            jax.block_until_ready(state)
            wall_ms = (time.perf_counter() - t0) / TRACED * 1e3
        from jaxspec.benchmark import trace
        events = trace.load_trace(trace_dir)
        device_ms = tp_device_time(events, TRACED, label, wall_ms)
        launches = host_launches(events, TRACED, label)
    return state, {"collectives": counts, "device_ms": device_ms, "host_launches": launches}


TRACED = 4     # steps a profile traces


def tp_device_time(events, steps, label, wall_ms):
    """[per GPU {kernel kind: ms a step}] of a trace's events, each GPU's table printed by
    `bench.profile_cycle.table` (kinds as it sorts kernel names: collective, gemm, ...)."""
    from bench.profile_cycle import table
    from jaxspec.benchmark import trace
    per_gpu = []
    for i, pid in enumerate(sorted(trace.gpu_pids(events))):
        spans = [(e["name"], e["ts"], e.get("dur", 0)) for e in events
                 if e.get("ph") == "X" and e.get("pid") == pid]
        per_gpu.append(dict(table(f"{label}, GPU {i}", wall_ms, spans, steps, top=8)["by_kind"]))
    return per_gpu


_LAUNCH = {"graphs": re.compile(r"^cu(da)?GraphLaunch"),
           "kernels": re.compile(r"^cu(da)?LaunchKernel")}


def host_launches(events, steps, label):
    """{graphs, kernels}: the host's CUDA graph and kernel launches a step, from a trace's
    runtime-API events: a collective outside the command buffers splits the step's graph and
    launches its kernels one by one."""
    got = {k: sum(1 for e in events if e.get("ph") == "X" and rx.match(str(e.get("name", ""))))
           / steps for k, rx in _LAUNCH.items()}
    print(f"   host launches a step ({label}): {got['graphs']:g} graphs, {got['kernels']:g} "
          "kernels", flush=True)
    return got


def _tp_time(cfg, p, d, preset, batch, args, placement, label, flags="default"):
    """-> (ms a call, `tp_profile`'s record or None) of the backend over `placement`, its
    programs built under the collective flag set `flags` (compiled once: the profile reads the
    same one)."""
    fill = lambda s: _fill(s, args.prompt_len)      # noqa: E731
    with collective_flags(flags):
        be = tp_backend(cfg, p, d, preset, batch, args, placement)
    state = be.init_state()
    mask = be.placement.put_mask(np.ones((batch,), bool))
    _, low = be.cycle(state, mask, LEAN, size=1, lower=True)
    exe, weights = low.compile(), be.weights
    call = lambda s: exe(*weights, s, mask)[0]      # noqa: E731
    profiled = None
    if args.profile and isinstance(placement, TensorParallel):
        state, profiled = tp_profile(exe, call, fill(state), label)
    state, ms = time_back_to_back(call, state, args, fill)
    del state, be
    return ms, profiled


def tp_step_times(cfg, args, model_parallel, save=lambda rows: None):
    """Per-call ms of a plain decode step and of a spec cycle (one a call, greedy) at each
    batch: the backend on one device, then over the model axis for each schedule (and vocab
    layout) of --tp-schedules and each collective flag set of --tp-flags; every ratio is against
    the one-device time measured just before it in this process."""
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    p, d = random_pair(cfg, dtype)
    mesh = make_mesh(model_parallel)
    rows = []
    for batch in args.tp_batches:
        for preset in ["plain"] + args.tp_spec:
            single, _ = _tp_time(cfg, p, d, preset, batch, args, OneDevice(), "single")
            for label, schedule, vocab, allreduce in tp_configs(args):
                for flags in args.tp_flags:
                    pl = TensorParallel(mesh, cfg, vocab=vocab, schedule=schedule,
                                        allreduce=allreduce)
                    name = f"{preset}_b{batch}_{schedule}_{vocab}_{allreduce}_{flags}"
                    ms, profiled = _tp_time(cfg, p, d, preset, batch, args, pl, name, flags)
                    rows.append(dict(part="tp", mode=preset, batch=batch,
                                     model_parallel=model_parallel, schedule=schedule,
                                     vocab=vocab, allreduce=allreduce, flags=flags,
                                     single_ms=single, tp_ms=ms,
                                     speedup=single / ms, **(profiled or {})))
                    save(rows)
                    print(f"tp {preset:6s} batch {batch:3d} {label} [{flags}]: 1 GPU "
                          f"{single:.2f} ms, {model_parallel} GPUs {ms:.2f} ms", flush=True)
    return rows


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
                    help="pmap (the engine end to end, per-device programs through jax.pmap), "
                         "engine or shard_map (the same through shard_map), calls (the "
                         "backends' calls back to back, no host read), device (the compiled "
                         "cycle back to back, no engine)")
    ap.add_argument("--waves", type=int, default=1,
                    help="engine rows: waves x the slots' requests each (1: one batch drained)")
    ap.add_argument("--packing", default="on", choices=("on", "off"),
                    help="the engine rows' first chunks packed (EngineConfig(packing=))")
    ap.add_argument("--tp-spec", default="chain,tree")
    ap.add_argument("--tp-batches", default="1,64")
    ap.add_argument("--tp-schedules", default="megatron",
                    help="TensorParallel schedules, each SCHEDULE[:VOCAB[:ALLREDUCE]] (vocab "
                         f"auto, shard or replicate; allreduce {', '.join(ALLREDUCES)}, "
                         f"oneshot with replicated_attention); schedules: {', '.join(SCHEDULES)}")
    ap.add_argument("--tp-flags", default="default",
                    help="collective XLA flag sets (xla_options.COLLECTIVE_FLAGS): "
                         f"{', '.join(COLLECTIVE_FLAGS)}")
    ap.add_argument("--profile", action="store_true",
                    help="tp: print each step's collectives (optimized HLO); with OUT set, "
                         "write the HLO to $OUT/tp_hlo/ and a jax.profiler trace to "
                         "$OUT/tp_trace/")
    args = ap.parse_args(argv)
    args.tp_spec = [x for x in args.tp_spec.split(",") if x]
    args.tp_batches = [int(x) for x in args.tp_batches.split(",")]
    args.tp_schedules = [x for x in args.tp_schedules.split(",") if x]
    args.tp_flags = [x for x in args.tp_flags.split(",") if x]
    for x in args.tp_flags:
        if x not in COLLECTIVE_FLAGS:
            ap.error(f"--tp-flags: unknown set {x!r}; choose from {', '.join(COLLECTIVE_FLAGS)}")
    try:
        tp_configs(args)
    except ValueError as e:
        ap.error(str(e))
    if args.profile:   # before the backend starts: the traced steps keep their CUDA graphs
        from jaxspec.benchmark.trace import keep_graphs_while_profiling
        keep_graphs_while_profiling()
    n = jax.local_device_count()
    if n < 2:
        sys.exit(f"needs at least 2 devices, found {n}")
    dp_cfg, tp_cfg = (TINY, TINY) if args.tiny else (SMOLLM2_135M, LLAMA3_8B)
    if args.tiny:
        args.slots, args.prompt_len, args.max_tokens = min(args.slots, 4), 16, 16
        args.cycles, args.reps = 4, 1
        args.tp_batches = [min(b, 2) for b in args.tp_batches]
    dp_cfg = dp_cfg.with_layout(unroll_layers=jax.default_backend() == "gpu")
    tp_cfg = tp_cfg.with_layout(unroll_layers=jax.default_backend() == "gpu")
    rows = []

    def save(more=()):   # after every row, so a run cut short keeps what it measured
        write_json("bench_parallel.json", {"device": device_name(), "devices": n,
                                           "args": vars(args), "rows": rows + list(more)})
    if "dp" in args.part:
        dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
        p, d = random_pair(dp_cfg, dtype)
        for mode in args.dp_modes.split(","):
            one = None
            for impl in dp_impls(args):
                got, one = dp_end_to_end(dp_cfg, p, d, args, 2, mode, impl, one)
                rows += got
                print(rows[-1], flush=True)
                save()
            del one
            if "calls" in args.dp_impl:
                rows += dp_engine_calls(dp_cfg, p, d, args, 2, mode)
            if mode != "plain" and "device" in args.dp_impl:
                rows += dp_device_only(dp_cfg, p, d, args, 2, mode)
            if rows:
                print(rows[-1], flush=True)
            save()
    if "tp" in args.part:
        rows += tp_step_times(tp_cfg, args, n, save)
    save()
    print(f"\n{device_name()} x{n}")
    for r in rows:
        if r["part"] == "dp" and r["measure"] == "engine end-to-end":
            print(f"dp {r['mode']:6s} {r['impl']:9s} end-to-end  1 GPU {r['single_tok_s']:9.0f} "
                  f"tok/s  {r['replicas']} GPUs {r['dp_tok_s']:9.0f} tok/s  scaling "
                  f"{r['scaling']:.2f}x  equal {r['first_replica_equals_single']}")
        elif r["part"] == "dp" and r["measure"] == "engine calls":
            print(f"dp {r['mode']:6s} calls{' short' if r['short'] else '      '}  1 GPU "
                  f"{r['single_call_ms']:6.2f} ms/call (dispatch {r['single_dispatch_ms']:.2f})  "
                  f"1-device mesh {r['mesh1_call_ms']:6.2f} ({r['mesh1_dispatch_ms']:.2f})  "
                  f"{r['replicas']} GPUs {r['dp_call_ms']:6.2f} ({r['dp_dispatch_ms']:.2f})  "
                  f"pmap {r['pmap_call_ms']:6.2f} ({r['pmap_dispatch_ms']:.2f})  "
                  f"scaling {r['scaling']:.2f}x / pmap {r['pmap_scaling']:.2f}x")
            if "single_compiled_dispatch_ms" in r:
                print("   dispatch ms, compiled / + prefetch: 1 GPU "
                      f"{r['single_compiled_dispatch_ms']:.2f} / "
                      f"{r['single_compiled_prefetch_dispatch_ms']:.2f}  {r['replicas']} GPUs "
                      f"{r['dp_compiled_dispatch_ms']:.2f} / "
                      f"{r['dp_compiled_prefetch_dispatch_ms']:.2f}  pmap "
                      f"{r['pmap_compiled_dispatch_ms']:.2f} / "
                      f"{r['pmap_compiled_prefetch_dispatch_ms']:.2f}")
        elif r["part"] == "dp":
            print(f"dp {r['mode']:6s} device      1 GPU {r['single_cycle_ms']:7.2f} ms/cycle  "
                  f"{r['replicas']} GPUs {r['dp_cycle_ms']:7.2f} (pmap "
                  f"{r['pmap_cycle_ms']:7.2f}) ms/cycle  scaling {r['scaling']:.2f}x (pmap "
                  f"{r['pmap_scaling']:.2f}x)")
        else:
            print(f"tp {r['mode']:6s} batch {r['batch']:3d}  {r['schedule']:20s} "
                  f"{r['vocab']:9s} {r.get('allreduce', 'xla'):7s} {r['flags']:11s}  1 GPU "
                  f"{r['single_ms']:7.2f} ms  "
                  f"{r['model_parallel']} GPUs {r['tp_ms']:7.2f} ms  x{r['speedup']:.2f}"
                  + (f"  {r['collectives']}" if r.get("collectives") else ""))


if __name__ == "__main__":
    main()
