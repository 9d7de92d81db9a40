#!/usr/bin/env bash
# Sets up (if needed) and runs the whole test suite on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export JAX_PLATFORMS=cpu
exec .venv/bin/python -m pytest tests "$@"
