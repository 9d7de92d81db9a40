"""`jaxspec demo`: what speculative decoding buys, shown on the default model
(SmolLM2-135M-Instruct) and its shipped EAGLE draft head.

Each prompt is answered twice, greedily and one request at a time, the text printed as it comes:
by plain decoding (one forward of the model per token) and by speculative decoding (the small
draft head proposes a few tokens, one forward of the model checks them all and keeps the ones it
would have produced itself, so the text is the same). Then the speed of each, the speedup and the
mean accept length, with a legend. Compilation happens before the timed replies."""
from __future__ import annotations

import argparse
import sys
import time
from typing import List, Optional

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = (
    "Write a short poem about the sea.",
    "Give three tips for learning to code.",
    "Describe a sunrise over the mountains.",
    "What makes a good friend?",
)
MAX_MODEL_LEN = 512
MAX_TOKENS = 128
LEGEND = (
    ("tokens", "tokens generated over all prompts (a reply ends at the model's end of turn or "
               "at --max-tokens)"),
    ("seconds", "wall time of those replies, prompt processing included (compilation was "
                "done before)"),
    ("tokens/s", "tokens / seconds"),
    ("accept", "mean accept length: tokens per forward of the model; speculative: the drafted "
               "tokens the model accepted plus the one it adds itself; plain: always 1"),
    ("speedup", "speculative tokens/s over plain tokens/s"),
)


def add_arguments(p: argparse.ArgumentParser):
    p.add_argument("--prompts", type=int, default=2, metavar="N",
                   help=f"how many of the demo's {len(PROMPTS)} prompts to answer (default 2)")
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS, metavar="N",
                   help=f"tokens per reply at most (default {MAX_TOKENS})")


def check(p: argparse.ArgumentParser, args: argparse.Namespace):
    from jaxspec.weights import default_model_path
    if not 1 <= args.prompts <= len(PROMPTS):
        p.error(f"argument --prompts: expected 1 to {len(PROMPTS)}, got {args.prompts}")
    if not 1 <= args.max_tokens <= MAX_MODEL_LEN - 64:
        p.error(f"argument --max-tokens: expected 1 to {MAX_MODEL_LEN - 64}, got "
                f"{args.max_tokens}")
    try:
        default_model_path()
    except FileNotFoundError as e:
        p.error(str(e))


def say(text: str = ""):
    print(text, flush=True)


def run(args: argparse.Namespace) -> int:
    from jaxspec import SamplingParams
    prompts = list(PROMPTS[:args.prompts])
    say(f"jaxspec demo: {MODEL} answers {len(prompts)} prompt(s) twice, greedily: by plain "
        "decoding,")
    say("and by speculative decoding with its EAGLE draft head (the same text, fewer forwards "
        "of the model).")
    # The speculative LLM is built after the first plain reply: text shows up sooner.
    llms = {"plain": load("plain", prompts)}
    sp = SamplingParams(max_tokens=args.max_tokens)
    results = {"plain": [], "speculative": []}
    for i, q in enumerate(prompts):
        say()
        say(f"[{i + 1}/{len(prompts)}] user: {q}")
        for mode in ("plain", "speculative"):
            if mode not in llms:
                llms[mode] = load(mode, prompts)
            results[mode].append(reply(mode, llms[mode], q, sp))
        say(f"  {_agreement(*(results[m][-1].token_ids for m in results))}")
    say()
    for line in summary(results):
        say(line)
    say()
    say("next: `jaxspec chat --draft default` to talk to the model, `jaxspec-bench` to measure "
        "more prompts and batch sizes (docs/benchmarking.md).")
    return 0


def load(mode: str, prompts: List[str]):
    """The LLM of a mode, 'plain' or 'speculative' (with the shipped head), its programs
    compiled for these prompts before anything is timed; says what takes time."""
    from jaxspec import LLM, SamplingParams
    if not weights_cached():
        from jaxspec.loading import cache
        say(f"first run: converting the weights to float32, cached in {cache.cache_dir()} "
            "(about 4 bytes a parameter, written once) ...")
    what = "the model" if mode == "plain" else "the model with its draft head"
    say(f"loading {what} and compiling its programs (XLA, once a process) ...")
    t0 = time.perf_counter()
    llm = LLM(draft="default" if mode == "speculative" else None, max_batch=1,
              max_model_len=MAX_MODEL_LEN)
    llm.chat([[_user(q)] for q in prompts], SamplingParams(max_tokens=2))
    say(f"  done in {time.perf_counter() - t0:.0f} s")
    return llm


def weights_cached() -> bool:
    """Whether the default model's converted weights are in the params cache already."""
    from jaxspec.loading import cache, gguf_file
    from jaxspec.weights import default_model_path, resolve_dtype
    key = cache.cache_key(gguf_file.fingerprint(default_model_path()), resolve_dtype(None))
    return cache.entry_path(key).is_file()


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def reply(mode: str, llm, prompt: str, sp):
    """One reply, streamed under its label, then its figures; its RequestOutput."""
    from jaxspec.cli_options import stream_reply, writer
    say(f"  {mode}:")
    sys.stdout.write("    ")
    out = stream_reply(llm, [_user(prompt)], sp, writer(sys.stdout, indent="    "))
    n, secs = len(out.token_ids), out.metrics["latency_s"]
    figures = f"{n} tokens in {secs:.1f} s = {n / secs:.1f} tokens/s"
    if accept_length([out]) is not None:
        figures += f", {accept_length([out]):.2f} tokens per forward of the model"
    say(f"\n    [{figures}]")
    return out


def _agreement(plain: List[int], spec: List[int]) -> str:
    if plain == spec:
        return "the same tokens both ways, as greedy speculative decoding promises"
    k = next((i for i, (x, y) in enumerate(zip(plain, spec)) if x != y), min(len(plain),
                                                                               len(spec)))
    return (f"the replies part at token {k} (a one-token forward and the verify forward may "
            "round a near-tie differently)")


def accept_length(outs) -> Optional[float]:
    """Tokens per cycle over all cycles of these requests, the bonus token included (None
    without a cycle: a reply of the prefill's one token)."""
    cycles = [a + 1 for o in outs for a in o.accept_lens or ()]
    return sum(cycles) / len(cycles) if cycles else None


def summary(results) -> List[str]:
    """The table of both modes and its legend, as lines."""
    base = None
    lines = [f"{'':13}{'tokens':>8}{'seconds':>10}{'tokens/s':>10}{'accept':>8}{'speedup':>9}"]
    for mode, outs in results.items():
        n = sum(len(o.token_ids) for o in outs)
        secs = sum(o.metrics["latency_s"] for o in outs)
        rate = n / secs
        base = base or rate
        acc = accept_length(outs) if mode != "plain" else 1.0
        acc_text = "-" if acc is None else f"{acc:.2f}"
        lines.append(f"{mode:13}{n:>8}{secs:>10.1f}{rate:>10.1f}{acc_text:>8}"
                     f"{rate / base:>8.2f}x")
    lines.append("")
    lines += [f"  {name:9} {text}" for name, text in LEGEND]
    return lines
