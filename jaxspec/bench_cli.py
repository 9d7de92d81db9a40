"""`jaxspec-bench`: should you speculate, and how? Plain vs speculative decoding, side by side.

With no arguments: the default model (SmolLM2-135M-Instruct) and its shipped EAGLE head on a
handful of MT-bench questions, greedy, batch 1: a table of tokens/s, accept length (tokens per
cycle, bonus included) and speedup over plain decoding.

Greedy speculative output should be plain greedy output: '=plain' is the share of requests
that are identical, 'prefix' the share of emitted tokens before a request's first token that
differs ('mean/med': common prefix in tokens). In bf16 (the GPU default) the verify forward and
a decode step sum in different orders, so near-tie argmaxes can flip; --dtype float32 checks
exactness.

Modes:
  sweep     (default) batch sizes x configs; --adaptive picks a config per batch size;
            HF transformers peers (static cache compiled or eager, prompt lookup) when torch
            has CUDA, or those named by --peers anywhere;
            --json (and --plot) are rewritten after every run, '"partial": true' until the end
  serve     Poisson arrivals at --request-rate: throughput, TTFT, TPOT, latency percentiles;
            with --url, against an OpenAI-compatible server (jaxspec serve, vLLM, SGLang, ...)
            instead of in-process, at a --request-rate and/or --max-concurrency, ITL added
  accuracy  GSM8K: accuracy of plain and speculative answers, and whether they are identical
  cycle     Llama-3-8B-shaped random weights: cycle cost vs a decode step; acceptance is only
            ever assumed (--assume-accept) or replayed (--replay-accept), never measured

Engine options are EngineConfig's and DraftConfig's fields, one option each under the same
name (--prefill-chunk is EngineConfig.prefill_chunk); unset, a field keeps its default, as in
`LLM()`. docs/benchmarking.md describes the runs and their output.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import json
import math
import os
import re
import sys
import time
import typing
from typing import List, Optional

from tqdm import tqdm

from jaxspec.config import ConfigError

SCHEMA = "jaxspec-bench/1"
DTYPES = ("auto", "bfloat16", "float32")
MODES = ("sweep", "serve", "accuracy", "cycle")
# EngineConfig's max_batch is what --batch-sizes sweeps: one LLM per batch size.
SWEPT = ("max_batch",)
# What a field means in this benchmark besides its EngineConfig / DraftConfig meaning.
MORE_HELP = {
    "max_model_len": "; prompts that do not fit with --max-tokens are left out",
    "seed": "; also the --draft random head's and the serving arrivals' seed",
    "cycles_per_call": "; --spec NAME:K sets it for one config",
    "draft_vocab": "; --spec NAME@V sets it for one config",
    "draft_context_vocab": "; --spec NAME@V+E sets it for one config",
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _with_flags(message: str, names) -> str:
    """A config error's message with each field name it mentions written as its flag."""
    for name in sorted(names, key=len, reverse=True):
        message = re.sub(rf"\b{name}\b", _flag(name), message)
    return message


def _field_help(cls) -> dict:
    """{field: its description} from a config dataclass's docstring, where each field is a
    line 'name  description' followed by indented continuation lines."""
    names = {f.name for f in dataclasses.fields(cls)}
    out, cur = {}, None
    for line in inspect.getdoc(cls).splitlines():
        head, _, rest = line.partition(" ")
        if head in names:
            cur, out[head] = head, rest.strip()
        elif cur and line.startswith(" ") and line.strip():
            out[cur] += " " + line.strip()
        else:
            cur = None
    return out


def _checked(cls, name: str, base, **fixed):
    """An argparse type: `base` of the text, refused (with the config's own reason) when
    cls(name=value, **fixed) is not a valid config."""
    def parse(text):
        try:
            value = base(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {base.__name__} value: {text!r}") from None
        try:
            cls(**{name: value}, **fixed)
        except (ConfigError, ValueError) as e:
            msg = str(e)
            raise argparse.ArgumentTypeError(msg[len(name) + 1:] if msg.startswith(name + " ")
                                             else msg) from None
        return value
    parse.__name__ = base.__name__
    return parse


def _at_least(low, base=int, above: bool = False):
    """An argparse type: a `base` number >= low (> low with above)."""
    def parse(text):
        try:
            value = base(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {base.__name__} value: {text!r}") from None
        if value < low or (above and value == low):
            raise argparse.ArgumentTypeError(f"must be {'>' if above else '>='} {low}, got "
                                             f"{text}")
        return value
    parse.__name__ = base.__name__
    return parse


def _url(text: str) -> str:
    if not re.match(r"https?://[^/\s]+", text):
        raise argparse.ArgumentTypeError(f"{text!r}: a base URL such as http://127.0.0.1:8000")
    return text.rstrip("/")


def _batch_list(text: str) -> List[int]:
    try:
        sizes = sorted({int(b) for b in text.split(",") if b.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma list of integers") from None
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: batch sizes must be >= 1")
    return sizes


def _spec_list(text: str) -> str:
    from jaxspec.benchmark.runner import parse_specs
    try:
        parse_specs(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix(f"--spec {text!r}: ")) from None
    return text


def _peer_list(text: str) -> List[str]:
    from jaxspec.benchmark import peers
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in peers.PEERS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown peer {', '.join(bad) or repr(text)}; choose "
                                         f"from {', '.join(peers.PEERS)}")
    return names


def _dataset(text: str) -> str:
    from jaxspec.benchmark.prompts import DATASETS
    if text not in DATASETS and not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"{text!r}: not one of {', '.join(DATASETS)} and no "
                                         "such file")
    return text


def _accepts(text: str) -> List[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma list of accept lengths >= 1")
    return values


def _add_config_options(ap, cls, title: str, skip=(), more_help=None):
    """One option per field of a config dataclass, named after it (--prefill-chunk for
    prefill_chunk), typed after its annotation, its help from the dataclass's docstring (and
    more_help's line for it: default, this benchmark's MORE_HELP); unset, the field keeps its
    default (None: the tuned default, `jaxspec.defaults`)."""
    more_help = MORE_HELP if more_help is None else more_help
    from jaxspec.engine.config import PACK_ROWS
    choices = {"pack_rows": PACK_ROWS, "layer_layout": ("scan", "unrolled")}
    group = ap.add_argument_group(title)
    docs, types = _field_help(cls), typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        kind = (typing.get_args(types[f.name]) or (types[f.name],))[0]
        doc = docs.get(f.name, "").rstrip(".") + more_help.get(f.name, "")
        if f.default is not None:
            doc += f" (default: {f.default})"
        elif "None:" not in doc:
            doc += " (default: tuned, see jaxspec.defaults)"
        doc = doc.replace("None:", "unset:").replace("%", "%%")
        if kind is bool:
            group.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction,
                               default=None, help=doc)
        elif f.name in choices:
            group.add_argument(_flag(f.name), choices=choices[f.name], default=None, help=doc)
        else:
            group.add_argument(_flag(f.name), type=_checked(cls, f.name, kind), default=None,
                               metavar="N" if kind is int else "PATH", help=doc)


def _config(cls, args, skip=()):
    """The config of the options given (the others at their defaults)."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                  if f.name not in skip and getattr(args, f.name) is not None})


def build_parser() -> argparse.ArgumentParser:
    from jaxspec.engine import EngineConfig
    from jaxspec.parallel.data_parallel import IMPLS
    from jaxspec.sampling import SamplingParams
    from jaxspec.spec.config import DraftConfig

    from jaxspec.cli import Parser
    ap = Parser(prog="jaxspec-bench", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=MODES, default=None,
                    help="default: serve if --request-rate or --url is given, else sweep")
    ap.add_argument("--model", default=None, help="HF model dir or .gguf (default: SmolLM2-135M)")
    ap.add_argument("--draft", default=None,
                    help="EAGLE-1 or EAGLE-3 head checkpoint, or 'random' (an untrained head, "
                         "to time the machinery) (default: the shipped head of the default "
                         "model)")
    ap.add_argument("--dataset", default=None, type=_dataset,
                    help="mt-bench, gsm8k, sharegpt, or a jsonl of prompts or chats "
                         "(default: mt-bench; gsm8k in accuracy mode)")
    ap.add_argument("--num-prompts", type=_at_least(1), default=None,
                    help="prompts from the dataset (default: 8 on GPU, 4 on CPU)")
    ap.add_argument("--max-tokens", type=_checked(SamplingParams, "max_tokens", int),
                    default=None, help="new tokens per request (default: 128 on GPU, 64 on CPU)")
    ap.add_argument("--batch-sizes", dest="batch_list", type=_batch_list, default=[1],
                    metavar="B,B,..",
                    help="comma list of batch sizes to sweep (max_batch of each run's LLM), "
                         "e.g. 1,4,16 (default: 1)")
    ap.add_argument("--spec", type=_spec_list, default=None,
                    help="comma list of presets (naive, chain, tree), STEPSxTOPKxTOKENS, or "
                         "'default' (the shape LLM() picks at each batch size: 4x8x32 at 1, "
                         "chain below 16, 3x2x4 from 16 on a GPU), "
                         "each optionally ':K' for K cycles per device call, e.g. chain:4, "
                         "'@V' for a draft vocabulary of the V most frequent tokens "
                         "(0: all), e.g. chain:4@16384, and '+E' after it for E of those V a "
                         "request's context tokens (default: chain,tree on GPU, chain on CPU)")
    ap.add_argument("--no-spec", action="store_true", help="plain decoding only")
    ap.add_argument("--temperature", type=_checked(SamplingParams, "temperature", float),
                    default=0.0)
    ap.add_argument("--top-p", type=_checked(SamplingParams, "top_p", float), default=1.0)
    ap.add_argument("--dtype", choices=DTYPES, default="auto",
                    help="weights, activations and KV cache (auto: bfloat16 on GPU, float32 on "
                         "CPU); float32 also runs matmuls at full float32 precision (no TF32), "
                         "the setting for checking greedy speculative == plain token for token")
    ap.add_argument("--data-parallel", type=_at_least(1), default=1,
                    help="replicas over local devices, one engine over all of them; batch "
                         "sizes are per replica")
    ap.add_argument("--data-parallel-impl", choices=IMPLS, default=IMPLS[0],
                    help="how the replicas' programs run (the same programs either way)")
    ap.add_argument("--tensor-parallel", type=_at_least(1), default=1,
                    help="shard the model over this many local devices (a model axis)")
    ap.add_argument("--adaptive", action="store_true",
                    help="choose the config (or plain) per batch size from a short run of each "
                         "on the run's first prompts (prefill included)")
    ap.add_argument("--peers", type=_peer_list, default=None,
                    help="comma list of HF transformers peers: hf-compiled (static cache, "
                         "decode step compiled), hf-static (static cache, eager), hf-pld "
                         "(prompt lookup) (default: all three where torch has CUDA; given, "
                         "they run on a CPU too)")
    ap.add_argument("--no-peers", action="store_true", help="skip the HF transformers peers")
    ap.add_argument("--repeats", type=_at_least(1), default=1,
                    help="timed passes per run, back to back; the row is the pass with the "
                         "median tokens/s (every pass's figure is in --json)")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="sweep: after each run's timed passes, run one more pass under "
                         "jax.profiler (CUDA graphs kept on) into DIR/b<B>_<mode> and print the "
                         "device's time per program (cycle, admissions, ...) and how busy it "
                         "was; the figures go in --json as 'profile' (the pass is not timed)")
    ap.add_argument("--time-budget", type=_at_least(0.0, float), default=None,
                    metavar="SECONDS",
                    help="sweep: start no new run (batch size x mode) after this many seconds; "
                         "what finished is kept and the result stays marked partial")
    ap.add_argument("--json", default=None,
                    help="write the results here, rewritten after every finished run with "
                         "\"partial\": true until the end ('-': stdout, at the end only)")
    ap.add_argument("--plot", default=None, help="write a PNG (sweep: speedup vs batch size, "
                    "accept-length histogram, per-category table)")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    serve = ap.add_argument_group("serve mode")
    serve.add_argument("--request-rate", type=_at_least(0.0, float, above=True), default=None,
                       help="requests per second (inf: all at once)")
    serve.add_argument("--num-requests", type=_at_least(1), default=None,
                       help="requests to send (default: --num-prompts; prompts repeat)")
    serve.add_argument("--url", default=None, type=_url,
                       help="benchmark the OpenAI-compatible server at this base URL "
                            "(http://host:port) over HTTP instead of serving in-process; no "
                            "model is loaded here")
    serve.add_argument("--endpoint", choices=("chat", "completions"), default="chat",
                       help="--url: /v1/chat/completions (the server's chat template) or "
                            "/v1/completions (the user message as raw text) (default: chat)")
    serve.add_argument("--max-concurrency", type=_at_least(1), default=None,
                       help="--url: requests in flight at most (default: no limit)")
    serve.add_argument("--served-model", default=None,
                       help="--url: the model name to request (default: the first of the "
                            "server's /v1/models)")
    serve.add_argument("--ignore-eos", action="store_true",
                       help="--url: ask the server to generate --max-tokens every time "
                            "(vLLM's and SGLang's ignore_eos)")
    serve.add_argument("--request-timeout", type=_at_least(0.0, float, above=True),
                       default=600.0, help="--url: seconds one request may take (default: 600)")
    cyc = ap.add_argument_group("cycle mode")
    cyc.add_argument("--shape", choices=("llama3-8b", "tiny"), default="llama3-8b")
    cyc.add_argument("--prefix", type=_at_least(1), default=None,
                     help="committed tokens (default 1024)")
    cyc.add_argument("--assume-accept", type=_accepts, default=None,
                     help="comma list of ASSUMED accept lengths to project speedups with")
    cyc.add_argument("--replay-accept", default=None,
                     help="an earlier --json result whose measured accept lengths are REPLAYED")
    _add_config_options(ap, EngineConfig, "engine (jaxspec.EngineConfig, one option a field)",
                        skip=SWEPT)
    _add_config_options(ap, DraftConfig, "draft head (jaxspec.DraftConfig, one option a field)")
    return ap


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The options, checked (a bad value is an argparse error naming its flag, exit code 2,
    before anything loads), with the defaults that depend on the device filled in."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.profile:        # before the backend starts
        from jaxspec.benchmark.trace import keep_graphs_while_profiling
        keep_graphs_while_profiling()
    return _defaults(args, ap)


def _defaults(args, ap: Optional[argparse.ArgumentParser] = None):
    import jax

    from jaxspec import defaults
    from jaxspec.engine import EngineConfig
    from jaxspec.spec.config import DraftConfig
    ap = ap or build_parser()
    gpu = jax.default_backend() == "gpu"
    args.num_prompts = args.num_prompts or (8 if gpu else 4)
    args.max_tokens = args.max_tokens or (128 if gpu else 64)
    if args.spec is None:
        args.spec = "chain,tree" if gpu else "chain"
    if args.mode is None:
        args.mode = "serve" if args.request_rate is not None or args.url else "sweep"
    url_only = [f for f in ("max_concurrency", "served_model") if getattr(args, f) is not None]
    url_only += ["ignore_eos"] if args.ignore_eos else []
    if args.url and args.mode != "serve":
        ap.error(f"--url benchmarks a server: it runs in serve mode, not {args.mode}")
    if url_only and not args.url:
        ap.error(f"{_flag(url_only[0])} is for a server at --url")
    if args.dataset is None:
        args.dataset = "gsm8k" if args.mode == "accuracy" else "mt-bench"
    if args.prefill_chunk is None:      # as LLM() resolves it, so that the checks below see it
        args.prefill_chunk = min(defaults.prefill_chunk(),
                                 args.max_model_len or defaults.MAX_MODEL_LEN)
    for cls, skip in ((EngineConfig, SWEPT), (DraftConfig, ())):
        try:
            _config(cls, args, skip)
        except ConfigError as e:
            ap.error(_with_flags(str(e), [f.name for f in dataclasses.fields(cls)]))
    if args.max_model_len is not None and args.max_tokens >= args.max_model_len:
        ap.error(f"--max-tokens {args.max_tokens} leaves no room for a prompt in "
                 f"--max-model-len {args.max_model_len}")
    if args.data_parallel > 1 and args.tensor_parallel > 1:
        ap.error("--data-parallel and --tensor-parallel together (a 2-D mesh) are not "
                 "supported: choose one")
    if args.profile and args.mode != "sweep":
        ap.error("--profile traces a sweep's runs (the default mode)")
    if args.plot and args.mode != "sweep":
        ap.error("--plot draws a sweep (the default mode)")
    return args


def _dtype(args) -> str:
    """The dtype the models run in: --dtype, or the loader's default for this backend."""
    import jax.numpy as jnp

    from jaxspec.weights import default_dtype
    return jnp.dtype(default_dtype()).name if args.dtype == "auto" else args.dtype


def _header(args) -> dict:
    import jax
    d = jax.devices()[0]
    return {"schema": SCHEMA, "mode": args.mode, "partial": True, "backend": jax.default_backend(),
            "device": f"{d.platform}:{getattr(d, 'device_kind', '?')}", "jax": jax.__version__,
            "model": args.model, "model_label": args.model or "SmolLM2-135M-Instruct (default)",
            "dataset": args.dataset, "dtype": _dtype(args),
            "matmul_precision": "highest" if args.dtype == "float32" else "default",
            "args": {k: v for k, v in vars(args).items() if k not in ("json", "plot")},
            "notes": []}


def _precision(args):
    """float32 is asked for to check exactness: XLA's default lets fp32 matmuls use TF32 on
    recent GPUs (10-bit mantissa inputs), which would bring back the near-tie flips of bf16."""
    if args.dtype != "float32":
        return contextlib.nullcontext()
    import jax
    return jax.default_matmul_precision("highest")


def _checkpoint(args, result):
    """Rewrites --json (and the --plot) with everything finished so far, so a run cut off by a
    time limit still leaves its finished rows. The file is replaced atomically: a kill during
    the write leaves the previous version, never half a file."""
    if args.json and args.json != "-":
        tmp = f"{args.json}.tmp"
        with open(tmp, "w") as f:
            f.write(json.dumps(result, indent=1, default=str))
        os.replace(tmp, args.json)
    if args.plot and result.get("rows"):
        from jaxspec.benchmark.plots import plot
        plot(result, args.plot)


def _say(args, *a):
    # The table goes to stderr when the JSON goes to stdout; tqdm.write keeps progress bars
    # from cutting through table rows printed while they run.
    f = sys.stderr if args.json == "-" else sys.stdout
    tqdm.write(" ".join(str(x) for x in a), file=f)
    f.flush()


# ----------------------------------------------------------------------------- sweep
def _setup(args, result):
    from jaxspec.benchmark import prompts as P
    from jaxspec.benchmark.runner import PLAIN, Target, parse_specs
    from jaxspec.engine import EngineConfig
    from jaxspec.spec.config import DraftConfig
    # ShareGPT: every first turn is read, _fit keeps the held-out ones up to --num-prompts
    prompts = P.load_prompts(args.dataset, None if _held_out(args) else args.num_prompts)
    if not prompts:
        raise SystemExit(f"--dataset {args.dataset}: no prompts")
    modes = [PLAIN] + ([] if args.no_spec else parse_specs(args.spec))
    target = Target(args.model, args.draft, _config(EngineConfig, args, SWEPT),
                    _config(DraftConfig, args), data_parallel=args.data_parallel,
                    tensor_parallel=args.tensor_parallel,
                    dtype=None if args.dtype == "auto" else args.dtype,
                    data_parallel_impl=args.data_parallel_impl)
    result["draft_label"] = target.draft_label if len(modes) > 1 else None
    if args.draft == "random":
        result["notes"].append("draft: a RANDOM EAGLE head; accept lengths and speedups measure "
                               "the machinery, not a trained head")
    return prompts, modes, target


def _sampling(args):
    from jaxspec import SamplingParams
    return SamplingParams(temperature=args.temperature, top_p=args.top_p,
                          max_tokens=args.max_tokens)


def _held_out(args) -> bool:
    """--dataset sharegpt keeps only prompts the shipped head never saw (_fit picks them)."""
    return args.dataset == "sharegpt"


def _fit(args, result, target, prompts):
    from jaxspec.benchmark.runner import fit_prompts
    from jaxspec.benchmark.prompts import SHAREGPT_TRAIN_PROMPT_TOKENS
    held_out = _held_out(args)
    shortest = SHAREGPT_TRAIN_PROMPT_TOKENS + 1 if held_out else 0
    kept, dropped = fit_prompts(target.tokenizer, prompts, args.max_tokens,
                                target.max_model_len, shortest,
                                args.num_prompts if held_out else None)
    if held_out:
        result["notes"].append(
            f"sharegpt: first turns of {shortest} to {target.max_model_len - args.max_tokens} "
            "prompt tokens, held out from the shipped head's training (its prompts had at most "
            f"{SHAREGPT_TRAIN_PROMPT_TOKENS})")
    elif dropped:
        result["notes"].append(f"{dropped} prompts longer than max_model_len - max_tokens "
                               "were left out")
    if args.dataset == "mt-bench" and len(kept) > 80:
        result["notes"].append(f"mt-bench: {len(kept)} requests go round the 80 questions "
                               f"{len(kept) / 80:.1f} times")
    if not kept:
        raise SystemExit("no prompt fits in --max-model-len with --max-tokens")
    return kept


def run_sweep(args, result):
    from jaxspec.benchmark import adaptive
    from jaxspec.benchmark import runner as R
    prompts, modes, target = _setup(args, result)
    sp = _sampling(args)
    rows, requests, decisions, plain_first = [], {}, {}, None
    result.update(rows=rows, requests=requests, runs_total=len(args.batch_list) * len(modes),
                  runs_done=0)
    t0, stopped = time.monotonic(), False
    _sweep_header(args, result)
    bar = tqdm(total=result["runs_total"], desc="runs", disable=args.quiet)
    for b in args.batch_list:
        plain_outs, base, probes = None, None, {}
        for m in modes:
            if args.time_budget is not None and time.monotonic() - t0 > args.time_budget:
                stopped = True
                break
            bar.set_postfix_str(f"batch {b}, {m.label}: load")
            llm = target.llm(b, m)
            if m is R.PLAIN and plain_first is None:
                prompts = _fit(args, result, target, prompts)
            chats = [p["chat"] for p in prompts]
            bar.set_postfix_str(f"batch {b}, {m.label}: warm-up")
            t_warm = time.perf_counter()
            R.warm(llm, chats, sp)
            warm_s = time.perf_counter() - t_warm      # compilations (or cache loads) included
            if args.adaptive:
                bar.set_postfix_str(f"batch {b}, {m.label}: probe")
                probes[m.label] = adaptive.probe(llm, adaptive.probe_chats(prompts, b), sp,
                                                 m.spec is not None)
            bar.set_postfix_str(f"batch {b}, {m.label}: timed")
            gc_runs = []
            outs, secs, compiled, rates = R.timed_generate(llm, chats, sp, args.repeats, gc_runs)
            profiled = _profile_pass(args, llm, chats, sp, b, m)
            row = R.summarize(m, b, outs, secs, target.draft_label)
            R.as_run(row, llm)
            del llm
            row["compiled_in_timed_pass"] = compiled
            row["warmup_s"] = round(warm_s, 2)
            row["tokens_per_s_runs"] = rates
            row["gc_runs"] = gc_runs
            if profiled is not None:
                row["profile"] = profiled
            if m is R.PLAIN:
                plain_outs, base = outs, row["tokens_per_s"]
                plain_first = plain_first or outs
            row["speedup"] = row["tokens_per_s"] / base if base else None
            reqs = R.per_request(prompts, outs)
            if m is not R.PLAIN and args.temperature == 0.0:
                div = R.divergence([o.token_ids for o in plain_outs], [o.token_ids for o in outs])
                for q, f in zip(reqs, div.pop("first_diff")):
                    q["first_diff"] = f
                row.update(div)
                _exactness_note(result, row)
            _capped_note(result, row)
            rows.append(row)
            requests[f"b{b}/{m.label}"] = reqs
            if args.adaptive:
                decisions[b] = adaptive.choose(probes)
                result["adaptive"] = adaptive.attach_measured(decisions, rows)
            b0 = args.batch_list[0]
            done_b0 = {k.label: requests.get(f"b{b0}/{k.label}") for k in modes}
            result["categories"] = R.categories(
                prompts, {label: reqs for label, reqs in done_b0.items() if reqs is not None})
            result["runs_done"] += 1
            _say(args, _row_line(row))
            _checkpoint(args, result)
            bar.update()
        if stopped:
            break
    bar.close()
    if stopped:
        result["notes"].append(f"--time-budget {args.time_budget:g} s: stopped after "
                               f"{result['runs_done']} of {result['runs_total']} runs; "
                               "HF peers skipped")
    else:
        result["peers"] = _peers(args, result, prompts, plain_first, rows, target)
    result["partial"] = stopped
    _print_sweep_tail(args, result)


def _profile_pass(args, llm, chats, sp, batch: int, mode) -> Optional[dict]:
    """With --profile: one more pass of the run under jax.profiler, summarized per program
    (`benchmark.trace`); the table is printed (quiet or not: it is what was asked for)."""
    if not args.profile:
        return None
    import jax
    from jaxspec.benchmark import trace
    where = os.path.join(args.profile, f"b{batch}_{mode.label.replace(':', '-')}")
    with jax.profiler.trace(where, create_perfetto_trace=True):
        t0 = time.perf_counter()
        llm.generate(chats, sp)
        wall = time.perf_counter() - t0
    summary = trace.program_times(trace.load_trace(where))
    summary["wall_ms"] = round(wall * 1e3, 2)
    print(f"\nprofile, batch {batch}, {mode.label}: pass {wall * 1e3:.1f} ms under the "
          f"profiler, trace in {where}\n{trace.format_programs(summary, kernels=True)}", flush=True)
    return summary


def _exactness_note(result, row):
    """One note when greedy speculative output is not plain greedy output, saying why."""
    if row.get("equals_plain") is None or row["equals_plain"] >= 1.0:
        return
    if result["dtype"] == "bfloat16":
        note = ("bf16: the verify forward (many tokens at once) and a plain decode step (one "
                "token) accumulate in different orders, so near-tie argmaxes can flip and greedy "
                "outputs part from there ('prefix': how far they agree); run with --dtype "
                "float32 for the exactness check")
    else:
        note = (f"{result['dtype']} with full-precision matmuls, yet greedy speculative output "
                "differs from plain: beyond rare exact ties this is a correctness problem (see "
                "'first_diff' per request in --json)")
    if note not in result["notes"]:
        result["notes"].append(note)


def _capped_note(result, row, share: float = 0.1):
    """A note when a speculative run's requests often hit max_tokens: its accept length there
    against the requests that ended by themselves, since looping answers inflate both."""
    if row.get("accept_len_capped") is None or row.get("accept_len_ended") is None \
            or row["capped"] < share:
        return
    result["notes"].append(
        f"batch {row['batch']}, {row['mode']}: {row['capped']:.0%} of requests hit max_tokens "
        f"('capped'); accept length {row['accept_len_capped']:.2f} there against "
        f"{row['accept_len_ended']:.2f} for requests that ended by themselves (EOS or a stop); "
        f"{row['looping']:.0%} of all requests loop (half or more of their 16-token windows "
        "occur again, 'repeat_share' per request in --json), which drafts predict easily")


def _peers(args, result, prompts, plain_outs, rows, target) -> List[dict]:
    from jaxspec.benchmark import peers
    from jaxspec.benchmark.runner import divergence
    if args.no_peers:
        return []
    why = peers.available(force_cpu=args.peers is not None)
    if why:
        result["notes"].append(f"HF transformers peers skipped: {why}")
        return []
    ids = [o.prompt_token_ids for o in plain_outs]
    eos = sorted(set(target.tokenizer.eos_token_ids) | set(target.config.eos_token_ids))
    model = peers.load_hf(args.model, None if args.dtype == "auto" else args.dtype)
    base = next((r["tokens_per_s"] for r in rows if r["batch"] == 1 and r["mode"] == "plain"),
                None)
    out = []
    for name in tqdm(args.peers or list(peers.PEERS), desc="peers", disable=args.quiet):
        r = peers.run_peer(model, name, ids, args.max_tokens, eos)
        toks = r.pop("token_ids")
        if name == "hf-compiled" and not r["compiled"]:
            result["notes"].append("hf-compiled ran eagerly: transformers compiles generate's "
                                   "decode step only on an accelerator, from its versions "
                                   "with auto-compilation")
        r["jaxspec_plain_speedup"] = base / r["tokens_per_s"] if base and r["tokens_per_s"] else None
        r["speedup"] = r["tokens_per_s"] / base if base else None
        if args.temperature == 0.0:
            div = divergence([o.token_ids for o in plain_outs], toks)
            r["first_diff"] = div.pop("first_diff")
            r["equals_jaxspec_plain"] = div.pop("equals_plain")
            r.update(div)
        out.append(r)
    return out


def _fmt(x, f="{:.2f}", none="-"):
    return none if x is None else f.format(x)


def _sweep_header(args, result):
    _say(args, f"\n{result['model_label']} | {result['dataset']} | {result['device']} | "
               f"{result['dtype']} | temperature {args.temperature} | {args.max_tokens} new "
               f"tokens | draft: {result.get('draft_label') or '-'}")
    _say(args, f"{'batch':>5s} {'mode':10s} {'reqs':>4s} {'tokens':>7s} {'tok/s':>9s} "
               f"{'accept':>7s} {'capped':>6s} {'speedup':>8s} {'=plain':>7s} {'prefix':>7s} "
               f"{'mean/med':>9s}")


def _row_line(r) -> str:
    eq = r.get("equals_plain", r.get("equals_jaxspec_plain"))
    mm = "-" if r.get("prefix_mean") is None else \
        f"{r['prefix_mean']:.0f}/{r['prefix_median']:.0f}"
    return (f"{r['batch']:5d} {r['mode']:10s} {r['requests']:4d} {r['tokens']:7d} "
            f"{r['tokens_per_s']:9.1f} {_fmt(r.get('accept_len')):>7s} "
            f"{_fmt(r.get('capped'), '{:.0%}'):>6s} {_fmt(r.get('speedup'), '{:.2f}x'):>8s} "
            f"{_fmt(eq, '{:.0%}'):>7s} "
            f"{_fmt(r.get('prefix_token_frac'), '{:.0%}'):>7s} {mm:>9s}")


def _print_sweep_tail(args, result):
    """What follows the per-run rows printed as they finished: peers, adaptive, categories."""
    for r in result.get("peers", []):
        _say(args, _row_line(r))
    if any(r.get("prefix_token_frac") is not None for r in result["rows"]):
        _say(args, "=plain: requests identical to plain greedy; prefix: emitted tokens before "
                   "each request's first difference; mean/med: that common prefix in tokens")
    if result.get("adaptive"):
        _say(args, "\nadaptive: per batch size, the config with the highest expected tokens/s")
        for a in result["adaptive"]:
            _say(args, f"  batch {a['batch']:3d}: {a['choice']:10s} expected "
                       f"{a['expected_speedup']:.2f}x, measured "
                       f"{_fmt(a['measured_speedup'], '{:.2f}x')}")
    cats = result.get("categories") or []
    if len(cats) > 1:
        modes = [k for k in cats[0] if k not in ("category", "requests")]
        _say(args, f"\nper category (batch {args.batch_list[0]}): tok/s per request "
                   "[accept length, speedup]")
        for c in cats:
            parts = []
            for m in modes:
                v = c[m]
                extra = "" if m == "plain" else \
                    f" [{_fmt(v['accept_len'])}, {_fmt(v['speedup'], '{:.2f}x')}]"
                parts.append(f"{m} {v['tokens_per_s']:.1f}{extra}")
            _say(args, f"  {c['category']:12s} " + "  ".join(parts))
    for n in result["notes"]:
        _say(args, f"note: {n}")


# ----------------------------------------------------------------------------- serve
def run_serve(args, result):
    if args.url:
        return run_serve_url(args, result)
    from jaxspec.benchmark import serving
    from jaxspec.benchmark import runner as R
    prompts, modes, target = _setup(args, result)
    sp = _sampling(args)
    rate = math.inf if args.request_rate is None else args.request_rate
    b = max(args.batch_list)
    n = args.num_requests or len(prompts)
    rows = []
    for m in tqdm(modes, desc="serve", disable=args.quiet):
        llm = target.llm(b, m)
        if m is R.PLAIN:
            prompts = _fit(args, result, target, prompts)
        chats = [prompts[i % len(prompts)]["chat"] for i in range(n)]
        R.warm(llm, chats[:len(prompts)], sp)
        res = serving.serve(llm, chats, sp, rate, seed=target.engine.seed,
                            tag=f"bench-{m.label}")
        rows.append({"mode": m.label, "batch": b, "spec": m.describe(b), **res})
        del llm
        result["serving"] = rows
        _checkpoint(args, result)
    ms = 1e3
    _say(args, f"\nserving: {n} requests at {rate} req/s, batch {b} | {result['model_label']} | "
               f"{result['dataset']} | {result['device']} | timestamps: {rows[0]['how']}")
    _say(args, f"{'mode':10s} {'req/s':>7s} {'tok/s':>8s} {'TTFT p50/p90/p99 ms':>22s} "
               f"{'TPOT p50/p90/p99 ms':>22s} {'E2E p50 ms':>10s}")
    for r in rows:
        def trio(k):
            return "/".join(_fmt(r[f"p{q}_{k}"] and r[f"p{q}_{k}"] * ms, "{:.0f}")
                            for q in (50, 90, 99))
        _say(args, f"{r['mode']:10s} {r['request_throughput']:7.2f} "
                   f"{r['output_throughput']:8.1f} {trio('ttft_s'):>22s} {trio('tpot_s'):>22s} "
                   f"{_fmt(r['p50_e2e_s'] and r['p50_e2e_s'] * ms, '{:.0f}'):>10s}")
    for note in result["notes"]:
        _say(args, f"note: {note}")


def run_serve_url(args, result):
    """Serve mode against a server at --url: one run of the requests, nothing loaded here."""
    from jaxspec.benchmark import prompts as P
    from jaxspec.benchmark import url_serving
    prompts = P.load_prompts(args.dataset, args.num_prompts)
    if not prompts:
        raise SystemExit(f"--dataset {args.dataset}: no prompts")
    n = args.num_requests or len(prompts)
    chats = [prompts[i % len(prompts)]["chat"] for i in range(n)]
    rate = math.inf if args.request_rate is None else args.request_rate
    model = args.served_model or url_serving.served_model(args.url)
    # the server's model, dtype and device are its own: none of this machine's
    result.update(model_label=f"{model} at {args.url}", model=model, dtype=None,
                  matmul_precision=None, url=args.url)
    bar = tqdm(total=n, desc="requests", disable=args.quiet)
    row = url_serving.run(args.url, chats, endpoint=args.endpoint, model=model,
                          max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, request_rate=rate,
                          max_concurrency=args.max_concurrency, seed=args.seed or 0,
                          ignore_eos=args.ignore_eos, timeout=args.request_timeout,
                          progress=bar.update)
    bar.close()
    result["serving"] = [{"mode": "url", **row}]
    _checkpoint(args, result)
    limit = f"concurrency {args.max_concurrency}" if args.max_concurrency else "no limit"
    _say(args, f"\nserving: {n} requests at {rate} req/s, {limit} | {result['model_label']} | "
               f"{args.endpoint} | {result['dataset']} | {args.max_tokens} new tokens")
    _say(args, f"{'done':>6s} {'req/s':>7s} {'tok/s':>8s} {'TTFT p50/p90/p99 ms':>22s} "
               f"{'ITL p50/p90/p99 ms':>22s} {'TPOT p50 ms':>11s} {'E2E p50/p90/p99 ms':>22s}")

    def trio(k):
        return "/".join(_fmt(row.get(f"p{q}_{k}") and row[f"p{q}_{k}"] * 1e3, "{:.0f}")
                        for q in (50, 90, 99))
    _say(args, f"{row['completed']:3d}/{n:<2d} {row.get('request_throughput', 0):7.2f} "
               f"{row.get('output_throughput', 0):8.1f} {trio('ttft_s'):>22s} "
               f"{trio('itl_s'):>22s} "
               f"{_fmt(row.get('p50_tpot_s') and row['p50_tpot_s'] * 1e3, '{:.1f}'):>11s} "
               f"{trio('e2e_s'):>22s}")
    for e in row["errors"]:
        _say(args, f"error: {e}")


# ----------------------------------------------------------------------------- accuracy
def run_accuracy(args, result):
    from jaxspec.benchmark import prompts as P
    from jaxspec.benchmark import runner as R
    if args.temperature != 0.0:
        result["notes"].append("accuracy mode decodes greedily: --temperature ignored")
        args.temperature = 0.0
    prompts, modes, target = _setup(args, result)
    if not any(p.get("answer") for p in prompts):
        raise SystemExit(f"--dataset {args.dataset}: accuracy mode needs reference answers "
                         "(GSM8K-style rows with 'answer')")
    sp = _sampling(args)
    b = max(args.batch_list)
    rows, plain_outs = [], None
    for m in tqdm(modes, desc="accuracy", disable=args.quiet):
        llm = target.llm(b, m)
        if m is R.PLAIN:
            prompts = _fit(args, result, target, prompts)
        chats = [p["chat"] for p in prompts]
        R.warm(llm, chats, sp)
        outs, secs, compiled, _ = R.timed_generate(llm, chats, sp)
        got = [P.last_number(o.text) for o in outs]
        correct = sum(g is not None and g == p["answer"] for g, p in zip(got, prompts))
        row = {**R.summarize(m, b, outs, secs, target.draft_label),
               "compiled_in_timed_pass": compiled,
               "accuracy": correct / len(prompts), "correct": correct,
               "answers": got}
        R.as_run(row, llm)
        if m is R.PLAIN:
            plain_outs = outs
        else:
            div = R.divergence([o.token_ids for o in plain_outs], [o.token_ids for o in outs])
            row["identical_answers"] = div.pop("equals_plain")
            row.update(div)
        rows.append(row)
        del llm
        result["accuracy"] = rows
        _checkpoint(args, result)
    _say(args, f"\nGSM8K accuracy, greedy, {len(prompts)} questions, {args.max_tokens} new "
               f"tokens | {result['model_label']} | {result['device']}")
    for r in rows:
        same = r.get("identical_answers")
        _say(args, f"  {r['mode']:10s} accuracy {r['accuracy']:.1%} ({r['correct']}/"
                   f"{r['requests']})  tok/s {r['tokens_per_s']:.1f}  accept "
                   f"{_fmt(r.get('accept_len'))}" +
             ("" if same is None else f"  outputs identical to plain: {same:.0%}"))
    for note in result["notes"]:
        _say(args, f"note: {note}")


# ----------------------------------------------------------------------------- cycle
def run_cycle(args, result):
    from jaxspec.benchmark import large
    from jaxspec.benchmark.runner import parse_specs
    modes = parse_specs(args.spec)
    bar = tqdm(total=len(modes), desc="cycle", disable=args.quiet)
    res = large.run(modes, args.shape, args.prefix, args.assume_accept, args.replay_accept,
                    progress=lambda _: bar.update())
    bar.close()
    result["cycle"] = res
    _say(args, f"\ncycle cost at {res['shape']}, {res['dtype']}, batch 1, prefix "
               f"{res['prefix']} | {result['device']}")
    _say(args, f"plain decode step {res['decode_ms']:.3f} ms; acceptance {res['acceptance']}")
    for r in res["rows"]:
        proj = "; ".join(f"{p['projected_speedup']:.2f}x at accept {p['accept_len']:.2f} "
                         f"({p['source'].upper()})" for p in r["projections"])
        _say(args, f"  {r['mode']:10s} cycle {r['cycle_ms']:.3f} ms = "
                   f"{r['cycle_over_decode']:.2f} steps; breaks even at accept length "
                   f"{r['break_even_accept_len']:.2f}" + (f"; projected {proj}" if proj else ""))


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.plot:
        from jaxspec.benchmark.plots import require_matplotlib
        require_matplotlib()
    result = _header(args)
    run = {"sweep": run_sweep, "serve": run_serve, "accuracy": run_accuracy,
           "cycle": run_cycle}[args.mode]
    try:
        with _precision(args):
            run(args, result)
    except BaseException as e:
        # What finished is already on disk; say why the rest is missing, then fail as before.
        result["partial"] = True
        result["error"] = f"{type(e).__name__}: {e}"
        with contextlib.suppress(Exception):
            _checkpoint(args, result)
        raise
    if args.mode != "sweep":
        result["partial"] = False
    _checkpoint(args, result)
    if args.plot:
        _say(args, f"plot: {args.plot}")
    if args.json == "-":
        print(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
