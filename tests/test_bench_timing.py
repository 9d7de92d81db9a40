"""The kernel benchmark's timing harness (`bench/bench_kernels.py`): the order its samples run
in, and what it does with a configuration that fails."""
import jax
import jax.numpy as jnp
import pytest

from bench import bench_kernels as bk


def _recorders(names, log):
    """Functions that append their name to `log` on every call and return an array."""
    def make(name):
        def f(x):
            log.append(name)
            return x + 1
        return f
    return {name: make(name) for name in names}


@pytest.fixture
def interleave(monkeypatch):
    def set_mode(on):
        monkeypatch.setattr(bk, "INTERLEAVE", on)
        monkeypatch.setattr(bk, "SMOKE", True)   # bursts of one call: one log entry a sample
    return set_mode


def test_samples_interleave_round_by_round(interleave):
    """Each round times every configuration once, starting one further along each round;
    every configuration gets `iters` samples."""
    interleave(True)
    log = []
    out = bk.median_times(_recorders("abc", log), (jnp.ones(2),), iters=4, warmup=1)
    timed = log[3:]   # after one warm-up call each
    assert timed == list("abc" "bca" "cab" "abc")
    assert set(out) == set("abc")
    for median, spread, host in out.values():
        assert median > 0 and spread >= 0 and 0 < host <= median


def test_sequential_mode_keeps_each_configurations_samples_together(interleave):
    interleave(False)
    log = []
    bk.median_times(_recorders("ab", log), (jnp.ones(2),), iters=3, warmup=1)
    assert log[2:] == list("aaabbb")


def test_a_failing_configuration_is_left_out_and_the_rest_timed(interleave, capsys):
    interleave(True)
    log = []
    fns = _recorders("ab", log)

    def broken(x):
        raise ValueError("bad tile")
    fns["broken"] = broken
    out = bk.median_times(fns, (jnp.ones(2),), iters=2, warmup=1)
    assert set(out) == {"a", "b"}
    assert "FAILED broken: ValueError: bad tile" in capsys.readouterr().out
    with pytest.raises(RuntimeError, match="failed"):
        bk.median_time(broken, jnp.ones(2))


def test_release_drops_each_executions_outputs_before_the_next(interleave, monkeypatch):
    """A `Release`-wrapped function's burst keeps one execution's outputs alive at a time; a
    plain one's keeps them all until the burst is synchronised."""
    interleave(True)
    monkeypatch.setattr(bk, "SMOKE", False)   # real bursts of 3
    alive, peak = set(), {}

    class Out:   # an output that knows while it is referenced
        def __init__(self, name, i):
            self.key = (name, i)
            alive.add(self.key)
            peak[name] = max(peak.get(name, 0), sum(k[0] == name for k in alive))

        def __del__(self):
            alive.discard(self.key)

    def make(name):
        count = iter(range(10 ** 6))
        return lambda x: Out(name, next(count))
    monkeypatch.setattr(bk.jax, "block_until_ready", lambda x: x)
    out = bk.median_times({"held": make("held"), "released": bk.Release(make("released"))},
                          (jnp.ones(2),), iters=2, warmup=1, burst=3)
    assert set(out) == {"held", "released"}
    assert peak == {"held": 3, "released": 1}


def test_trace_times_counts_gpu_kernels_and_host_graph_updates_per_execution():
    """Busy time sums the GPU processes' spans, span runs from the first to the last of them,
    and the update time sums the host's `command_buffer::update` spans; all per execution."""
    gpu = {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}}
    host = {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}}
    events = [gpu, host,
              {"ph": "X", "pid": 7, "name": "tree_attention", "ts": 100, "dur": 10},
              {"ph": "X", "pid": 7, "name": "combine", "ts": 115, "dur": 2},
              {"ph": "X", "pid": 7, "name": "tree_attention", "ts": 140, "dur": 10},
              {"ph": "X", "pid": 1, "name": "command_buffer::update", "ts": 90, "dur": 6},
              {"ph": "X", "pid": 1, "name": "PjitFunction(f)", "ts": 80, "dur": 50}]
    busy, span, update = bk.trace_times(events, execs=2)
    assert busy == pytest.approx(11e-6) and span == pytest.approx(25e-6)
    assert update == pytest.approx(3e-6)
    assert bk.trace_times([host, events[-1]], execs=2) == (None, None, None)


def test_loop_call_runs_every_layer_and_returns_the_last():
    """loop_call: one loop over the layers, trip i on layer i (the layer a traced operand); the
    output is the last trip's, as multi_call's last call gives it."""
    seen = []

    def fn(q, kc, vc, layer, sl, kn, vn, mask):
        seen.append(layer)   # traced once: a traced layer, not a constant
        return kc[layer].sum() * q

    args = (jnp.ones(2), jnp.arange(12.0).reshape(4, 3), None, None, None, None, None)
    got = bk.loop_call(fn, 3)(*args)
    want = bk.multi_call(fn, 3)(*args)[-1]
    assert float(got[0]) == float(want[0]) == 6 + 7 + 8   # layer 2's row
    assert len(seen) == 5 and not isinstance(seen[-1], int)   # 2 traces + 3 multi_call calls


def test_alternate_takes_its_compiled_copies_in_turn():
    f = bk.Alternate(bk.jax.jit(lambda x: x * 2))
    outs = [float(f(jnp.float32(3))) for _ in range(3)]
    assert outs == [6.0] * 3 and len(f.compiled) == 2
    assert f.compiled[0] is not f.compiled[1] and f.turn == 1


def test_kernel_defaults_set_for_one_run(monkeypatch):
    """`--kernel-default` (bench_cycle, profile_cycle): a tree_attention _MOSAIC_*
    constant or a top-k policy constant set from a literal before the run; anything else is
    refused by name."""
    from bench.common import set_kernel_defaults
    from jaxspec.spec import topk
    from pallas_kernels import tree_attention as ta
    monkeypatch.setattr(ta, "_MOSAIC_TREE_TILE", ta._MOSAIC_TREE_TILE)   # restored after
    monkeypatch.setattr(topk, "RANK_MAX_WIDTH", topk.RANK_MAX_WIDTH)
    assert set_kernel_defaults(["_MOSAIC_TREE_TILE=(128, 8)", "topk.RANK_MAX_WIDTH=0"]) == {
        "_MOSAIC_TREE_TILE": (128, 8), "topk.RANK_MAX_WIDTH": 0}
    assert ta._MOSAIC_TREE_TILE == (128, 8) and topk.RANK_MAX_WIDTH == 0
    with pytest.raises(ValueError, match="_MOSAIC_TREE_TILE"):   # the known names are listed
        set_kernel_defaults(["_SPLIT_KEYS=3"])
    with pytest.raises(ValueError, match="not a Python literal"):
        set_kernel_defaults(["_MOSAIC_TREE_TILE=maybe"])
    with pytest.raises(ValueError, match="expected NAME=VALUE"):
        set_kernel_defaults(["_MOSAIC_TREE_TILE"])


def test_topk_defaults_set_for_one_run(monkeypatch):
    """`--kernel-default topk.NAME=VALUE`: the top-k policy's constants, by module name; its
    functions and lower-case names are not settable."""
    from bench.common import set_kernel_defaults
    from jaxspec.spec import topk
    monkeypatch.setattr(topk, "SMALL_ABOVE_MIN_K", topk.SMALL_ABOVE_MIN_K)   # restored after
    monkeypatch.setattr(topk, "RANK_MAX_WIDTH", topk.RANK_MAX_WIDTH)
    assert set_kernel_defaults(["topk.SMALL_ABOVE_MIN_K='rank'", "topk.RANK_MAX_WIDTH=512"]) \
        == {"topk.SMALL_ABOVE_MIN_K": "rank", "topk.RANK_MAX_WIDTH": 512}
    assert topk.SMALL_ABOVE_MIN_K == "rank" and topk.RANK_MAX_WIDTH == 512
    for bad in ("topk.top_k=1", "topk._lowest=1", "RANK_MAX_WIDTH=512"):
        with pytest.raises(ValueError, match="topk.RANK_MAX_WIDTH"):
            set_kernel_defaults([bad])


def test_topk_kernel_form_set_for_one_run(monkeypatch):
    """`--kernel-default vocab_topk.NAME=VALUE`: the top-k kernel's form, read when it is
    called: a row of 4 chunks takes one launch by default, two with FUSED_MAX_CHUNKS=0."""
    from bench.common import set_kernel_defaults
    from pallas_kernels import vocab_topk
    monkeypatch.setattr(vocab_topk, "FUSED_MAX_CHUNKS", vocab_topk.FUSED_MAX_CHUNKS)  # restored
    monkeypatch.setattr(vocab_topk, "CHUNK", vocab_topk.CHUNK)
    x = jnp.zeros((2, 64), jnp.float32)

    def launches(chunk=16):
        jaxpr = jax.make_jaxpr(lambda x: vocab_topk.vocab_top_k_pallas(x, 3, chunk=chunk,
                                                                       interpret=True))(x)
        return str(jaxpr).count("pallas_call")

    assert vocab_topk.FUSED_MAX_CHUNKS >= 4 and launches() == 1
    assert set_kernel_defaults(["vocab_topk.FUSED_MAX_CHUNKS=0"]) == {
        "vocab_topk.FUSED_MAX_CHUNKS": 0}
    assert launches() == 2
    # the chunk width too: 64 wide, one chunk of it within FUSED_MAX_CHUNKS 1
    set_kernel_defaults(["vocab_topk.CHUNK=64", "vocab_topk.FUSED_MAX_CHUNKS=1"])
    assert launches(chunk=None) == 1
    with pytest.raises(ValueError, match="vocab_topk.FUSED_MAX_CHUNKS"):
        set_kernel_defaults(["vocab_topk.fused=1"])


def test_heads_of_the_timed_rows(monkeypatch):
    """`--heads` (bench_kernels, read_floor): the rows' inputs and scale follow "Hq,Hkv,D";
    specs that name no heads, or query heads that do not group over the KV heads, are refused."""
    for name in ("HQ", "HKV", "D", "SM_SCALE"):
        monkeypatch.setattr(bk, name, getattr(bk, name))   # restored after
    monkeypatch.setitem(bk.RESULTS, "heads", None)
    bk.set_heads("9,3,64")
    assert (bk.HQ, bk.HKV, bk.D, bk.RESULTS["heads"]) == (9, 3, 64, [9, 3, 64])
    assert bk.SM_SCALE == pytest.approx(0.125)
    q, kc, _, _, kn, _, _ = bk.make_inputs(jax.random.key(0), 2, 5, 16, 1)
    assert q.shape == (2, 5, 9, 64) and kc.shape == (1, 2, 3, 16, 64) and kn.shape == (2, 3, 5, 64)
    for bad in ("9,3", "9,4,64", "a,b,c", "0,1,64"):
        with pytest.raises(ValueError, match="--heads"):
            bk.set_heads(bad)
