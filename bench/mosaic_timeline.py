"""Where the Mosaic prefix kernel's time goes inside one call: Mosaic GPU's profiler records
each warpgroup's named regions (`prefix_attention_mgpu.region`: the query tile's load, each
key block's wait, QK, softmax, the values' wait, PV, the store; the producer's waits for free
ring slots), and this prints, per shape, when the CTAs start and end against the earliest
start, and what each region takes (median and max over the CTAs' compute warpgroups); and, for
consecutive calls, whether the same CTAs (by their place in the grid) or the same SMs were
the late ones (`call_to_call`).

    python3 bench/mosaic_timeline.py [--shapes "B,N,L;..."] [--tuning '{"num_splits": 8}']
        [--clock-ghz 1.98] [--calls 3]

Issue 4's harness shapes (Hq/Hkv 32/8, head dim 128, bf16; the prefix ends at the cache's last
row); the Mosaic path is forced, so N 1 runs it too. Each call reads a layer that L2 does not
hold (a 256 MB write runs before it). A CTA's start is the GPU's global timer (ns); its regions
are the SM's clock cycles after that, converted at --clock-ghz. Writes each call's summary to
$OUT/mosaic_timeline.json.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile
from collections import defaultdict

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench import bench_kernels as bk  # noqa: E402
from pallas_kernels import tree_attention as ta  # noqa: E402

PRODUCER_REGIONS = ("fetch", "k_free", "v_free", "drain")


def warpgroup_timelines(trace, clock_ghz):
    """A dumped trace -> {tid: (sm, start_ns, [(name, begin_ns, end_ns), ...])}, times from the
    warpgroup's start. The dump writes ts = (start_ns + cycles since its first event) / 1e3, so
    the first event's ts is the start and later ones carry cycles, rescaled here."""
    by_tid = defaultdict(list)
    for ev in trace["traceEvents"]:
        by_tid[ev["tid"]].append(ev)
    out = {}
    for tid, evs in by_tid.items():
        start_us = evs[0]["ts"]
        stack, spans = [], []
        for ev in evs:
            t_ns = (ev["ts"] - start_us) * 1e3 / clock_ghz
            if ev["ph"] == "B":
                stack.append((ev["name"], t_ns))
            else:
                name, t0 = stack.pop()
                if name != ev["name"]:
                    raise ValueError(f"region {ev['name']} ends inside {name} (warpgroup {tid})")
                spans.append((name, t0, t_ns))
        out[tid] = (evs[0]["pid"] - 1, start_us * 1e3, spans)
    return out


def region_totals(spans):
    """{region name: its total time} over one warpgroup's spans."""
    totals = defaultdict(float)
    for name, begin, end in spans:
        totals[name] += end - begin
    return totals


def summarize(timelines):
    """Per-CTA figures of the compute warpgroups (those with a "qk" region) and the producers:
    starts and ends against the earliest start, the first key block's arrival and the last
    values' (the end of the last "v_wait"), each region's total a warpgroup (median, max over
    warpgroups), and the ends by the key blocks a warpgroup took (split 0 takes the tree's
    block too)."""
    t0 = min(start for _, start, _ in timelines.values())
    compute = {k: v for k, v in timelines.items() if any(s[0] == "qk" for s in v[2])}
    producer = {k: v for k, v in timelines.items()
                if k not in compute and any(s[0] in PRODUCER_REGIONS for s in v[2])}

    def pct(xs):
        xs = np.asarray(xs, float)
        return dict(min=float(xs.min()), median=float(np.median(xs)), max=float(xs.max()))

    starts = [start - t0 for _, start, _ in compute.values()]
    ends = [start - t0 + max(e for _, _, e in spans) for _, start, spans in compute.values()]
    first_keys, last_values, tails = [], [], []
    ends_by_blocks = defaultdict(list)
    totals = defaultdict(list)
    for (_, start, spans), end in zip(compute.values(), ends):
        keys = [s for s in spans if s[0] == "k_wait"]
        values = [s for s in spans if s[0] == "v_wait"]
        first_keys.append(start - t0 + keys[0][2] if keys else np.nan)
        last_values.append(start - t0 + values[-1][2] if values else np.nan)
        tails.append(end - last_values[-1])
        ends_by_blocks[sum(s[0] == "qk" for s in spans)].append(end)
        for name, total in region_totals(spans).items():
            totals[name].append(total)
    waits = defaultdict(list)
    for _, _, spans in producer.values():
        per = region_totals(spans)
        for name in PRODUCER_REGIONS:
            waits[name].append(per[name])
    per_wg = {tid: dict(sm=sm, end=end, last_values=lv)
              for (tid, (sm, _, _)), end, lv in zip(compute.items(), ends, last_values)}
    return dict(warpgroups=len(compute), sms=len({sm for sm, _, _ in compute.values()}),
                per_warpgroup=per_wg,
                start_ns=pct(starts), end_ns=pct(ends), first_keys_ns=pct(first_keys),
                last_values_ns=pct(last_values), tail_ns=pct(tails),
                end_by_blocks_ns={k: dict(pct(v), ctas=len(v))
                                  for k, v in sorted(ends_by_blocks.items())},
                regions_ns={k: pct(v) for k, v in sorted(totals.items())},
                producer_ns={k: pct(v) for k, v in waits.items() if v})


def profile_shape(b, n, length, tuning, calls, clock_ghz):
    """`calls` profiled calls (after one that compiles), each on a layer L2 does not hold."""
    layers = calls + 1
    q, kc, vc, sl, kn, vn, mask = bk.make_inputs(jax.random.key(3), b, n, length, layers)
    flush = jnp.zeros((64 * 1024 * 1024,), jnp.float32)
    out = []
    with tempfile.TemporaryDirectory() as prof_dir:
        run = jax.jit(lambda *args: ta.tree_attention_pallas(
            *args, sm_scale=0.088, backend="mosaic", mosaic_profile=prof_dir, **tuning))
        for layer in range(layers):
            (flush + layer).block_until_ready()
            jax.block_until_ready(run(q, kc, vc, jnp.int32(layer), sl, kn, vn, mask))
            jax.effects_barrier()   # the profile's dump is a host callback
            # The dump's file name is fixed when the call is lowered, and it never overwrites:
            # each call's file is read and removed before the next.
            (path,) = glob.glob(os.path.join(prof_dir, "*-trace.json"))
            with open(path) as f:
                trace = json.load(f)
            os.remove(path)
            if layer:   # (not the compiling call)
                out.append(dict(layer=layer,
                                summary=summarize(warpgroup_timelines(trace, clock_ghz))))
    return out


def call_to_call(runs, key="last_values"):
    """Whether the same CTAs, or the same SMs, are the late ones from call to call: the
    correlation of each compute warpgroup's `key` time between consecutive calls, matched by
    the warpgroup (its CTA's place in the grid) and by the SM it ran on (an SM's time: its
    latest warpgroup's, where a CTA has two), and the share of warpgroups that kept their SM.
    -> [dict(by_cta, by_sm, same_sm)] a pair of calls."""
    def by_sm(per):
        out = defaultdict(lambda: -np.inf)
        for v in per.values():
            out[v["sm"]] = max(out[v["sm"]], v[key])
        return out

    out = []
    for a, b in zip(runs, runs[1:]):
        pa, pb = a["summary"]["per_warpgroup"], b["summary"]["per_warpgroup"]
        ctas = sorted(set(pa) & set(pb))
        sm_a, sm_b = by_sm(pa), by_sm(pb)
        sms = sorted(set(sm_a) & set(sm_b))

        def corr(x, y):
            return float(np.corrcoef(x, y)[0, 1]) if len(x) > 2 else float("nan")
        out.append(dict(by_cta=corr([pa[c][key] for c in ctas], [pb[c][key] for c in ctas]),
                        by_sm=corr([sm_a[m] for m in sms], [sm_b[m] for m in sms]),
                        same_sm=float(np.mean([pa[c]["sm"] == pb[c]["sm"] for c in ctas]))))
    return out


def print_summary(shape, s):
    f = lambda d: f"{d['median'] / 1e3:6.2f} {d['max'] / 1e3:6.2f}"  # noqa: E731
    print(f"B,N,L {shape}: {s['warpgroups']} compute warpgroups on {s['sms']} SMs "
          "(us: median max)")
    print(f"  start {f(s['start_ns'])}   first keys {f(s['first_keys_ns'])}   last values "
          f"{f(s['last_values_ns'])}   end {f(s['end_ns'])}   tail {f(s['tail_ns'])}")
    print("  end by key blocks: " + "  ".join(f"{k} ({v['ctas']} CTAs) {f(v)}"
                                              for k, v in s["end_by_blocks_ns"].items()))
    print("  " + "  ".join(f"{k} {f(v)}" for k, v in s["regions_ns"].items()))
    if s["producer_ns"]:
        print("  producer: " + "  ".join(f"{k} {f(v)}" for k, v in s["producer_ns"].items()))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="1,16,8192;1,1,8192;1,64,8192;8,16,8192")
    ap.add_argument("--tuning", default="{}", help="tree_attention_pallas tuning, JSON")
    ap.add_argument("--clock-ghz", type=float, default=1.98, help="the SM clock under load")
    ap.add_argument("--calls", type=int, default=3)
    a = ap.parse_args()
    tuning = {k: tuple(v) if isinstance(v, list) else v
              for k, v in json.loads(a.tuning).items()}
    results = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                   clock_ghz=a.clock_ghz, tuning=a.tuning, shapes=[])
    for shape in bk.parse_shapes(a.shapes):
        runs = profile_shape(*shape, tuning, a.calls, a.clock_ghz)
        results["shapes"].append(dict(shape=shape, runs=runs))
        for r in runs:
            print_summary(shape, r["summary"])
        for key in ("last_values", "end"):
            pairs = call_to_call(runs, key)
            results["shapes"][-1][f"call_to_call_{key}"] = pairs
            print(f"  {key}, call to call: " + "; ".join(
                f"r by CTA {p['by_cta']:.2f}, by SM {p['by_sm']:.2f}, same SM "
                f"{p['same_sm']:.0%}" for p in pairs))
        with open(os.path.join(os.environ.get("OUT", "."), "mosaic_timeline.json"), "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
