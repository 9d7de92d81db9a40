"""bench/bench_accept.py: the loop split of tau (looping requests apart from the rest)."""
from types import SimpleNamespace as NS

import pytest

from bench.bench_accept import loop_split


def test_loop_split_keeps_looping_answers_out_of_tau_unlooped():
    loop = NS(token_ids=[4, 5] * 40, accept_lens=[3, 3, 3])        # a loop, long accepts
    text = NS(token_ids=list(range(60)), accept_lens=[0, 1, 2])     # no window repeats
    got = loop_split([loop, text, text])
    assert got["looping"] == pytest.approx(1 / 3)
    assert got["tau_unlooped"] == pytest.approx(2.0)                # (1 + 2 + 3) / 3, twice
    assert loop_split([loop]) == {"looping": 1.0, "tau_unlooped": None}
    assert loop_split([]) == {"looping": 0.0, "tau_unlooped": None}
