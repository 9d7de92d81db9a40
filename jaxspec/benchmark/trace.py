"""Device time per program from a jax.profiler trace: which compiled program (the cycle, an
admission, a decode block) the GPU's kernels belonged to, and how long the device sat idle.

A kernel is tied to the program that launched it by CUPTI's correlation id: the GPU event and
the host's launch call (cuGraphLaunch, cuLaunchKernel, a copy) carry the same one, and the
launch sits inside the host span of the XLA module that ran it (`jit_<name>:XLA GPU module`,
or `PjitFunction(<name>)` around it). Kernels inside a CUDA graph share their graph launch's
id, so a whole graph lands on its program.

    summary = program_times(load_trace(trace_dir))
    print(format_programs(summary))
"""
from __future__ import annotations

import bisect
import collections
import glob
import gzip
import json
import os
import re
from typing import Dict, List, Optional, Tuple

_MODULE = re.compile(r"^(?:jit_)?([\w.\-]+?)(?:\(\d+\))?:XLA GPU module$")
_PJIT = re.compile(r"^PjitFunction\((?:jit\()?([\w.\-<>]+?)\)*$")
UNMATCHED = "(no launch found)"


def keep_graphs_while_profiling():
    """Keeps XLA's CUDA graphs on while profiling (XLA turns them off by default then), so a
    traced run runs the programs an untraced one runs. Set before the backend starts."""
    flag = "--xla_enable_command_buffers_during_profiling=true"
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()


def load_trace(trace_dir: str) -> List[dict]:
    """The events of the newest perfetto trace (`*.trace.json.gz`) under trace_dir."""
    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.json.gz"), recursive=True),
                   key=os.path.getmtime)
    if not paths:
        raise FileNotFoundError(f"no *.json.gz trace under {trace_dir}")
    with gzip.open(paths[-1]) as f:
        events = json.load(f)
    return events.get("traceEvents", []) if isinstance(events, dict) else events


def gpu_pids(events) -> set:
    """The trace's process ids of GPUs (their kernels and copies)."""
    return {e.get("pid") for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
            and "GPU" in str(e.get("args", {}).get("name", ""))}


def gpu_spans(events) -> List[Tuple[str, float, float]]:
    """[(name, start us, duration us)] of the GPUs' kernels and copies among the events."""
    gpu = gpu_pids(events)
    return [(e["name"], e["ts"], e.get("dur", 0)) for e in events
            if e.get("ph") == "X" and e.get("pid") in gpu]


def _program_spans(host) -> Dict[tuple, Tuple[List[float], List[tuple]]]:
    """Per host thread: sorted span starts, and (start, end, program, is the XLA module span
    rather than the PjitFunction one) of every program run."""
    spans = collections.defaultdict(list)
    for e in host:
        name = e.get("name", "")
        module = _MODULE.match(name)
        m = module or _PJIT.match(name)
        if m:
            spans[(e.get("pid"), e.get("tid"))].append(
                (e["ts"], e["ts"] + e.get("dur", 0), m.group(1), module is not None))
    out = {}
    for key, rows in spans.items():
        rows.sort()
        out[key] = ([r[0] for r in rows], rows)
    return out


def _program_of(spans, thread, ts) -> Optional[str]:
    """The innermost module span of `thread` holding time ts (XLA module names first)."""
    starts, rows = spans.get(thread, ([], []))
    i = bisect.bisect_right(starts, ts)
    best = None
    for start, end, name, is_module in reversed(rows[max(0, i - 64):i]):
        if start <= ts <= end and (best is None or (is_module and not best[1])):
            best = (name, is_module)
    return None if best is None else best[0]


def _kernel_kind(name: str) -> str:
    """A kernel's name without what varies per instance (fusion numbers, template noise)."""
    name = re.sub(r"[_.]\d+$", "", name.split("(")[0])
    return name[:60]


def _host_side(host, spans, progs) -> Dict[str, str]:
    """Fills each program's calls, host ms and CUDA-graph update ms from the host's events;
    returns {correlation id: program} of the launches made inside a program's run."""
    launch = {}
    for e in host:
        cid = e.get("args", {}).get("correlation_id")
        update = e.get("name") == "command_buffer::update"
        prog = (_program_of(spans, (e.get("pid"), e.get("tid")), e["ts"])
                if update or cid is not None else None)   # (the Python calls are many)
        if prog is not None and update:
            progs[prog]["update_ms"] += e.get("dur", 0) / 1e3
        if prog is not None and cid is not None:
            launch[str(cid)] = prog
    for _, rows in spans.values():
        for start, end, name, is_module in rows:
            progs[name]["calls"] += is_module
            progs[name]["host_ms"] += (end - start) / 1e3 if is_module else 0.0
    return launch


def program_times(events: List[dict], top: int = 10) -> dict:
    """{"programs": {name: {"device_ms", "kernels", "calls", "host_ms" (the host's time inside
    its XLA module runs: argument buffers, CUDA-graph updates and launches), "update_ms" (of
    which CUDA-graph updates), "top": {kernel kind: ms} of its `top` costliest kinds}},
    "device_ms": all kernels,
    "busy_ms": their union (overlaps once), "span_ms": first kernel start to last end,
    "correlated": kernels tied to a program}. Without GPU events (a CPU run) every figure is 0."""
    gpu = gpu_pids(events)
    kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu]
    host = [e for e in events if e.get("ph") == "X" and e.get("pid") not in gpu]
    spans = _program_spans(host)
    progs = collections.defaultdict(lambda: {"device_ms": 0.0, "kernels": 0, "calls": 0,
                                             "host_ms": 0.0, "update_ms": 0.0})
    launch = _host_side(host, spans, progs)
    by_name = collections.defaultdict(collections.Counter)   # program -> kernel name -> us
    correlated = 0
    for e in kernels:
        cid = e.get("args", {}).get("correlation_id")
        prog = launch.get(str(cid)) if cid is not None else None
        correlated += prog is not None
        row = progs[prog or UNMATCHED]
        row["device_ms"] += e.get("dur", 0) / 1e3
        row["kernels"] += 1
        by_name[prog or UNMATCHED][_kernel_kind(e.get("name", ""))] += e.get("dur", 0)
    for prog, kinds in by_name.items():
        progs[prog]["top"] = {k: round(us / 1e3, 3) for k, us in kinds.most_common(top)}
    return {"programs": {k: v for k, v in progs.items() if v["kernels"]},
            "device_ms": sum(e.get("dur", 0) for e in kernels) / 1e3,
            "busy_ms": _union_ms(kernels), "span_ms": _span_ms(kernels),
            "correlated": correlated, "kernels": len(kernels)}


def _union_ms(kernels) -> float:
    total, end = 0.0, None
    for s, d in sorted((e["ts"], e.get("dur", 0)) for e in kernels):
        if end is None or s >= end:
            total, end = total + d, s + d
        elif s + d > end:
            total, end = total + s + d - end, s + d
    return total / 1e3


def _span_ms(kernels) -> float:
    if not kernels:
        return 0.0
    return (max(e["ts"] + e.get("dur", 0) for e in kernels) - min(e["ts"] for e in kernels)) / 1e3


def format_programs(summary: dict, kernels: bool = False) -> str:
    """A table: device ms per program, its share, kernels and calls (with kernels: each
    program's costliest kernel kinds under it); then busy / span."""
    rows = sorted(summary["programs"].items(), key=lambda kv: -kv[1]["device_ms"])
    total = summary["device_ms"] or 1.0
    lines = [f"{'program':36} {'device ms':>10} {'share':>6} {'kernels':>8} {'calls':>6} "
             f"{'ms/call':>8} {'host ms':>8} {'updates':>8}"]
    for name, r in rows:
        per = f"{r['device_ms'] / r['calls']:8.3f}" if r["calls"] else f"{'-':>8}"
        lines.append(f"{name[:36]:36} {r['device_ms']:10.2f} {r['device_ms'] / total:6.1%} "
                     f"{r['kernels']:8d} {r['calls']:6d} {per} {r['host_ms']:8.2f} "
                     f"{r['update_ms']:8.2f}")
        if kernels:
            lines += [f"    {k[:56]:56} {ms:9.2f} ms" for k, ms in r["top"].items()]
    span = summary["span_ms"]
    lines.append(f"kernels {summary['kernels']}, tied to a program {summary['correlated']}; "
                 f"device busy {summary['busy_ms']:.1f} ms of {span:.1f} ms from the first "
                 f"kernel to the last ({summary['busy_ms'] / span if span else 0:.0%})")
    return "\n".join(lines)
