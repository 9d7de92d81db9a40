"""Prompt sets for benchmarks and demos: MT-bench (shipped), GSM8K, any jsonl of prompts or chats."""
from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import List, Optional


def mt_bench(limit: Optional[int] = None) -> List[dict]:
    """MT-bench first turns as chats, each {'id', 'category', 'chat', 'turns'} ('turns': every
    user turn's text, for multi-turn runs)."""
    text = resources.files("jaxspec.data").joinpath("mt_bench.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    out = [{"id": r["question_id"], "category": r["category"],
            "chat": [{"role": "user", "content": r["turns"][0]}], "turns": list(r["turns"])}
           for r in rows]
    return out[:limit] if limit else out


def load_jsonl_prompts(path: str, limit: Optional[int] = None) -> List[dict]:
    """A jsonl whose rows hold 'prompt' (text), 'messages'/'chat' (a chat), 'turns' (MT-bench) or
    'question' (GSM8K). Unknown rows are an error naming the line."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    out = []
    for i, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not valid JSON ({e.msg})") from None
        if "messages" in r or "chat" in r:
            chat = r.get("messages") or r.get("chat")
        elif "turns" in r:
            chat = [{"role": "user", "content": r["turns"][0]}]
        elif "question" in r or "prompt" in r:
            chat = [{"role": "user", "content": r.get("question") or r.get("prompt")}]
        else:
            raise ValueError(f"{path}:{i}: a row needs 'prompt', 'messages', 'chat', 'turns' or "
                             f"'question'; got keys {sorted(r)}")
        out.append({"id": r.get("question_id", i), "category": r.get("category", ""),
                    "chat": chat, "answer": r.get("answer")})
        if limit and len(out) >= limit:
            break
    return out
