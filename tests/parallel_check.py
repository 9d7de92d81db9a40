"""Multi-device checks, run by test_parallel.py in subprocesses whose XLA_FLAGS fake N CPU
devices (the flag must be set before jax initialises, so they cannot run inside pytest's
process).

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/parallel_check.py \\
        dp:shard_map dp:pmap tp:2 tp:4 tp-gspmd:4

Each argument is a group of checks: `dp:IMPL` the engine over 2 devices' slots (data parallel
through shard_map or jax.pmap), `tp:N` the engine with weights and KV caches sharded over N
devices, `tp-gspmd:N` the programs called with sharded inputs outside the mesh (GSPMD alone)
and the plain engine with a tied, vocab-sharded embedding, over N devices. Every backend is
built over its placement (`jaxspec.parallel`) and driven by the one engine; greedy outputs are
compared with the single-device static-batch references (tests/reference_runner.py), token for
token. Each check prints `ok <name>`; a mismatch raises.
"""
import dataclasses
import functools
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reference_runner import CompileCounter, PlainRunner, SpecRunner, prefill  # noqa: E402
from reference_runner import serve as serve_over_time  # noqa: E402

from jaxspec.build import build_engine  # noqa: E402
from jaxspec.config import ModelConfig  # noqa: E402
from jaxspec.engine import Engine, EngineConfig, PlainBackend  # noqa: E402
from jaxspec.kv import init_cache  # noqa: E402
from jaxspec.models import eagle, llama  # noqa: E402
from jaxspec.parallel import (DataParallel, OneDevice, TensorParallel, make_mesh,  # noqa: E402
                              shard_draft_params, shard_params, shard_state)
from jaxspec.sampling import LEAN, SamplingParams, flat_params  # noqa: E402
from jaxspec.spec import SpecConfig, init_state, jit_cycle  # noqa: E402
from jaxspec.xla_options import gemm_backend  # noqa: E402

# 8 q heads over 4 kv heads (GQA 2), q/k/v biases: 4 devices hold one kv head and two q heads.
CFG = ModelConfig(arch="Qwen2ForCausalLM", vocab_size=320, hidden_size=64, intermediate_size=96,
                  num_layers=2, num_heads=8, num_kv_heads=4, head_dim=16, attention_bias=True)
CFG_TIED = dataclasses.replace(CFG, arch="LlamaForCausalLM", attention_bias=False,
                               tie_word_embeddings=True)
SPEC = SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)
MAX_LEN = 96
PLAIN_STEPS = 8
PROMPTS = [[5, 17, 42, 8, 99], [3] * 11 + [250, 7], list(range(60, 80)), [1, 2],
           [300, 301, 7, 7, 7, 9], [44] * 3, list(range(100, 130, 3))]
NEW = [24, 17, 30, 9, 24, 12, 20]
DP = 2            # data-parallel devices
PER = 2           # slots per device


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
def cut_draft():
    """The head with a cut vocabulary (half of it) and a context vocabulary of 8 ids a slot
    (`spec.context_vocab`), whose per-slot state is split with the slots."""
    from jaxspec.spec.draft_vocab import restrict
    p, d = pair()
    return restrict(p, d, np.random.default_rng(0).permutation(CFG.vocab_size)[:48], context=8)


@functools.lru_cache(maxsize=None)
def spec_reference():
    p, d = pair()
    r = SpecRunner(CFG, p, d, SPEC, max_slots=4, max_len=MAX_LEN + 2 * SPEC.max_emit)
    return [x.token_ids for x in r.generate(PROMPTS, NEW)]


@functools.lru_cache(maxsize=None)
def plain_reference(cfg=CFG):
    p, _ = pair(cfg)
    r = PlainRunner(cfg, p, 4, MAX_LEN + 2 * PLAIN_STEPS, decode_steps=PLAIN_STEPS)
    return [x.token_ids for x in r.generate(PROMPTS, NEW)]


def check(name, got, want):
    for i, (a, b) in enumerate(zip(got, want)):
        if list(a) != list(b):
            raise AssertionError(f"{name}: prompt {i} differs\n got  {list(a)}\n want {list(b)}")
    assert len(got) == len(want), (name, len(got), len(want))
    print("ok", name, flush=True)


def ok(name):
    print("ok", name, flush=True)


COMPILES = CompileCounter()


def serve(eng, prompts, sps):
    """Adds the requests, steps until all have ended; -> their Requests, in order."""
    ids = [eng.add_request(x, sp) for x, sp in zip(prompts, sps)]
    list(eng.drain())
    return [eng.pop_finished(i) for i in ids]


def greedy(news=NEW):
    return [SamplingParams(max_tokens=m) for m in news]


# ------------------------------------------------------------------------------ data parallel


def record_admissions(eng):
    """eng.admitted: per admission call, each replica's slot indices; eng.later: the first row
    each chunk-form call wrote from (> 0: a later chunk)."""
    call, eng.admitted, eng.later = eng.backend.admit, [], []

    def admit(state, form, parts, **kw):
        if not kw.get("lower"):
            eng.admitted.append([np.asarray(part[0]) for part in parts])
            if form == "chunk":
                eng.later.append(max(int(np.max(part[2])) for part in parts))
        return call(state, form, parts, **kw)
    eng.backend.admit = admit
    return eng


def own_slots_only(eng) -> bool:
    """Every admission gave replica r only its own slots (r * PER ..) or padding (DP * PER)."""
    return bool(eng.admitted) and all(
        ((s == DP * PER) | (s // PER == r)).all()
        for parts in eng.admitted for r, s in enumerate(parts))


def device_share(state, device):
    """numpy copies of every state leaf's part on `device`."""
    def take(x):
        shard, = [s for s in x.addressable_shards if s.device == device]
        return np.asarray(shard.data)
    return [take(x) for x in jax.tree_util.tree_leaves(state)]


def check_layout(name, eng, impl):
    """The state split along the slot axis (shard_map: one global array per leaf, the slot axis
    on the data axis; pmap: a leading device axis), the weights once on every device, each
    device's programs compiled for its own slots."""
    be, devs = eng.backend, jax.devices()[:DP]
    pl = be.placement
    assert isinstance(pl, DataParallel) and pl.impl == impl and pl.replicas == DP, pl
    axes = be._axes
    for x, ax in zip(jax.tree_util.tree_leaves(eng.state), jax.tree_util.tree_leaves(axes)):
        assert x.sharding.device_set == set(devs), x.sharding
        if impl == "pmap":
            assert x.shape[0] == DP and x.shape[1 + ax] == PER, (x.shape, ax)
            assert x.addressable_shards[0].data.shape[0] == 1
        else:
            assert x.shape[ax] == DP * PER and tuple(x.sharding.spec)[ax] == "data", \
                (x.shape, x.sharding)
            assert x.addressable_shards[0].data.shape[ax] == PER
    for x in jax.tree_util.tree_leaves(be.weights):
        assert x.sharding.device_set == set(devs) and x.sharding.is_fully_replicated, x.sharding
    # each device's share compiles under the GEMM rule (`xla_options`) of its own PER slots, as
    # a single-device engine of PER slots does, not of all DP * PER
    assert {f.gemm_rows for f in be._jitted["cycles"].values()} == {DP * PER}
    assert {f.gemm_rows for f in be._build()[0].values()} == {PER}
    # no admission program wider than one device's slots: each call's rows are one device's
    # newcomers
    admits = [k for k in be.programs.executables if k[0] == "admit"]
    assert admits and {k[2] for k in admits} <= {1, PER}, admits
    assert eng.planner.slot_buckets == [1, PER], eng.planner.slot_buckets
    ok(name)


def check_own_newcomers(name, backend, config):
    """One request admitted into device 1's first slot: device 0's share of the state is what
    it was, bit for bit (it prefilled nothing: its rows are padding, which the engine never
    reads), device 1's changed, and device 1's first row holds the request's first token."""
    eng = Engine(backend, config, vocab_size=CFG.vocab_size)
    devs = backend.placement.devices
    prompt = PROMPTS[2]
    f, i = flat_params(SamplingParams())
    fields = dict(n_prompt=len(prompt), samp_f=f, samp_i=i, key=np.zeros(2, np.uint32),
                  serial=0, root=-1)
    plans = eng.planner.plan([(0, PER, prompt, fields)])
    before = [device_share(eng.state, d) for d in devs]
    state = eng.state
    firsts = []
    for adm in plans:
        state, first = backend.admit(state, adm.form, adm.parts, features=LEAN)
        firsts.append(backend.host(first.tokens))
    after = [device_share(state, d) for d in devs]
    assert all(np.array_equal(a, b) for a, b in zip(before[0], after[0])), "device 0 changed"
    assert any(not np.array_equal(a, b) for a, b in zip(before[1], after[1]))
    toks = firsts[-1].reshape(DP, -1)
    assert toks[1, 0] == spec_reference()[2][0], toks
    assert [a.run_ids for a in plans][-1][len(toks[0])] == 0
    ok(name)


def churn(eng, *, aborts: bool):
    """Fourteen requests arriving over the first steps (greedy, seeded and unseeded sampled,
    penalized, with logprobs), two of them aborted while they run when `aborts`; every step's
    deltas collected. -> (Requests in order, streamed tokens per request, final reasons)."""
    g = greedy()
    sps = g + [SamplingParams(max_tokens=16, temperature=1.0, seed=5, ignore_eos=True),
               SamplingParams(max_tokens=14, temperature=0.8, top_k=20),
               SamplingParams(max_tokens=18, repetition_penalty=1.3, presence_penalty=0.5),
               SamplingParams(max_tokens=12, logprobs=3),
               SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=11,
                              frequency_penalty=0.4),
               SamplingParams(max_tokens=10, temperature=1.2, logprobs=2),
               SamplingParams(max_tokens=22)]
    prompts = PROMPTS + [PROMPTS[4], PROMPTS[0], PROMPTS[1], PROMPTS[3], PROMPTS[2],
                         PROMPTS[5], PROMPTS[6][::-1]]
    arrive = [0, 0, 0, 1, 1, 2, 3, 3, 4, 5, 6, 6, 8, 9]
    abort_at = {2: 4, 8: 7} if aborts else {}
    ids, streams, finals = serve_over_time(eng, prompts, sps, arrive, abort_at, max_steps=2000)
    reqs = [eng.pop_finished(ids[i]) for i in range(len(prompts))]
    return reqs, [streams.get(ids[i], []) for i in range(len(prompts))], \
        [finals[ids[i]] for i in range(len(prompts))], sorted(abort_at)


def check_churn(name, backend, config, want):
    """Requests over time on the data-parallel backend (an engine of a small KV budget over the
    backend already warmed up): streams equal the outputs, aborted requests end with 'abort'
    and a prefix of their output, retracts happen, and every other request's output (and
    logprobs) equals the one-device engine's; nothing compiles."""
    eng = Engine(backend, config.replace(kv_budget=110), vocab_size=CFG.vocab_size)
    COMPILES.on = True
    try:
        reqs, streams, finals, aborted = churn(eng, aborts=True)
    finally:
        COMPILES.on = False
    assert COMPILES.n == 0, f"{COMPILES.n} compilations after warm-up"
    assert eng.stats.retracts > 0, eng.stats.retracts
    assert any(r.retracts for r in reqs)
    ref = spec_reference()
    for i, (r, s, f, w) in enumerate(zip(reqs, streams, finals, want)):
        assert s == r.output and f == r.finish_reason, (i, s, r.output, f)
        if i in aborted:
            assert r.finish_reason == "abort" and r.output == w.output[:len(r.output)], \
                (i, r.output, w.output)
            continue
        assert (r.output, r.finish_reason) == (w.output, w.finish_reason), \
            (i, r.retracts, r.output, w.output)
        if i < len(ref):
            assert r.output == ref[i], i
        if r.logprobs is not None:
            assert len(r.logprobs) == len(w.logprobs)
            for a, b in zip(r.logprobs, w.logprobs):
                assert a.keys() == b.keys(), (a, b)
                np.testing.assert_allclose([a[k] for k in a], [b[k] for k in a], atol=1e-4)
    assert not eng.requests and not eng.scheduler.runs
    ok(name)


@functools.lru_cache(maxsize=None)
def one_device_churn():
    """The churn's requests, without aborts, on one device's engine of as many slots."""
    econf = EngineConfig(max_batch=DP * PER, max_model_len=MAX_LEN, prefill_chunk=16,
                         cycles_per_call=2)
    eng = build_engine(CFG, pair()[0], econf, draft=cut_draft(), spec=SPEC)
    assert isinstance(eng.backend.placement, OneDevice)
    return churn(eng, aborts=False)[0]


def check_dp_spec(impl):
    """The speculative engine over DP devices' slots, built by `build_engine`, its draft with a
    cut and a context vocabulary, packed first chunks and later chunks, 2 cycles a call."""
    pre = f"dp{DP}-{impl}-spec"
    econf = EngineConfig(max_batch=PER, max_model_len=MAX_LEN, prefill_chunk=16,
                         cycles_per_call=2)
    eng = record_admissions(build_engine(CFG, pair()[0], econf, draft=cut_draft(), spec=SPEC,
                                         data_parallel=DP, data_parallel_impl=impl))
    assert eng.slots == DP * PER and eng.backend.sizes == (1, 2)
    eng.warmup()
    eng.admitted.clear()
    eng.later.clear()
    COMPILES.on = True
    try:
        got = serve(eng, PROMPTS, greedy())
    finally:
        COMPILES.on = False
    assert COMPILES.n == 0 and eng.backend.jit_calls == 0, (COMPILES.n, eng.backend.jit_calls)
    check(pre, [r.output for r in got], spec_reference())
    # every cycle's accepted drafts plus its bonus token cover the output after the root
    assert all(sum(a + 1 for a in r.accept_lens) >= len(r.output) - 1 for r in got)
    assert all(r.accept_lens for r in got if len(r.output) > 1)
    assert {k[3] for k in eng.stats.admit_shapes} == {"packed", "chunk"}, eng.stats.admit_shapes
    assert eng.later and min(eng.later) >= 16, eng.later      # chunk calls: later chunks
    assert own_slots_only(eng), eng.admitted
    ok(f"{pre}-own-slots")
    check_layout(f"{pre}-layout", eng, impl)
    # the same engine again (state kept, nothing compiled) with fewer prompts than slots
    again = serve(eng, PROMPTS[:1], greedy(NEW[:1]))
    assert eng.backend.jit_calls == 0
    check(f"{pre}-again", [r.output for r in again], spec_reference()[:1])
    check_own_newcomers(f"{pre}-own-newcomers", eng.backend, eng.config)
    check_churn(f"{pre}-churn", eng.backend, eng.config, one_device_churn())


def check_dp_plain(impl):
    """The plain engine over DP devices' slots, its backend built over the placement directly
    and under the cuBLAS GEMM rule (`xla_options`: compiler options, which jax.pmap itself
    does not take); first chunks padded (no packing), 16-token chunks: prompts over 16 tokens
    take later chunks, each form stacked per device. Greedy outputs equal the single device's
    plain and speculative references, before warm-up (each program compiled on its first
    call) and after it (nothing compiled; each program run once by the warm-up itself)."""
    name = f"dp{DP}-{impl}-plain"
    devices = jax.devices()[:DP]
    with gemm_backend("cublas"):
        be = PlainBackend(CFG, pair()[0], DP * PER, MAX_LEN + 2 * PLAIN_STEPS,
                          n_steps=PLAIN_STEPS, placement=DataParallel(devices, impl))
    conf = EngineConfig(max_batch=PER, max_model_len=MAX_LEN, prefill_chunk=16, packing=False)
    eng = record_admissions(Engine(be, conf, vocab_size=CFG.vocab_size))
    # the per-device programs, built with the state (outside the context), follow its rule
    cycles, admits, advance = be._build()
    assert {f.gemm_rows for f in cycles.values()} == {PER}
    if impl == "pmap":
        progs = [*cycles.values(), *admits.values(), advance]
        assert all(f.options == {"xla_gpu_enable_triton_gemm": False}
                   for f in progs), [f.options for f in progs]
    cold = [r.output for r in serve(eng, PROMPTS, greedy())]
    assert be.jit_calls > 0
    if impl == "pmap":     # the calls ran executables compiled with the options
        assert cycles[LEAN, PLAIN_STEPS]._compiled and admits[LEAN, "chunk"]._compiled
    check(f"{name}-cold", cold, plain_reference())
    eng.warmup(variants=(LEAN,), execute=True)
    eng.admitted.clear()
    eng.later.clear()
    calls = be.jit_calls
    COMPILES.on = True
    try:
        got = [r.output for r in serve(eng, PROMPTS, greedy())]
    finally:
        COMPILES.on = False
    assert COMPILES.n == 0 and be.jit_calls == calls, (COMPILES.n, be.jit_calls - calls)
    assert {k[3] for k in eng.stats.admit_shapes} == {"chunk"}
    # padded first chunks (from row 0) and later chunks (from row 16) of the longer prompts
    assert 0 in eng.later and max(eng.later) >= 16, eng.later
    assert own_slots_only(eng), eng.admitted
    check(name, got, plain_reference())
    check(f"{name}-vs-spec", got, spec_reference())


# ------------------------------------------------------------------------------ tensor parallel


def check_tp_forward(n, mesh):
    p, _ = pair()
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
    with jax.set_mesh(mesh):   # attention per head shard (shard_map), as a TP backend traces it
        got = logits(sp, CFG, skv.k, skv.v)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    ok(f"tp{n}-forward")


def check_tp_spec(n):
    """The speculative engine with weights and KV caches sharded over n devices
    (`build_engine(tensor_parallel=n)`), fp32: greedy outputs equal one device's."""
    p, d = pair()
    econf = EngineConfig(max_batch=4, max_model_len=MAX_LEN, prefill_chunk=16)
    eng = build_engine(CFG, p, econf, draft=d, spec=SPEC, tensor_parallel=n)
    pl = eng.backend.placement
    assert isinstance(pl, TensorParallel) and pl.mesh.shape["model"] == n
    got = serve(eng, PROMPTS, greedy())
    check(f"tp{n}-spec", [r.output for r in got], spec_reference())
    # the KV caches (target and draft) on the kv-head axis, each device its own heads; the
    # weights in the blocked layout, sharded; the per-slot leaves replicated
    for kv in (eng.state.target.k, eng.state.target.v, eng.state.draft_k):
        assert kv.sharding.spec[2] == "model", kv.sharding
        assert kv.addressable_shards[0].data.shape[2] == kv.shape[2] // n
    assert eng.state.root.sharding.is_fully_replicated
    wqkv = eng.backend.params["layers"]["wqkv"]
    assert wqkv.sharding.spec[2] == "model" and wqkv.shape[2] == n, wqkv.sharding
    assert eng.backend.draft_params["layers"]["wqkv"].sharding.spec[-2] == "model"
    ok(f"tp{n}-spec-layout")
    return eng


def check_tp_kernels(n, eng):
    """The engine's cycle as a TP backend lowers it (under the mesh): the kernels run per shard
    of the kv heads (manual computations over the model axis), and the compiled cycle's only
    collectives are all-reduces of [.., H] activations (Megatron: after the attention output
    and the MLP down projections, and the vocab-sharded embedding lookup), no all-gather of a
    KV cache or of logits."""
    be = eng.backend
    mask = be.placement.put_mask(np.ones(eng.slots, bool))
    _, low = be.cycle(eng.state, mask, LEAN, size=1, lower=True)
    text = low.as_text()
    assert "sdy.manual_computation" in text or "SPMDFullToShardShape" in text, \
        "no per-shard kernel in the cycle"
    hlo = low.compile().as_text()
    colls = re.findall(r"= (\S+) (all-gather|all-reduce|collective-permute|all-to-all)[-a-z]*\(",
                       hlo)
    bad = [c for c in colls if c[1] != "all-reduce" or not c[0].split("]")[0].endswith(",64")]
    assert colls and not bad, bad
    ok(f"tp{n}-kernels")


def check_tp_plain(n):
    p, _ = pair()
    econf = EngineConfig(max_batch=4, max_model_len=MAX_LEN, prefill_chunk=16,
                         decode_steps=PLAIN_STEPS)
    eng = build_engine(CFG, p, econf, tensor_parallel=n)
    assert isinstance(eng.backend.placement, TensorParallel)
    check(f"tp{n}-plain", [r.output for r in serve(eng, PROMPTS, greedy())], plain_reference())


def check_tp_gspmd(n, mesh):
    """The admission and cycle programs as jitted, called with sharded inputs and no mesh
    context: GSPMD follows the inputs' shardings, and the outputs are the single device's."""
    p, d = pair()
    sp, sd = shard_params(p, CFG, mesh), shard_draft_params(d, CFG, mesh)
    state = shard_state(init_state(CFG, SPEC, 2, MAX_LEN, jnp.float32), CFG, mesh)
    tokens = np.zeros((2, 32), np.int32)
    tokens[0, :20], tokens[1, :13] = PROMPTS[2], PROMPTS[1]
    state, root = prefill(CFG, SPEC, sp, sd, state, tokens, np.asarray([20, 13], np.int32),
                          features=LEAN)
    outs = [[int(root[0])], [int(root[1])]]
    active = jnp.ones((2,), bool)
    cyc = jit_cycle(CFG, SPEC, features=LEAN)
    for _ in range(6):
        state, co = cyc(sp, sd, state, active)
        co = jax.device_get(co)
        for j in range(2):
            outs[j] += [int(t) for t in co.tokens[j, :co.accept_len[j] + 1]]
    ref = spec_reference()
    assert state.target.k.sharding.spec[2] == "model", state.target.k.sharding
    check(f"tp{n}-gspmd", [o[:len(r)] for o, r in zip(outs, [ref[2], ref[1]])],
          [ref[2][:len(outs[0])], ref[1][:len(outs[1])]])


def check_tp_plain_tied(n, mesh):
    """Plain decoding with a tied embedding, vocab-sharded and read as the lm_head, its backend
    built over `TensorParallel(mesh, cfg, vocab='shard')`."""
    pt, _ = pair(CFG_TIED)
    be = PlainBackend(CFG_TIED, pt, 4, MAX_LEN + 2 * PLAIN_STEPS, n_steps=PLAIN_STEPS,
                      placement=TensorParallel(mesh, CFG_TIED, vocab="shard"))
    assert tuple(be.params["embed"].sharding.spec) == ("model", None), be.params["embed"].sharding
    eng = Engine(be, EngineConfig(max_batch=4, max_model_len=MAX_LEN, prefill_chunk=16),
                 vocab_size=CFG_TIED.vocab_size)
    check(f"tp{n}-plain-tied", [r.output for r in serve(eng, PROMPTS, greedy())],
          plain_reference(CFG_TIED))


def check_tp(n):
    mesh = make_mesh(n)
    check_tp_forward(n, mesh)
    eng = check_tp_spec(n)
    check_tp_kernels(n, eng)
    check_tp_plain(n)


if __name__ == "__main__":
    groups = sys.argv[1:] or ["dp:shard_map", "dp:pmap", f"tp:{jax.device_count()}",
                              f"tp-gspmd:{jax.device_count()}"]
    need = max([DP] + [int(g.split(":")[1]) for g in groups if g.startswith("tp")])
    assert need <= jax.device_count(), \
        f"{jax.device_count()} devices; set XLA_FLAGS=--xla_force_host_platform_device_count={need}"
    # the references first: their compiles are shared by every group
    spec_reference()
    plain_reference()
    for g in groups:
        kind, arg = g.split(":")
        t0 = time.perf_counter()
        if kind == "dp":
            check_dp_spec(arg)
            check_dp_plain(arg)
        elif kind == "tp":
            check_tp(int(arg))
        elif kind == "tp-gspmd":
            check_tp_gspmd(int(arg), make_mesh(int(arg)))
            check_tp_plain_tied(int(arg), make_mesh(int(arg)))
        else:
            raise SystemExit(f"unknown group {g!r}")
        print(f"time {g} {time.perf_counter() - t0:.1f}s", flush=True)
