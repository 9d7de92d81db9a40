"""Output: new tokens into a request, where it stops, its text and its stream deltas.

The one place a request's end is decided: `take` keeps tokens up to the first that ends it (a
stop token, max_tokens, or a stop string, the text checked after every token), and the rest of
the call's tokens are dropped, never streamed. Text is detokenized incrementally (as vLLM does):
through the request's own decoder when the tokenizer has one, else by decoding only the tokens
since the last call plus the one before them; an incomplete UTF-8 character at the end is held
back until its bytes arrive, and text that could still become a stop string is held back from
the stream. The text is what the user sees: special tokens (EOS, end of turn) are left out when
the request's `skip_special_tokens` says so (the default), in the final text, the stream and the
stop-string checks alike; its token ids keep them.
"""
from __future__ import annotations

import inspect
import time
from typing import Any, Callable, List, Optional

from jaxspec.engine.request import Request, StreamDelta
from jaxspec.sampling import logprob_dicts


def _takes_args(fn: Callable, n: int) -> bool:
    """Whether fn can be called with n positional arguments (True when its signature is not
    known: the caller's contract is then the full one)."""
    try:
        inspect.signature(fn).bind(*range(n))
    except TypeError:
        return False
    except ValueError:      # no signature to read (some builtins)
        return True
    return True


class OutputProcessor:
    """detokenize: (token ids, skip_special_tokens) -> text, or token ids -> text for a decoder
    with no special tokens to skip (None: no text, no stop strings); stream_decoder:
    (skip_special_tokens) -> a fresh incremental decoder (`feed(ids) -> str`) or None, or the
    same with no argument."""

    def __init__(self, detokenize: Optional[Callable[..., str]] = None,
                 stream_decoder: Optional[Callable[..., Any]] = None):
        self.detokenize = detokenize
        self.stream_decoder = stream_decoder if detokenize is not None else None
        self._arity: dict = {}      # callable -> whether it takes the skip flag

    def _takes_flag(self, fn: Callable, n: int) -> bool:
        # read once per callable (the attributes may be replaced), not once per call
        got = self._arity.get(n)
        if got is None or got[0] is not fn:
            got = self._arity[n] = (fn, _takes_args(fn, n))
        return got[1]

    def decode(self, req: Request, ids: List[int]) -> str:
        """Text of ids as this request shows it (special tokens per its sampling params)."""
        if self._takes_flag(self.detokenize, 2):
            return self.detokenize(ids, req.sp.skip_special_tokens)
        return self.detokenize(ids)

    def _new_decoder(self, req: Request):
        if not self.stream_decoder:
            return None
        if self._takes_flag(self.stream_decoder, 1):
            return self.stream_decoder(req.sp.skip_special_tokens)
        return self.stream_decoder()

    def take(self, req: Request, tokens: List[int], lp=None) -> Optional[str]:
        """Appends the tokens that the request keeps; returns its finish reason or None.
        lp: (logprob [n], top_ids [n, k], top_logprobs [n, k]) of the tokens, or None."""
        if req.t_first is None:
            req.t_first = time.perf_counter()
        n, reason = len(tokens), None
        if req.stop:                       # the text decides: token by token
            for i, tok in enumerate(tokens):
                self._keep(req, [tok], None if lp is None else [x[i:i + 1] for x in lp])
                reason = self._reason(req, tok)
                if reason:
                    return reason
            return None
        if not req.stop_ids.isdisjoint(tokens):
            n = next(i for i, t in enumerate(tokens) if t in req.stop_ids) + 1
            reason = "stop"
        room = req.sp.max_tokens - len(req.output)      # >= 1 while running
        if room <= n and (reason is None or room < n):
            n, reason = room, "length"
        self._keep(req, tokens[:n], None if lp is None else [x[:n] for x in lp])
        return reason

    def _keep(self, req: Request, kept: List[int], lp):
        req.output += kept
        req.pending_tokens += kept
        if req.logprobs is not None:
            d = logprob_dicts(kept, *lp, req.sp.logprobs)
            req.logprobs += d
            req.pending_logprobs += d

    def _reason(self, req: Request, tok: int) -> Optional[str]:
        if tok in req.stop_ids:
            return "stop"
        if len(req.output) >= req.sp.max_tokens:
            return "length"
        text = self.text_so_far(req)
        window = max(len(s) for s in req.stop) + 16   # a new token adds few characters
        tail = text[max(0, len(text) - window):]
        return "stop" if any(s in tail for s in req.stop) else None

    def text_so_far(self, req: Request) -> str:
        """Text of req.output, O(new tokens) per call."""
        ids = req.output
        if req.read_offset >= len(ids):
            return req.detok_text
        if req.decoder is None:
            req.decoder = self._new_decoder(req) or False
        if req.decoder:
            req.detok_text += req.decoder.feed(ids[req.read_offset:])
            req.read_offset = len(ids)
        else:
            prefix = self.decode(req, ids[req.prefix_offset:req.read_offset])
            new = self.decode(req, ids[req.prefix_offset:])
            if len(new) > len(prefix) and not new.endswith("\ufffd"):
                req.detok_text += new[len(prefix):]
                req.prefix_offset, req.read_offset = req.read_offset, len(ids)
        return req.detok_text

    def finish(self, req: Request, reason: str):
        """Ends the request: its reason, time and final text (cut at a stop string)."""
        req.finish_reason = reason
        req.t_finish = time.perf_counter()
        if self.detokenize is not None:
            text = self.decode(req, req.output)
            if reason == "stop" and req.stop:
                cut = [text.find(s) for s in req.stop if s in text]
                text = text[:min(cut)] if cut else text
            req.text = text

    def delta(self, req: Request) -> StreamDelta:
        """The tokens and text since the request's last delta."""
        text = ""
        if self.detokenize is not None:
            if req.finished:
                full = req.text
            else:
                full = self.text_so_far(req)
                hold = max((len(s) for s in req.stop), default=1) - 1  # a stop string may grow
                full = full[:max(req.sent_text, len(full) - hold)]
            text, req.sent_text = full[req.sent_text:], max(req.sent_text, len(full))
        lps = req.pending_logprobs if req.logprobs is not None else None
        out = StreamDelta(req.request_id, req.pending_tokens, text, req.finished,
                          req.finish_reason, lps)
        req.pending_tokens, req.pending_logprobs = [], []
        return out
