"""bench/mosaic_timeline.py's reading of Mosaic GPU's profiler dumps: a buffer laid out as the
device writes it, dumped by jax's own `ProfilerSpec.dump`, read back to the regions' times."""
import io
import json

import numpy as np
import pytest

from pallas_kernels import prefix_attention_mgpu as pm

pytestmark = pytest.mark.skipif(pm.plgpu is None, reason="no Mosaic GPU in this jaxlib")

# Two CTAs of a compute warpgroup and a producer: (name, begin, end) in cycles after the first
# event, 20 apart at least as on the device (the dump's overhead estimate takes the least gap);
# the compute one's "pv" holds the next block's "k_wait".
COMPUTE = [("q_wait", 0, 1000), ("k_wait", 1020, 3000), ("qk", 3020, 3400),
           ("softmax", 3420, 4000), ("v_wait", 4020, 4200), ("pv", 4220, 5000),
           ("k_wait", 4400, 4800), ("store", 5020, 6000)]
PRODUCER = [("fetch", 0, 200), ("k_free", 220, 3400), ("v_free", 3420, 5000),
            ("drain", 5020, 5100)]
STARTS = [10_000, 12_000]   # each CTA's global timer at its start, ns


def _dump(compute, producer, starts):
    """The trace `ProfilerSpec.dump` writes from a device buffer of these CTAs."""
    from jax.experimental.mosaic.gpu import profiler
    spec = profiler.ProfilerSpec(64)
    buf = np.zeros((len(starts), 2, 64), np.uint32)
    for cta, start in enumerate(starts):
        for trace, spans in enumerate((compute, producer)):
            events = sorted([(b, 0, n) for n, b, _ in spans] + [(e, 1, n) for n, _, e in spans],
                            key=lambda x: (x[0], -x[1]))
            words = []
            for t, is_end, name in events:
                words += [spec.intern_name(name) | (spec.EXIT if is_end else 0), 500 + t]
            buf[cta, trace, :3] = (start, 7 + cta, len(words))
            buf[cta, trace, 3:3 + len(words)] = words
    f = io.StringIO()
    spec.dump(buf.reshape(-1), f, grid=(len(starts),), block=(256,))
    return json.loads(f.getvalue())


def test_timeline_reads_the_profilers_dump():
    from bench import mosaic_timeline as mt
    clock = 2.0
    lines = mt.warpgroup_timelines(_dump(COMPUTE, PRODUCER, STARTS), clock)
    assert sorted(sm for sm, _, _ in lines.values()) == [7, 7, 8, 8]
    s = mt.summarize(lines)
    assert s["warpgroups"] == 2 and s["sms"] == 2
    # The dump takes its per-event overhead estimate (11 cycles) off each later event.
    tol = 11 * 16 / clock
    assert s["start_ns"]["min"] == 0 and s["start_ns"]["max"] == 2000
    assert s["end_ns"]["max"] == pytest.approx(2000 + 6000 / clock, abs=tol)
    # the first key block arrives when the first k_wait ends
    assert s["first_keys_ns"]["min"] == pytest.approx(3000 / clock, abs=tol)
    # k_wait sums the first block's wait and the one inside pv
    assert s["regions_ns"]["k_wait"]["median"] == pytest.approx(2380 / clock, abs=tol)
    assert s["regions_ns"]["pv"]["max"] == pytest.approx(780 / clock, abs=tol)
    assert s["producer_ns"]["k_free"]["median"] == pytest.approx(3180 / clock, abs=tol)
    assert s["last_values_ns"]["max"] == pytest.approx(2000 + 4200 / clock, abs=tol)
    assert s["tail_ns"]["median"] == pytest.approx(1800 / clock, abs=tol)
    assert list(s["end_by_blocks_ns"]) == [1] and s["end_by_blocks_ns"][1]["ctas"] == 2


def test_summary_keeps_each_warpgroups_sm_and_times():
    from bench import mosaic_timeline as mt
    clock = 2.0
    s = mt.summarize(mt.warpgroup_timelines(_dump(COMPUTE, PRODUCER, STARTS), clock))
    per = s["per_warpgroup"]
    assert len(per) == 2 and sorted(v["sm"] for v in per.values()) == [7, 8]
    assert max(v["end"] for v in per.values()) == s["end_ns"]["max"]
    assert min(v["last_values"] for v in per.values()) == s["last_values_ns"]["min"]


def _run(per):
    """A call's summary holding only what `call_to_call` reads: {tid: (sm, last_values)}."""
    return dict(summary=dict(per_warpgroup={t: dict(sm=sm, last_values=x, end=x + 1)
                                            for t, (sm, x) in per.items()}))


def test_call_to_call_tells_late_ctas_from_late_sms():
    from bench import mosaic_timeline as mt
    # Call 2 keeps every CTA's time but moves each CTA to another SM: late by CTA, not by SM.
    a = _run({1: (10, 1.0), 2: (11, 2.0), 3: (12, 3.0), 4: (13, 4.0)})
    b = _run({1: (13, 1.0), 2: (10, 2.0), 3: (11, 3.0), 4: (12, 4.0)})
    # Call 3 keeps every SM's time with the CTAs moved: late by SM.
    c = _run({1: (11, 2.0), 2: (12, 3.0), 3: (13, 4.0), 4: (10, 1.0)})
    ab, bc = mt.call_to_call([a, b, c])
    assert ab["by_cta"] == pytest.approx(1.0) and ab["same_sm"] == 0.0
    assert ab["by_sm"] == pytest.approx(np.corrcoef([1, 2, 3, 4], [2, 3, 4, 1])[0, 1])
    assert bc["by_sm"] == pytest.approx(np.corrcoef([2, 3, 4, 1], [1, 2, 3, 4])[0, 1])
    (ac,) = mt.call_to_call([a, c])
    assert ac["by_sm"] == pytest.approx(1.0) and ac["by_cta"] < 0.5
    assert mt.call_to_call([a, a], "end")[0]["same_sm"] == 1.0
    # Two warpgroups on one SM (a CTA of two): the SM's time is the later one's.
    d = _run({1: (10, 1.0), 2: (10, 5.0), 3: (11, 2.0), 4: (12, 3.0)})
    e = _run({1: (10, 4.0), 2: (10, 2.0), 3: (11, 5.0), 4: (12, 3.0)})
    (de,) = mt.call_to_call([d, e])
    assert de["by_sm"] == pytest.approx(np.corrcoef([5, 2, 3], [4, 5, 3])[0, 1])


def test_profile_is_refused_in_interpret_mode():
    import jax.numpy as jnp
    q = jnp.zeros((1, 1, 64, 64), jnp.bfloat16)
    kc = jnp.zeros((1, 1, 1, 128, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="profile needs the device"):
        pm.prefix_partials_mgpu(q, kc, kc, jnp.int32(0), jnp.full((1,), 128, jnp.int32),
                                scale_log2=0.1, num_splits=1, profile="/tmp/x",
                                interpret=True)
