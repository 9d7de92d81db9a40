"""benchmark.trace: GPU kernels tied to the program that launched them by correlation id, on a
hand-written trace in the layout jax.profiler writes (perfetto JSON, gzip)."""
import gzip
import json

import pytest

from jaxspec.benchmark import trace


def _meta(pid, name):
    return {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}}


def _x(pid, tid, name, ts, dur, **args):
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur, "args": args}


EVENTS = [
    _meta(1, "/host:CPU"), _meta(2, "/device:GPU:0"),
    # a cycle: module span holding a graph launch (id 7); the Pjit span around it
    _x(1, 10, "PjitFunction(jit(cycles))", 0, 100),
    _x(1, 10, "jit_cycles:XLA GPU module", 5, 90),
    _x(1, 10, "command_buffer::update", 20, 25),
    _x(1, 10, "cuGraphLaunch (CudaGraph:3)", 50, 10, correlation_id=7),
    # an admission, its layer loop launching twice (ids 8, 9)
    _x(1, 10, "jit_admit:XLA GPU module", 200, 100),
    _x(1, 10, "cuGraphLaunch (CudaGraph:4)", 210, 5, correlation_id=8),
    _x(1, 10, "cuGraphLaunch (CudaGraph:4)", 260, 5, correlation_id=9),
    # a launch outside any program (a transfer): its kernel stays unmatched
    _x(1, 10, "cuMemcpyHtoDAsync", 400, 2, correlation_id=11),
    # GPU: two kernels of the cycle's graph (overlapping), the loop's, the transfer's
    _x(2, 1, "nvjet_gemm", 1000, 40, correlation_id=7),
    _x(2, 2, "fusion_12", 1030, 20, correlation_id=7),
    _x(2, 1, "tree_attention", 1100, 30, correlation_id=8),
    _x(2, 1, "tree_attention", 1200, 30, correlation_id=9),
    _x(2, 1, "memcpy", 1300, 10, correlation_id=11),
]


@pytest.fixture
def trace_dir(tmp_path):
    d = tmp_path / "plugins" / "profile" / "run"
    d.mkdir(parents=True)
    with gzip.open(d / "host.perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": EVENTS}, f)
    return tmp_path


def test_kernels_go_to_the_program_that_launched_them(trace_dir):
    s = trace.program_times(trace.load_trace(str(trace_dir)))
    progs = s["programs"]
    assert set(progs) == {"cycles", "admit", trace.UNMATCHED}
    assert progs["cycles"] == {"device_ms": pytest.approx(0.060), "kernels": 2, "calls": 1,
                               "host_ms": pytest.approx(0.090), "update_ms": pytest.approx(0.025),
                               "top": {"nvjet_gemm": 0.04, "fusion": 0.02}}
    assert progs["admit"] == {"device_ms": pytest.approx(0.060), "kernels": 2,
                                          "calls": 1, "host_ms": pytest.approx(0.100),
                                          "update_ms": 0.0, "top": {"tree_attention": 0.06}}
    assert progs[trace.UNMATCHED]["kernels"] == 1
    assert s["kernels"] == 5 and s["correlated"] == 4
    assert s["device_ms"] == pytest.approx(0.130)
    # the two cycle kernels overlap by 10 us: busy counts it once
    assert s["busy_ms"] == pytest.approx(0.120)
    assert s["span_ms"] == pytest.approx(0.310)
    table = trace.format_programs(s)
    assert table.splitlines()[1].startswith("cycles") or table.splitlines()[1].startswith(
        "admit")
    assert "tied to a program 4" in table and "nvjet_gemm" not in table
    assert "    nvjet_gemm" in trace.format_programs(s, kernels=True)


def test_no_trace_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no \\*.json.gz trace"):
        trace.load_trace(str(tmp_path))


def test_a_cpu_trace_has_no_device_time():
    s = trace.program_times([_meta(1, "/host:CPU"), _x(1, 1, "jit_f:XLA GPU module", 0, 5)])
    assert s["programs"] == {} and s["device_ms"] == 0 and s["busy_ms"] == 0
