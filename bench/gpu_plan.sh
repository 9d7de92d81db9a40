#!/usr/bin/env bash
# The GPU measurements still owed, grouped so a device session can run them in few calls.
# Run on the device machine from the repo root, after the SmolLM2 GGUF is in place
# (bash ../shared/tools/gpu-prepare.sh prints the two calls that carry it):
#   bash bench/gpu_plan.sh decode      # issues 2 and 4: plain decode, kernels in, XLA and HF peers
#   bash bench/gpu_plan.sh cycle       # issues 3 and 4: cycle cost at the Llama-3-8B shape
#   bash bench/gpu_plan.sh serve       # issues 5, 6, 7: engine busy fraction, sampling accept,
#                                      #   end-to-end speculative vs plain vs HF on MT-bench
#   bash bench/gpu_plan.sh sweep       # issue 8: jaxspec-bench batch sweep (MT-bench, ShareGPT)
#   bash bench/gpu_plan.sh parallel    # issue 9: needs the nvidia-h200-x2 kind
# Every part writes its logs and JSON under $OUT (or ./gpu_out) and prints a short table last.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
GGUF=${GGUF:-$HOME/models/smollm2.gguf}
run() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | tail -24; }

case "${1:-}" in
  decode)
    run decode 260 python3 -m bench.bench_decode --layouts static
    run decode_xla 150 python3 -m bench.bench_decode --layouts static --attn reference --only llama3-8b
    run hf_smollm2 120 python3 bench/peers/hf_decode.py --shape smollm2-135m --compile
    ;;
  cycle)
    run cycle 420 python3 bench/bench_cycle.py
    ;;
  serve)
    run engine 200 python3 -m bench.bench_engine --model "$GGUF"
    run sampling_accept 150 python3 -m bench.bench_sampling_accept --model "$GGUF"
    run e2e 300 python3 -m jaxspec.bench_cli --model "$GGUF" --num-prompts 16 --max-tokens 256 --spec chain,tree --json "$OUT/e2e.json"
    ;;
  sweep)
    run sweep_mtbench 280 python3 -m jaxspec.bench_cli --model "$GGUF" --batch-sizes 1,4,16,64 --spec chain,tree --num-prompts 64 --json "$OUT/sweep_mtbench.json" --plot "$OUT/sweep_mtbench.png"
    run sweep_sharegpt 280 python3 -m jaxspec.bench_cli --model "$GGUF" --dataset sharegpt --batch-sizes 1,4,16,64 --spec chain,tree --num-prompts 64 --json "$OUT/sweep_sharegpt.json"
    ;;
  parallel)
    run parallel 540 python3 bench/bench_parallel.py
    ;;
  *) sed -n 2,12p "$0"; exit 2 ;;
esac
