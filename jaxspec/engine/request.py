"""Requests and what the engine gives back for them."""
from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Union

from jaxspec.sampling import SamplingParams

RequestId = Union[int, str]


@dataclasses.dataclass
class StreamDelta:
    """What a step produced for one request: the new tokens and text since the last delta."""
    request_id: RequestId
    token_ids: List[int]
    text: str
    finished: bool
    finish_reason: Optional[str]      # "stop", "length", "abort" once finished
    logprobs: Optional[List[dict]] = None   # per new token {token: logprob}, when asked for
    output: Optional["RequestOutput"] = None    # `LLM.stream`'s last delta: the whole request


@dataclasses.dataclass
class RequestOutput:
    """A finished request, as `LLM.generate` returns it."""
    request_id: RequestId
    prompt_token_ids: List[int]
    token_ids: List[int]              # special tokens (EOS, end of turn) included
    text: str
    finish_reason: str                # "stop", "length" or "abort"
    metrics: dict                     # ttft_s, latency_s, tokens_per_s, retracts
    accept_lens: Optional[List[int]] = None   # speculative: accepted drafted tokens per cycle
    logprobs: Optional[list] = None   # per token {token id: logprob}, when asked for


@dataclasses.dataclass
class Request:
    request_id: RequestId
    prompt: List[int]
    sp: SamplingParams
    stop_ids: frozenset
    stop: tuple                       # stop strings (cut from the text, never streamed)
    serial: int = 0                   # the engine's count of requests: unseeded rng keys
    seq: int = 0                      # add order: a step's deltas follow it
    stream: bool = True               # False: one delta, when it ends (no per-step work)
    output: List[int] = dataclasses.field(default_factory=list)
    accept_lens: List[int] = dataclasses.field(default_factory=list)
    logprobs: Optional[List[dict]] = None   # per output token, when sp.logprobs is set
    text: str = ""                    # final text once finished
    finish_reason: Optional[str] = None
    retracts: int = 0
    t_arrival: float = 0.0
    t_first: Optional[float] = None
    t_finish: Optional[float] = None
    # not yet in a delta
    pending_tokens: List[int] = dataclasses.field(default_factory=list)
    pending_logprobs: List[dict] = dataclasses.field(default_factory=list)
    # incremental detokenization (`engine.output`): text of output[:read_offset], where the
    # last decode window started, characters already streamed, the request's decoder
    detok_text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    sent_text: int = 0
    decoder: Any = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def output_record(self, index: Optional[RequestId] = None,
                      speculative: bool = False) -> RequestOutput:
        """This finished request as a RequestOutput (request_id `index` when given)."""
        latency = (self.t_finish or self.t_arrival) - self.t_arrival
        ttft = (self.t_first or self.t_finish or self.t_arrival) - self.t_arrival
        return RequestOutput(
            request_id=self.request_id if index is None else index,
            prompt_token_ids=self.prompt, token_ids=self.output, text=self.text,
            finish_reason=self.finish_reason,
            metrics={"ttft_s": ttft, "latency_s": latency, "retracts": self.retracts,
                     "tokens_per_s": len(self.output) / max(latency, 1e-9)},
            accept_lens=self.accept_lens if speculative else None, logprobs=self.logprobs)
