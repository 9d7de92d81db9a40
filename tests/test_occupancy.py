"""bench.occupancy: the engine's admission rule replayed on request lengths, checked on cases
worked out by hand and against the engine itself."""
import json

import numpy as np

from bench.occupancy import Occupancy, report, simulate


def test_one_slot_waits_a_call_for_the_host():
    # slot 1, 2 cycles a call, two requests of 4 cycles: calls 0-1 run the first; the host
    # learns of its end after dispatching call 2 (idle), admits the second at call 3
    assert simulate([4, 4], slots=1, per_call=2, lag=1) == Occupancy(8 / 12, 6, 2)
    # without the lag the second starts at call 2 and nothing idles
    assert simulate([4, 4], slots=1, per_call=2, lag=0) == Occupancy(1.0, 4, 2)


def test_interval_and_partial_calls():
    # 2 slots, 3 cycles a call, admissions every 2nd call while slots are held
    occ = simulate([3, 6, 3, 3], slots=2, per_call=3, interval=2, lag=0)
    # call 0: admit 3, 6 (both run 3); call 1: slot 0 free, no admission (interval), slot 1
    # runs its last 3; call 2: nothing held, so the two waiting are admitted at once
    assert occ == Occupancy(15 / 18, 3, 2)
    # a request shorter than a call ends mid-call: the call's rest of that slot is idle
    assert simulate([1], slots=1, per_call=4, lag=0) == Occupancy(1 / 4, 1, 1)


def test_lag_and_refill_order():
    rng = np.random.default_rng(0)
    lengths = [int(n) for n in rng.integers(20, 80, 200)]
    as_run = simulate(lengths, 16, 4, 3, 1)
    no_lag = simulate(lengths, 16, 4, 3, 0)
    refill = simulate(lengths, 16, 1, 1, 0)
    assert as_run.share < no_lag.share < refill.share <= 1.0
    # every slot-cycle of work is counted once, whatever the rule
    for o, k in ((as_run, 4), (no_lag, 4), (refill, 1)):
        assert round(o.share * o.calls * k * 16) == sum(lengths)


def test_report_reads_a_bench_json(tmp_path, capsys):
    run = {"rows": [{"mode": "plain", "batch": 2, "admit_interval": 1},
                    {"mode": "chain:4", "batch": 2, "admit_interval": 1}],
           "requests": {"b2/plain": [{"tokens": 9}, {"tokens": 5}],
                        "b2/chain:4": [{"accept_lens": [1, 2, 0]}, {"accept_lens": [3]}]}}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    report(str(path), cycles_per_call=2, plain_steps=4)
    out = capsys.readouterr().out
    # plain: 8 and 4 decode steps (the first token comes from the admission), 4 steps a call
    assert "b2/plain: 2 requests, 12 request-cycles" in out
    assert "b2/chain:4: 2 requests, 4 request-cycles" in out
    assert f"occupancy {simulate([8, 4], 2, 4, 1, 1).share:6.1%}" in out
