"""Engine overhead: host time per cycle and how busy the device stays in steady state (issue 6).

For each mode (speculative 'chain', plain) and batch (1, 64), in one run:
  device    ms per cycle with the cycles dispatched back to back and nothing else on the host
            (the state full: every slot active), blocked once at the end
  engine    the same cycles driven by Engine.step() in steady state: every slot busy, a new
            request admitted as soon as one finishes (prefill included), tokens read, stopped
            and detokenized on the host
  host      Engine host time per step (all of step() except blocking reads of device outputs)
  dispatch  of host: in the backend's cycle and admit calls (argument handling, launch)
  busy      device ms per cycle x cycles / engine wall time: the fraction of wall time the
            device has work queued (goal >= 0.95 at batch 1)
  +admit    busy counting the admissions' prompt chunks too (each admission shape the run
            dispatched, timed back to back afterwards): the device's whole load
Warm-up (compilation of the cycle and every admission bucket) is timed first; --warmup-only stops
there (a sweep over batch sizes of compile times).
Usage: python -m bench.bench_engine [--model PATH] [--head PATH] [--steps 300] [--tiny]
           [--bucket-growth 4] [--warmup-only]
Without --model, SmolLM2-135M-shaped random weights (acceptance does not change a cycle's cost;
with random weights the chain accepts little, so tokens per cycle are low, not the cost).
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import (SMOLLM2_135M, add_kernel_default, apply_kernel_defaults, device_name,
                          timed, write_json)
from jaxspec import compile_cache
from jaxspec.config import ModelConfig
from jaxspec.engine import Engine, PlainBackend, SpecBackend
from jaxspec.models import eagle, llama
from jaxspec.sampling import LEAN, VARIANTS, SamplingParams
from jaxspec.spec.config import resolve_spec

TINY = ModelConfig(arch="LlamaForCausalLM", vocab_size=128, hidden_size=64, intermediate_size=96,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)


def load(args):
    dtype = jnp.float32 if args.tiny or jax.default_backend() == "cpu" else jnp.bfloat16
    if args.model:
        from jaxspec.weights import load_model
        cfg, params, tok = load_model(args.model, dtype=dtype)
    else:
        cfg = TINY if args.tiny else SMOLLM2_135M
        params, tok = llama.init_random_params(cfg, jax.random.PRNGKey(0), dtype=dtype), None
    cfg = dataclasses.replace(cfg, unroll_layers=jax.default_backend() == "gpu")
    if args.head:
        from jaxspec.loading import eagle_ckpt
        head = eagle_ckpt.load_eagle1(args.head, cfg, dtype=dtype)
    else:
        head = jax.tree_util.tree_map(lambda x: x.astype(dtype),
                                      eagle.init_eagle_params(cfg, jax.random.PRNGKey(1)))
    return cfg, params, head, tok


def make(cfg, params, head, mode, batch, max_model_len, tok, bucket_growth=4, admit_interval=1,
         pack=True, short_rows=None):
    """mode: 'plain' (4 decode steps per cycle), 'plain:N' (N steps; LLM uses 16), or a spec
    preset, 'preset:K' for K cycles per call. short_rows: the backends' (None: their default)."""
    name, _, n = mode.partition(":")
    if name == "plain":
        n = int(n or 4)
        backend = PlainBackend(cfg, params, batch, max_model_len + 2 * n, n_steps=n,
                               short_rows=short_rows)
    else:
        spec, k = resolve_spec(name), int(n or 1)
        backend = SpecBackend(cfg, params, head, spec, batch,
                              max_model_len + 2 * spec.max_emit * k, cycles_per_call=k,
                              short_rows=short_rows)
    return Engine(backend, max_model_len=max_model_len, vocab_size=cfg.vocab_size, chunk=256,
                  bucket_growth=bucket_growth, detokenize=tok.decode if tok is not None else None,
                  stream_decoder=tok.stream_decoder if tok is not None else None,
                  admit_interval=admit_interval, pack_first_chunks=pack)


def device_ms_per_cycle(engine, n, size=None):
    """Back-to-back calls (of `size`, default the largest) on a full state: the device's own
    time per call (host idle), of the build the engine would pick now (short or not)."""
    be = engine.backend
    active = np.ones(be.slots, bool)
    short = engine._short(size or max(be.sizes))
    ms, engine.state = timed(lambda s: be.cycle(s, active, LEAN, size=size, short=short)[0],
                             engine.state, n, 1)
    return ms


def padding_admit_args(backend, a: int, width: int) -> list:
    """Device arguments (slot_idx, tokens, start, n_valid, next_tok) of an admission of a slots,
    chunk width `width`, every row padding: the state is kept, so it can run again and again."""
    z = np.zeros(a, np.int32)
    return [jax.device_put(x) for x in (np.full(a, backend.slots, np.int32),
                                        np.zeros((a, width), np.int32), z, z, z - 1)]


def device_ms_per_admit(engine, a, width, features, form, n):
    """Back-to-back admissions of one shape (`Engine.admission_forms`), every row padding
    (dropped, so the state is kept): the device's time for a prompt chunk of that shape.
    Arguments live on the device, since numpy arguments make each call wait (bench_dispatch)."""
    call = engine.padding_admission(a, width, form, features, on_device=True)
    ms, engine.state = timed(lambda s: call(s)[0], engine.state, n, 1)
    return ms


def compiled(engine):
    """Executables compiled ahead, calls that found none, jit cache sizes: unchanged unless
    something compiled after warm-up."""
    be = engine.backend
    return (len(be.executables), be.jit_calls, [f._cache_size() for f in be.jitted()])


def run_case(cfg, params, head, tok, mode, batch, steps, max_model_len, gen, args,
             masks="device", admit_interval=1, pack=True, short_rows=None):
    rng = np.random.default_rng(0)
    engine = make(cfg, params, head, mode, batch, max_model_len, tok, args.bucket_growth,
                  admit_interval, pack, short_rows)
    engine.device_masks = masks == "device"
    t0 = time.perf_counter()
    engine.warmup((LEAN,) if args.variants == "lean" else VARIANTS)
    compile_s = time.perf_counter() - t0
    print(f"{mode} batch {batch}: warm-up (compilation) {compile_s:.1f} s, "
          f"{len(engine.admission_shapes())} admission shapes", flush=True)
    if args.warmup_only:
        return dict(mode=mode, batch=batch, compile_s=compile_s,
                    admission_shapes=len(engine.admission_shapes()))
    sizes = compiled(engine)
    gen_min = args.gen_min or gen

    def params_():     # max_tokens uniform in [gen_min, gen]: requests end at different cycles
        return SamplingParams(max_tokens=int(rng.integers(gen_min, gen + 1)), ignore_eos=True)

    def prompt():
        return [int(t) for t in rng.integers(0, cfg.vocab_size, int(rng.integers(16, 128)))]

    for _ in range(batch):
        engine.add_request(prompt(), params_())
    for _ in range(20):                       # fill every slot
        engine.step()
    # slots hold live requests: a realistic state; each call size the engine may run
    dev = {k: device_ms_per_cycle(engine, 50, k) for k in engine.backend.sizes}
    dev_ms = dev[max(dev)]
    engine.stats = type(engine.stats)()
    t0 = time.perf_counter()
    tokens = 0
    for _ in range(steps):
        while len(engine.requests) < batch:   # steady state: a newcomer per finished request
            engine.add_request(prompt(), params_())
        tokens += sum(len(d.token_ids) for d in engine.step())
    wall = time.perf_counter() - t0
    st = engine.stats
    host_ms = st.host_s / steps * 1e3
    # The device's whole load: the cycles and the admissions' prompt chunks, each shape timed.
    admit_ms = sum(c * device_ms_per_admit(engine, a, w, f, first, 10)
                   for (a, w, f, first), c in st.admit_shapes.items())
    cycle_ms = sum(c * dev[k] for k, c in st.call_sizes.items())
    return dict(mode=mode, batch=batch, masks=masks, admit_interval=admit_interval,
                packing=pack, short_rows=engine.backend.short_rows,
                device_ms_per_cycle=dev_ms,
                engine_ms_per_step=wall / steps * 1e3, host_ms_per_step=host_ms,
                dispatch_ms_per_step=st.dispatch_s / steps * 1e3,
                step_p90_ms=float(np.percentile(st.step_s, 90) * 1e3),
                busy=min(1.0, cycle_ms / (wall * 1e3)),
                busy_all=min(1.0, (cycle_ms + admit_ms) / (wall * 1e3)),
                admit_device_ms_per_step=admit_ms / steps, cycles=st.cycles,
                admissions=st.admissions, prefill_chunks=st.prefill_chunks,
                tokens_per_s=tokens / wall, compile_s=compile_s,
                recompiled=compiled(engine) != sizes)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--head", default=None)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--gen", type=int, default=128, help="tokens per request")
    ap.add_argument("--gen-min", type=int, default=None,
                    help="vary max_tokens uniformly in [gen-min, gen] (as EOS would)")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--modes", default="chain,plain",
                    help="comma list: plain, plain:N (N decode steps per cycle), spec presets")
    ap.add_argument("--tiny", action="store_true", help="tiny config, CPU smoke run")
    ap.add_argument("--bucket-growth", type=int, default=4,
                    help="ratio of successive admission buckets (Engine(bucket_growth=))")
    ap.add_argument("--warmup-only", action="store_true", help="time warm-up only")
    ap.add_argument("--masks", default="device",
                    help="comma list: device (the engine's cached device masks), numpy (the "
                         "active mask passed as numpy each cycle: the earlier engine)")
    ap.add_argument("--admit-interval", default="1",
                    help="comma list: Engine(admit_interval=) values to compare")
    ap.add_argument("--packing", default="on",
                    help="comma list of on/off: first chunks packed (Engine(pack_first_chunks=))")
    ap.add_argument("--short-rows", default="default",
                    help="comma list: the backends' short_rows (default: their rule; 0: off)")
    ap.add_argument("--variants", choices=("all", "lean"), default="all",
                    help="program variants to compile at warm-up (the requests are greedy: "
                         "lean is enough)")
    add_kernel_default(ap)
    args = ap.parse_args()
    settings = apply_kernel_defaults(args)
    compile_cache.enable()
    cfg, params, head, tok = load(args)
    rows = []
    for mode in args.modes.split(","):
        for b in (int(x) for x in args.batches.split(",")):
            for masks, every, pack, short in itertools.product(
                    args.masks.split(","), args.admit_interval.split(","),
                    args.packing.split(","), args.short_rows.split(",")):
                r = run_case(cfg, params, head, tok, mode, b, args.steps, args.max_model_len,
                             args.gen, args, masks, int(every), pack == "on",
                             None if short == "default" else int(short))
                rows.append(r)
                print(r, flush=True)
    write_json("bench_engine.json", dict(device=device_name(), kernel_defaults=settings,
                                         rows=rows))
    print(f"\n{device_name()}")
    if args.warmup_only:
        for r in rows:
            print(f"{r['mode']:6} {r['batch']:>3} warm-up {r['compile_s']:.1f} s "
                  f"({r['admission_shapes']} admission shapes + cycle)")
        return
    print(f"{'mode':8} {'B':>3} {'masks':6} {'adm':>3} {'pack':>4} {'short':>5} {'dev ms/cyc':>10} {'eng ms/step':>11} {'host ms':>8} "
          f"{'dispatch':>8} {'busy':>5} {'+admit':>6} {'adm ms':>6} {'tok/s':>8} {'recompiled':>10}")
    for r in rows:
        print(f"{r['mode']:8} {r['batch']:>3} {r['masks']:6} {r['admit_interval']:>3} "
              f"{'on' if r['packing'] else 'off':>4} {r['short_rows']:>5} "
              f"{r['device_ms_per_cycle']:>10.3f} "
              f"{r['engine_ms_per_step']:>11.3f} {r['host_ms_per_step']:>8.3f} "
              f"{r['dispatch_ms_per_step']:>8.3f} {r['busy']:>5.2f} {r['busy_all']:>6.2f} "
              f"{r['admit_device_ms_per_step']:>6.2f} "
              f"{r['tokens_per_s']:>8.0f} {str(r['recompiled']):>10}")


if __name__ == "__main__":
    main()
