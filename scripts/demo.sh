#!/usr/bin/env bash
# Sets up .venv if needed (scripts/setup.sh), then runs `jaxspec demo`: the default model
# (SmolLM2-135M-Instruct) answers a few prompts by plain decoding and by speculative decoding with
# its shipped EAGLE head, the replies printed as they come, then the speedup and a legend.
# Arguments go to `jaxspec demo` (e.g. --prompts 3 --max-tokens 64).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/jaxspec demo "$@"
