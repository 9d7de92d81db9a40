#!/usr/bin/env bash
# Sets up (if needed) and runs the main job: jaxspec-bench on the default model (SmolLM2-135M).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/jaxspec-bench "$@"
