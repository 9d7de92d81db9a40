"""Multi-device checks, run by test_parallel.py in a subprocess whose XLA_FLAGS fakes N CPU
devices (the flag must be set before jax initialises, so it cannot run inside pytest's process).

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/parallel_check.py 2 4

runs tensor parallel on the first 2 and on all 4 devices, speculative data parallel on the
first 2 and plain on all 4 (one process, so the single-device references and their compilations
are shared; the GSPMD-only tensor-parallel paths run on all devices only). Each check compares
greedy outputs with the single-device runners, token for token, and prints `ok <name>`; a
mismatch raises.
"""
import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.decode import PlainRunner
from jaxspec.kv import init_cache
from jaxspec.models import eagle, llama
from jaxspec.parallel import (DataParallelPlainRunner, DataParallelSpecRunner,
                              TensorParallelSpecRunner, make_mesh, shard_draft_params,
                              shard_params, shard_state)
from jaxspec.sampling import LEAN, SamplingParams
from jaxspec.spec import SpecConfig, SpecRunner, init_state, jit_cycle, jit_prefill

# 8 q heads over 4 kv heads (GQA 2), q/k/v biases: 4 devices hold one kv head and two q heads.
CFG = ModelConfig(arch="Qwen2ForCausalLM", vocab_size=320, hidden_size=64, intermediate_size=96,
                  num_layers=2, num_heads=8, num_kv_heads=4, head_dim=16, attention_bias=True)
CFG_TIED = dataclasses.replace(CFG, arch="LlamaForCausalLM", attention_bias=False,
                               tie_word_embeddings=True)
SPEC = SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)
MAX_LEN = 96
PROMPTS = [[5, 17, 42, 8, 99], [3] * 11 + [250, 7], list(range(60, 80)), [1, 2],
           [300, 301, 7, 7, 7, 9], [44] * 3, list(range(100, 130, 3))]
NEW = [24, 17, 30, 9, 24, 12, 20]


@functools.lru_cache(maxsize=None)
def pair(cfg=CFG):
    """Target and a head that mostly agrees with it (accepts are long, so the tree paths and the
    compaction of several rows per cycle are exercised)."""
    p = llama.init_random_params(cfg, jax.random.PRNGKey(2), scale=0.02)
    p = dict(p, embed=jax.random.normal(jax.random.PRNGKey(3), p["embed"].shape),
             final_norm=jnp.ones_like(p["final_norm"]))
    if "lm_head" in p:
        p["lm_head"] = 0.5 * jax.random.normal(jax.random.PRNGKey(7), p["lm_head"].shape)
    h = cfg.hidden_size
    d = eagle.init_eagle_params(cfg, jax.random.PRNGKey(4), scale=0.02)
    d = dict(d, fc=jnp.concatenate([jnp.eye(h), jnp.zeros((h, h))], 0), fc_bias=jnp.zeros((h,)))
    return p, d


@functools.lru_cache(maxsize=None)
def spec_reference():
    p, d = pair()
    r = SpecRunner(CFG, p, d, SPEC, max_slots=2, max_len=MAX_LEN)
    return [x.token_ids for x in r.generate(PROMPTS, NEW)]


@functools.lru_cache(maxsize=None)
def plain_reference(cfg=CFG):
    p, _ = pair(cfg)
    r = PlainRunner(cfg, p, init_cache(cfg, 4, MAX_LEN, jnp.float32), decode_chunk=8)
    out = []
    for i in range(0, len(PROMPTS), 4):
        sps = [SamplingParams(max_tokens=m) for m in NEW[i:i + 4]]
        out += [g.token_ids for g in r.generate(PROMPTS[i:i + 4], sps, [set()] * len(sps))]
    return out


def check(name, got, want):
    for i, (a, b) in enumerate(zip(got, want)):
        if list(a) != list(b):
            raise AssertionError(f"{name}: prompt {i} differs\n got  {list(a)}\n want {list(b)}")
    assert len(got) == len(want), (name, len(got), len(want))
    print("ok", name, flush=True)


def check_dp(n):
    p, d = pair()
    if n < jax.device_count():
        # Speculative on the fewer devices, plain on all: the pmap runner and the engine are
        # the same code at any replica count, and each count's compiles are the cost.
        r = DataParallelSpecRunner(CFG, p, d, SPEC, slots=2, max_len=MAX_LEN, replicas=n)
        res = r.generate(PROMPTS, NEW)
        check(f"dp{n}-spec", [x.token_ids for x in res], spec_reference())
        assert all(sum(a + 1 for a in x.accept_lens) >= len(x.token_ids) - 1 for x in res)
        # The same runner again (state reused, nothing recompiled) with fewer prompts than slots.
        check(f"dp{n}-spec-again", [x.token_ids for x in r.generate(PROMPTS[:1], NEW[:1])],
              spec_reference()[:1])
        check_dp_engine(n, "spec")
        return
    check_dp_engine(n, "plain")
    pr = DataParallelPlainRunner(CFG, p, slots=2, max_len=MAX_LEN, replicas=n, decode_chunk=8)
    gens = pr.generate(PROMPTS, [SamplingParams(max_tokens=m) for m in NEW], [set()] * 7)
    check(f"dp{n}-plain", [g.token_ids for g in gens], plain_reference())
    check(f"dp{n}-plain-vs-spec", [g.token_ids for g in gens], spec_reference())


def check_dp_engine(n, kind):
    """One engine over n devices' slots (parallel.dp_engine), its draft with a cut vocabulary and
    a context vocabulary (`spec.context_vocab`): greedy outputs equal the single device's, and a seeded sampled request equals the single-device engine's (slot placement and
    the device it lands on change nothing); nothing compiles after warm-up."""
    from jaxspec.engine import Engine, PlainBackend, SpecBackend
    from jaxspec.parallel.dp_engine import data_parallel_backend
    from jaxspec.spec.draft_vocab import restrict
    p, d = pair()
    # the draft cut to half the vocabulary plus a context of 8 ids a slot, sharded with the slots
    d = restrict(p, d, np.random.default_rng(0).permutation(CFG.vocab_size)[:48], context=8)

    def engine(devices, **kw):
        be = (SpecBackend(CFG, p, d, SPEC, 2 * n, MAX_LEN + 2 * SPEC.max_emit) if kind == "spec"
              else PlainBackend(CFG, p, 2 * n, MAX_LEN + 16, n_steps=8))
        if devices:
            data_parallel_backend(be, devices)
        return Engine(be, max_model_len=MAX_LEN, vocab_size=CFG.vocab_size, **{"chunk": 64, **kw})

    def recorded(eng):
        """eng with each admission's slot indices [n, A] recorded in eng.stacked."""
        call, eng.stacked = eng.backend.admit_stacked, []

        def admit_stacked(form, state, slot_idx, *a, **k):
            eng.stacked.append(np.asarray(slot_idx))
            return call(form, state, slot_idx, *a, **k)
        eng.backend.admit_stacked = admit_stacked
        return eng

    def own_slots_only(eng):
        """Every admission gave device d only its own slots (2 a device) or padding (2n)."""
        return eng.stacked and all(((s == 2 * n) | (s // 2 == np.arange(n)[:, None])).all()
                                   for s in eng.stacked)

    sampled = SamplingParams(max_tokens=16, temperature=1.0, seed=5, ignore_eos=True)
    single = engine(None)
    want = single.add_request(PROMPTS[4], sampled)
    list(single.drain())
    eng = recorded(engine(jax.devices()[:n]))
    eng.warmup()
    eng.stacked.clear()
    ids = [eng.add_request(x, SamplingParams(max_tokens=m)) for x, m in zip(PROMPTS, NEW)]
    got = eng.add_request(PROMPTS[4], sampled)
    list(eng.drain())
    assert eng.backend.jit_calls == 0
    assert own_slots_only(eng), eng.stacked
    # each device's share compiles under the GEMM rule (`xla_options`) of its own 2 slots, as a
    # single-device engine of 2 slots does, not of all 2n
    assert {x.gemm_rows for x in single.backend._cycles.values()} == {2 * n}
    assert {x.gemm_rows for x in eng.backend._cycles.values()} == {2}
    assert all("data" in tuple(x.sharding.spec) for x in jax.tree_util.tree_leaves(eng.state))
    # the weights sit on every device already (else each call copies them there)
    assert all(x.sharding.device_set == set(jax.devices()[:n]) and x.sharding.is_fully_replicated
               for x in jax.tree_util.tree_leaves(eng.backend.weights))
    ref = spec_reference() if kind == "spec" else plain_reference()
    check(f"dp{n}-engine-{kind}", [eng.pop_finished(i).output for i in ids], ref)
    check(f"dp{n}-engine-{kind}-sampled", [eng.pop_finished(got).output],
          [single.pop_finished(want).output])
    # 16-token chunks, padded first chunks: prompts over 16 tokens take later chunks, each form
    # stacked per device; outputs equal one device's engine of the same chunking
    kw = dict(chunk=16, pack_first_chunks=False)
    one, eng = engine(None, **kw), recorded(engine(jax.devices()[:n], **kw))
    eng.warmup(variants=(LEAN,))
    eng.stacked.clear()
    outs = []
    for e in (one, eng):
        ids = [e.add_request(x, SamplingParams(max_tokens=m)) for x, m in zip(PROMPTS, NEW)]
        list(e.drain())
        outs.append([e.pop_finished(i).output for i in ids])
    assert {form for _, _, _, form in eng.stats.admit_shapes} == {True, False}
    assert eng.backend.jit_calls == 0     # the stacked padded and later-chunk forms warmed up
    # warm-up compiled no admission wider than one device's 2 slots (each call's rows are one
    # device's newcomers), while a single device's engine of 2n slots has forms up to 2n
    admits = [k for k in eng.backend.executables if k[0] == "admit_stacked"]
    assert admits and {k[2] for k in admits} <= {1, 2}, admits
    assert max(one.admit_buckets) == 2 * n and eng.admit_buckets == [1, 2]
    assert own_slots_only(eng), eng.stacked
    check(f"dp{n}-engine-{kind}-chunks", outs[1], outs[0])


def check_tp(n):
    mesh = make_mesh(n)
    p, d = pair()
    sp = shard_params(p, CFG, mesh)
    wqkv = sp["layers"]["wqkv"]
    assert wqkv.shape == (2, 64, n, (128 + 2 * 64) // n), wqkv.shape
    assert wqkv.addressable_shards[0].data.shape == (2, 64, 1, (128 + 2 * 64) // n)
    # Forward (prefill shape): logits equal the single-device ones.
    toks = jnp.asarray([PROMPTS[2][:16], PROMPTS[6][:10] + [0] * 6], jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (2, 16))
    kv = init_cache(CFG, 2, 32, jnp.float32)

    @functools.partial(jax.jit, static_argnums=1)
    def logits(params, cfg, k, v):
        h, _, _, _ = llama.forward(params, cfg, toks, pos, k, v, jnp.zeros((2,), jnp.int32),
                                   llama.causal_mask(2, 16))
        return llama.lm_head(params, cfg, h)

    want = logits(p, CFG, kv.k, kv.v)
    skv = shard_state(kv, CFG, mesh)
    got = logits(sp, CFG, skv.k, skv.v)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    with jax.set_mesh(mesh):   # attention per head shard (shard_map), as the TP runner traces it
        got = logits(sp, CFG, skv.k, skv.v)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    print("ok", f"tp{n}-forward", flush=True)

    # The speculative runner, sharded end to end.
    r = TensorParallelSpecRunner(CFG, p, d, SPEC, max_slots=2, max_len=MAX_LEN, mesh=mesh)
    check(f"tp{n}-spec", [x.token_ids for x in r.generate(PROMPTS, NEW)], spec_reference())
    k = r._state.target.k
    assert k.sharding.spec[2] == "model" and k.addressable_shards[0].data.shape[2] == 4 // n

    if n < jax.device_count():
        return   # the GSPMD-only paths below once, on all devices (their compiles are the cost)
    # jit_cycle / jit_prefill as they are (no sharding arguments, no mesh context): GSPMD
    # follows the inputs' shardings.
    sd = shard_draft_params(d, CFG, mesh)
    state = shard_state(init_state(CFG, SPEC, 2, MAX_LEN, jnp.float32), CFG, mesh)
    tokens = np.zeros((2, 32), np.int32)
    tokens[0, :20], tokens[1, :13] = PROMPTS[2], PROMPTS[1]
    state, root = jit_prefill(CFG, SPEC, greedy_only=True)(
        sp, sd, state, jnp.asarray(tokens), jnp.asarray([20, 13], jnp.int32))
    outs = [[int(root[0])], [int(root[1])]]
    active = jnp.ones((2,), bool)
    for _ in range(6):
        state, co = jit_cycle(CFG, SPEC, greedy_only=True)(sp, sd, state, active)
        co = jax.device_get(co)
        for j in range(2):
            outs[j] += [int(t) for t in co.tokens[j, :co.accept_len[j] + 1]]
    ref = spec_reference()
    check(f"tp{n}-jit-cycle", [o[:len(r_)] for o, r_ in zip(outs, [ref[2], ref[1]])],
          [ref[2][:len(outs[0])], ref[1][:len(outs[1])]])

    # Collectives of the cycle: only all-reduces of [B, N, H] activations (Megatron: after the
    # attention output and the MLP down projections, and the vocab-sharded embedding lookup); no
    # all-gather of a KV cache or of logits.
    import re
    with jax.set_mesh(mesh):
        hlo = jit_cycle(CFG, SPEC, greedy_only=True).lower(sp, sd, state, active).compile()
    colls = re.findall(r"= (\S+) (all-gather|all-reduce|collective-permute|all-to-all)[-a-z]*\(",
                       hlo.as_text())
    bad = [c for c in colls if c[1] != "all-reduce" or not c[0].split("]")[0].endswith(",64")]
    assert colls and not bad, bad
    print("ok", f"tp{n}-collectives", flush=True)

    # Plain decoding with a tied embedding, vocab-sharded and read as the lm_head.
    pt, _ = pair(CFG_TIED)
    pr = PlainRunner(CFG_TIED, shard_params(pt, CFG_TIED, mesh, vocab="shard"),
                     shard_state(init_cache(CFG_TIED, 4, MAX_LEN, jnp.float32), CFG_TIED, mesh),
                     decode_chunk=8)
    out = []
    for i in range(0, len(PROMPTS), 4):
        sps = [SamplingParams(max_tokens=m) for m in NEW[i:i + 4]]
        out += [g.token_ids for g in pr.generate(PROMPTS[i:i + 4], sps, [set()] * len(sps))]
    check(f"tp{n}-plain-tied", out, plain_reference(CFG_TIED))

    # The engine's speculative backend, made tensor parallel (LLM(..., tensor_parallel=n)).
    from jaxspec.engine import Engine, SpecBackend
    from jaxspec.parallel import shard_backend
    be = shard_backend(SpecBackend(CFG, sp, sd, SPEC, 2, MAX_LEN + 2 * SPEC.max_emit), CFG, mesh)
    eng = Engine(be, max_model_len=MAX_LEN, vocab_size=CFG.vocab_size)
    ids = [eng.add_request(x, SamplingParams(max_tokens=m)) for x, m in zip(PROMPTS, NEW)]
    while eng.has_work():
        eng.step()
    check(f"tp{n}-engine", [eng.pop_finished(i).output for i in ids], ref)


if __name__ == "__main__":
    import time
    counts = [int(a) for a in sys.argv[1:]] or [jax.device_count()]
    assert max(counts) <= jax.device_count(), \
        f"{jax.device_count()} devices; set XLA_FLAGS=--xla_force_host_platform_device_count=N"
    for n in counts:
        for fn in (check_dp, check_tp):
            t0 = time.perf_counter()
            fn(n)
            print(f"time {fn.__name__}({n}) {time.perf_counter() - t0:.1f}s", flush=True)
