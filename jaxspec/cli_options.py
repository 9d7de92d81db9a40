"""The options `jaxspec generate` and `jaxspec chat` share: the model, the draft head, the
speculation tree and SamplingParams' fields. Every value is checked while the command line is
parsed (an argparse error naming its flag), so a mistake is reported before any model loads."""
from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

from jaxspec.sampling import SamplingParams

# SamplingParams fields offered as flags: (field, type, help). Unset, a field keeps
# SamplingParams' default, except max_tokens (each command's own default).
SAMPLING_FLAGS = (
    ("temperature", float, "0 is greedy (default 0)"),
    ("top_p", float, "keep the smallest set of tokens whose probability reaches this (default 1: "
                     "off)"),
    ("top_k", int, "keep the k most likely tokens (default 0: off)"),
    ("min_p", float, "drop tokens less likely than this times the most likely one "
                     "(default 0: off)"),
    ("seed", int, "seed of this request's sampling (default: the engine's)"),
    ("repetition_penalty", float, "> 1 discourages tokens already in the prompt or the output "
                                  "(default 1: off)"),
    ("frequency_penalty", float, "in [-2, 2]: subtracted from a token's logit once per "
                                 "occurrence in the output (default 0)"),
    ("presence_penalty", float, "in [-2, 2]: subtracted from the logit of each token already in "
                                "the output (default 0)"),
)
DEFAULT_MAX_MODEL_LEN = 2048


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def _sampling_type(field: str, base):
    """An argparse type: `base` of the text, refused with SamplingParams' own reason when
    SamplingParams(field=value) is not valid."""
    def parse(text):
        try:
            value = base(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {base.__name__}, got {text!r}") from None
        try:
            SamplingParams(**{field: value})
        except (TypeError, ValueError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return value
    parse.__name__ = base.__name__
    return parse


def _stop_string(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("a stop string must not be empty")
    return text


def add_sampling_options(p: argparse.ArgumentParser, max_tokens: int):
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=_sampling_type("max_tokens", int), default=max_tokens,
                   metavar="N", help=f"tokens to generate at most (default {max_tokens})")
    for field, base, text in SAMPLING_FLAGS:
        g.add_argument(_flag(field), type=_sampling_type(field, base), default=None, help=text,
                       metavar="N" if base is int else "X")
    g.add_argument("--stop", action="append", type=_stop_string, default=None,
                   metavar="TEXT", help="end the reply before this text (repeatable)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past the model's end of turn, up to --max-tokens")


def add_model_options(p: argparse.ArgumentParser):
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None, metavar="PATH",
                   help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    g.add_argument("--draft", default=None, metavar="HEAD",
                   help="speculate with this EAGLE-1 or EAGLE-3 head checkpoint (file or "
                        "directory), or 'default' (the shipped head of the default model) "
                        "(default: plain decoding, unless --spec is given)")
    g.add_argument("--spec", default=None, metavar="TREE",
                   help="the speculation tree: a preset (naive, chain, tree) or "
                        "STEPSxTOPKxTOKENS such as 4x8x32; alone, with the shipped head "
                        "(default with --draft: the tuned shape for one request)")
    g.add_argument("--max-model-len", type=_max_model_len, default=DEFAULT_MAX_MODEL_LEN,
                   metavar="N",
                   help=f"tokens of context, prompt and reply (default {DEFAULT_MAX_MODEL_LEN})")


def _max_model_len(text: str) -> int:
    from jaxspec.config import ConfigError
    from jaxspec.engine import EngineConfig
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected int, got {text!r}") from None
    try:
        EngineConfig(max_model_len=value)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def check_options(p: argparse.ArgumentParser, args: argparse.Namespace):
    """What parsing alone cannot see: the files named exist, the tree is one, the reply fits
    the context. Sets args.sampling."""
    from jaxspec.config import ConfigError
    from jaxspec.spec.config import resolve_spec
    from jaxspec.weights import default_model_path

    if args.model is None:
        try:
            default_model_path()
        except FileNotFoundError as e:
            p.error(f"argument --model: not given, and {e}")
    elif not Path(args.model).expanduser().exists():
        p.error(f"argument --model: no such file or directory: {args.model}")
    if args.draft not in (None, "default") and not Path(args.draft).expanduser().exists():
        p.error(f"argument --draft: expected 'default' or an EAGLE head checkpoint (a file or "
                f"directory), got {args.draft!r}: no such file or directory")
    if args.spec is not None:
        try:
            resolve_spec(args.spec)
        except ConfigError as e:
            p.error(f"argument --spec: {e}")
    if args.max_tokens >= args.max_model_len:
        p.error(f"argument --max-tokens: {args.max_tokens} leaves no room for a prompt in "
                f"--max-model-len {args.max_model_len}")
    chosen = {f: getattr(args, f) for f, _, _ in SAMPLING_FLAGS if getattr(args, f) is not None}
    args.sampling = SamplingParams(max_tokens=args.max_tokens, stop=tuple(args.stop or ()),
                                   ignore_eos=args.ignore_eos, **chosen)


def model_label(args) -> str:
    """The model and the decoding the options ask for, in words."""
    name = Path(args.model).name if args.model else "SmolLM2-135M-Instruct"
    if args.draft is None and args.spec is None:
        return f"{name} (plain decoding)"
    head = "its shipped head" if args.draft in (None, "default") else args.draft
    return f"{name} (speculative decoding with {head})"


def load_llm(args):
    """The LLM the options describe, for one conversation at a time."""
    from jaxspec import LLM
    return LLM(args.model, draft=args.draft, spec=args.spec, max_batch=1,
               max_model_len=args.max_model_len)




def writer(out, indent: str = ""):
    """write(text) for stream_reply: text to the stream `out` at once (flushed, so a terminal
    shows each piece as it comes), every line after the first indented by `indent`."""
    def write(text: str):
        out.write(text.replace("\n", "\n" + indent) if indent else text)
        out.flush()
    return write


def stream_reply(llm, prompt, sp: SamplingParams, write):
    """Generates one reply, passing its text to write() as it comes (LLM.stream); returns its
    RequestOutput, with the figures LLM.generate gives (accept lengths, tokens/s). A caller
    interrupted mid-reply (Ctrl-C) leaves nothing running: the stream aborts the request."""
    deltas = llm.stream(prompt, sp)
    with contextlib.closing(deltas):
        for d in deltas:
            if d.text:
                write(d.text)
    return d.output
