"""The kernel benchmark's timing harness (`bench/bench_kernels.py`): the order its samples run
in, and what it does with a configuration that fails."""
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
