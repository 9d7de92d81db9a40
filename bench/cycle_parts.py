"""Where a batch-B speculative cycle's device time goes, against a plain decode step, by layers.

Times the engine's LEAN programs (a 1-cycle spec call, a 1-step plain call) on SmolLM2-shaped
random weights with 1, 2 and the model's own number of layers, every slot at `--prefix` rows:
  per layer = T(2) - T(1);  outside the layers = T(1) - per layer
and checks that T(L) = outside + L x per layer holds. So the cycle's cost splits into its verify
layers (the target's, at N tree tokens a slot) and everything else (draft steps, catch-up, the
tree, acceptance, compaction, the lm_heads), each next to the plain step's counterpart. With
`--profile 1,30`, the programs of those layer counts also run under jax.profiler and their
kernels are listed with their time and the source line XLA's HLO gives each (GEMMs through
cuBLAS have no name in the HLO; they are listed by their kernel name).
A 1-step plain call can be bound by the host's launch, not the device: its `measured` time
may then exceed the layer model's.

    python3 -m bench.cycle_parts [--batch 64] [--prefix 320] [--spec chain] [--profile 1,30]
        [--draft-vocab 16384]
Writes $OUT/cycle_parts.json.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import SMOLLM2_135M, timed, write_json
from jaxspec.kv import KVCache
from jaxspec.models import eagle, llama
from jaxspec.sampling import LEAN


def _programs(cfg, spec_name: str, batch: int, prefix: int, draft_vocab: int = 0,
              context: int = 0):
    """[(backend, step, state)] for the spec and the plain backend: back-to-back callables.
    draft_vocab: the head drafts only that many target ids (as the shipped head's 16,384);
    context: that many of the draft_vocab ids a slot's context, all held by ids outside them."""
    from jaxspec.engine.backends import PlainBackend, SpecBackend
    gpu = jax.default_backend() == "gpu"
    dtype = jnp.bfloat16 if gpu else jnp.float32
    params = llama.init_random_params(cfg, jax.random.PRNGKey(0), dtype=dtype)
    head = jax.tree_util.tree_map(lambda x: x.astype(dtype),
                                  eagle.init_eagle_params(cfg, jax.random.PRNGKey(1)))
    if draft_vocab:
        from jaxspec.spec import draft_vocab as dv
        ids = np.random.default_rng(0).permutation(cfg.vocab_size)[:draft_vocab]
        head = dv.restrict(params, head, ids, context=context)
    max_len = prefix + 1024
    spec = SpecBackend(cfg, params, head, spec_name, batch, max_len, cycles_per_call=1)
    plain = PlainBackend(cfg, params, batch, max_len, n_steps=1)
    active = jax.device_put(np.ones(batch, bool))
    out = []
    for be in (spec, plain):
        st = be.init_state()
        # Random caches: kernels may run faster on zeros (METHOD.md).
        k = jax.random.normal(jax.random.PRNGKey(2), st.target.k.shape, dtype)
        st = st.replace(target=KVCache(k, k * 0.5, jnp.full((batch,), prefix, jnp.int32)))
        if hasattr(st, "seed") and context:                    # a full context: every id live
            held = np.setdiff1d(np.arange(cfg.vocab_size), ids)
            ctx = np.broadcast_to(held[:context], st.seed.ctx.shape).astype(np.int32)
            st = st.replace(seed=st.seed._replace(ctx=jnp.asarray(ctx)))
        out.append((be, lambda s, be=be: be.cycle(s, active, LEAN)[0], st))
    return out


def profile_kernels(step, state, calls: int = 10):
    """[(kernel name, ms a call, launches a call)] of `calls` back-to-back calls, costliest
    first (traced by `profile_cycle.profile`)."""
    from bench.profile_cycle import profile
    _, ev, state = profile(step, state, calls)
    ms, n = collections.defaultdict(float), collections.Counter()
    for name, _, dur in ev:
        ms[name] += dur / calls / 1e3
        n[name] += 1
    return sorted(((k, v, n[k] / calls) for k, v in ms.items()), key=lambda r: -r[1]), state


def hlo_sources(backend, state, features=LEAN) -> dict:
    """{kernel name: "opcode kind file:line function"} of the backend's cycle program, for the
    fusions and Pallas calls the HLO names (the profiler shows a fusion `a.b` as `a_b`)."""
    from bench.kernel_census import kernels
    active = np.ones(backend.slots, bool)
    _, low = backend.cycle(state, active, features, lower=True)
    out = {}
    for name, op, detail, src in kernels(low.compile().as_text()):
        out[name.replace(".", "_")] = f"{op} {detail} {src}".strip()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prefix", type=int, default=320)
    ap.add_argument("--spec", default="chain")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile", default="",
                    help="layer counts (of 1, 2 and the model's) whose programs to profile, "
                         "e.g. 1,30")
    ap.add_argument("--top", type=int, default=60)
    ap.add_argument("--draft-vocab", type=int, default=0,
                    help="the head drafts this many target ids (0: all; the shipped head 16384)")
    ap.add_argument("--context-vocab", type=int, default=0,
                    help="with --draft-vocab: this many of its ids a slot's context")
    a = ap.parse_args()
    full = SMOLLM2_135M.num_layers
    gpu = jax.default_backend() == "gpu"
    rows, profiles = {}, {}
    for layers in (1, 2, full):
        cfg = dataclasses.replace(SMOLLM2_135M, num_layers=layers).with_layout(unroll_layers=gpu)
        progs = dict(zip(("spec", "plain"), _programs(cfg, a.spec, a.batch, a.prefix, a.draft_vocab,
                                                        a.context_vocab)))
        rows[layers] = {}
        for m, (be, step, st) in progs.items():   # states are donated: keep the last
            rows[layers][m], st = timed(step, st, a.calls, a.repeats)
            progs[m] = (be, step, st)
        print(f"{layers:3d} layers: spec cycle {rows[layers]['spec']:.4f} ms, plain step "
              f"{rows[layers]['plain']:.4f} ms", flush=True)
        if str(layers) in a.profile.split(","):
            for mode, (be, step, st) in progs.items():
                src = hlo_sources(be, st)
                ks, _ = profile_kernels(step, st)
                profiles[f"{mode}, {layers} layers"] = [(k, ms, n, src.get(k, ""))
                                                        for k, ms, n in ks]
    parts = {}
    for mode in ("spec", "plain"):
        per = rows[2][mode] - rows[1][mode]
        outside = rows[1][mode] - per
        parts[mode] = {"per_layer_ms": per, "outside_ms": outside,
                       "layers_ms": full * per, "model_ms": outside + full * per,
                       "measured_ms": rows[full][mode]}
    print(f"\nbatch {a.batch}, prefix {a.prefix}, {a.spec} (1 cycle a call) against 1 plain "
          f"step a call, LEAN, ms:")
    print(f"{'':8} {'per layer':>10} {'x' + str(full):>8} {'outside':>8} {'model':>8} "
          f"{'measured':>9}")
    for mode, p in parts.items():
        print(f"{mode:8} {p['per_layer_ms']:10.4f} {p['layers_ms']:8.3f} {p['outside_ms']:8.3f} "
              f"{p['model_ms']:8.3f} {p['measured_ms']:9.3f}")
    for mode, ks in profiles.items():
        print(f"\n{mode}: kernels by device time (ms a call, launches a call)")
        for name, ms, n, src in ks[:a.top]:
            print(f"  {name[:48]:48} {ms:8.4f} x{n:<3g} {src}")
    write_json("cycle_parts", dict(args=vars(a), rows={str(k): v for k, v in rows.items()},
                                   parts=parts, profiles=profiles))


if __name__ == "__main__":
    main()
