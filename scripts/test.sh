#!/usr/bin/env bash
# Sets up (if needed) and runs the whole test suite on the CPU.
# With arguments they go to one pytest run (e.g. `bash scripts/test.sh tests/test_llm.py -x`).
# Without, the test files run in five pytest processes: a single process that compiles the
# whole suite's programs (hundreds of XLA CPU executables kept alive by jit caches) has crashed
# inside XLA's compiler late in the run, while every file passes alone. The processes run
# TEST_JOBS at a time (default: 2, or 1 on a single core): most of a test's time is XLA
# compiling on one thread, so two processes keep two cores busy. Each group's output is
# printed whole when it ends.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export JAX_PLATFORMS=cpu
# XLA's older CPU runtime compiled and ran tests/test_spec_sampling.py 17% faster than the thunk
# runtime (58 against 70 s) on jaxlibs that have it; set only where the flag is known (an
# unknown flag aborts). jaxlib 0.10.2 still knows the flag but ignores it (a warning says so).
legacy=--xla_cpu_use_thunk_runtime=false
if XLA_FLAGS="${XLA_FLAGS:-} $legacy" .venv/bin/python -c 'import jax; jax.devices()' \
    >/dev/null 2>&1; then
  export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }$legacy"
fi
# Most of the suite's time is XLA compiling small programs; LLVM's optimizations of the CPU code
# are most of that and buy little on these tiny shapes. Level 0 (HLO passes unchanged, so the
# HLO programs and their collectives are the same; only the machine code differs) took
# tests/test_engine_warmup.py's first_chunk_wider_than_the_slot[plain] from 92 to 41 s. Tests
# that run the real SmolLM2 weights (marked real_weights) are the opposite: their time is the
# model running, and at level 0 a SmolLM2 forward ran 3.4x slower. They run in a process of
# their own at the full level: 293 s against 401 s, alone on 2 cores.
full_flags=${XLA_FLAGS:-}
optlevel=--xla_backend_optimization_level=0
if XLA_FLAGS="${XLA_FLAGS:-} $optlevel" .venv/bin/python -c 'import jax; jax.devices()' \
    >/dev/null 2>&1; then
  export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }$optlevel"
fi
# The same processes also compile with XLA's older CPU emitters (not the MLIR fusion emitters) and
# one LLVM module a program (no parallel codegen split: two lanes already keep both cores busy):
# the same HLO programs, compiled in about half the time (tests/test_engine.py's spec engine
# warm-up: 76 programs, 34 s against 17-19 s). Each only where this jaxlib has it.
for flag in --xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1; do
  if XLA_FLAGS="${XLA_FLAGS:-} $flag" .venv/bin/python -c 'import jax; jax.devices()' \
      >/dev/null 2>&1; then
    export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }$flag"
  fi
done
quick_flags=$XLA_FLAGS
if [ "$#" -gt 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi
cores=$(nproc 2>/dev/null || echo 1)
jobs=${TEST_JOBS:-$(( cores > 1 ? 2 : 1 ))}
# The work goes to `jobs` lanes that run side by side, balanced by the seconds each part took
# (tests/durations.json; a file not listed counts as the median). The parts are the test files
# (without their real_weights tests) and one process of all real_weights tests ("@real_weights"),
# longest first, each to the lane with the least so far. Each lane runs its files in up to
# ceil(5 / jobs) pytest processes one after another, its longest files first (one process for
# the whole suite has crashed inside XLA's compiler late in the run, while every file passes
# alone). Plan lines: "<lane> quick|full <files>".
mapfile -t plan < <(.venv/bin/python - "$jobs" <<'PY'
import json, pathlib, re, statistics, sys
jobs = int(sys.argv[1])
files = sorted(str(p) for p in pathlib.Path("tests").glob("test_*.py"))
text = {f: pathlib.Path(f).read_text() for f in files}
marked = [f for f in files if "pytest.mark.real_weights" in text[f]]
# files whose every test is real_weights (a module-level mark) have nothing for the quick ones
whole = {f for f in marked if re.search(r"^pytestmark = pytest\.mark\.real_weights", text[f], re.M)}
known = json.loads(pathlib.Path("tests/durations.json").read_text())
default = statistics.median(known.values()) if known else 60
# at least a second each: a file of 0 s must still fall in some process's share
cost = {f: max(1, known.get(pathlib.Path(f).name, default)) for f in files if f not in whole}
full = "@real_weights"
if marked:
    cost[full] = max(1, known.get(full, default))
lanes = [[0.0, []] for _ in range(jobs)]
for f in sorted(cost, key=lambda f: -cost[f]):
    lane = min(lanes, key=lambda l: l[0])
    lane[0] += cost[f]
    lane[1].append(f)
per_lane = max(1, -(-5 // jobs)) if jobs > 1 else 5
for i, (_, items) in enumerate(lanes):
    if full in items:
        print(i, "full", " ".join(marked))
    fs = [f for f in items if f != full]
    total = sum(cost[f] for f in fs)
    n = min(per_lane, len(fs))
    # split the lane by time: process j takes the files that start in its share of the seconds
    # (every file lands in exactly one: its start is below the lane's total)
    parts, start = [[] for _ in range(n)], 0.0
    for f in fs:
        parts[min(n - 1, int(start * n / total))].append(f)
        start += cost[f]
    for part in parts:
        if part:
            print(i, "quick", " ".join(part))
PY
)
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
# One persistent compilation cache for the run's processes: tests in different files build the
# same programs (the default model's engines, the same tiny configs), and a process finds what
# an earlier one compiled. It starts empty and is removed with the logs.
export JAX_COMPILATION_CACHE_DIR="$logs/xla" JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
  JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
lanes=$(printf '%s\n' "${plan[@]}" | cut -d' ' -f1 | sort -u)
pids=()
for lane in $lanes; do
  ( n=0
    for entry in "${plan[@]}"; do
      [ "${entry%% *}" = "$lane" ] || continue
      rest=${entry#* }
      kind=${rest%% *}
      read -ra part <<< "${rest#* }"
      if [ "$kind" = full ]; then
        flags=$full_flags select="real_weights" xml="$logs/$lane.$n.full.xml"
      else
        flags=$quick_flags select="not real_weights" xml="$logs/$lane.$n.xml"
      fi
      ( echo "== pytest -m '$select' ${part[*]}"
        XLA_FLAGS=$flags .venv/bin/python -m pytest --durations="${PYTEST_DURATIONS:-8}" \
          -m "$select" --junitxml="$xml" "${part[@]}" ) \
        > "$logs/$lane.$n.log" 2>&1 \
        || echo "$lane.$n" >> "$logs/failed"
      n=$((n + 1))
    done ) &
  pids+=("$!")
done
status=0
for pid in "${pids[@]}"; do
  wait "$pid" || status=$?
done
for log in $(ls "$logs"/*.log | sort -V); do
  cat "$log"
done
# Seconds per file in this run (from the JUnit reports), the figures the lanes are balanced by;
# UPDATE_DURATIONS=1 writes them to tests/durations.json.
.venv/bin/python - "$logs" "${UPDATE_DURATIONS:-0}" <<'PY'
import collections, json, pathlib, sys
import xml.etree.ElementTree as ET
secs = collections.Counter()
for xml in pathlib.Path(sys.argv[1]).glob("*.xml"):
    full = xml.name.endswith(".full.xml")
    for case in ET.parse(xml).iter("testcase"):
        name = "@real_weights" if full else (case.get("classname") or "").split(".")[-1] + ".py"
        secs[name] += float(case.get("time") or 0)
if secs:
    print("seconds per file:", ", ".join(f"{f} {s:.0f}" for f, s in secs.most_common()))
    if sys.argv[2] == "1":
        out = {f: round(s) for f, s in sorted(secs.items())}
        pathlib.Path("tests/durations.json").write_text(json.dumps(out, indent=1) + "\n")
PY
[ -e "$logs/failed" ] && status=1
exit "$status"
