"""`jaxspec chat`: a conversation with the model in the terminal.

Each turn goes to the model with the whole conversation so far, through its chat template, and
the reply is printed as it is generated. `/reset` starts the conversation afresh (the --system
prompt stays), `/exit`, end of input (Ctrl-D) or Ctrl-C ends it. When stdin is not a terminal,
each of its lines is a user turn and each reply is followed by a blank line:

    printf 'Name a color.\\nAnd another one?\\n' | jaxspec chat
"""
from __future__ import annotations

import argparse
import sys
from typing import Iterator, List, Optional

from jaxspec.cli_options import (add_model_options, add_sampling_options, check_options,
                                 load_llm, model_label, stream_reply, writer)

MAX_TOKENS = 256
PROMPT = ">>> "
COMMANDS = "/reset clears the conversation; /exit, Ctrl-D or Ctrl-C ends it"


def add_arguments(p: argparse.ArgumentParser):
    p.add_argument("--system", default=None, metavar="TEXT",
                   help="a system prompt, the conversation's first message")
    add_model_options(p)
    add_sampling_options(p, MAX_TOKENS)


def check(p: argparse.ArgumentParser, args: argparse.Namespace):
    check_options(p, args)


def run(args: argparse.Namespace) -> int:
    interactive = sys.stdin.isatty()
    if interactive:
        print("loading the model ...", file=sys.stderr, flush=True)
    llm = load_llm(args)
    if interactive:
        print(f"chatting with {model_label(args)}: {COMMANDS}")
    return converse(llm, args.sampling, args.system, sys.stdin, sys.stdout, interactive)


def converse(llm, sp, system: Optional[str], stdin, stdout, interactive: bool) -> int:
    """Turns from stdin until /exit, its end or Ctrl-C; replies to stdout."""
    history = _opening(system)
    try:
        for line in _lines(stdin, interactive):
            text = line.strip()
            if text in ("/exit", "/quit"):
                break
            if text == "/reset":
                history = _opening(system)
                if interactive:
                    print("(conversation cleared)", file=stdout)
                continue
            if not text:
                continue
            history.append({"role": "user", "content": text})
            if not _fit(llm, history, sp.max_tokens):
                history.pop()
                continue
            out = stream_reply(llm, history, sp, writer(stdout))
            stdout.write("\n\n")
            stdout.flush()
            history.append({"role": "assistant", "content": out.text})
    except KeyboardInterrupt:       # a way to leave, not an error
        stdout.write("\n")
    return 0


def _opening(system: Optional[str]) -> List[dict]:
    return [{"role": "system", "content": system}] if system else []


def _lines(stdin, interactive: bool) -> Iterator[str]:
    if not interactive:
        yield from stdin
        return
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    while True:
        try:
            yield input(PROMPT)
        except EOFError:
            print()
            return


def _fit(llm, history: List[dict], max_tokens: int) -> bool:
    """Leaves out the oldest exchanges (never the system prompt) until the conversation and a
    reply of max_tokens fit the context; False (said on stderr) when the last message alone
    does not."""
    first = 1 if history[0]["role"] == "system" else 0
    dropped = 0
    while True:
        n = len(llm.tokenizer.apply_chat_template(history))
        if n + max_tokens <= llm.max_model_len:
            break
        if len(history) - first <= 1:
            print(f"message too long: {n} tokens and a reply of up to {max_tokens} "
                  f"(--max-tokens) exceed the context of {llm.max_model_len} "
                  f"(--max-model-len)", file=sys.stderr)
            return False
        del history[first:first + 2]
        dropped += 1
    if dropped:
        print(f"(the conversation outgrew the context of {llm.max_model_len} tokens: its "
              f"{dropped} oldest exchange(s) were left out)", file=sys.stderr)
    return True
