"""Engine warm-up: the admission buckets it compiles, executables compiled ahead of time that keep
the state donated, and a shape warm-up missed showing up in the engine's no-compilation check."""
import collections

import jax
import numpy as np
import pytest

from jaxspec.config import ConfigError
from jaxspec.engine import Engine, EngineConfig, PlainBackend
from jaxspec.engine.admission import AdmitArgs
from jaxspec.engine.prefill_plan import bucket, buckets, build_pack
from jaxspec.sampling import FULL, LEAN, VARIANTS, SamplingParams
from test_engine import (CFG, MAX_MODEL_LEN, PLAIN_STEPS, SLOTS, agreeing_pair, chunk_part,
                         compiled_shapes, greedy_ref, make_engine)


def admit_key(a, w, features, form):
    """The backend's executable key of admission form (a, w, form) (`PrefillPlanner.forms`):
    a requests and their tokens in all (a pack's size; a chunk's a x w)."""
    return ("admit", form, a, w if form == "packed" else a * w, features)


def test_buckets():
    assert buckets(16, 512, 4) == [16, 64, 256, 512]
    assert buckets(16, 512, 2) == [16, 32, 64, 128, 256, 512]
    assert buckets(1, 64, 4) == [1, 4, 16, 64]
    assert buckets(1, 8, 4) == [1, 4, 8]
    assert buckets(1, 1, 4) == [1] and buckets(16, 16, 4) == [16]
    widths = buckets(16, 512, 4)
    assert [bucket(n, widths) for n in (1, 16, 17, 64, 65, 256, 257, 512)] == \
        [16, 16, 64, 64, 256, 256, 512, 512]


def test_admission_shapes_follow_bucket_growth():
    """Without packing, first chunks run padded to a slot bucket and a width bucket: the
    programs are every (slot bucket, width) pair."""
    be = PlainBackend(CFG, agreeing_pair()[0], SLOTS, 64 + 2 * PLAIN_STEPS, n_steps=PLAIN_STEPS)

    def shapes(**kw):
        engine = Engine(be, EngineConfig(max_model_len=64, packing=False, **kw),
                        vocab_size=CFG.vocab_size)
        forms = engine.planner.forms()
        assert {form for _, _, form in forms} == {"chunk"}
        return sorted((a, w) for a, w, _ in forms)

    assert shapes(prefill_chunk=64) == [(1, 16), (1, 64), (4, 16), (4, 64)]
    # each growth sets its own buckets: slot counts, widths, or both
    assert shapes(prefill_chunk=64, slot_growth=2) == \
        [(a, w) for a in (1, 2, 4) for w in (16, 64)]
    with pytest.raises(ConfigError, match="slot_growth"):
        shapes(slot_growth=1)
    assert shapes(prefill_chunk=64, width_growth=2) == \
        [(a, w) for a in (1, 4) for w in (16, 32, 64)]
    assert shapes(prefill_chunk=64, slot_growth=2, width_growth=2) == \
        [(a, w) for a in (1, 2, 4) for w in (16, 32, 64)]
    with pytest.raises(ConfigError, match="width_growth"):
        shapes(width_growth=1)


@pytest.mark.parametrize("kind", ["spec", "plain"])   # spec:3: test_engine's over-time test
def test_warmup_compiles_ahead_and_serves_without_jit(kind):
    engine = make_engine(kind)
    engine.warmup()
    be = engine.backend
    want = {("cycle", f, k) for f in VARIANTS for k in be.sizes} | \
        {admit_key(a, w, f, form) for a, w, form in engine.planner.forms()
         for f in VARIANTS} | \
        {("advance", a) for a in engine.planner.slot_buckets}
    assert set(be.programs.executables) == want
    assert be.jit_calls == 0
    before = compiled_shapes(engine)
    prompts = [[5, 17, 42, 8, 99], list(range(30, 60)), [3, 9, 27]]   # 30 tokens: two chunks
    ids = [engine.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in prompts]
    list(engine.drain())
    for rid, p in zip(ids, prompts):
        assert engine.pop_finished(rid).output == greedy_ref(p)
    assert compiled_shapes(engine) == before

    # The executables keep the jitted functions' donation: the old state is consumed.
    old = jax.tree_util.tree_leaves(engine.state)
    engine.state, _ = be.cycle(engine.state, be.placement.put_mask(np.zeros(SLOTS, bool)))
    assert all(x.is_deleted() for x in old)

    # A shape warm-up did not compile goes through jit, and the check sees it.
    engine.state, _ = be.admit(engine.state, "chunk",
                               [chunk_part([SLOTS] * 2, np.zeros((2, 16)), [0, 0])])
    assert compiled_shapes(engine) != before and be.jit_calls == 1


@pytest.mark.parametrize("kind,copies", [("spec", 1), ("plain", 1), ("spec", 2)])
def test_warmup_can_run_every_program_once_and_leaves_the_state_as_it_was(kind, copies,
                                                                          monkeypatch):
    """execute=True (the default on accelerators): each compiled program runs once on idle or
    padding arguments, through its executable (each loaded copy of a cycle once); the state is
    bit-identical afterwards."""
    monkeypatch.setenv("JAXSPEC_CYCLE_COPIES", str(copies))
    engine = make_engine(kind)
    before = [np.asarray(x) for x in jax.tree_util.tree_leaves(engine.state)]
    be = engine.backend
    ran = []
    for name in ("cycle", "admit", "advance_keys"):
        fn = getattr(be, name)

        def spy(*a, _fn=fn, _name=name, **kw):
            if not kw.get("lower"):
                ran.append(_name)
            return _fn(*a, **kw)
        setattr(be, name, spy)
    engine.warmup(execute=True)
    n_cycles = len(VARIANTS) * len(be.sizes) * copies
    n_admits = len(VARIANTS) * len(engine.planner.forms())
    assert ran == ["cycle"] * n_cycles + ["admit"] * n_admits + \
        ["advance_keys"] * len(engine.planner.slot_buckets)
    assert be.jit_calls == 0                          # every run found its executable
    after = jax.tree_util.tree_leaves(engine.state)
    assert all(np.array_equal(x, np.asarray(y)) for x, y in zip(before, after))
    assert sum(map(len, be.programs.spares.values())) == \
        (copies - 1) * len(VARIANTS) * len(be.sizes)
    engine.warmup(execute=False)                      # again: the copies start over
    assert sum(map(len, be.programs.spares.values())) == \
        (copies - 1) * len(VARIANTS) * len(be.sizes)
    runs = collections.Counter()

    def counted(exe):
        def call(*a):
            runs[id(call)] += 1
            return exe(*a)
        return call
    progs = be.programs
    progs.executables = {k: counted(x) for k, x in progs.executables.items()}
    progs.spares = {k: [counted(x) for x in v] for k, v in progs.spares.items()}
    prompt = [5, 17, 42, 8, 99]
    rid = engine.add_request(prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    list(engine.drain())
    assert engine.pop_finished(rid).output == greedy_ref(prompt)[:8]
    key = ("cycle", LEAN, be.call_size(1))   # one slot, greedy: every cycle runs this one
    copies_run = [runs[id(x)] for x in [progs.executables[key], *progs.spares.get(key, [])]]
    assert len(copies_run) == copies and min(copies_run) >= 1     # taken in turn
    assert max(copies_run) - min(copies_run) <= 1


def test_warmup_freezes_the_startup_heap_and_frees_what_was_dropped():
    """freeze_heap: the objects alive after warm-up leave the collector's view (gc.freeze); the
    next warm-up unfreezes and collects first, so a reference cycle frozen earlier and dropped
    since (an engine replaced by another) is freed then. On the CPU it is off by default."""
    import gc
    import weakref

    class Node:
        pass

    gc.unfreeze()
    try:
        engine = make_engine("plain")
        engine.warmup(execute=False)
        assert gc.get_freeze_count() == 0
        kept = Node()
        kept.me = kept                                   # a cycle: only the collector frees it
        ref = weakref.ref(kept)
        engine.warmup(execute=False, freeze_heap=True)
        frozen = gc.get_freeze_count()
        assert frozen > 1000
        del kept
        gc.collect()
        assert ref() is not None                         # frozen: not collected
        engine.warmup(execute=False, freeze_heap=True)
        assert ref() is None                             # the next freeze collected it first
        assert gc.get_freeze_count() > 1000
    finally:
        gc.unfreeze()


def test_warmup_of_the_variants_requests_need():
    engine = make_engine("spec")
    engine.warmup((LEAN,))
    be = engine.backend
    assert set(be.programs.executables) == {("cycle", LEAN, 1)} | \
        {admit_key(a, w, LEAN, form) for a, w, form in engine.planner.forms()}
    before = compiled_shapes(engine)
    prompt = [5, 17, 42, 8, 99]
    rid = engine.add_request(prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    list(engine.drain())
    assert engine.pop_finished(rid).output == greedy_ref(prompt)[:8]
    assert compiled_shapes(engine) == before          # greedy serving found every program
    engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=1.0, seed=1))
    list(engine.drain())
    assert be.jit_calls > 0                           # a sampled request compiled FULL
    with pytest.raises(ValueError, match="variants"):
        engine.warmup(())


@pytest.mark.parametrize("kind", ["spec", "plain", "spec:3"])
def test_cycle_variants_have_no_conditional(kind):
    """The engine's cycle variants decide sampling, penalties and logprobs at trace time: no
    conditional in the program. The device-flag form (features=None) is what they replace."""
    from jaxspec.spec.cycle import cycle
    engine = make_engine(kind)
    be = engine.backend
    idle = be.placement.put_mask(np.zeros(SLOTS, bool))
    for f in VARIANTS:
        for k in be.sizes:
            _, lowered = be.cycle(engine.state, idle, f, size=k, lower=True)
            assert "stablehlo.case" not in lowered.as_text(), (f, k)
    if kind == "spec":
        dyn = jax.jit(lambda p, d, s, a: cycle(p, d, s, a, cfg=be.cfg, spec=be.spec))
        text = dyn.lower(be.params, be.draft_params, engine.state, idle).as_text()
        assert "stablehlo.case" in text      # the check can see a conditional


def _primitives(jaxpr) -> set:
    """Names of every primitive in a jaxpr, nested jaxprs (jit, scan bodies) included."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for v in eqn.params.values():
            for sub in v if isinstance(v, (list, tuple)) else (v,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    names |= _primitives(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    names |= _primitives(sub)
    return names


@pytest.mark.parametrize("kind", ["spec", "plain", "spec:3"])
def test_serving_programs_have_no_device_control_flow(kind):
    """Cycles and admissions, both variants: no cond and no loop on a device value (on the GPU
    each reads a flag back and holds the host until the device gets there). Scans over layers or
    decode steps have static trip counts and stay; the rare key advance of a resumed sampling
    request is the one loop, in its own program."""
    engine = make_engine(kind)
    be = engine.backend
    pad = np.full(2, SLOTS, np.int32)
    z = np.zeros(2, np.int32)
    adm = AdmitArgs.host(2)
    programs = be._jitted
    for key, fn in programs["cycles"].items():           # every variant and call size
        cyc = _primitives(jax.make_jaxpr(fn)(*be.weights, engine.state,
                                             np.zeros(SLOTS, bool)).jaxpr)
        assert not cyc & {"cond", "while"}, (key, cyc & {"cond", "while"})
    for f, fn in programs["admits"].items():   # every variant, both forms
        chunk = (*build_pack([], [], 1, 32, 2), z) if f[1] == "packed" else \
            (np.zeros((2, 16), np.int32), z, z)
        adm_p = _primitives(jax.make_jaxpr(fn)(
            *be.weights, engine.state, pad, *chunk, z - 1, adm, be.key).jaxpr)
        assert not adm_p & {"cond", "while"}, (f, adm_p & {"cond", "while"})
    adv = _primitives(jax.make_jaxpr(programs["advance"])(engine.state, pad, z + 3).jaxpr)
    assert "while" in adv          # the check can see a loop on a device value


def test_engine_picks_lean_while_every_request_is_greedy():
    engine = make_engine("spec")
    used = []
    cyc = engine.backend.cycle
    engine.backend.cycle = lambda st, act, f=FULL, **kw: (used.append(f), cyc(st, act, f, **kw))[1]
    a = engine.add_request([5, 17, 42], SamplingParams(max_tokens=6, ignore_eos=True))
    list(engine.drain())
    assert set(used) == {LEAN} and engine.pop_finished(a).output == greedy_ref([5, 17, 42])[:6]
    used.clear()
    engine.add_request([5, 17, 42], SamplingParams(max_tokens=6, ignore_eos=True))
    engine.add_request([7, 8], SamplingParams(max_tokens=6, temperature=1.0, seed=3,
                                              ignore_eos=True))
    list(engine.drain())
    assert FULL in used
    used.clear()
    engine.add_request([9, 10], SamplingParams(max_tokens=4, ignore_eos=True,
                                               repetition_penalty=1.3))
    list(engine.drain())
    assert set(used) == {FULL}


def test_features_of_params():
    from jaxspec.sampling import Features
    assert Features.of([SamplingParams(), SamplingParams(max_tokens=3)]) is LEAN
    for sp in (SamplingParams(temperature=0.7), SamplingParams(presence_penalty=0.5),
               SamplingParams(repetition_penalty=1.2), SamplingParams(frequency_penalty=0.1),
               SamplingParams(logprobs=0), SamplingParams(logprobs=3)):
        assert Features.of([SamplingParams(), sp]) is FULL, sp   # logprobs=0: its own logprob


def test_defaults_by_backend_and_batch(monkeypatch):
    """Tree shape, cycles per call and admission interval when none is asked for
    (bench/RESULTS.md, sixth, seventh, fifteenth, twenty-first, twenty-sixth and thirty-first
    sets): on a GPU a 4-step, 32-token tree at 2 cycles per call at batch 1, the chain with 4
    cycles per call above it (a 2-wide tree of the chain's 4 tokens from 16 slots), and
    speculative engines of 32+ slots admitting every second call (64+: every third), prompts
    prefilled in chunks of up to 2048 tokens (twenty-seventh set); on a CPU the chain, one
    cycle per call, admissions at once, 512-token chunks (`jaxspec.defaults`)."""
    from jaxspec import defaults
    from jaxspec.spec.config import SpecConfig, resolve_spec
    assert defaults.spec(1) == defaults.spec(8) == "chain"
    assert defaults.cycles_per_call(8) == 1
    assert defaults.admit_interval(64, True) == 1
    assert defaults.prefill_chunk() == 512
    monkeypatch.setattr(defaults.jax, "default_backend", lambda: "gpu")
    assert defaults.prefill_chunk() == defaults.GPU_PREFILL_CHUNK == 2048
    assert resolve_spec(defaults.spec(1)) == SpecConfig(4, 8, 32)
    assert defaults.spec(4) == defaults.spec(15) == "chain"
    assert resolve_spec(defaults.spec(16)) == resolve_spec(defaults.spec(64)) \
        == SpecConfig(3, 2, 4)
    assert (defaults.cycles_per_call(1), defaults.cycles_per_call(4)) == (2, 4)
    assert [defaults.admit_interval(s, True) for s in (1, 16, 31, 32, 63, 64, 128)] == \
        [1, 1, 1, 2, 2, 3, 3]
    assert defaults.admit_interval(64, False) == 1
    # short builds: from 64 slots, and plain decoding at 1 slot (none on a CPU)
    assert [defaults.short_rows(s) for s in (1, 4, 63, 64)] == [0, 0, 0, 512]
    assert [defaults.short_rows(s, plain=True) for s in (1, 4, 64)] == [512, 0, 512]
    # none for a cache no longer than the bound: the full build is sized for it already
    assert [defaults.short_rows(64, max_len=t) for t in (352, 512, 513, 2048)] == \
        [0, 0, 512, 512]
    assert defaults.short_rows(1, plain=True, max_len=320) == 0
    monkeypatch.setattr(defaults.jax, "default_backend", lambda: "cpu")
    assert defaults.short_rows(1, plain=True) == defaults.short_rows(64) == 0


@pytest.mark.parametrize("kind", ["spec", "plain"])
def test_first_chunk_wider_than_the_slot(kind):
    """Packs up to 128 tokens wide over slots of ~60 rows: a pack's attention runs over its own
    rows (zero caches as wide as the pack, wider than the slot), and only the slot's rows are
    written back."""
    be = make_engine(kind).backend
    engine = Engine(be, EngineConfig(max_model_len=MAX_MODEL_LEN, prefill_chunk=32,
                                     pack_tokens=128), vocab_size=CFG.vocab_size)
    assert engine.planner.pack_shape(engine.planner.pack_sizes[-1]) == (1, 128)
    assert 128 > be.max_len
    prompts = [[5, 17, 42, 8, 99], list(range(10, 50)), list(range(60, 90)), [3, 9, 27] * 7]
    engine.warmup()
    ids = [engine.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in prompts]
    list(engine.drain())
    for rid, p in zip(ids, prompts):
        assert engine.pop_finished(rid).output == greedy_ref(p)
    # first chunks of 5 + 32 + 30 + 21 tokens in one 128-token pack; the 40-token prompt's
    # last 8 in a chunk
    assert sorted((a, t, form) for a, t, _, form in engine.stats.admit_shapes) == \
        [(1, 32, "chunk"), (4, 128, "packed")]
