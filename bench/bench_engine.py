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
           [--slot-growth 4] [--warmup-only]
Without --model, SmolLM2-135M-shaped random weights (acceptance does not change a cycle's cost;
with random weights the chain accepts little, so tokens per cycle are low, not the cost).
"""
from __future__ import annotations

import argparse
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import (SMOLLM2_135M, add_kernel_default, apply_kernel_defaults, device_name,
                          timed, write_json)
from jaxspec import compile_cache
from jaxspec.config import ModelConfig
from jaxspec.engine import EngineConfig
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
    cfg = cfg.with_layout(unroll_layers=jax.default_backend() == "gpu")
    if args.head:
        from jaxspec.loading import eagle_ckpt
        head = eagle_ckpt.load_eagle1(args.head, cfg, dtype=dtype)
    else:
        head = jax.tree_util.tree_map(lambda x: x.astype(dtype),
                                      eagle.init_eagle_params(cfg, jax.random.PRNGKey(1)))
    return cfg, params, head, tok


def make(cfg, params, head, mode, batch, max_model_len, tok, slot_growth=4, admit_interval=1,
         packing=True, short_rows=None):
    """An engine (`build.build_engine`) for mode: 'plain' (4 decode steps per call), 'plain:N'
    (N steps; LLM uses 16), or a spec preset, 'preset:K' for K cycles per call. The other
    arguments are EngineConfig's (short_rows None: the backends' rule)."""
    from jaxspec.build import build_engine
    name, _, n = mode.partition(":")
    conf = EngineConfig(max_batch=batch, max_model_len=max_model_len, prefill_chunk=256,
                        slot_growth=slot_growth, admit_interval=admit_interval, packing=packing,
                        short_rows=short_rows)
    if name == "plain":
        conf, draft, spec = conf.replace(decode_steps=int(n or 4)), None, None
    else:
        conf, draft, spec = conf.replace(cycles_per_call=int(n or 1)), head, resolve_spec(name)
    return build_engine(cfg, params, conf, draft=draft, spec=spec, tokenizer=tok)


def device_ms_per_cycle(engine, n, size=None):
    """Back-to-back calls (of `size`, default the largest) on a full state: the device's own
    time per call (host idle), of the build the engine would pick now (short or not)."""
    be = engine.backend
    active = be.placement.put_mask(np.ones(be.slots, bool))
    short = engine._short(size or max(be.sizes))
    ms, engine.state = timed(lambda s: be.cycle(s, active, LEAN, size=size, short=short)[0],
                             engine.state, n, 1)
    return ms


def padding_admission(engine, a: int, width: int, form: str = "chunk"):
    """The device arguments of an admission of shape (a requests, width tokens a row) in `form`
    (`engine.planner.forms()`), every row padding: it changes nothing, so it can run again and
    again. On the device, since numpy arguments make each call wait (bench_dispatch)."""
    return jax.device_put(engine.planner.padding(a, width, form).parts)


def device_ms_per_admit(engine, a, width, features, form, n):
    """Back-to-back admissions of one shape (`engine.planner.forms()`), every row padding
    (dropped, so the state is kept): the device's time for a prompt chunk of that shape."""
    be, parts = engine.backend, padding_admission(engine, a, width, form)
    ms, engine.state = timed(lambda s: be.admit(s, form, parts, features=features)[0],
                             engine.state, n, 1)
    return ms


def compiled(engine):
    """Executables compiled ahead and calls that found none: unchanged unless something
    compiled after warm-up."""
    be = engine.backend
    return len(be.programs.executables), be.jit_calls


def run_case(cfg, params, head, tok, mode, batch, steps, max_model_len, gen, args,
             admit_interval=1, packing=True, short_rows=None):
    rng = np.random.default_rng(0)
    engine = make(cfg, params, head, mode, batch, max_model_len, tok, args.slot_growth,
                  admit_interval, packing, short_rows)
    t0 = time.perf_counter()
    engine.warmup((LEAN,) if args.variants == "lean" else VARIANTS)
    compile_s = time.perf_counter() - t0
    forms = len(engine.planner.forms())
    print(f"{mode} batch {batch}: warm-up (compilation) {compile_s:.1f} s, "
          f"{forms} admission shapes", flush=True)
    if args.warmup_only:
        return dict(mode=mode, batch=batch, compile_s=compile_s, admission_shapes=forms)
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
    admit_ms = sum(c * device_ms_per_admit(engine, a, w, f, form, 10)
                   for (a, w, f, form), c in st.admit_shapes.items())
    cycle_ms = sum(c * dev[k] for k, c in st.call_sizes.items())
    return dict(mode=mode, batch=batch, admit_interval=admit_interval,
                packing=packing, short_rows=engine.backend.short_rows,
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
    ap.add_argument("--slot-growth", type=int, default=4,
                    help="ratio of successive admission slot counts (EngineConfig.slot_growth)")
    ap.add_argument("--warmup-only", action="store_true", help="time warm-up only")
    ap.add_argument("--admit-interval", default="1",
                    help="comma list: EngineConfig.admit_interval values to compare")
    ap.add_argument("--packing", default="on",
                    help="comma list of on/off: first chunks packed (EngineConfig.packing)")
    ap.add_argument("--short-rows", default="default",
                    help="comma list: EngineConfig.short_rows (default: the backends' rule; 0: "
                         "off)")
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
            for every, pack, short in itertools.product(
                    args.admit_interval.split(","), args.packing.split(","),
                    args.short_rows.split(",")):
                r = run_case(cfg, params, head, tok, mode, b, args.steps, args.max_model_len,
                             args.gen, args, int(every), pack == "on",
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
    print(f"{'mode':8} {'B':>3} {'adm':>3} {'pack':>4} {'short':>5} {'dev ms/cyc':>10} "
          f"{'eng ms/step':>11} {'host ms':>8} {'dispatch':>8} {'busy':>5} {'+admit':>6} "
          f"{'adm ms':>6} {'tok/s':>8} {'recompiled':>10}")
    for r in rows:
        print(f"{r['mode']:8} {r['batch']:>3} {r['admit_interval']:>3} "
              f"{'on' if r['packing'] else 'off':>4} {r['short_rows']:>5} "
              f"{r['device_ms_per_cycle']:>10.3f} "
              f"{r['engine_ms_per_step']:>11.3f} {r['host_ms_per_step']:>8.3f} "
              f"{r['dispatch_ms_per_step']:>8.3f} {r['busy']:>5.2f} {r['busy_all']:>6.2f} "
              f"{r['admit_device_ms_per_step']:>6.2f} "
              f"{r['tokens_per_s']:>8.0f} {str(r['recompiled']):>10}")


if __name__ == "__main__":
    main()
