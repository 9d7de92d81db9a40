"""`jaxspec serve`: its options (`add_arguments`, every value checked as it is parsed) and its
entry (`run`: load the model, warm up, serve until SIGINT or SIGTERM, shut down gracefully)."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

DEFAULT_NAME = "SmolLM2-135M-Instruct"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def _existing(what: str, allow=()):
    def parse(text):
        if text in allow or os.path.exists(text):
            return text
        extra = f" or {', '.join(allow)}" if allow else ""
        raise argparse.ArgumentTypeError(f"{what} {text!r}: no such file or directory{extra}")
    parse.__name__ = what
    return parse


def _spec(text: str) -> str:
    from jaxspec.config import ConfigError
    from jaxspec.spec.config import resolve_spec
    try:
        resolve_spec(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is an integer in [0, 65535], got {text!r}")
    return port


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `jaxspec serve`; an invalid value is an argparse error naming its flag."""
    from jaxspec.bench_cli import DTYPES, _add_config_options, _at_least, _checked
    from jaxspec.engine import EngineConfig
    from jaxspec.parallel.data_parallel import IMPLS
    from jaxspec.spec.config import DraftConfig

    parser.add_argument("--model", type=_existing("model"), default=None,
                        help=f"HF model dir or .gguf (default: {DEFAULT_NAME})")
    parser.add_argument("--draft", type=_existing("draft", ("default",)), default=None,
                        help="speculate with this EAGLE-1 or EAGLE-3 head checkpoint, or "
                             "'default' (the shipped head of the default model) (default: "
                             "plain decoding, unless --spec is given)")
    parser.add_argument("--spec", type=_spec, default=None,
                        help="the speculation tree: a preset (naive, chain, tree) or "
                             "STEPSxTOPKxTOKENS such as 4x8x32; alone, with the shipped head "
                             "(default with --draft: the tuned shape for --max-batch)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (0.0.0.0: every interface) "
                             "(default: 127.0.0.1)")
    parser.add_argument("--port", type=_port, default=8000, help="(default: 8000)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name requests give and /v1/models lists (default: "
                             "the model file's or directory's name)")
    parser.add_argument("--max-batch", type=_checked(EngineConfig, "max_batch", int),
                        default=EngineConfig.max_batch,
                        help=f"requests decoded together, the engine's slots (default: "
                             f"{EngineConfig.max_batch})")
    parser.add_argument("--max-queue", type=_at_least(0), default=256,
                        help="requests accepted beyond the running ones; past that a request "
                             "gets 503 with Retry-After (default: 256)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="weights, activations and KV cache (auto: bfloat16 on GPU, float32 "
                             "on CPU)")
    parser.add_argument("--kv-budget-gb", type=_at_least(0.0, float, above=True), default=None,
                        help="derive max_model_len from a KV memory budget")
    parser.add_argument("--data-parallel", type=_at_least(1), default=1,
                        help="replicas over local devices, --max-batch slots each")
    parser.add_argument("--data-parallel-impl", choices=IMPLS, default=IMPLS[0])
    parser.add_argument("--tensor-parallel", type=_at_least(1), default=1,
                        help="shard the model over this many local devices")
    parser.add_argument("--no-warmup", action="store_true",
                        help="serve at once; programs compile when first needed (the first "
                             "requests wait for them)")
    parser.add_argument("--shutdown-timeout", type=_at_least(0.0, float), default=30.0,
                        help="seconds requests in flight may take to finish after SIGINT or "
                             "SIGTERM before they are aborted (default: 30)")
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    _add_config_options(parser, EngineConfig, "engine (jaxspec.EngineConfig, one option a field)",
                        skip=("max_batch",), more_help={})
    _add_config_options(parser, DraftConfig, "draft head (jaxspec.DraftConfig, one option a "
                                             "field)", more_help={})


def served_name(args: argparse.Namespace) -> str:
    if args.served_model_name:
        return args.served_model_name
    if args.model is None:
        return DEFAULT_NAME
    p = Path(args.model)
    return p.stem if p.is_file() else p.resolve().name


def build_llm(args: argparse.Namespace):
    """The LLM of the options (raises ConfigError for a combination the engine refuses)."""
    from jaxspec import LLM
    from jaxspec.bench_cli import _config
    from jaxspec.engine import EngineConfig
    from jaxspec.spec.config import DraftConfig

    engine = _config(EngineConfig, args, skip=("max_batch",)).replace(max_batch=args.max_batch)
    return LLM(args.model, draft=args.draft, spec=args.spec,
               dtype=None if args.dtype == "auto" else args.dtype,
               kv_budget_gb=args.kv_budget_gb, data_parallel=args.data_parallel,
               data_parallel_impl=args.data_parallel_impl, tensor_parallel=args.tensor_parallel,
               engine=engine, draft_config=_config(DraftConfig, args))


def run(args: argparse.Namespace) -> int:
    """Loads the model, warms up (unless --no-warmup) and serves until SIGINT or SIGTERM; then
    requests in flight finish (up to --shutdown-timeout) and it returns 0."""
    from jaxspec.config import ConfigError
    from jaxspec.loading.common import WeightsError
    from jaxspec.serve.app import build_app
    from jaxspec.serve.server import serve_forever

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(message)s")
    log = logging.getLogger("jaxspec.serve")
    try:
        llm = build_llm(args)
    except (ConfigError, WeightsError, OSError, ValueError) as e:   # what the user gave
        print(f"jaxspec serve: error: {e}", file=sys.stderr)
        return 2
    name = served_name(args)
    log.info("%s: max_batch %d, max_model_len %d, %s", name, llm.max_batch, llm.max_model_len,
             f"speculative {llm.spec}" if llm.spec else "plain decoding")
    if not args.no_warmup:
        log.info("warming up (compiling every program serving runs)")
        llm.warmup()
    app = build_app(llm, served_model_name=name, max_queue=args.max_queue)
    return serve_forever(app, args.host, args.port, args.shutdown_timeout, args.log_level)


def main(argv=None) -> int:
    """`python -m jaxspec.serve.cli`: the same as `jaxspec serve`."""
    from jaxspec.cli import Parser
    ap = Parser(prog="jaxspec serve", description=__doc__)
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
