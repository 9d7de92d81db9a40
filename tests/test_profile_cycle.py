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
