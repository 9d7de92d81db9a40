#!/usr/bin/env bash
# Sets up (if needed) and runs the whole test suite on the CPU.
# With arguments they go to one pytest run (e.g. `bash scripts/test.sh tests/test_llm.py -x`).
# Without, the test files run in five pytest processes, one after another: a single process
# that compiles the whole suite's programs (hundreds of XLA CPU executables kept alive by jit
# caches) has crashed inside XLA's compiler late in the run, while every file passes alone.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export JAX_PLATFORMS=cpu
if [ "$#" -gt 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi
mapfile -t files < <(ls tests/test_*.py | sort)
groups=5
per=$(( (${#files[@]} + groups - 1) / groups ))
status=0
for ((i = 0; i < ${#files[@]}; i += per)); do
  echo "== pytest ${files[*]:i:per}"
  .venv/bin/python -m pytest --durations=8 "${files[@]:i:per}" || status=$?
done
exit "$status"
