#!/usr/bin/env bash
# The runs behind bench/RESULTS.md's current figures, one part a device call (each fits the
# 600 s a call may take). Run on the GPU machine from the repo root, with the SmolLM2 GGUF at
# $GGUF (default ~/models/smollm2.gguf). Every part writes its logs and JSON under $OUT (or
# ./gpu_out) and prints a short table last; docs/benchmarking.md says what each tool measures.
# JAXSPEC's persistent compilation cache (~/.cache/jaxspec/xla) makes a later part that reuses
# an earlier one's shapes on the same machine start in seconds.
#
# End to end (SmolLM2-135M-Instruct, the shipped EAGLE-1 head, greedy):
#   sweep         batch 1, 4, 16, 64 at the default spec against plain, MT-bench; SET=sg for
#                 held-out ShareGPT (carry .gpu/sharegpt_heldout.jsonl); one merged plot
#   ab            a change against REV (bash bench/ab_prepare.sh REV; carry .base): jaxspec-bench
#                 on both trees alternated (ORDER), BATCH, SPEC, PROMPTS, TOKENS, REPEATS, DATASET
#   peers         batch 1 beside HF transformers: hf-compiled on the 80 questions, then the eager
#                 peers (hf-static, hf-pld) on bench/mtbench16.jsonl
#   tau           the shipped head's tau over both MT-bench turns (the default 16,128 + 256
#                 drafted tokens, then all 49,152), then tau at temperature 1 against greedy
#   digest        greedy outputs in fp32 on the GPU: every single-device mode against plain
#   families      the compiled Triton tree kernel with windows, soft-caps and 256-wide heads
#                 against its reference, and the model families' parity tests, on the GPU
#   serve         `jaxspec serve` at 64 requests in flight against offline generate on the same
#                 384 prompts, 64 slots, plain then the shipped head at the default spec
# 8B shape, random weights:
#   cycle         the speculative cycle against a plain decode step and its bytes floor, batch 1,
#                 four tree shapes (SHAPES), the catch-up's dead-row skip at batch 64; then
#                 where the (6,10,60) cycle's kernel time goes (PROFILE=0 leaves it out: all
#                 three may not fit one call from a cold compile cache)
#   decode        the engine's decode step against its floor (8B under the GEMM rule and with
#                 Triton GEMMs, SmolLM2 shape), then the batch-64 step's kernels
#   kernels_e2e   the decode step (E2E=decode) or the cycle (E2E=cycle) with the Pallas kernels
#                 in, out (JAXSPEC_KERNELS=0), in again
# Kernels (Hq/Hkv/D 32/8/128 unless said):
#   kernels       the device checks, then the tree-attention table's 8K rows
#   kernels_floor batch 1's bare-read floor at 8K, and cuDNN / FlashAttention-2 on the N 64 rows
#   kernels_32k   the table's 32K rows
#   kernels_1k    the table's 1K rows and KV compaction, then 32 chained layers' kernels (main
#                 kernel and combine, batch 1)
#   topk          the draft's vocabulary top-k: the Pallas kernel against XLA's routes
# Two or more GPUs (nvidia-h200-x2):
#   parallel      data parallel, one GPU against two: the engine, pmap, the compiled cycle alone
#   parallel_calls  the engine's calls alone on one and two GPUs, then four batches of requests
#   parallel_tp   tensor parallel at 8B: decode step and cycles, batch 1 and 64
#   tp_batch1     tensor parallel at 8B, one GPU against two, plain decode and chain cycle: batch 1
#                 for each schedule (megatron; replicated_attention, embedding whole) and
#                 collective flag set (default, cmdbuf_sync, oneshot: XLA's one-shot all-reduce
#                 kernel) with the HLO's collectives and profiler traces, then batch 64
#                 (default and oneshot)
#   tp_oneshot    the one-shot Pallas all-reduce kernel: its tests on two GPUs (the part stops
#                 if they fail or hang), the all-reduce alone (NCCL, XLA's one-shot kernel, the
#                 Pallas kernel; rows 1-64 of 4096), then plain decode and chain cycle at batch
#                 1, replicated_attention with XLA's all-reduce (default and oneshot flags)
#                 against with the Pallas kernel's
# Training (carry what each names):
#   lossweight    the shipped head fine-tuned with the token term at 1.0 and 0.1 (stage 4's run;
#                 WEIGHTS=1.0 TRAIN_S=330 is stage 4's own); carry .gpu/train/
#   stage4        stage 4 trained on all 42.5K self-distilled answers: the run that gave stage 5,
#                 the shipped head; carry .gpu/stage4/ and .gpu/train/sharegpt_more2.npz
#   eagle3        stage 1 of the EAGLE-3 head (checkpoints/smollm2-135m-instruct-eagle3);
#                 carry .gpu/train/
#   eagle3_more   the EAGLE-3 head's next stage: from HEAD (default .gpu/eagle3, the card's
#                 head) on its answers (.gpu/eagle3_answers/) and 27,832 later turns more
#                 (.gpu/train/sharegpt_more2.npz); the new head and answers land in $OUT
# Measured (HEAD: an EAGLE-3 head directory, beside the shipped EAGLE-1 head, one call each):
#   eagle3_tau    tau over both MT-bench turns, chain and tree, both heads
#   eagle3_e2e    end to end at batch 1 and 64 against plain, both heads
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)   # absolute: parts may cd
GGUF=${GGUF:-$HOME/models/smollm2.gguf}
run() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout "$limit" "$@" 2>&1 | tr '\r' '\n' | grep -v 'it/s\]' | tee "$OUT/$name.log" | tail -24; }
BENCH="python3 -m jaxspec.bench_cli --model $GGUF --quiet"
KTABLE="python3 bench/bench_kernels.py --no-sweep --device-time"
rows() { local l=$1 r="" b n; for b in 1 8 64; do for n in 1 16 64; do r="$r$b,$n,$l;"; done; done; echo "${r%;}"; }

case "${1:-}" in
  sweep)
    DS=""; N=mt; [ "${SET:-mt}" = sg ] && { DS="--dataset $PWD/.gpu/sharegpt_heldout.jsonl"; N=sg; }
    S="$BENCH --no-peers --max-tokens 128 --repeats 2 --spec default $DS"
    run sweep_${N}_small 280 $S --batch-sizes 1,4 --num-prompts 80 --json "$OUT/sweep_${N}_small.json"
    run sweep_${N}_large 280 $S --batch-sizes 16,64 --num-prompts 384 --json "$OUT/sweep_${N}_large.json"
    python3 -m bench.merge_sweeps "$OUT/sweep_$N.png" "$OUT/sweep_${N}_small.json" "$OUT/sweep_${N}_large.json"
    python3 -m bench.pass_parts "$OUT/sweep_${N}_small.json" "$OUT/sweep_${N}_large.json"
    ;;
  ab)
    [ -d .base ] || { echo "no .base: run bash bench/ab_prepare.sh REV and carry .base"; exit 2; }
    S="$BENCH --no-peers --max-tokens ${TOKENS:-128} --spec ${SPEC:-default} --repeats ${REPEATS:-2}
       --batch-sizes ${BATCH:-64} --num-prompts ${PROMPTS:-384} ${DATASET:+--dataset $PWD/$DATASET}"
    echo "base: $(cat .base/REV)"
    i=0; for t in ${ORDER:-new base base new}; do i=$((i + 1)); d=$PWD; [ "$t" = base ] && d=$PWD/.base
      (cd "$d" && PYTHONPATH=$d:$PYTHONPATH run ab_${i}_$t 250 $S --json "$OUT/ab_${i}_$t.json")
    done
    python3 -m bench.pass_parts "$OUT"/ab_*.json
    ;;
  peers)
    run peers_compiled 300 $BENCH --max-tokens 128 --repeats 2 --spec default --batch-sizes 1 \
      --num-prompts 80 --peers hf-compiled --json "$OUT/peers_compiled.json"
    run peers_eager 280 $BENCH --max-tokens 128 --repeats 1 --spec default --batch-sizes 1 \
      --dataset bench/mtbench16.jsonl --num-prompts 16 --peers hf-static,hf-pld --json "$OUT/peers_eager.json"
    ;;
  tau)
    A="python3 -m bench.bench_accept --model $GGUF --presets chain tree --questions 80 --max-new 256 --turns 2"
    run tau_default 200 $A --draft-vocab 16384 --context-vocab 256 --out "$OUT/tau_default.json"
    run tau_all 200 $A --out "$OUT/tau_all.json"
    run tau_sampled 150 python3 -m bench.bench_sampling_accept --model "$GGUF" --questions 16 \
      --max-new 128 --out "$OUT/tau_sampled.json"
    ;;
  digest)
    run digest 500 python3 bench/greedy_digest.py --modes plain,naive,chain,tree,4x8x32 --json "$OUT/digest.json"
    ;;
  families)
    P="env JAX_DEFAULT_MATMUL_PRECISION=highest python3 -m pytest -q -p no:cacheprovider"
    run families_kernel 250 $P tests/test_tree_attention.py -k compiled_kernel
    run families 300 $P tests/test_families.py
    ;;
  serve)
    S="python3 -m bench.serve_vs_offline --model $GGUF --num-prompts 384 --max-tokens 128
       --concurrency 64 --max-batch 64 --passes 3"
    run serve_plain 280 $S
    run serve_spec 280 $S --draft default
    ;;
  cycle)
    run cycle 390 python3 bench/bench_cycle.py --no-ablation --cycles 20 --repeats 3 \
      --shapes "${SHAPES:-1,1,2;3,1,4;5,8,32;6,10,60}" --variants lean
    run cycle_b64 120 python3 bench/bench_cycle.py --batch 64 --cycles 10 --repeats 3 --shapes "3,2,4"
    [ "${PROFILE:-1}" = 0 ] || run cycle_profile 200 python3 -m bench.profile_cycle --shapes "6,10,60" --variant lean
    ;;
  decode)
    run decode 250 python3 -m bench.bench_decode --layouts static --only llama3-8b --program engine --gemm auto,triton
    run decode_small 60 python3 -m bench.bench_decode --layouts static --only smollm2-135m --program engine
    run decode_b64_profile 120 python3 -m bench.profile_cycle --shapes "" --batch 64 --prefix 512
    ;;
  kernels_e2e)
    case ${E2E:-decode} in
      decode) LIMIT=170 CMD="python3 -m bench.bench_decode --layouts static --only llama3-8b,smollm2-135m --program engine --batches 1,64" ;;
      cycle) LIMIT=190 CMD="python3 bench/bench_cycle.py --no-ablation --cycles 20 --repeats 3 --shapes 3,1,4;6,10,60 --variants lean" ;;
      *) echo "E2E must be decode or cycle, not $E2E"; exit 2 ;;
    esac
    i=0; for k in 1 0 1; do i=$((i + 1))
      run ${E2E:-decode}${i}_k$k $LIMIT env JAXSPEC_KERNELS=$k $CMD
    done
    ;;
  kernels)
    # with a cold compile cache the checks take about 215 s; the 8K rows fill the rest
    run kernels 500 $KTABLE --skip compact --table-shapes "$(rows 8192)"
    ;;
  kernels_floor)
    run read_floor 200 python3 bench/read_floor.py --device-time --sizes "1,8192;1,32768"
    run torch_peers 120 python3 bench/peers/torch_attention.py --shapes "1,64,8192;8,64,8192;64,64,8192;8,64,32768;64,64,32768"
    ;;
  kernels_32k)
    run kernels_32k 400 $KTABLE --skip check,compact --table-shapes "$(rows 32768)"
    ;;
  kernels_1k)
    run kernels_1k 420 $KTABLE --skip check --table-shapes "$(rows 1024)"
    run kernels_profile 90 python3 -m bench.profile_cycle --attention --attn-shapes "1,1,1024;1,1,8192;1,1,32768;64,1,1024;1,60,1024"
    ;;
  topk)
    run topk_128k 240 python3 -m bench.bench_draft_ops --only 'chunk_max_sort|pallas'
    cp "$OUT/bench_draft_ops.json" "$OUT/bench_draft_ops_128k.json"
    run topk_16k 150 python3 -m bench.bench_draft_ops --only 'two_stage_c1024|pallas' --vocab 16384 --topk 8 --chunks 1024
    ;;
  parallel)
    run parallel_dp 560 python3 bench/bench_parallel.py --part dp --dp-impl engine,pmap,device --reps 3
    ;;
  parallel_calls)
    run parallel_calls 250 python3 bench/bench_parallel.py --part dp --dp-impl calls --reps 3
    run parallel_waves 300 python3 bench/bench_parallel.py --part dp --dp-impl engine \
      --dp-modes chain,plain --reps 3 --waves 4
    ;;
  parallel_tp)
    run parallel_tp 360 python3 bench/bench_parallel.py --part tp --reps 3
    ;;
  tp_batch1)
    TP="python3 bench/bench_parallel.py --part tp --tp-spec chain --reps 3
        --tp-schedules megatron,replicated_attention:replicate"
    run tp_batch1 320 $TP --tp-batches 1 --tp-flags default,cmdbuf_sync,oneshot --profile
    cp "$OUT/bench_parallel.json" "$OUT/tp_batch1.json"
    run tp_batch64 270 $TP --tp-batches 64 --tp-flags default,oneshot
    cp "$OUT/bench_parallel.json" "$OUT/tp_batch64.json"
    # at most 8 files come back from a call: the HLO and traces as one archive
    tar czf "$OUT/tp_profile.tgz" -C "$OUT" tp_hlo tp_trace && rm -rf "$OUT/tp_hlo" "$OUT/tp_trace"
    ;;
  tp_oneshot)
    run tp_oneshot_tests 150 python3 -m pytest -q -p no:cacheprovider tests/test_allreduce_mgpu.py \
      || NO_PALLAS=--no-pallas   # the Pallas kernel failed or hung: time XLA's alone
    run tp_allreduce 100 python3 bench/bench_allreduce.py ${NO_PALLAS:-}
    TP="python3 bench/bench_parallel.py --part tp --tp-spec chain --reps 3 --tp-batches 1"
    run tp_oneshot_xla 200 $TP --tp-schedules replicated_attention:replicate --tp-flags default,oneshot
    cp "$OUT/bench_parallel.json" "$OUT/tp_oneshot_xla.json"
    [ -n "${NO_PALLAS:-}" ] || run tp_oneshot_pallas 110 $TP \
      --tp-schedules replicated_attention:replicate:oneshot
    ;;
  lossweight)
    run lossweight 590 python3 -m bench.train_gpu run --gguf "$GGUF" --out "$OUT" --mode sd \
      --init-head shipped --ttt-steps 4 --lr 2e-4 --warmup 100 --more-data \
      .gpu/train/sharegpt_more.npz --gen-seconds ${GEN_S:-45} --train-seconds ${TRAIN_S:-120} \
      --token-weights ${WEIGHTS:-1.0 0.1} --vs-shipped --deadline 580
    rm -f "$OUT"/tw*/loss.png    # at most 8 files come back
    ;;
  stage4)
    run stage4 590 python3 -m bench.train_gpu run --gguf "$GGUF" --out "$OUT" --mode sd \
      --init-head shipped --ttt-steps 4 --lr ${LR:-1.5e-4} --warmup 100 \
      --sd-data .gpu/stage4/examples_sd_first.npz .gpu/stage4/examples_sd_more.npz \
      --more-data .gpu/train/sharegpt_more2.npz --gen-seconds 140 --train-seconds ${TRAIN_S:-300} \
      --token-weights 1.0 --target-temps ${TEMP:-1.0} --vs-shipped --deadline 580
    rm -f "$OUT"/examples_sd_first.npz    # the carried answers; the new ones come back
    ;;
  eagle3)
    run eagle3 590 env XLA_PYTHON_CLIENT_MEM_FRACTION=.92 python3 -m bench.train_gpu run \
      --gguf "$GGUF" --out "$OUT" --arch eagle3 --mode sd --data .gpu/train/sharegpt.npz \
      --more-data .gpu/train/sharegpt_more.npz --gen-seconds 60 --draft-vocab 16384 --ttt-steps 6 \
      --batch-size 32 --lr 6e-4 --warmup 200 --questions 0 --precompute-share 0.45 --train-seconds 340
    ;;
  eagle3_more)
    A=.gpu/eagle3_answers
    run eagle3_more 590 env XLA_PYTHON_CLIENT_MEM_FRACTION=.92 python3 -m bench.train_gpu run \
      --gguf "$GGUF" --out "$OUT" --arch eagle3 --mode sd --init-head "${HEAD:-.gpu/eagle3}" \
      --sd-data $A/examples_sd_first.npz $A/examples_sd_more.npz \
      --more-data .gpu/train/sharegpt_more2.npz --gen-seconds 150 --ttt-steps 6 --lr 2e-4 \
      --warmup 50 --train-seconds ${TRAIN_S:-330} --questions 0 --precompute-share 0.45
    rm -f "$OUT"/examples_sd_first.npz    # the carried answers; the new ones come back
    ;;
  eagle3_tau)
    A="python3 -m bench.bench_accept --model $GGUF --presets chain tree --questions 80 --max-new 256 --turns 2"
    run tau_eagle3 280 $A --head "${HEAD:-.gpu/eagle3}" --out "$OUT/tau_eagle3.json"
    run tau_eagle1 280 $A --draft-vocab 16384 --context-vocab 256 --out "$OUT/tau_eagle1.json"
    ;;
  eagle3_e2e)
    E="$BENCH --no-peers --max-tokens 128 --repeats 2 --spec default"
    for b in 1 64; do n=80; [ $b = 64 ] && n=384
      run e2e_eagle3_b$b 140 $E --batch-sizes $b --num-prompts $n --draft "${HEAD:-.gpu/eagle3}" \
        --json "$OUT/e2e_eagle3_b$b.json"
      run e2e_eagle1_b$b 140 $E --batch-sizes $b --num-prompts $n --json "$OUT/e2e_eagle1_b$b.json"
    done
    ;;
  *) sed -n "2,/^set -uo/p" "$0" | sed '$d'; exit 2 ;;
esac
