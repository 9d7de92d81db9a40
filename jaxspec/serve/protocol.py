"""The requests the server takes (OpenAI's fields, with vLLM's extensions for the sampling
parameters OpenAI lacks) and their mapping onto SamplingParams.

Every model is strict (no string for a number, no number for a bool) and refuses unknown
fields, as OpenAI's API does: a misspelled parameter is an error, never silently ignored. A known
field whose value the engine cannot serve (n > 1, echo, tools, ...) is a 400 naming it.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, Union

from pydantic import BaseModel, ConfigDict

from jaxspec.sampling import SamplingParams
from jaxspec.serve.errors import APIError, bad_request, unsupported

# OpenAI's default max_tokens for completions; chat completions default to the room left.
COMPLETION_MAX_TOKENS = 16
# OpenAI's default temperature (jaxspec's SamplingParams defaults to greedy).
DEFAULT_TEMPERATURE = 1.0


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Generation(_Strict):
    """The fields both endpoints share."""
    model: str
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = 1
    logit_bias: Optional[Dict[str, float]] = None
    user: Optional[str] = None
    # vLLM's extension: each choice (and stream chunk) also carries its token ids
    return_token_ids: bool = False

    def check_supported(self):
        """A 400 naming the first field set to something the server does not serve."""
        if self.n != 1:
            raise unsupported("n", f"{self.n} choices per request are not supported, only "
                                   "n=1; send n requests, each with its own seed")
        if self.logit_bias:
            raise unsupported("logit_bias", "logit_bias is not supported")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options: only allowed when stream is true",
                              "stream_options")


class CompletionRequest(_Generation):
    prompt: Union[str, List[str], List[int], List[List[int]]]
    logprobs: Optional[int] = None
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    def check_supported(self):
        super().check_supported()
        if self.echo:
            raise unsupported("echo", "echo is not supported (prompt logprobs are not computed)")
        if self.suffix is not None:
            raise unsupported("suffix", "suffix (insertion) is not supported")
        if self.best_of not in (None, 1):
            raise unsupported("best_of", f"best_of={self.best_of}: only 1 is supported")

    def prompts(self) -> List[Union[str, List[int]]]:
        """The prompts, one per choice: texts and token-id lists."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            p = [p]
        if not p:
            raise bad_request("prompt: no prompt given", "prompt")
        return list(p)

    def max_tokens_field(self) -> Tuple[str, Optional[int]]:
        return "max_tokens", self.max_tokens

    def logprobs_wanted(self) -> Optional[int]:
        return self.logprobs


class ChatMessage(_Strict):
    role: str
    content: Union[str, List[Dict[str, Any]], None] = None
    name: Optional[str] = None


class ChatCompletionRequest(_Generation):
    messages: List[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[List[Any]] = None
    tool_choice: Optional[Any] = None
    parallel_tool_calls: Optional[bool] = None
    response_format: Optional[Dict[str, Any]] = None

    def check_supported(self):
        super().check_supported()
        if self.tools:
            raise unsupported("tools", "tool calls are not supported")
        if self.tool_choice not in (None, "none"):
            raise unsupported("tool_choice", "tool calls are not supported")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise unsupported("response_format", "structured output is not supported; "
                                                 "only {'type': 'text'}")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs: only allowed when logprobs is true",
                              "top_logprobs")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise bad_request("max_tokens and max_completion_tokens: give one of them",
                              "max_completion_tokens")

    def conversation(self) -> List[dict]:
        """The messages as the chat template reads them: role and text content."""
        if not self.messages:
            raise bad_request("messages: a conversation needs at least one message",
                              "messages")
        out = []
        for i, m in enumerate(self.messages):
            where = f"messages.{i}.content"
            if isinstance(m.content, str):
                text = m.content
            elif m.content is None:
                raise bad_request(f"{where}: a message needs text content", where)
            else:
                parts = []
                for j, part in enumerate(m.content):
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise unsupported(f"{where}.{j}", "only text parts ({'type': 'text', "
                                                          "'text': ...}) are supported")
                    parts.append(part["text"])
                text = "\n".join(parts)
            out.append({"role": m.role, "content": text})
        return out

    def max_tokens_field(self) -> Tuple[str, Optional[int]]:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens

    def logprobs_wanted(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None


# SamplingParams field -> the request field that sets it, where the names differ
_FIELD_OF = {"chat": {"logprobs": "top_logprobs"}, "completion": {}}


def sampling_params(req: _Generation, prompt_len: int, room: int) -> SamplingParams:
    """The request's SamplingParams for a prompt of prompt_len tokens. room: the most tokens
    it may generate (the context and KV budget left); max_tokens unset takes OpenAI's default
    (16 for completions, the room for chat). A value SamplingParams refuses is a 400 naming
    the request's field."""
    kind = "chat" if isinstance(req, ChatCompletionRequest) else "completion"
    name, max_tokens = req.max_tokens_field()
    if max_tokens is None:
        max_tokens = room if kind == "chat" else COMPLETION_MAX_TOKENS
    if room < 1 or (isinstance(max_tokens, int) and max_tokens > room):
        where = "messages" if kind == "chat" else "prompt"
        raise APIError(400, f"the prompt has {prompt_len} tokens and {name}={max_tokens} asks "
                            f"for more than the {prompt_len + max(room, 0)} tokens this server "
                            f"holds per request; shorten the {where} or lower {name}",
                       param=name if room >= 1 else where, code="context_length_exceeded")
    values = dict(max_tokens=max_tokens, logprobs=req.logprobs_wanted(),
                  temperature=DEFAULT_TEMPERATURE if req.temperature is None else req.temperature,
                  stop=req.stop or (), stop_token_ids=tuple(req.stop_token_ids or ()),
                  ignore_eos=req.ignore_eos, skip_special_tokens=req.skip_special_tokens,
                  seed=req.seed)
    for field in ("top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                  "repetition_penalty"):
        if getattr(req, field) is not None:
            values[field] = getattr(req, field)
    try:
        return SamplingParams(**values)
    except (TypeError, ValueError) as e:
        field = str(e).split(" ", 1)[0]
        param = _FIELD_OF[kind].get(field, name if field == "max_tokens" else field)
        message = str(e) if param == field else f"{param}: {e}"
        raise bad_request(message, param if param in type(req).model_fields else None) from None
