"""Engine output as OpenAI's bodies: completions and chat completions, whole or as stream
chunks (server-sent events), with logprobs and usage."""
from __future__ import annotations

import functools
import json
import math
from typing import Dict, List, Optional

from jaxspec.engine import StreamDelta

DONE = "data: [DONE]\n\n"
# JSON has no infinity: a token the filters (top-k, top-p, min-p) removed, of logprob -inf,
# shows this instead (vLLM's choice).
MIN_LOGPROB = -9999.0


def sse(obj: dict) -> str:
    """One server-sent event carrying obj as JSON."""
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":"),
                                 allow_nan=False) + "\n\n"


def _lp(x: float) -> float:
    return x if math.isfinite(x) else MIN_LOGPROB


class TokenText:
    """Token id -> its text as logprobs show it (special tokens written out), cached."""

    def __init__(self, tokenizer):
        self.text = functools.lru_cache(maxsize=1 << 16)(
            lambda t: tokenizer.decode([t], skip_special_tokens=False))


def completion_logprobs(ids: List[int], lps: List[Dict[int, float]], text: TokenText,
                        offset: int) -> dict:
    """Completions' logprobs of tokens ids (lps: per token {token id: logprob}, the token's own
    and its alternatives), their text offsets counted from offset."""
    tokens = [text.text(t) for t in ids]
    offsets = []
    for s in tokens:
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": [_lp(lp[t]) for t, lp in zip(ids, lps)],
            "top_logprobs": [{text.text(k): _lp(v) for k, v in lp.items()} for lp in lps],
            "text_offset": offsets}


def chat_logprobs(ids: List[int], lps: List[Dict[int, float]], top: int,
                  text: TokenText) -> dict:
    """Chat's logprobs: per token its text, logprob, UTF-8 bytes and its `top` best
    alternatives, most likely first."""
    def entry(t, v):
        s = text.text(t)
        return {"token": s, "logprob": _lp(v), "bytes": list(s.encode("utf-8"))}

    content = []
    for t, lp in zip(ids, lps):
        best = sorted(lp.items(), key=lambda kv: -kv[1])[:top]
        content.append({**entry(t, lp[t]), "top_logprobs": [entry(k, v) for k, v in best]})
    return {"content": content}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class _Choice:
    def __init__(self):
        self.text, self.token_ids, self.logprobs = "", [], []
        self.finish_reason: Optional[str] = None
        self.offset = 0         # characters of the tokens given logprobs so far


class Responder:
    """The bodies of one request: kind 'completion' or 'chat'; logprobs: alternatives per
    token (None: no logprobs); prompt_lens: each choice's prompt tokens."""

    def __init__(self, kind: str, request_id: str, model: str, created: int,
                 prompt_lens: List[int], text: TokenText, *, logprobs: Optional[int],
                 token_ids: bool, include_usage: bool):
        self.kind, self.id, self.model, self.created = kind, request_id, model, created
        self.prompt_lens, self.text, self.logprobs = prompt_lens, text, logprobs
        self.token_ids, self.include_usage = token_ids, include_usage
        self.choices = [_Choice() for _ in prompt_lens]

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(self, c: _Choice, ids, lps) -> Optional[dict]:
        """The logprobs of c's tokens ids, which follow the c.offset characters of its tokens
        before them (completions' text_offset)."""
        if self.logprobs is None or lps is None:
            return None
        if self.kind == "chat":
            return chat_logprobs(ids, lps, self.logprobs, self.text)
        out = completion_logprobs(ids, lps, self.text, c.offset)
        c.offset += sum(len(s) for s in out["tokens"])
        return out

    def add(self, index: int, d: StreamDelta) -> _Choice:
        c = self.choices[index]
        c.text += d.text
        c.token_ids += d.token_ids
        c.logprobs += d.logprobs or []
        c.finish_reason = d.finish_reason
        return c

    def usage(self) -> dict:
        return usage(sum(self.prompt_lens), sum(len(c.token_ids) for c in self.choices))

    # ------------------------------------------------------------------ whole
    def body(self) -> dict:
        choices = []
        for i, c in enumerate(self.choices):
            lp = self._logprobs(_Choice(), c.token_ids, c.logprobs)
            if self.kind == "chat":
                ch = {"index": i, "message": {"role": "assistant", "content": c.text},
                      "logprobs": lp, "finish_reason": c.finish_reason}
            else:
                ch = {"index": i, "text": c.text, "logprobs": lp,
                      "finish_reason": c.finish_reason}
            if self.token_ids:
                ch["token_ids"] = c.token_ids
            choices.append(ch)
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": choices, "usage": self.usage()}

    # ------------------------------------------------------------------ streamed
    def _chunk(self, choice: dict) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        out = {**self._head(obj), "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        return out

    def opening(self) -> List[dict]:
        """Chat streams open each choice with the assistant's role."""
        if self.kind != "chat":
            return []
        extra = {"token_ids": []} if self.token_ids else {}
        return [self._chunk({"index": i, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None, **extra})
                for i in range(len(self.choices))]

    def chunk(self, index: int, d: StreamDelta) -> Optional[dict]:
        """The chunk of one delta (None when it carries nothing: no token, no end)."""
        c = self.add(index, d)
        if not d.token_ids and not d.text and not d.finished:
            return None
        lp = self._logprobs(c, d.token_ids, d.logprobs)
        if self.kind == "chat":
            ch = {"index": index, "delta": {"content": d.text} if d.text or not d.finished
                  else {}, "logprobs": lp, "finish_reason": d.finish_reason}
        else:
            ch = {"index": index, "text": d.text, "logprobs": lp,
                  "finish_reason": d.finish_reason}
        if self.token_ids:
            ch["token_ids"] = d.token_ids
        return self._chunk(ch)

    def usage_chunk(self) -> dict:
        """The last chunk when stream_options.include_usage: no choices, the usage."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": self.usage()}
