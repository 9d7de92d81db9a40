#!/usr/bin/env bash
# The GPU measurements still owed, grouped so a device session can run them in few calls, each
# under the 600 s a call may take. Run on the device machine from the repo root, after the
# SmolLM2 GGUF is in place (bash ../shared/tools/gpu-prepare.sh prints the two calls that carry
# it). JAXSPEC's persistent compilation cache (~/.cache/jaxspec/xla) makes a later part that
# reuses shapes of an earlier one on the same machine start in seconds. In priority order:
#   bash bench/gpu_plan.sh h200owed    # issues 3/4: the (6,10,60) cycle again (the thirty-fifth
#                                      #   set timed it once on the H200), then the issue 4 kernel
#                                      #   profile (the end of the kernels_rest part; the table
#                                      #   is the kernels and kernels_rest parts, a call each)
#   bash bench/gpu_plan.sh mosaic      # issue 4: the Mosaic GPU prefix kernel against Triton on the
#                                      #   wide tiles (backend sweep, then the 8K/32K table rows);
#                                      #   mosaic_short, batch 1-32 over 1-4K prefixes, the rule
#                                      #   under 8K (SHAPES="B,N,L;..." for others; forty-third
#                                      #   set: 57 shapes, 256-4K; with kernel times since the
#                                      #   forty-fourth, ~30 s a shape)
#   bash bench/gpu_plan.sh read_floor  # issue 4: what one kernel alone takes to read batch 1's
#                                      #   K and V (a Pallas stream, XLA's and torch's reductions,
#                                      #   torch's copy) beside the tree kernel at N = 1
#   bash bench/gpu_plan.sh release     # issue 4: the same, each function also timed with its
#                                      #   outputs dropped execution by execution
#                                      #   (bench_kernels.Release), where the harness's bursts
#                                      #   hold them all (forty-sixth set: no change)
#   bash bench/gpu_plan.sh launch_floor # issue 4: kernels that read one block a program (touch)
#                                      #   beside the layer's reads and the tree kernel at N 1,
#                                      #   unrolled and as one layer loop (forty-sixth set: a
#                                      #   touch call costs 7.2-9.7 us, the host's dispatch)
#   bash bench/gpu_plan.sh topk_rank   # the draft's top-k by chunk maxima with its two small
#                                      #   selections as sorts (default) and by pairwise ranks
#                                      #   (bench_draft_ops), then the 8B batch-1 cycle (SHAPES)
#                                      #   as is, with ranks, and with ranks for the tree's
#                                      #   choice of 510 candidates too (RANK_MAX_WIDTH 512)
#   bash bench/gpu_plan.sh topk_pallas # the draft's top-k by two Pallas passes against the chunk
#                                      #   maxima (bench_draft_ops; and against chunks of 1,024
#                                      #   at a 16,384 draft vocabulary, k 8), then the 8B cycle
#                                      #   (SHAPES) with the XLA top-k routes of before (and the
#                                      #   tree's choice of 510 by lax.top_k) and with the
#                                      #   defaults (the kernel; ranks up to 512), twice each
#   bash bench/gpu_plan.sh topk_fused  # the top-k kernel in one launch against two passes:
#                                      #   bench_draft_ops at 128K and 16K, the 8B cycle
#                                      #   alternated (forty-ninth set: two passes at 128K)
#   bash bench/gpu_plan.sh topk_e2e    # batch 1 end to end (bench_cli, MT-bench, default spec,
#                                      #   plain in the same run) with the top-k by the XLA routes
#                                      #   and by the kernel (bench/with_defaults.py); ORDER
#   bash bench/gpu_plan.sh topk_engine # the SmolLM2 engine at batch 1 (4x8x32:2, the shipped
#                                      #   head's 16,384-token draft vocabulary) with the top-k by
#                                      #   the XLA routes, the kernel's two-pass form and its
#                                      #   default, alternated
#   bash bench/gpu_plan.sh cycle_hlo   # issue 4: the 8B batch-1 cycle's optimized HLO (the largest
#                                      #   module XLA dumps while bench_cycle runs), gzipped, to
#                                      #   read here which fusions each layer launches
#   bash bench/gpu_plan.sh ncu         # issue 4: ncu's DRAM bytes, L2 hit rate and tensor-pipe
#                                      #   activity of the Mosaic kernel at B 64, N 64, 8K
#                                      #   (forty-first set: sections on 3 shapes ran past 280 s)
#   bash bench/gpu_plan.sh cluster_costs  # issue 4: what launching 128 CTAs as thread-block
#                                      #   clusters of 1-16 costs (fifty-first set: 2.0 us
#                                      #   against 1.3 without clusters)
#   bash bench/gpu_plan.sh compaction  # issue 4: kv_compact alone and its share of the (6,10,60)
#                                      #   cycle's kernels on the H200
#   bash bench/gpu_plan.sh timeline    # issue 4: the Mosaic kernel's timeline (CTA starts, first
#                                      #   keys, last values, ends, each region's time) at batch
#                                      #   1 and 8 over 8K (fifty-sixth set), and whether the
#                                      #   same CTAs or SMs end late call after call (fifty-
#                                      #   seventh)
#   bash bench/gpu_plan.sh lossweight  # issue 7: the shipped head fine-tuned twice from the same
#                                      #   start, data (17.5K self-distilled ShareGPT answers,
#                                      #   carry .gpu/train/ from `python -m bench.train_gpu
#                                      #   prepare` and `prepare --later-turns --examples 9000
#                                      #   --data .gpu/train/sharegpt_more.npz`) and time, with
#                                      #   the token term weighted 1.0 and 0.1 (EAGLE-1's), then
#                                      #   chain and tree tau of both and of the shipped head on
#                                      #   MT-bench (80 questions, 256 tokens); the heads, logs and
#                                      #   answers come back under $OUT
#   bash bench/gpu_plan.sh stage4      # issue 7: the shipped head (token weight 1.0; TEMP: the
#                                      #   token target's temperature, default 1) on all 42.5K
#                                      #   self-distilled answers (carry .gpu/stage4/ and
#                                      #   .gpu/train/sharegpt_more2.npz from `python -m
#                                      #   bench.train_gpu prepare --later-turns --skip 9000
#                                      #   --examples 30000 --data .gpu/train/sharegpt_more2.npz`);
#                                      #   its run in the twenty-ninth set gave stage 5; the
#                                      #   27.8K answers it makes come back as
#                                      #   examples_sd_more.npz (keep them under .gpu/stage4/)
#   bash bench/gpu_plan.sh ctxvocab    # issue 7: the context vocabulary (E = CTX, default 256)
#                                      #   against none: chain and tree tau over both MT-bench
#                                      #   turns drafting 16,384 tokens (ctxvocab_tau), batch 1
#                                      #   end to end at 4x8x32:2 both orders (ctxvocab_b1), batch
#                                      #   64 at the default spec with E = 0, 64, 256 (ctxvocab_b64)
#   bash bench/gpu_plan.sh turns2      # issue 7: chain and tree tau over both MT-bench turns, as
#                                      #   EAGLE's evaluation runs them (per turn too), drafting
#                                      #   16,384 tokens and all (VOCABS; thirty-first set)
#   bash bench/gpu_plan.sh b1calls     # issue 7: batch 1 at 4x8x32 with 1, 2 and 3 cycles a call
#                                      #   (':1', ':2', ':3'), both orders (thirty-first set: 2
#                                      #   became the batch-1 default; ':1' is the old one)
#   bash bench/gpu_plan.sh sweep_s4    # issue 8: batch 1, 4, 16, 64 at the default specs with the
#                                      #   shipped head, MT-bench (SET=sg: held-out ShareGPT,
#                                      #   carry .gpu/sharegpt_heldout.jsonl); one merged plot
#   bash bench/gpu_plan.sh targettemp  # issue 7: the shipped head fine-tuned with the token term's
#                                      #   target at T = 1 and at a sharper TEMP (default 0.5),
#                                      #   same start, answers (carry .gpu/stage4/) and time
#   bash bench/gpu_plan.sh newhead     # issues 7/8: HEAD against the shipped head, batch 1, 4, 16
#                                      #   and 64, MT-bench (all 80 questions at batch 1), default
#                                      #   specs (at batch 1 and 64 with the draft vocabulary the
#                                      #   shipped head gets)
#   bash bench/gpu_plan.sh b1trees     # issue 7: batch 1, MT-bench, trees of 4 to 6 draft steps,
#                                      #   two runs in opposite orders, 2 passes each, at TOKENS
#                                      #   new tokens (default 256; at 128, twenty-first set:
#                                      #   4x8x32 2.40-2.47x, 5x8x40 2.26-2.35x, 6x8x40 2.14-2.25x)
#   bash bench/gpu_plan.sh shortprefix # issues 4/8: tree attention's split counts on short
#                                      #   prefixes at batch 64 (twenty-second set: the combine's
#                                      #   launch costs ~2.3 us a layer; 1 split wins on short
#                                      #   prefixes and loses on long, uneven ones)
#   bash bench/gpu_plan.sh packing_rand   # issue 8: packed first chunks against padded, batch 64,
#                                      #   random weights (admission device time); packing_exact,
#                                      #   fp32 spec == plain at batch 16; packing_mt / packing_sg,
#                                      #   real weights, batch 64, both settings alternated;
#                                      #   packing_w, rows of 512 / 1024 / padded on ShareGPT;
#                                      #   packing_knobs, admit interval 1-3 x 4 or 8 cycles
#                                      #   (all run in the seventeenth set; interval 3 to repeat)
#   bash bench/gpu_plan.sh slotgrowth  # issue 8: batch 64, prefill slot counts 1, 2, 4, .., 64 against
#                                      #   1, 4, 16, 64 (MT-bench, held-out ShareGPT: carry it);
#                                      #   the MT-bench rows' warmup_s is the first warm-up each
#                                      #   setting costs (own empty compile caches; unmeasured)
#   bash bench/gpu_plan.sh fuseflags   # issues 3/8: XLA's experimental fusion flags, kernels per
#                                      #   layer and the 8B (5,8,32) cycle (random weights)
#   bash bench/gpu_plan.sh unroll_sg   # issue 8: batch 64, held-out ShareGPT, the prefill layer loop
#                                      #   at 1, 6 and 30 layers an iteration; unroll_mt, the same on
#                                      #   MT-bench (30 against 1 run in the sixteenth set on
#                                      #   MT-bench: 1.29x / 1.31x, a 201 s first warm-up)
#   bash bench/gpu_plan.sh copies      # issue 6: one or two loaded copies of the cycle program,
#                                      #   batch 1 and 64, each setting twice in alternation
#                                      #   (random weights, no GGUF needed)
#   bash bench/gpu_plan.sh kcompare    # issue 8: 4 against 8 cycles per call at batch 16/64,
#                                      #   128 and 512 tokens, since the text change of commit
#                                      #   6b7ac0c (8 won at 128 and lost at 512 before it; batch
#                                      #   64, 128 tokens, interval 2: 1.33x / 1.32x, fifteenth set)
#   bash bench/gpu_plan.sh cbmode      # issues 6/8: stable addresses for the CUDA graphs' temporaries
#                                      #   (no graph updates), batch 64 and 1, random weights (run
#                                      #   in the fifteenth set: SKIP_PROFILED 0.58x, SKIP_TEMP 1.01x)
#   bash bench/gpu_plan.sh b1k         # issues 6/8: batch 1, chain (1 cycle a call) against chain:4
#                                      #   (run in the fifteenth set, first two runs: 1.82x / 1.76x)
#   bash bench/gpu_plan.sh admit2      # issue 8: batch 64, admit every call or every 2nd, MT-bench
#                                      #   and held-out ShareGPT (carry .gpu/sharegpt_heldout.jsonl),
#                                      #   with --adaptive (run in the fifteenth set: interval 2 is
#                                      #   now the default for speculative engines of 32+ slots)
#   bash bench/gpu_plan.sh sweep13     # issue 8: the batch sweep 1/4/16/64 on MT-bench, 128
#                                      #   tokens, 3 timed passes (run in the fourteenth set);
#                                      #   sweep13_sg, held-out ShareGPT (carry
#                                      #   .gpu/sharegpt_heldout.jsonl), in a call of its own
#   bash bench/gpu_plan.sh hostprof    # issues 6/8: the batch-64 host profile with real weights
#                                      #   and the tokenizer, text once at the end (generate)
#                                      #   and streamed (stream) (run in the fourteenth set)
#   bash bench/gpu_plan.sh firstpass   # issues 6/8: batch 64, 128 tokens, 3 timed passes: does
#                                      #   the warm-up that runs every program (commit 3dda846)
#                                      #   make pass 1 as fast as passes 2-3 (27% slower before;
#                                      #   9% slower on 2026-11-25, thirteenth set)
#   bash bench/gpu_plan.sh peers       # issue 7: batch 1 with the HF transformers peers, in a
#                                      #   call of its own (bench/mtbench16.jsonl: two
#                                      #   MT-bench questions per category; hf-compiled first)
#   bash bench/gpu_plan.sh parallel    # issue 9 (nvidia-h200-x2): data parallel, engine and pmap
#                                      #   (forty-first set: engine 1.87-1.99x draining one
#                                      #   batch; fortieth: pmap 1.26-1.77x)
#   bash bench/gpu_plan.sh parallel_calls  # issue 9 (nvidia-h200-x2): the engine's calls alone
#                                      #   on 1 and 2 GPUs, then 4 batches of requests
#                                      #   (forty-first set: 2.00x on the device; 1.92-1.94x)
#   bash bench/gpu_plan.sh parallel_more  # issue 9 (nvidia-h200-x2): the engine at 8 cycles per
#                                      #   call, then tensor parallel
#   bash bench/gpu_plan.sh wide        # issue 7: batch 1 end to end, the 2x-MLP head (carry
#                                      #   .gpu/run7/head.safetensors) against the shipped one
#   bash bench/gpu_plan.sh steady_big  # issue 8: 512 requests at batch 16 and 64, MT-bench and
#                                      #   held-out ShareGPT (carry .gpu/sharegpt_heldout.jsonl),
#                                      #   after the admission fix of commit b499da5
#   bash bench/gpu_plan.sh widths      # issues 6/8: batch 64, MT-bench x 6.4, prefill widths
#                                      #   16, 64, 256, 512 against 16, 32, .., 512 (1.83x against
#                                      #   1.35x the prompts' tokens), same call
#   bash bench/gpu_plan.sh admit       # issues 6/8: the kernels of one admission shape, with
#                                      #   and without XLA's dynamic-slice fusion (random weights)
#   bash bench/gpu_plan.sh steady      # issue 8: 512 requests, batch 1 to 64 (the budget ends
#                                      #   it partway: batch 1 and 4 on 2026-11-24)
#   bash bench/gpu_plan.sh host        # issue 6: engine table with admit_interval 1 and 2, and the
#                                      #   prefill loop inside the CUDA graph (+WHILE) with its
#                                      #   batch-64 profile; random weights, no GGUF needed
#   bash bench/gpu_plan.sh census      # issues 2/3: kernels per layer by source line (b1, b64)
#   bash bench/gpu_plan.sh exact       # issues 3/8: fp32 greedy spec == plain on the GPU, batch 1
#   bash bench/gpu_plan.sh e2e         # issues 5/7: bf16 batch 1 spec vs plain vs HF; accept at T=1
#   bash bench/gpu_plan.sh sweep_a     # issue 8: batch 1, 4 (MT-bench); chain = the default
#                                      #   cycles per call (1 at batch 1, else 4), chain:1 = one
#   bash bench/gpu_plan.sh sweep_b     # issue 8: batch 16, 64 (MT-bench), 4 and 8 cycles per call
#   bash bench/gpu_plan.sh chains      # issues 7/8: longer chains and small trees at batch 1
#   bash bench/gpu_plan.sh sharegpt    # issue 8: batch 1, 16, 64 (ShareGPT)
#   bash bench/gpu_plan.sh engine      # issue 6: busy fraction and host ms per step, real model
#   bash bench/gpu_plan.sh decode      # issue 2: the engine's 8B decode program (LEAN), its GEMM rule against
#                                      #   Triton GEMMs, SmolLM2 shape, the batch-64 step's profile
#   bash bench/gpu_plan.sh cycle       # issues 3/4: 8B LEAN cycle table incl. (6,10,60), its profile
#   bash bench/gpu_plan.sh kernels     # issue 4: the checks, then the kernel table's 8K rows (wall,
#                                      #   host and kernel time)
#   bash bench/gpu_plan.sh kernels_rest # issue 4: the table's 32K and 1K rows, then the
#                                      #   chained-call kernel profile
#   bash bench/gpu_plan.sh h100_32k    # issue 4 on the H100: the 32K rows, cuDNN on the N 64 rows,
#                                      #   batch 1's read floor (then kernels_1k: the 1K rows;
#                                      #   h100_b1: batch 1's splits at 8K; fifty-eighth set)
#   bash bench/gpu_plan.sh eagle3      # issue 7: train an EAGLE-3 head, tau vs the shipped EAGLE-1
#                                      #   (carry .gpu/train/ and .gpu/run2/examples_sd.npz, the
#                                      #   self-distilled answers of an earlier call, if present)
#   bash bench/gpu_plan.sh si_gen      # issue 7: self-instruct data: the target writes 40,000
#                                      #   queries and answers them, plus ShareGPT's first turns
#                                      #   (carry .gpu/train/sharegpt.npz, from `python -m
#                                      #   bench.train_gpu prepare`), into $HOME/si; si_train
#                                      #   (next call, same machine): the shipped head fine-tuned
#                                      #   on them, tau against the shipped head; si_bench: batch
#                                      #   64 and 1, MT-bench, the new head against the shipped one
#   bash bench/gpu_plan.sh profile64   # issues 6/8: batch 64, MT-bench then held-out ShareGPT (carry
#                                      #   .gpu/sharegpt_heldout.jsonl), plain and chain:4, with
#                                      #   --profile: device ms, host ms and CUDA-graph updates
#                                      #   per program (nineteenth set: the device alone gives
#                                      #   1.40x on MT-bench; host time is the rest)
#   bash bench/gpu_plan.sh b1copies    # issue 7: batch 1, MT-bench, 128 tokens, 4x8x32 with one
#                                      #   and two loaded copies of each cycle program, real
#                                      #   weights, alternated 1, 2, 2, 1 (plain gets the same
#                                      #   copies in each run)
#   bash bench/gpu_plan.sh stall64     # issue 8: batch 64, MT-bench, chain:4, 4 timed passes:
#                                      #   each slow step's time split into admission calls,
#                                      #   cycle call, device wait and the rest (slowest_steps)
#   bash bench/gpu_plan.sh ab          # any change: jaxspec-bench on the working tree and on .base
#                                      #   (bash bench/ab_prepare.sh REV; carry .base), alternated
#                                      #   new, base, base, new (ORDER), then each pass's parts;
#                                      #   BATCH (64), SPEC (chain:4), PROMPTS (384), TOKENS (128),
#                                      #   REPEATS (3), DATASET (a jsonl under the repo; carry it)
#   bash bench/gpu_plan.sh slices      # issue 8: batch 64, MT-bench, chain:4, generate's
#                                      #   --submit-slice 16, 32, 64 (the default) and 384 (one
#                                      #   slice: no overlap), in turn, then each pass's parts
#                                      #   (twenty-fourth set: 64 sped both modes up, not the ratio)
#   bash bench/gpu_plan.sh prefill_attn  # issue 4: prompt-chunk attention settings on admission
#                                      #   shapes (random data, no GGUF needed)
#   bash bench/gpu_plan.sh widechain   # issue 8: 3x2x4:4 (the default from 16 slots) against
#                                      #   chain:4 at batch 16 and 64, both orders, MT-bench,
#                                      #   then held-out ShareGPT at 64 (carry
#                                      #   .gpu/sharegpt_heldout.jsonl); twenty-sixth set, MT-bench:
#                                      #   batch 16 1.35x against 1.28x, batch 64 1.38-1.42x
#                                      #   against 1.31-1.38x; ShareGPT unmeasured
#   bash bench/gpu_plan.sh packcap     # issue 8: why the 32,768-token pack cap made plain 11%
#                                      #   faster on held-out ShareGPT at batch 64 and left
#                                      #   speculation as it was (twenty-seventh set): plain and
#                                      #   3x2x4:4 with --profile on the working tree and on .base
#                                      #   (bash bench/ab_prepare.sh 9dbd651; carry .base and
#                                      #   .gpu/sharegpt_heldout.jsonl)
#   bash bench/gpu_plan.sh h200_short  # issue 4: the H100's two under-8K findings on the H200
#                                      #   (N 16 from batch 32; one-block splits at batch 1; and
#                                      #   h200_short2, the rest of the splits sweep)
#   bash bench/gpu_plan.sh decode_warps # issue 4: the Triton kernel's decode tiles (N 1-4) at 1
#                                      #   and 2 warps a program against the default 4, SmolLM2's
#                                      #   heads at batch 64 over 256-1K rows and the 8B rows at
#                                      #   N 1 (sixtieth set timed part of it: 1 warp slower,
#                                      #   2 warps 2-3% faster at SmolLM2's heads)
#   bash bench/gpu_plan.sh stages_smollm2 # issue 4: every key block of a program in flight
#                                      #   (deeper pipelines) at SmolLM2's heads, batch 64
#                                      #   over 256-512 rows (sixty-third set: all slower)
#   bash bench/gpu_plan.sh splits_smollm2 # issue 4: the same rows split in 2-4 (sixty-third
#                                      #   set: slower or a tie)
#   bash bench/gpu_plan.sh kernels_e2e # issue 4: the engine's decode step and the 8B cycle with
#                                      #   the Pallas kernels in, out (JAXSPEC_KERNELS=0), in
#   bash bench/gpu_plan.sh pdl         # issue 4: a Mosaic GPU kernel after the tree kernel,
#                                      #   with and without griddepcontrol.wait (does this
#                                      #   runtime launch it early?), bench/pdl_probe.py
#   bash bench/gpu_plan.sh ncu_decode  # issue 4: ncu's warp states and memory sections of the
#                                      #   Triton kernel at SmolLM2's heads, batch 64, N 1, 256
#                                      #   rows: where its 3-4 us over a bare read go (sixtieth set)
#   bash bench/gpu_plan.sh packrows    # issue 8: packs of 2, 3, 4, 6, 8 rows (--pack-rows
#                                      #   fine) against 2, 4, 8, batch 64, held-out ShareGPT
#                                      #   (carry it), alternated; arithmetic on its lengths: 1.27x
#                                      #   the tokens of groups of 11 against 1.56x (unmeasured)
# Every part writes its logs and JSON under $OUT (or ./gpu_out) and prints a short table last.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)   # absolute: parts may cd
GGUF=${GGUF:-$HOME/models/smollm2.gguf}
run() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout "$limit" "$@" 2>&1 | tr '\r' '\n' | grep -v 'it/s\]' | tee "$OUT/$name.log" | tail -24; }
BENCH="python3 -m jaxspec.bench_cli --model $GGUF --quiet"
# issue 4: 32 chained layers a shape, the time split between the attention's kernels
# issue 4: the table's 32K and 1K rows (kernels_rest; h100_32k and kernels_1k)
ROWS_32K="1,1,32768;1,16,32768;1,64,32768;8,1,32768;8,16,32768;8,64,32768;64,1,32768;64,16,32768;64,64,32768"
ROWS_1K="1,1,1024;1,16,1024;1,64,1024;8,1,1024;8,16,1024;8,64,1024;64,1,1024;64,16,1024;64,64,1024"
kernels_profile() { run kernels_profile 90 python3 -m bench.profile_cycle --attention --attn-shapes "1,1,1024;1,1,8192;1,1,32768;64,1,1024;1,60,1024"; }

case "${1:-}" in
  lossweight)
    run lossweight 590 python3 -m bench.train_gpu run --gguf "$GGUF" --out "$OUT" --mode sd \
      --init-head shipped --ttt-steps 4 --lr 2e-4 --warmup 100 --more-data \
      .gpu/train/sharegpt_more.npz --gen-seconds ${GEN_S:-45} --train-seconds ${TRAIN_S:-120} \
      --token-weights ${WEIGHTS:-1.0 0.1} --vs-shipped --deadline 580
    rm -f "$OUT"/tw*/loss.png    # at most 8 files come back
    ;;
  stage4)
    # the shipped head trained on all 42.5K answers: the 14.6K of the twenty-eighth set (carry
    # .gpu/stage4/) and the 27.8K later turns of sharegpt_more2.npz answered here (carry it)
    run stage4 590 python3 -m bench.train_gpu run --gguf "$GGUF" --out "$OUT" --mode sd \
      --init-head shipped --ttt-steps 4 --lr ${LR:-1.5e-4} --warmup 100 \
      --sd-data .gpu/stage4/examples_sd_first.npz .gpu/stage4/examples_sd_more.npz \
      --more-data .gpu/train/sharegpt_more2.npz --gen-seconds 140 --train-seconds ${TRAIN_S:-300} \
      --token-weights 1.0 --target-temps ${TEMP:-1.0} --vs-shipped --deadline 580
    rm -f "$OUT"/examples_sd_first.npz    # the carried answers; the new ones come back
    ;;
  targettemp)
    # issue 7: the shipped head fine-tuned twice from the same start on the same 14.6K answers
    # (carry .gpu/stage4/) for the same time, the token term's target softmax(logits / T) at
    # T = 1 (EAGLE's) and a sharper T (TEMP, default 0.5), then chain and tree tau of both
    run targettemp 590 python3 -m bench.train_gpu run --gguf "$GGUF" --out "$OUT" --mode sd \
      --init-head shipped --ttt-steps 4 --lr ${LR:-1.5e-4} --warmup 100 \
      --sd-data .gpu/stage4/examples_sd_first.npz .gpu/stage4/examples_sd_more.npz \
      --train-seconds ${TRAIN_S:-150} --token-weights 1.0 --target-temps 1.0 ${TEMP:-0.5} \
      --vs-shipped --deadline 580
    rm -f "$OUT"/tt*/loss.png    # at most 8 files come back
    ;;
  newhead)
    # a head (HEAD, a file under the repo: carry it) against the shipped one, batch 1, 4, 16
    # and 64 at the default specs, MT-bench, in alternation
    H=${HEAD:?HEAD=path/to/head.safetensors}
    S="$BENCH --no-peers --max-tokens 128 --repeats 2"
    for d in new ship; do D=""; [ $d = new ] && D="--draft $PWD/$H"
      run nh_b1_$d 150 $S --batch-sizes 1 --num-prompts 80 --spec 4x8x32@16384 $D --json "$OUT/nh_b1_$d.json"
      run nh_b4_16_$d 150 $S --batch-sizes 4,16 --num-prompts 64 --json "$OUT/nh_b4_16_$d.json" $D
    done
    for d in ship new; do D=""; [ $d = new ] && D="--draft $PWD/$H"
      run nh_b64_$d 110 $S --batch-sizes 64 --num-prompts 384 --spec 3x2x4:4@16384 $D --json "$OUT/nh_b64_$d.json"
    done
    ;;
  b1trees)
    T=${TOKENS:-256}
    S="$BENCH --no-peers --max-tokens $T --repeats 2 --batch-sizes 1 --num-prompts 40"
    run b1trees_a 280 $S --spec 4x8x32,5x8x40,6x8x40 --json "$OUT/b1trees_a.json"
    run b1trees_b 280 $S --spec 6x8x40,5x8x40,4x8x32 --json "$OUT/b1trees_b.json"
    ;;
  profile64)
    S="$BENCH --no-peers --max-tokens 128 --spec chain:4 --repeats 1 --batch-sizes 64 --num-prompts 384"
    run prof_mt 250 $S --profile /tmp/prof_mt --json "$OUT/prof_mt.json"
    run prof_sg 280 $S --dataset .gpu/sharegpt_heldout.jsonl --profile /tmp/prof_sg --json "$OUT/prof_sg.json"
    ;;
  ctxvocab_tau)
    for c in ${CTXS:-0 256}; do
      run ctx_tau_c$c 280 python3 -m bench.bench_accept --model "$GGUF" --presets chain tree \
        --questions 80 --max-new 256 --draft-vocab 16384 --context-vocab $c --turns 2 \
        --out "$OUT/ctx_tau_c$c.json"
    done
    ;;
  ctxvocab_b1)
    S="$BENCH --no-peers --max-tokens ${TOKENS:-128} --repeats 2 --batch-sizes 1 --num-prompts 80"
    A=4x8x32:2@16384+0 B=4x8x32:2@16384+${CTX:-256}
    run ctx_b1_a 290 $S --spec $A,$B --json "$OUT/ctx_b1_a.json"
    run ctx_b1_b 290 $S --spec $B,$A --json "$OUT/ctx_b1_b.json"
    ;;
  ctxvocab_b64)
    run ctx_b64 580 $BENCH --no-peers --max-tokens ${TOKENS:-128} --repeats 2 --batch-sizes 64 \
      --num-prompts 384 --spec default@16384+0,default@16384+64,default@16384+256 \
      --json "$OUT/ctx_b64.json"
    ;;
  turns2)
    # issue 7: tau over both MT-bench turns (EAGLE's evaluation: the second turn follows the
    # first turn's answer), chain and tree, 256 new tokens, drafting the shipped head's 16,384
    # tokens and all of them (thirty-first set: 2.49993 / 4.321 and 2.568 / 4.654), 50 s each
    for v in ${VOCABS:-16384 0}; do
      run turns2_v$v 280 python3 -m bench.bench_accept --model "$GGUF" --presets chain tree \
        --questions 80 --max-new 256 --draft-vocab $v --turns 2 --out "$OUT/turns2_v$v.json"
    done
    ;;
  b1calls)
    # issue 7: batch 1 with 2 and 3 cycles a call (a one-slot engine runs the ':K' it is given)
    # against one, both orders; MT-bench, 80 questions, 128 tokens
    S="$BENCH --no-peers --max-tokens ${TOKENS:-128} --repeats 2 --batch-sizes 1 --num-prompts 80"
    run b1calls_a 280 $S --spec 4x8x32:1,4x8x32:2,4x8x32:3 --json "$OUT/b1calls_a.json"
    run b1calls_b 280 $S --spec 4x8x32:3,4x8x32:2,4x8x32:1 --json "$OUT/b1calls_b.json"
    python3 -m bench.pass_parts "$OUT"/b1calls_*.json
    ;;
  b1copies)
    S="$BENCH --no-peers --max-tokens ${TOKENS:-128} --spec ${SPEC:-4x8x32} --repeats 2 --batch-sizes 1 --num-prompts 40"
    i=0; for c in ${COPIES:-1 2 2 1}; do i=$((i + 1))
      run b1copies_${i}_c$c 200 env JAXSPEC_CYCLE_COPIES=$c $S --json "$OUT/b1copies_${i}_c$c.json"
    done
    ;;
  widechain)
    S="$BENCH --no-peers --max-tokens 128 --repeats 2"
    run wide_64a 230 $S --spec 3x2x4:4,chain:4 --batch-sizes 64 --num-prompts 384 --json "$OUT/wide_64a.json"
    run wide_64b 230 $S --spec chain:4,3x2x4:4 --batch-sizes 64 --num-prompts 384 --json "$OUT/wide_64b.json"
    run wide_16 200 $S --spec chain:4,3x2x4:4 --batch-sizes 16 --num-prompts 64 --json "$OUT/wide_16.json"
    run wide_sg 280 $S --spec 3x2x4:4,chain:4 --batch-sizes 64 --num-prompts 384 \
      --dataset .gpu/sharegpt_heldout.jsonl --json "$OUT/wide_sg.json"
    python3 -m bench.pass_parts "$OUT"/wide_*.json
    ;;
  packrows)
    S="$BENCH --no-peers --max-tokens 128 --spec 3x2x4:4 --repeats 2 --batch-sizes 64 --num-prompts 384
       --dataset $PWD/.gpu/sharegpt_heldout.jsonl"
    i=0; for r in fine pow2 pow2 fine; do i=$((i + 1))
      run packrows_${i}_$r 170 $S --pack-rows $r --json "$OUT/packrows_${i}_$r.json"
    done
    python3 -m bench.pass_parts "$OUT"/packrows_*.json
    ;;
  packcap)
    [ -d .base ] || { echo "no .base: run bash bench/ab_prepare.sh 9dbd651 and carry .base"; exit 2; }
    S="$BENCH --no-peers --max-tokens 128 --spec 3x2x4:4 --repeats 1 --batch-sizes 64 --num-prompts 384
       --dataset $PWD/.gpu/sharegpt_heldout.jsonl"
    run packcap_new 280 $S --profile /tmp/prof_new --json "$OUT/packcap_new.json"
    d=$PWD/.base
    (cd "$d" && PYTHONPATH=$d:$PYTHONPATH run packcap_base 280 $S --profile /tmp/prof_base \
      --json "$OUT/packcap_base.json")
    ;;
  ab)
    [ -d .base ] || { echo "no .base: run bash bench/ab_prepare.sh REV and carry .base"; exit 2; }
    S="$BENCH --no-peers --max-tokens ${TOKENS:-128} --spec ${SPEC:-chain:4} --repeats ${REPEATS:-3}
       --batch-sizes ${BATCH:-64} --num-prompts ${PROMPTS:-384} ${DATASET:+--dataset $PWD/$DATASET}"
    echo "base: $(cat .base/REV)"
    i=0; for t in ${ORDER:-new base base new}; do i=$((i + 1)); d=$PWD; [ "$t" = base ] && d=$PWD/.base
      (cd "$d" && PYTHONPATH=$d:$PYTHONPATH run ab_${i}_$t 250 $S --json "$OUT/ab_${i}_$t.json")
    done
    python3 -m bench.pass_parts "$OUT"/ab_*.json
    ;;
  slices)
    S="$BENCH --no-peers --max-tokens 128 --spec chain:4 --repeats 3 --batch-sizes 64 --num-prompts 384"
    i=0; for n in ${SLICES:-384 64 32 16 64 384}; do i=$((i + 1))
      run slices_${i}_$n 200 $S --submit-slice $n --json "$OUT/slices_${i}_$n.json"
    done
    python3 -m bench.pass_parts "$OUT"/slices_*.json
    ;;
  stall64)
    run stall64 280 $BENCH --no-peers --max-tokens 128 --spec chain:4 --repeats 4 --batch-sizes 64 \
      --num-prompts 384 --json "$OUT/stall64.json"
    ;;
  prefill_attn)
    run prefill_attn 400 python3 -m bench.bench_prefill_attention
    ;;
  shortprefix)
    # tree attention's split counts at batch 64 on short live prefixes in a 2,048-row cache,
    # equal and spread lengths (random data, no GGUF needed)
    run shortprefix 400 python3 -m bench.bench_short_prefix --iters 40 --batches 64 --news 1,4 --lens 128,384,1024 --spread 0,1 --variants default,s1,s2
    ;;
  packing_rand)
    # Packed first chunks (the default) against padded ones, batch 64, random SmolLM2-shaped
    # weights: admission device ms a step (each shape timed) and tokens/s, same call.
    run pk_rand 480 python3 -m bench.bench_engine --steps 150 --gen 128 --gen-min 16 --max-model-len 2048 --variants lean --modes chain:4,plain:16 --batches 64 --packing on,off
    ;;
  packing_exact)
    # fp32 greedy spec == plain on the GPU with many newcomers packed together (batch 16)
    run pk_exact 300 $BENCH --dtype float32 --num-prompts 32 --max-tokens 64 --spec chain --batch-sizes 16 --no-peers --json "$OUT/pk_exact.json"
    ;;
  packing_w)
    # held-out ShareGPT (carry it), batch 64: pack rows of 512 against 1024 tokens and padded
    # first chunks; PK_ROUND names the files of a second round
    S="$BENCH --no-peers --max-tokens 128 --spec chain:4 --repeats 3 --batch-sizes 64 --num-prompts 384 --dataset .gpu/sharegpt_heldout.jsonl"
    R=${PK_ROUND:-1}
    run pw512_$R 150 $S --pack-tokens 512 --json "$OUT/pw512_$R.json"
    run pw1024_$R 150 $S --json "$OUT/pw1024_$R.json"
    run pwoff_$R 150 $S --no-packing --json "$OUT/pwoff_$R.json"
    ;;
  packing_knobs)
    # with packed first chunks: admit every 1, 2 (default) or 3 calls, 4 or 8 cycles a call,
    # batch 64, MT-bench (each invocation has its own plain baseline)
    S="$BENCH --no-peers --max-tokens 128 --spec chain:4,chain:8 --repeats 3 --batch-sizes 64 --num-prompts 384"
    for i in 2 1 3; do run knob_i$i 170 $S --admit-interval $i --json "$OUT/knob_i$i.json"; done
    ;;
  packing_mt|packing_sg)
    # batch 64, 384 requests, chain:4 and plain: packed and padded alternated (MT-bench, or
    # held-out ShareGPT: carry .gpu/sharegpt_heldout.jsonl); the first packed run compiles into
    # an empty cache, so its warmup_s is a first warm-up
    S="$BENCH --no-peers --max-tokens 128 --spec chain:4 --repeats 3 --batch-sizes 64 --num-prompts 384"
    [ "$1" = packing_sg ] && S="$S --dataset .gpu/sharegpt_heldout.jsonl"
    run ${1}_on 170 env XDG_CACHE_HOME=/tmp/ccpk $S --json "$OUT/${1}_on.json"
    run ${1}_off 150 $S --no-packing --json "$OUT/${1}_off.json"
    run ${1}_on2 150 env XDG_CACHE_HOME=/tmp/ccpk $S --json "$OUT/${1}_on2.json"
    run ${1}_off2 150 $S --no-packing --json "$OUT/${1}_off2.json"
    ;;
  slotgrowth)
    # Admissions pad their newcomers to the next slot count (1, 4, 16, 64) and the longest
    # prompt's width (16, 64, 256, 512): 3-8x the prompts' tokens for MT-bench groups of 2-12.
    # Slot growth 2 (1, 2, 4, .., 64) against the default, batch 64, MT-bench and ShareGPT.
    S="$BENCH --no-peers --max-tokens 128 --spec chain:4 --repeats 3 --batch-sizes 64 --num-prompts 384"
    SG="--dataset .gpu/sharegpt_heldout.jsonl"
    # each with an empty compile cache of its own, so the rows' warmup_s are first warm-ups
    run sg_mt_4 150 env XDG_CACHE_HOME=/tmp/cc4 $S --json "$OUT/sg_mt_4.json"
    run sg_mt_2 170 env XDG_CACHE_HOME=/tmp/cc2 $S --slot-growth 2 --json "$OUT/sg_mt_2.json"
    run sg_sg_4 150 $S $SG --json "$OUT/sg_sg_4.json"
    run sg_sg_2 170 $S $SG --slot-growth 2 --json "$OUT/sg_sg_2.json"
    run sg_mt_22 170 $S --slot-growth 2 --width-growth 2 --json "$OUT/sg_mt_22.json"
    ;;
  fuseflags|fuseflags2)
    # XLA's experimental fusion passes against the small kernels around the GEMMs (residual adds,
    # SiLU*up, norms: 1.3 ms of the (5,8,32) cycle's 9.25, twelfth set). Each flag set that this
    # jaxlib accepts: kernels per SmolLM2 layer (batch 1 and 64), then the 8B (5,8,32) cycle.
    # fuseflags2: the cycle only, for FUSE_SETS (names below).
    declare -A FS=([default]="" [heroless]="--xla_gpu_experimental_enable_triton_heroless_priority_fusion=true"
      [mof]="--xla_gpu_experimental_enable_triton_heroless_priority_fusion=true --xla_gpu_unsupported_enable_triton_multi_output_fusion=true"
      [alltriton]="--xla_gpu_experimental_all_fusions_with_triton=true"
      [blr]="--xla_gpu_experimental_enable_fusion_block_level_rewriter=true"
      [tiling]="--xla_gpu_experimental_enable_tiling_propagation=true")
    SETS=${FUSE_SETS:-default heroless mof alltriton blr tiling}
    for n in $SETS; do
      if [ -n "${FS[$n]}" ] && ! XLA_FLAGS="${FS[$n]}" timeout 60 python3 -c "import jax; jax.devices()" >/dev/null 2>&1
      then echo "== $n: flags not accepted: ${FS[$n]}"; continue; fi
      if [ "$1" = fuseflags ]; then
        for b in 1 64; do
          run census_${n}_b$b 100 env XLA_FLAGS="${FS[$n]}" python3 -m bench.kernel_census --mode chain --batch $b
        done
      fi
      [ "$1" = fuseflags2 ] || [ "$n" = default ] || [ "$n" = heroless ] && \
        run cycle_$n 150 env XLA_FLAGS="${FS[$n]}" python3 bench/bench_cycle.py --no-ablation --cycles 20 --repeats 3 --shapes "5,8,32" --variants lean
    done
    ;;
  cbmode)
    # CUDA-graph updates: XLA re-records a command buffer's nodes whenever a buffer they use has
    # moved (2.4 ms of host time a 4-cycle call at batch 64, fourteenth set). Newer XLA can give
    # the temporaries stable virtual addresses (--xla_gpu_command_buffer_update_mode, VMM
    # allocator); the mode names changed between versions, so the ones this jaxlib knows are
    # found first. CB_MODES overrides the list.
    SO=$(python3 -c 'import jaxlib, os; print(os.path.dirname(jaxlib.__file__))')
    PL=$(python3 -c 'import jax_plugins.xla_cuda12 as p, os; print(os.path.dirname(p.__file__))' 2>/dev/null)
    grep -a -o -h -E "(ALWAYS_UPDATE|NEVER_UPDATE|CAPTURE_CMD_NEVER_UPDATE|SKIP_TEMP|SKIP_PROFILED|DYNAMIC_ALLOCATE|VMM_PERSISTENT_TEMP)" \
      "$SO"/*.so ${PL:+"$PL"/*.so} 2>/dev/null | sort | uniq -c | tee "$OUT/cbmode_names.log"
    MODES=""
    for m in ${CB_MODES:-SKIP_PROFILED VMM_PERSISTENT_TEMP SKIP_TEMP NEVER_UPDATE}; do
      if XLA_FLAGS=--xla_gpu_command_buffer_update_mode=$m timeout 60 python3 -c "import jax; jax.devices()" >/dev/null 2>&1
      then MODES="$MODES $m"; [ -n "${CB_MODES:-}" ] || break; fi   # the first one known
    done
    echo "accepted modes:$MODES" | tee -a "$OUT/cbmode_names.log"
    ENG="python3 -m bench.bench_engine --steps 150 --gen 128 --gen-min 16 --max-model-len 2048 --variants lean"
    flag() { [ "$1" = default ] || echo "--xla_gpu_command_buffer_update_mode=$1"; }
    for m in default $MODES; do
      run cbmode_b64_$m 160 env XLA_FLAGS=$(flag $m) $ENG --modes chain:4,plain:16 --batches 64
    done
    for m in default $MODES; do
      run cbmode_b1_$m 80 env XLA_FLAGS=$(flag $m) $ENG --modes chain --batches 1
    done
    ;;
  b1k)
    run b1k 400 $BENCH --no-peers --max-tokens 128 --spec chain,chain:4 --repeats 3 --batch-sizes 1 \
      --num-prompts 80 --json "$OUT/b1k.json"
    run b1k_engine 150 python3 -m bench.bench_engine --steps 200 --gen 128 --gen-min 16 \
      --max-model-len 2048 --variants lean --modes chain,chain:4 --batches 1
    # does the 4-cycle engine's single-cycle call update its CUDA graph every time?
    for m in chain chain:4; do
      run b1k_profile_$m 120 python3 -m bench.profile_engine --model $GGUF --mode $m --batch 1 \
        --steps 60 --top 16
    done
    ;;
  admit2)
    S="$BENCH --no-peers --max-tokens 128 --spec chain:4 --repeats 3 --batch-sizes 64 --num-prompts 384 --adaptive"
    run admit2_mt_1 140 $S --json "$OUT/admit2_mt_1.json"
    run admit2_mt_2 120 $S --admit-interval 2 --json "$OUT/admit2_mt_2.json"
    run admit2_sg_1 140 $S --dataset .gpu/sharegpt_heldout.jsonl --json "$OUT/admit2_sg_1.json"
    run admit2_sg_2 120 $S --dataset .gpu/sharegpt_heldout.jsonl --admit-interval 2 --json "$OUT/admit2_sg_2.json"
    ;;
  unroll_sg|unroll_mt)
    # The prefill's layer loop runs as an XLA while loop, one host launch an iteration: 1, 6
    # and 30 layers an iteration (30: no loop left, one CUDA graph an admission; longer warm-up)
    S="$BENCH --no-peers --max-tokens 128 --spec chain:4 --repeats 3 --batch-sizes 64 --num-prompts 384"
    [ "$1" = unroll_sg ] && S="$S --dataset .gpu/sharegpt_heldout.jsonl"
    for u in 1 6 30; do
      run ${1}_$u 190 env JAXSPEC_PREFILL_UNROLL=$u $S --json "$OUT/${1}_$u.json"
    done
    ;;
  copies)
    ENG="python3 -m bench.bench_engine --steps 150 --gen 128 --gen-min 16 --max-model-len 2048 --variants lean"
    for round in a b; do for c in 1 2; do
      run copies_b1_${c}_$round 120 env JAXSPEC_CYCLE_COPIES=$c $ENG --modes chain --batches 1
      run copies_b64_${c}_$round 150 env JAXSPEC_CYCLE_COPIES=$c $ENG --modes chain:4 --batches 64
    done; done
    ;;
  sweep_s4)    # issue 8: the batch sweep at the default specs (SET=sg: held-out ShareGPT)
    DS=""; N=mt; [ "${SET:-mt}" = sg ] && { DS="--dataset $PWD/.gpu/sharegpt_heldout.jsonl"; N=sg; }
    S="$BENCH --no-peers --max-tokens 128 --repeats 2 --spec default $DS"
    run s4_${N}_small 280 $S --batch-sizes 1,4 --num-prompts 80 --json "$OUT/s4_${N}_small.json"
    run s4_${N}_large 280 $S --batch-sizes 16,64 --num-prompts 384 --json "$OUT/s4_${N}_large.json"
    python3 -m bench.merge_sweeps "$OUT/sweep_$N.png" "$OUT/s4_${N}_small.json" "$OUT/s4_${N}_large.json"
    ;;
  sweep13)     # MT-bench; sweep13_sg: the same on held-out ShareGPT
    S="$BENCH --no-peers --max-tokens 128 --spec chain:4 --repeats 3"
    run sweep13_small 300 $S --batch-sizes 1,4 --num-prompts 80 --json "$OUT/sweep13_small.json"
    run sweep13_large 250 $S --batch-sizes 16,64 --num-prompts 384 --json "$OUT/sweep13_large.json"
    ;;
  sweep13_sg)
    S="$BENCH --no-peers --max-tokens 128 --spec chain:4 --repeats 3 --dataset .gpu/sharegpt_heldout.jsonl"
    run sweep13_sg_small 300 $S --batch-sizes 1,4 --num-prompts 80 --json "$OUT/sweep13_sg_small.json"
    run sweep13_sg_large 250 $S --batch-sizes 16,64 --num-prompts 384 --json "$OUT/sweep13_sg_large.json"
    ;;
  kcompare)
    S="$BENCH --no-peers --spec chain:4,chain:8"
    run kcompare_64_128 200 $S --batch-sizes 64 --num-prompts 384 --max-tokens 128 --repeats 3 --json "$OUT/kcompare_64_128.json"
    run kcompare_16_128 160 $S --batch-sizes 16 --num-prompts 192 --max-tokens 128 --repeats 3 --json "$OUT/kcompare_16_128.json"
    run kcompare_64_512 200 $S --batch-sizes 64 --num-prompts 384 --max-tokens 512 --repeats 2 --json "$OUT/kcompare_64_512.json"
    ;;
  hostprof)
    P="python3 -m bench.profile_engine --model $GGUF --mode chain:4 --batch 64 --steps 20 --top 40"
    run hostprof_generate 200 $P
    run hostprof_stream 200 $P --stream
    ;;
  firstpass)
    S="$BENCH --no-peers --batch-sizes 64 --spec chain:4 --num-prompts 384 --repeats 3"
    run firstpass_128 280 $S --max-tokens 128 --json "$OUT/firstpass_128.json"
    run firstpass_512 280 $S --max-tokens 512 --json "$OUT/firstpass_512.json"
    ;;
  peers)
    run peers 560 $BENCH --batch-sizes 1 --spec chain,6x8x40 --dataset bench/mtbench16.jsonl \
      --num-prompts 16 --max-tokens 256 --peers hf-compiled,hf-static,hf-pld --json "$OUT/peers.json"
    ;;
  admit)
    # the admission's weight slices (8 memcpys per layer, 17% of its kernels): XLA's
    # dynamic-slice fusion lets the GEMMs read the stacked weights in place, if it applies
    P="python3 -m bench.profile_engine --mode chain --batch 4 --steps 10 --top 12 --admit 4,256"
    run admit_profile 150 $P
    run admit_profile_dsf 150 env XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=true $P
    ;;
  steady_big)
    S="$BENCH --no-peers --max-tokens 128 --num-prompts 512 --spec chain:4,4x1x5:4 --time-budget 270"
    run steady_big_mt 290 $S --batch-sizes 64,16 --json "$OUT/steady_big_mt.json"
    run steady_big_sg 290 $S --dataset .gpu/sharegpt_heldout.jsonl --batch-sizes 64,16 --json "$OUT/steady_big_sg.json"
    ;;
  widths)
    S="$BENCH --no-peers --max-tokens 128 --num-prompts 512 --batch-sizes 64 --spec chain:4 --time-budget 260"
    run widths_4 280 $S --json "$OUT/widths_4.json"
    run widths_2 280 $S --width-growth 2 --json "$OUT/widths_2.json"
    ;;
  steady)
    S="$BENCH --no-peers --max-tokens 128 --num-prompts 512"
    run steady_mt 290 $S --batch-sizes 1,4,16,64 --spec chain:4 --time-budget 270 --json "$OUT/steady_mt.json"
    run steady_sg 290 $S --dataset .gpu/sharegpt_heldout.jsonl --batch-sizes 1,4,16,64 --spec chain:4 --time-budget 270 --json "$OUT/steady_sg.json"
    ;;
  host)
    ENG="python3 -m bench.bench_engine --steps 150 --gen 128 --gen-min 16 --max-model-len 2048"
    WHILE=--xla_gpu_enable_command_buffer=+WHILE
    run host_default 240 $ENG --modes chain,plain:16 --batches 1,64 --admit-interval 1,2
    run host_while 150 env XLA_FLAGS=$WHILE $ENG --modes chain,plain:16 --batches 64
    run host_profile_b64 150 env XLA_FLAGS=$WHILE python3 -m bench.profile_engine --mode chain --batch 64 --steps 40 --top 40
    ;;
  census)
    run census_b1 150 python3 -m bench.kernel_census --mode chain --batch 1
    run census_b64 150 python3 -m bench.kernel_census --mode chain --batch 64
    ;;
  exact)
    run exact_fp32 420 $BENCH --dtype float32 --num-prompts 16 --max-tokens 256 --spec chain,tree --no-peers --json "$OUT/exact_fp32.json"
    ;;
  e2e)
    run e2e 330 $BENCH --num-prompts 16 --max-tokens 256 --spec chain,tree --time-budget 280 --json "$OUT/e2e.json"
    run sampling_accept 200 python3 -m bench.bench_sampling_accept --model "$GGUF" --questions 16 --max-new 128
    ;;
  sweep_a)
    run sweep_a 560 $BENCH --batch-sizes 1,4 --spec chain,chain:1,tree --num-prompts 80 --max-tokens 128 --no-peers --time-budget 480 --json "$OUT/sweep_a.json" --plot "$OUT/sweep_a.png"
    ;;
  sweep_b)
    run sweep_b 560 $BENCH --batch-sizes 16,64 --spec chain,chain:8,tree --num-prompts 80 --max-tokens 256 --no-peers --time-budget 480 --json "$OUT/sweep_b.json" --plot "$OUT/sweep_b.png"
    ;;
  chains)
    run chains 560 $BENCH --batch-sizes 1 --spec chain,4x2x8,5x2x10,4x4x16 --num-prompts 80 --max-tokens 128 --no-peers --time-budget 480 --json "$OUT/chains.json"
    ;;
  sharegpt)
    run sharegpt 560 $BENCH --dataset sharegpt --batch-sizes 1,16,64 --spec chain --num-prompts 128 --max-tokens 128 --no-peers --time-budget 480 --json "$OUT/sharegpt.json"
    ;;
  engine)
    run engine 560 python3 -m bench.bench_engine --model "$GGUF"
    ;;
  decode)
    run decode 250 python3 -m bench.bench_decode --layouts static --only llama3-8b --program engine --gemm auto,triton
    run decode_small 60 python3 -m bench.bench_decode --layouts static --only smollm2-135m --program engine
    run decode_b64_profile 120 python3 -m bench.profile_cycle --shapes "" --batch 64 --prefix 512
    ;;
  cycle)
    run cycle 390 python3 bench/bench_cycle.py --no-ablation --cycles 20 --repeats 5 --shapes "6,10,60;5,8,32;3,1,4;1,1,2" --variants lean
    run cycle_profile 200 python3 -m bench.profile_cycle --shapes "6,10,60" --variant lean
    ;;
  h200owed)
    run cycle_6x10x60 150 python3 bench/bench_cycle.py --no-ablation --cycles 20 --repeats 3 --shapes "6,10,60" --variants lean
    kernels_profile
    ;;
  mosaic)
    run mosaic_sweep 300 python3 bench/bench_kernels.py --skip check,table,compact --sweep-grid backends
    run mosaic_table 280 python3 bench/bench_kernels.py --no-sweep --skip compact --table-shapes "1,16,8192;1,64,8192;8,16,8192;8,64,8192;64,16,8192;64,64,8192;1,16,32768;1,64,32768;8,16,32768;8,64,32768;64,16,32768;64,64,32768"
    ;;
  cluster_costs)
    # clustered launches of 128 CTAs (fifty-first set)
    run cluster_launch 120 python3 bench/cluster_launch_probe.py
    ;;
  compaction)
    # issue 4's compaction goal on the H200 (last timed on the H100, tenth set): kv_compact
    # alone against XLA's scatter (32 layers, 16 chained calls), then its share of the kernels
    # of the 8B-shaped (6,10,60) cycle and of the decode step
    run compact 240 python3 bench/bench_kernels.py --no-sweep --skip check,table
    run compact_cycle 300 python3 -m bench.profile_cycle --shapes "${SHAPES:-6,10,60}" --variant lean --top 30
    ;;
  timeline)
    run timeline 240 python3 bench/mosaic_timeline.py --calls 3 --shapes "${SHAPES:-1,16,8192;1,1,8192;1,64,8192;8,16,8192}"
    ;;
  mosaic_short)
    run mosaic_short 450 python3 bench/bench_kernels.py --device-time --skip check,table,compact --sweep-grid backends --sweep-shapes "${SHAPES:-8,16,1024;8,64,1024;16,16,1024;16,64,1024;32,64,1024;8,64,2048;16,64,4096;32,64,4096;1,64,4096}"
    ;;
  read_floor)
    # issue 4's batch-1 floor: one kernel that only reads a layer's K and V, beside the tree
    # kernel at N = 1 (SIZES="B,L;..." for others)
    run read_floor 420 python3 bench/read_floor.py --device-time ${SIZES:+--sizes "$SIZES"}
    ;;
  release)
    # issue 4: batch 1's read floor and the tree kernel timed two ways: the harness's bursts
    # holding 8 executions' outputs, and each execution's dropped before the next is dispatched
    run release 200 python3 bench/read_floor.py --device-time --sizes "1,8192;1,32768" --only "tree_n1|tma_16_64_4|tma_16_128_3|stream_64_64_4|xla_sum" --release
    ;;
  launch_floor)
    run launch_floor 200 python3 bench/read_floor.py --device-time --sizes "1,8192;1,32768" --only "tree_n1|tma_16_128_3|stream_64_64_4|xla_sum|touch.*" --loop
    ;;
  cycle_hlo)
    rm -rf /tmp/hlo
    run cycle_hlo 300 env XLA_FLAGS="--xla_dump_to=/tmp/hlo --xla_dump_hlo_as_text" python3 bench/bench_cycle.py --no-ablation --cycles 2 --repeats 1 --shapes "${SHAPES:-6,10,60}" --variants lean
    f=$(ls -S /tmp/hlo/*after_optimizations.txt | head -1)
    echo "largest optimized module: $f"; gzip -9 -c "$f" > "$OUT/cycle_after_optimizations.txt.gz"
    ;;
  topk_rank)
    run draft_ops 240 python3 -m bench.bench_draft_ops --only 'chunk_max_(sort|rank)'
    # (the XLA routes, as in the forty-eighth set's call 2: the Pallas top-k off)
    XLA_TOPK=(--kernel-default topk.PALLAS_TOP_K=False)
    for v in base rank rank512; do
      case $v in base) KD=(--kernel-default topk.RANK_MAX_WIDTH=256);;
        rank) KD=(--kernel-default "topk.SMALL_ABOVE_MIN_K='rank'" --kernel-default topk.RANK_MAX_WIDTH=256);;
        rank512) KD=(--kernel-default "topk.SMALL_ABOVE_MIN_K='rank'" --kernel-default topk.RANK_MAX_WIDTH=512);; esac
      run cycle_$v 200 python3 bench/bench_cycle.py --no-ablation --cycles 20 --repeats 5 --shapes "${SHAPES:-6,10,60}" --variants lean "${XLA_TOPK[@]}" "${KD[@]}"
      cp "$OUT/bench_cycle.json" "$OUT/bench_cycle_$v.json"
    done
    ;;
  topk_pallas)
    run draft_ops 240 python3 -m bench.bench_draft_ops --only 'chunk_max_sort|pallas'
    cp "$OUT/bench_draft_ops.json" "$OUT/bench_draft_ops_128k.json"
    run draft_ops_16k 150 python3 -m bench.bench_draft_ops --only 'two_stage_c1024|pallas' --vocab 16384 --topk 8 --chunks 1024
    for v in xla pallas xla2 pallas2; do
      case $v in xla*) KD=(--kernel-default topk.PALLAS_TOP_K=False --kernel-default topk.RANK_MAX_WIDTH=256);;
        pallas*) KD=();; esac
      run cycle_$v 200 python3 bench/bench_cycle.py --no-ablation --cycles 20 --repeats 5 --shapes "${SHAPES:-6,10,60}" --variants lean "${KD[@]}"
      cp "$OUT/bench_cycle.json" "$OUT/bench_cycle_$v.json"
    done
    ;;
  topk_fused)
    # the top-k kernel in one launch against two passes: the ops, then the 8B cycle (128K
    # rows: the default takes two passes there) alternated. The forty-ninth set ran this with
    # a third form since dropped (rounds of one argmax reduction, commit 7440bcb)
    for v in draft_ops two one two2 one2; do
      case $v in two*) KD=();; one*) KD=(--kernel-default vocab_topk.FUSED_MAX_CHUNKS=64);;
        draft_ops)
          run draft_ops 150 python3 -m bench.bench_draft_ops --only 'pallas'
          cp "$OUT/bench_draft_ops.json" "$OUT/bench_draft_ops_128k.json"
          run draft_ops_16k 120 python3 -m bench.bench_draft_ops --only 'pallas_c4096' --vocab 16384 --topk 8
          continue;;
      esac
      run cycle_$v 200 python3 bench/bench_cycle.py --no-ablation --cycles 20 --repeats 5 --shapes "${SHAPES:-6,10,60}" --variants lean "${KD[@]}"
      cp "$OUT/bench_cycle.json" "$OUT/bench_cycle_$v.json"
    done
    ;;
  topk_e2e)
    # batch 1 end to end (MT-bench, 128 new tokens, the default spec; plain in the same run)
    # with the top-k by the XLA routes and by the kernel, each in its own process (ORDER: the
    # other order in a second call; each run takes a few minutes)
    S=(--no-peers --max-tokens ${TOKENS:-128} --repeats 2 --batch-sizes 1 --num-prompts 80 --spec default)
    for v in ${ORDER:-pallas xla}; do
      case $v in xla*) KD=(--kernel-default topk.PALLAS_TOP_K=False --kernel-default topk.RANK_MAX_WIDTH=256);;
        *) KD=();; esac
      run e2e_$v 280 python3 bench/with_defaults.py "${KD[@]}" jaxspec.bench_cli --model "$GGUF" --quiet "${S[@]}" --json "$OUT/e2e_$v.json"
    done
    ;;
  topk_engine)
    # the SmolLM2 engine at batch 1 (the shipped head drafts over 16,384 tokens), the top-k by
    # the XLA routes, by the kernel's two-pass form and by its default, alternated (carry the
    # GGUF: ../shared/tools/gpu-prepare.sh)
    for v in xla two pallas xla2 two2 pallas2; do
      case $v in xla*) KD=(--kernel-default topk.PALLAS_TOP_K=False --kernel-default topk.RANK_MAX_WIDTH=256);;
        two*) KD=(--kernel-default vocab_topk.FUSED_MAX_CHUNKS=0);;
        pallas*) KD=();; esac
      run engine_$v 140 python3 -m bench.bench_engine --model "$GGUF" --batches 1 --modes 4x8x32:2 --steps 150 --variants lean "${KD[@]}"
      cp "$OUT/bench_engine.json" "$OUT/bench_engine_$v.json"
    done
    ;;
  kernels)
    # the checks, then the 8K rows; with a cold compile cache the checks take 215 s, and the
    # whole table did not fit beside them in one call (fifty-third set)
    ROWS="1,1,8192;1,16,8192;1,64,8192;8,1,8192;8,16,8192;8,64,8192;64,1,8192;64,16,8192;64,64,8192"
    run kernels 500 python3 bench/bench_kernels.py --no-sweep --skip compact --device-time --table-shapes "$ROWS"
    ;;
  kernels_rest)
    # the table's 32K and 1K rows, then the chained-call kernel profile
    ROWS="$ROWS_32K;$ROWS_1K"
    run kernels_rest 400 python3 bench/bench_kernels.py --no-sweep --skip check,compact --device-time --table-shapes "$ROWS"
    kernels_profile
    ;;
  h100_32k)
    # issue 4 on the H100 (the issue's named device): the table's 32K rows, cuDNN and
    # FlashAttention-2 on the N = 64 rows (the tensor-bound ones), and batch 1's bare-read floor
    run kernels_32k 330 python3 bench/bench_kernels.py --no-sweep --skip check,compact --device-time --table-shapes "$ROWS_32K"
    run torch_peers 90 python3 bench/peers/torch_attention.py --shapes "1,64,8192;8,64,8192;64,64,8192;1,64,32768;8,64,32768;64,64,32768"
    run read_floor_h100 120 python3 bench/read_floor.py --device-time --sizes "1,8192;1,32768"
    ;;
  kernels_1k)
    # issue 4: the table's 1K rows alone (the H100's third call)
    run kernels_1k 250 python3 bench/bench_kernels.py --no-sweep --skip check,compact --device-time --table-shapes "$ROWS_1K"
    ;;
  h100_b1)
    # batch 1 over 8K on the H100: the Triton kernel's splits and key blocks, and Mosaic's split
    # count around its rule, by kernel time (the rules were last chosen on the H200)
    run b1_splits 200 python3 bench/bench_kernels.py --device-time --skip check,table,compact --sweep-grid splits --sweep-shapes "1,1,8192;1,16,8192"
    run b1_mosaic 200 python3 bench/bench_kernels.py --device-time --skip check,table,compact --sweep-grid mosaic_splits --sweep-shapes "1,16,8192;1,64,8192"
    ;;
  ncu_decode)
    # Every section (--set full, with the SASS's stall samples) of the Triton kernel at 256 and
    # 1K rows, then XLA's fused sum of the same K and V at 256 rows, the floor beside it.
    # Without preallocation: ncu saves and restores the device's allocated memory every pass.
    export XLA_PYTHON_CLIENT_PREALLOCATE=false
    NCU="$(command -v ncu || echo /usr/local/cuda/bin/ncu) --clock-control none --set full"
    run ncu_decode 300 $NCU --import-source yes --kernel-name regex:tree -c 4 \
      -o "$OUT/decode" -f python3 bench/ncu_attention.py --heads 9,3,64 --backend triton \
      --shapes "64,1,256;64,1,1024"
    run ncu_xla 200 $NCU --kernel-name regex:fusion -c 2 -o "$OUT/xla_sum" -f python3 -c "
import jax, jax.numpy as jnp, numpy as np   # host-made data: no other fusions to catch
kc, vc = (jax.device_put(np.random.default_rng(i).standard_normal((2, 64, 3, 256, 64))
          .astype(jnp.bfloat16)) for i in (1, 2))
f = jax.jit(lambda k, v, i: (k[i].astype(jnp.float32) + v[i].astype(jnp.float32)).sum(2))
for _ in range(2): jax.block_until_ready(f(kc, vc, 1))"
    for r in decode xla_sum; do
      ${NCU%% *} -i "$OUT/$r.ncu-rep" --page details > "$OUT/$r.details.txt" 2>&1
    done
    ${NCU%% *} -i "$OUT/decode.ncu-rep" --page source --print-source sass --csv \
      > "$OUT/decode_sass.csv" 2>&1
    grep -E "Duration|DRAM Throughput|Stall|Achieved Occupancy|Registers Per|Waves" \
      "$OUT/decode.details.txt" "$OUT/xla_sum.details.txt" | head -60
    ;;
  stages_smollm2)
    # SmolLM2's batch 64 over 256-512 rows with all of a program's key blocks in flight:
    # stages 1-4 and 32/128-key blocks at 3 stages were measured (twenty-sixth set)
    S='{"s5": {"num_stages": 5}, "k32s5": {"block_k": 32, "num_stages": 5}, "k32s8": {"block_k": 32, "num_stages": 8}, "k128s2": {"block_k": 128, "num_stages": 2}}'
    run stages_smollm2 280 python3 bench/kernel_ab.py --heads 9,3,64 --base '{"backend":"triton"}' --no-checks --device-time --shapes "64,1,256;64,1,512;64,4,256;64,4,512;1,1,512" --variants "$S"
    ;;
  splits_smollm2)
    # SmolLM2's batch 64 over 256-1K rows split in 2-4 (a combine launch, and a program's
    # chain of key blocks halved or quartered); the default keeps one split under 512 keys
    S='{"sp2": {"num_splits": 2}, "sp4": {"num_splits": 4}, "sp2k32": {"num_splits": 2, "block_k": 32}}'
    run splits_smollm2 280 python3 bench/kernel_ab.py --heads 9,3,64 --base '{"backend":"triton"}' --no-checks --device-time --shapes "64,1,256;64,1,512;64,1,1024;64,4,256;64,4,512;16,1,512" --variants "$S"
    ;;
  kernels_e2e)
    # issue 4's end-to-end figure on the current kernels: the engine's decode step (8B shape and
    # SmolLM2's, batch 1 and 64) or the 8B speculative cycle (E2E=decode or cycle, a call each:
    # the two take about 10 minutes together), Pallas kernels in, then all of them out (the jnp
    # references: JAXSPEC_KERNELS=0), then in again
    case ${E2E:-decode} in
      decode) LIMIT=170 CMD="python3 -m bench.bench_decode --layouts static --only llama3-8b,smollm2-135m --program engine --batches 1,64" ;;
      cycle) LIMIT=190 CMD="python3 bench/bench_cycle.py --no-ablation --cycles 20 --repeats 3 --shapes 3,1,4;6,10,60 --variants lean" ;;
      *) echo "E2E must be decode or cycle, not $E2E"; exit 2 ;;
    esac
    i=0; for k in 1 0 1; do i=$((i + 1))
      run ${E2E:-decode}${i}_k$k $LIMIT env JAXSPEC_KERNELS=$k $CMD
    done
    ;;
  pdl)
    # whether this jax launches a Mosaic GPU kernel that waits on griddepcontrol as a
    # programmatic dependent launch, and what it takes off a layer after the tree kernel
    D=$(python3 -c "import jax, os; print(os.path.dirname(jax.__file__))")
    grep -rn -i "uses_pdl\|griddepcontrol" "$D" --include=*.py | grep -v _test | head -20
    run pdl_probe 300 python3 bench/pdl_probe.py --reps ${REPS:-8} --chunks ${CHUNKS:-512} --loops ${LOOPS:-1} --shapes "${SHAPES:-1,1,8192;1,16,8192}"
    ;;
  decode_warps)
    W='{"w1": {"num_warps": 1}, "w2": {"num_warps": 2}, "w1k128": {"num_warps": 1, "block_k": 128}}'
    run warps_smollm2 280 python3 bench/kernel_ab.py --heads 9,3,64 --base '{}' --no-checks --device-time --shapes "64,1,256;64,1,512;64,4,256;64,4,512;64,1,1024;1,1,512" --variants "$W"
    cp "$OUT/kernel_ab.json" "$OUT/kernel_ab_smollm2.json"
    run warps_8b 280 python3 bench/kernel_ab.py --base '{}' --no-checks --device-time --shapes "1,1,8192;1,1,1024;8,1,8192;1,1,32768;64,1,8192;8,1,1024" --variants "$W"
    ;;
  h200_short|h200_short2)
    # under 8K on the H200: the two places the H100 differed (fifty-eighth set). Call 1: N 16
    # from batch 32 over 1-4K, Triton against Mosaic, then Mosaic's splits at batch 1 over 1K
    # (one key block a split is 8); call 2 (h200_short2): the rest of the splits sweep
    if [ "$1" = h200_short ]; then
      run short_n16 240 python3 bench/bench_kernels.py --device-time --skip check,table,compact --sweep-grid backends --sweep-shapes "32,16,1024;64,16,1024;32,16,2048;64,16,2048;64,16,4096"
      run b1_1k_splits 300 python3 bench/bench_kernels.py --device-time --skip check,table,compact --sweep-grid mosaic_splits --sweep-shapes "1,16,1024;1,32,1024;1,60,1024"
    else
      run b1_1k_splits2 520 python3 bench/bench_kernels.py --device-time --skip check,table,compact --sweep-grid mosaic_splits --sweep-shapes "1,64,1024;2,16,1024;1,16,2048;1,64,2048;2,64,1024"
    fi
    ;;
  eagle3)
    SD=.gpu/run2/examples_sd.npz       # 16,680 self-distilled answers of an earlier call
    if [ -f "$SD" ]; then DATA="--sd-data $SD --train-seconds 420"
    else DATA="--more-data .gpu/train/sharegpt_more.npz --gen-seconds 60 --train-seconds 300"; fi
    run eagle3 580 python3 -m bench.train_gpu run --gguf "$GGUF" --out "$OUT/e3" --arch eagle3 --mode sd $DATA --draft-vocab 16384 --ttt-steps 5 --batch-size 32 --lr 6e-4 --vs-shipped
    ;;
  parallel)
    # (bench/dp_compile_probe.py names the program if a two-device compile crashes again)
    run parallel_dp 560 python3 bench/bench_parallel.py --part dp --dp-impl engine,pmap,device --reps 3
    ;;
  ncu)
    # four metrics (few replay passes) of the Mosaic kernel at B 64, N 64, 8K, two launches
    # (compile, then the second); ncu prints when the process exits, so the limit must cover it
    NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
    run ncu 450 "$NCU" --kernel-name regex:entry_mosaic -c 6 --metrics \
      gpu__time_duration.sum,dram__bytes_read.sum,lts__t_sector_hit_rate.pct,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active \
      python3 bench/ncu_attention.py --shapes "64,64,8192"
    ;;
  parallel_calls)
    run parallel_calls 250 python3 bench/bench_parallel.py --part dp --dp-impl calls --reps 3
    run parallel_waves 300 python3 bench/bench_parallel.py --part dp --dp-impl engine \
      --dp-modes chain,plain --reps 3 --waves 4
    ;;
  parallel_more)
    run parallel_dp8 200 python3 bench/bench_parallel.py --part dp --dp-impl engine \
      --dp-modes chain --cycles-per-call 8 --reps 3
    run parallel_tp 360 python3 bench/bench_parallel.py --part tp --reps 3
    ;;
  wide)
    S="$BENCH --no-peers --batch-sizes 1 --spec chain,6x8x40 --num-prompts 80 --max-tokens 128"
    run wide_shipped 280 $S --json "$OUT/wide_shipped.json"
    run wide_2x 280 $S --draft .gpu/run7/head.safetensors --json "$OUT/wide_2x.json"
    ;;
  si_gen)
    run si_gen 580 python3 -m bench.train_gpu run --gguf $GGUF --out $HOME/si --self-instruct 40000 \
      --instruct-seconds 150 --more-data .gpu/train/sharegpt.npz --gen-seconds 170 --gen-batch 1024 \
      --generate-only
    cp $HOME/si/results.json "$OUT/si_gen.json"; cp $HOME/si/examples_sd_*.npz "$OUT/" 2>/dev/null
    ;;
  si_train)
    run si_train 590 python3 -m bench.train_gpu run --gguf $GGUF --out $HOME/si_head \
      --sd-data $HOME/si/examples_sd_instruct.npz $HOME/si/examples_sd_more.npz --init-head shipped \
      --ttt-steps 4 --train-seconds ${SI_SECONDS:-300} --lr 2e-4 --warmup 100 --vs-shipped
    cp $HOME/si_head/{head.safetensors,results.json,loss.png,train_log.jsonl} "$OUT/"
    ;;
  si_bench)
    S="$BENCH --no-peers --max-tokens 128 --spec chain:4 --repeats 3 --batch-sizes 64 --num-prompts 384"
    run si_b64_new 170 $S --draft $HOME/si_head/head.safetensors --json "$OUT/si_b64_new.json"
    run si_b64_old 150 $S --json "$OUT/si_b64_old.json"
    S1="$BENCH --no-peers --max-tokens 256 --batch-sizes 1 --num-prompts 40 --spec chain,6x8x40"
    run si_b1_new 100 $S1 --draft $HOME/si_head/head.safetensors --json "$OUT/si_b1_new.json"
    run si_b1_old 100 $S1 --json "$OUT/si_b1_old.json"
    ;;
  *) sed -n "2,/^# Every part/p" "$0"; exit 2 ;;
esac
