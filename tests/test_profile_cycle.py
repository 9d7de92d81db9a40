"""bench/profile_cycle.py's accounting of a GPU trace (synthetic events: no GPU here)."""

from bench.profile_cycle import kind_of, table


def test_profile_table_sums_device_time_by_kind_and_name():
    """Per-call ms by kernel name and kind, kernels per call, and the first-to-last span."""
    assert [kind_of(n) for n in ("tree_attention_combine", "tree_attention__5", "kv_compact",
                                 "gemm_fusion_dot_3", "nvjet_sm90_tss", "loop_add_fusion_63",
                                 "void stream_executor::cuda::Run<16ul, float>", "memcpy32_post",
                                 "ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "oneshot_allreduce",
                                 "all-reduce-start.3", "input_reduce_fusion_1")
            ] == ["tree_attention_combine", "tree_attention", "kv_compact", "gemm", "gemm",
                  "fusion", "other", "copy", "collective", "collective", "collective", "reduce"]
    # Two calls, each: a GEMM of 30 us, attention of 10 us, a fusion of 5 us, 2 us apart.
    ev = []
    for c in range(2):
        t0 = 1000.0 * c
        ev += [("gemm_fusion_dot_1", t0, 30.0), ("tree_attention", t0 + 32, 10.0),
               ("loop_add_fusion_2", t0 + 44, 5.0)]
    row = table("synthetic", 0.1, ev, calls=2, top=3)
    assert row["kernels_per_call"] == 3
    assert abs(row["kernel_ms"] - 0.045) < 1e-12
    assert abs(row["by_kind"]["gemm"] - 0.030) < 1e-12
    assert abs(row["by_kind"]["tree_attention"] - 0.010) < 1e-12
    assert abs(row["span_ms"] - (1049.0 / 2 / 1e3)) < 1e-12      # first start to last end
    assert row["by_name"]["loop_add_fusion_2"] == [0.005, 1.0]


def test_tp_device_time_splits_each_gpu_by_kind(tmp_path):
    """bench_parallel --profile's summary of a two-GPU trace (synthetic perfetto events): per GPU
    and step, device ms by kernel kind (host events left out), and the host's graph and kernel
    launches a step."""
    import gzip
    import json
    from bench.bench_parallel import host_launches, tp_device_time
    from jaxspec.benchmark.trace import load_trace
    meta = [{"ph": "M", "name": "process_name", "pid": p, "args": {"name": n}}
            for p, n in ((1, "/host:CPU"), (7, "/device:GPU:0"), (9, "/device:GPU:1"))]
    spans = []
    for step in range(2):
        t = 1000.0 * step
        for pid, ar_us in ((7, 40.0), (9, 25.0)):
            spans += [{"ph": "X", "pid": pid, "name": "gemm_fusion_dot_1", "ts": t, "dur": 300.0},
                      {"ph": "X", "pid": pid, "name": "ncclDevKernel_AllReduce_Sum_bf16_RING_LL",
                       "ts": t + 310, "dur": ar_us},
                      {"ph": "X", "pid": pid, "name": "loop_add_fusion", "ts": t + 400,
                       "dur": 10.0}]
        spans += [{"ph": "X", "pid": 1, "name": "PjitFunction(cycle)", "ts": t, "dur": 900.0},
                  {"ph": "X", "pid": 1, "name": "cudaGraphLaunch", "ts": t + 1, "dur": 5.0},
                  {"ph": "X", "pid": 1, "name": "cuLaunchKernel", "ts": t + 7, "dur": 2.0},
                  {"ph": "X", "pid": 1, "name": "cuLaunchKernelEx", "ts": t + 9, "dur": 2.0},
                  {"ph": "X", "pid": 1, "name": "cudaGraphLaunch", "ts": t + 11, "dur": 5.0}]
    with gzip.open(tmp_path / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": meta + spans}, f)
    events = load_trace(str(tmp_path))
    got = tp_device_time(events, 2, "synthetic", wall_ms=0.9)
    assert got == [{"gemm": 0.3, "collective": 0.04, "fusion": 0.01},
                   {"gemm": 0.3, "collective": 0.025, "fusion": 0.01}]
    assert host_launches(events, 2, "synthetic") == {"graphs": 2, "kernels": 2}
