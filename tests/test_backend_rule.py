"""The Mosaic-or-Triton rule (`backend_rule`) against the H200's measurements."""
import jax.numpy as jnp
import pytest

from pallas_kernels import backend_rule as rule
from pallas_kernels import prefix_attention_mgpu as pm


def test_mosaic_serves_the_measured_shapes_on_hopper_only(monkeypatch):
    """Wide tiles over 8K+ live rows of a cache of whole key blocks in bf16/f16, on Hopper: the
    shapes where it measured faster. Short prefixes at batch 1, narrow tiles, f32, other GPUs
    and JAXSPEC_MOSAIC=0 keep the Triton kernel."""
    bf16 = jnp.bfloat16
    assert not rule.mosaic_serves(256, 8192, 8192, 128, bf16)   # this CPU
    monkeypatch.setattr(pm, "on_hopper", lambda: True)
    assert rule.mosaic_serves(256, 8192, 8192, 128, bf16)
    assert rule.mosaic_serves(64, 32768, 32768, 64, jnp.float16)
    assert rule.mosaic_serves(256, 1024, 8192, 128, bf16)       # batch 1 from 1K live rows
    assert not rule.mosaic_serves(256, 512, 8192, 128, bf16)    # live_rows says short
    assert not rule.mosaic_serves(256, 512, 512, 128, bf16)
    assert not rule.mosaic_serves(40, 8192, 8192, 128, bf16)    # under one warpgroup's rows
    assert not rule.mosaic_serves(8192, 8192, 8192, 128, bf16)  # a prompt chunk
    assert not rule.mosaic_serves(256, 8192, 8200, 128, bf16)   # not whole 128-key blocks
    assert not rule.mosaic_serves(256, 8192, 8192, 128, jnp.float32)
    monkeypatch.setenv("JAXSPEC_MOSAIC", "0")
    assert not rule.mosaic_serves(256, 8192, 8192, 128, bf16)


# (head dim, batch, N, live rows, Mosaic at its default split count against Triton in the same
# call: "win" more than 3% faster than Triton's fastest timing there, "loss" more than 3%
# slower than its slowest, else "tie"): H200, G = 4 over 8 KV heads (head dim 128), G = 3 over
# 3 (64, SmolLM2's) (bench/RESULTS.md, forty-third set).
_MEASURED = [
    (64, 1, 32, 512, "tie"), (64, 1, 32, 1024, "tie"), (64, 1, 32, 2048, "loss"),
    (64, 1, 32, 4096, "tie"), (64, 1, 64, 1024, "tie"), (64, 1, 64, 2048, "tie"),
    (64, 2, 32, 1024, "tie"), (64, 2, 64, 2048, "tie"), (64, 4, 32, 1024, "tie"),
    (64, 4, 32, 2048, "tie"), (64, 8, 32, 512, "tie"), (64, 8, 32, 1024, "win"),
    (64, 8, 64, 4096, "win"), (64, 16, 32, 2048, "tie"), (64, 16, 64, 1024, "win"),
    (64, 64, 32, 512, "tie"), (64, 64, 32, 2048, "win"), (64, 64, 64, 512, "win"),
    (64, 64, 64, 2048, "win"), (128, 1, 16, 1024, "tie"), (128, 1, 16, 2048, "tie"),
    (128, 1, 16, 4096, "tie"), (128, 1, 64, 512, "tie"), (128, 1, 64, 1024, "loss"),
    (128, 1, 64, 2048, "win"), (128, 1, 64, 4096, "win"), (128, 2, 16, 1024, "tie"),
    (128, 2, 16, 2048, "win"), (128, 2, 64, 512, "win"), (128, 2, 64, 1024, "win"),
    (128, 2, 64, 2048, "win"), (128, 2, 64, 4096, "win"), (128, 4, 16, 512, "tie"),
    (128, 4, 16, 1024, "win"), (128, 4, 64, 512, "win"), (128, 4, 64, 1024, "win"),
    (128, 8, 16, 1024, "win"), (128, 8, 64, 512, "win"), (128, 8, 64, 1024, "win"),
    (128, 12, 64, 1024, "win"), (128, 16, 16, 1024, "win"), (128, 16, 64, 512, "win"),
    (128, 16, 64, 1024, "win"), (128, 16, 64, 2048, "win"), (128, 32, 64, 1024, "win"),
    (128, 32, 64, 2048, "win"), (128, 64, 16, 1024, "win"), (128, 64, 16, 2048, "win"),
    (128, 64, 64, 512, "win"), (128, 64, 64, 1024, "win"), (128, 64, 64, 2048, "win"),
    (128, 2, 64, 256, "loss"), (128, 4, 64, 256, "win"), (128, 8, 64, 256, "tie"),
    (128, 64, 64, 256, "win"), (128, 8, 16, 256, "loss"), (128, 64, 16, 256, "loss")]


# Wins the rule passes up: N 64 under 1K rows (from batch 2 over 512, from batch 4 over 256),
# where N 16 lost over 256 rows at batch 8 and 64, so no bound under 1K is taken; head dim 64
# at batch 64 over 512, under its 1K bound.
_RULE_MISSES = {(128, 2, 64, 512), (128, 4, 64, 512), (128, 8, 64, 512), (128, 16, 64, 512),
                (128, 64, 64, 512), (128, 4, 64, 256), (128, 64, 64, 256), (64, 64, 64, 512)}


def _heads(d):
    """(query heads a KV head, KV heads) of the measured shapes: 4 over 8 at head dim 128
    (8B-class), 3 over 3 at 64 (SmolLM2's)."""
    return (4, 8) if d == 128 else (3, 3)


def _serves(d, b, n, live):
    """The rule on a measured point."""
    return rule.mosaic_serves(_heads(d)[0] * n, live, live, d, jnp.bfloat16, batch=b)


@pytest.mark.parametrize("d,b,n,live,verdict", _MEASURED)
def test_mosaic_serves_short_prefixes_where_it_measured_no_slower(monkeypatch, d, b, n, live,
                                                                 verdict):
    """Under 8K live rows by head dim and batch (`_MOSAIC_SHORT`): Mosaic never where it lost
    (but where the GPU's kernel time, timed later at the current split count, says it wins),
    and Triton never where Mosaic won, but for the listed misses."""
    monkeypatch.setattr(pm, "on_hopper", lambda: True)
    if _serves(d, b, n, live):
        assert verdict != "loss" or (d, b, n, live) in _KERNEL_WINS
    else:
        assert verdict != "win" or (d, b, n, live) in _RULE_MISSES


def test_rule_misses_are_measured_wins_the_rule_passes_up(monkeypatch):
    """Each listed miss is a measured win that `mosaic_serves` turns down (none stale)."""
    monkeypatch.setattr(pm, "on_hopper", lambda: True)
    wins = {m[:4] for m in _MEASURED if m[4] == "win"}
    for d, b, n, live in _RULE_MISSES:
        assert (d, b, n, live) in wins
        assert not _serves(d, b, n, live)


# (head dim, batch, N, live rows, Mosaic's split count, its kernel time, Triton's): the GPU's
# kernel-busy us a call from a profiler trace (`bench_kernels --device-time`), where the wall
# time of these 13-23 us calls sits near the host's dispatch time (bench/RESULTS.md,
# forty-fourth set: calls 3 and 4, H200).
_KERNEL_TIMES = [
    (128, 1, 16, 2048, 8, 9.4, 12.6), (128, 1, 32, 2048, 8, 12.0, 14.0),
    (128, 1, 64, 2048, 8, 12.9, 19.2), (128, 2, 16, 1024, 4, 9.7, 12.7),
    (128, 2, 32, 1024, 4, 12.4, 14.2), (128, 4, 16, 1024, 4, 11.3, 17.6),
    (128, 8, 64, 1024, 1, 25.3, 42.9), (64, 8, 32, 1024, 4, 10.1, 12.6),
    (64, 8, 32, 2048, 4, 13.0, 14.9),
    # forty-fifth set, call 5: batch 1 over 1K, which the rule now sends to Mosaic
    (128, 1, 64, 1024, 4, 11.6, 14.8),
    # fifty-ninth set, call 1: batch 1, one row tile over 1K in splits of one key block
    (128, 1, 16, 1024, 8, 7.0, 12.2), (128, 1, 32, 1024, 8, 8.9, 13.3)]
_KERNEL_WINS = {t[:4] for t in _KERNEL_TIMES if t[5] < t[6]}
# Same call, at half the batch-1 bound: kernel time (Mosaic at its default count, Triton). The
# rule takes a bound only where Mosaic won at half of it too.
_KERNEL_TIMES_HALF_BOUND = [(128, 1, 16, 512, 2, 8.5, 11.5), (128, 1, 64, 512, 2, 11.1, 14.1)]


@pytest.mark.parametrize("d,b,n,live,splits,mosaic_us,triton_us", _KERNEL_TIMES)
def test_rule_and_split_count_match_the_kernel_times(monkeypatch, d, b, n, live, splits,
                                                     mosaic_us, triton_us):
    """Each shape goes to Mosaic at the split count that was timed, and there Mosaic's kernel
    time was under Triton's, including where the wall time of an isolated call was not
    (B 2, N 32, 1K; head dim 64 at batch 8)."""
    monkeypatch.setattr(pm, "on_hopper", lambda: True)
    g, hkv = _heads(d)
    assert _serves(d, b, n, live)
    assert rule.mosaic_splits(b, hkv, g * n, live) == splits
    assert mosaic_us < triton_us


@pytest.mark.parametrize("d,b,n,live,splits,mosaic_us,triton_us", _KERNEL_TIMES_HALF_BOUND)
def test_batch_one_bound_is_taken_where_mosaic_won_at_half_of_it(monkeypatch, d, b, n, live,
                                                                 splits, mosaic_us, triton_us):
    """At half the batch-1 bound Triton still serves, Mosaic's kernel time there (at the split
    count it then took; it takes one-block splits now, faster still at N 16-32: fifty-ninth
    set) was under Triton's, and twice that many rows go to Mosaic."""
    monkeypatch.setattr(pm, "on_hopper", lambda: True)
    g, hkv = _heads(d)
    assert not _serves(d, b, n, live) and _serves(d, b, n, 2 * live)
    assert rule.mosaic_splits(b, hkv, g * n, live) >= splits
    assert mosaic_us < triton_us


# (batch, N, live rows, the rule's split count, its kernel us, the previous rule's count, its
# kernel us): H200, same call (bench/RESULTS.md, fifty-ninth set, `kernel_ab.py`), 8 KV heads.
_ONE_BLOCK_SPLITS = [(1, 16, 1024, 8, 7.0, 4, 8.0), (1, 32, 1024, 8, 8.8, 4, 9.8),
                     (1, 16, 512, 4, 6.4, 2, 7.6), (1, 32, 512, 4, 8.0, 2, 9.7),
                     (1, 64, 512, 4, 8.7, 2, 10.0), (2, 16, 512, 4, 7.1, 2, 8.1),
                     (2, 32, 512, 4, 9.2, 2, 10.4)]


@pytest.mark.parametrize("b,n,live,splits,us,before,before_us", _ONE_BLOCK_SPLITS)
def test_one_block_splits_where_their_grid_fills_half_the_sms(b, n, live, splits, us, before,
                                                              before_us):
    """A split a key block where that makes 64 CTAs at most (half the SMs: batch 1-2, one or
    two row tiles, 8 KV heads), where the same call timed it faster than the 2-block splits of
    before."""
    assert rule.mosaic_splits(b, 8, 4 * n, live) == splits == live // pm.BLOCK_KV
    assert pm.grid_ctas(b, 8, pm.padded_rows(4 * n), splits) <= pm.NUM_SMS // 2
    assert us < before_us and rule.mosaic_splits(b, 8, 4 * n, live) != before


def test_one_block_splits_cover_a_last_partial_block():
    """Live rows that end inside a key block (`ModelConfig.live_rows`) count that block, so
    every split holds keys: 1,000 rows are 8 blocks, 8 splits, all busy."""
    assert rule.mosaic_splits(1, 8, 64, 1000) == 8 == pm.active_splits(1000, 8, pm.BLOCK_KV)


@pytest.mark.parametrize("b,n,live", [(1, 64, 1024), (1, 60, 1024), (2, 16, 1024),
                                      (1, 16, 2048)])
def test_two_block_splits_where_one_block_splits_would_fill_more(b, n, live):
    """Where splits of one block would take 128 CTAs they tied or lost on both devices (H200
    N 64 10.7 against 10.5 us, batch 2 8.1 against 8.5 but a tie on the H100, 2K a loss there):
    the 2-block splits stay."""
    chosen = rule.mosaic_splits(b, 8, 4 * n, live)
    assert pm.grid_ctas(b, 8, pm.padded_rows(4 * n), live // pm.BLOCK_KV) > pm.NUM_SMS // 2
    assert live // chosen >= 2 * pm.BLOCK_KV


# N 16 (one warpgroup's rows) over 8 KV heads, kernel us (Triton, Mosaic) in the same call on
# the H100 (fifty-eighth set) and the H200 (fifty-ninth set).
_H100_N16 = [(32, 1024, 56.1, 61.0), (64, 1024, 107.1, 115.6), (64, 2048, 194.3, 201.3)]
_H100_N16_MOSAIC = [(16, 1024, 39.3, 31.9), (64, 8192, 731.0, 723.5)]
_H200_N16 = [(32, 1024, 47.0, 46.1), (64, 1024, 89.6, 86.5), (32, 2048, 84.2, 75.3),
             (64, 2048, 164.1, 145.0), (64, 4096, 310.8, 261.0)]


@pytest.mark.parametrize("kind", ["NVIDIA H100 80GB HBM3", "NVIDIA H200"])
def test_one_warpgroup_tiles_at_large_batch_follow_each_device(monkeypatch, kind):
    """On the H100, N 16 from batch 32 under 4K takes Triton, where Triton was faster there;
    batch 16 and 8K keep Mosaic on both, and the H200 keeps Mosaic where it was faster."""
    monkeypatch.setattr(pm, "on_hopper", lambda: True)
    monkeypatch.setattr(pm, "device_kind", lambda: kind)
    h100 = "H100" in kind
    for b, live, triton_us, mosaic_us in (_H100_N16 if h100 else _H200_N16):
        assert _serves(128, b, 16, live) == (mosaic_us < triton_us)
    for b, live, triton_us, mosaic_us in _H100_N16_MOSAIC:
        assert _serves(128, b, 16, live) and mosaic_us < triton_us
    assert _serves(128, 64, 64, 1024)    # N 64 (two row tiles) keeps Mosaic on both
