"""The public API, in the style of vLLM: `LLM(...).generate(prompts, SamplingParams(...))`,
`LLM.stream(...)` and `LLM.abort(request_id)`, all on the continuous-batching engine."""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Iterator, List, Optional, Sequence, Union

import jax

from jaxspec.config import ConfigError
from jaxspec.engine import Engine, PlainBackend, SpecBackend, StreamDelta
from jaxspec.kv import kv_bytes_per_token
from jaxspec.sampling import SamplingParams

Chat = List[dict]
Prompt = Union[str, Chat, Sequence[int]]


@dataclasses.dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: List[int]
    token_ids: List[int]
    text: str
    finish_reason: str                 # "stop", "length" or "abort"
    metrics: dict                      # ttft_s, latency_s, tokens_per_s (retracts)
    accept_lens: Optional[List[int]] = None   # speculative runs: accepted tokens per cycle
    logprobs: Optional[list] = None    # per token {token id: logprob}, when asked for


class LLM:
    """A target model (and later a draft head) ready to generate.

    model: None (the default SmolLM2-135M-Instruct GGUF), an HF model directory, or a .gguf file.
    max_batch: slots decoded together. max_model_len: per-slot context (prompt + output).
    kv_budget_gb: if given, max_model_len is derived from it (and capped by the model's limit).
    """

    def __init__(self, model: Optional[str] = None, *, dtype=None, max_batch: int = 8,
                 max_model_len: Optional[int] = None, kv_budget_gb: Optional[float] = None,
                 decode_chunk: int = 16, seed: int = 0, layer_layout: Optional[str] = None,
                 draft: Any = None, spec: Any = None):
        from jaxspec.weights import load_model
        if max_batch <= 0:
            raise ConfigError(f"max_batch must be positive, got {max_batch}")
        self.config, self.params, self.tokenizer = load_model(model, dtype=dtype)
        # GPU: layers unrolled over static slices of the stacked weights (see ModelConfig).
        layer_layout = layer_layout or ("unrolled" if jax.default_backend() == "gpu" else "scan")
        if layer_layout not in ("scan", "unrolled"):
            raise ConfigError(f"layer_layout must be 'scan' or 'unrolled', got {layer_layout!r}")
        self.config = dataclasses.replace(self.config, unroll_layers=layer_layout == "unrolled")
        self.dtype = jax.tree_util.tree_leaves(self.params)[0].dtype
        limit = self.config.max_position_embeddings
        if kv_budget_gb is not None:
            per_slot = int(kv_budget_gb * 2**30) // (max_batch * kv_bytes_per_token(self.config, self.dtype))
            max_model_len = min(limit, per_slot) if max_model_len is None else min(max_model_len, per_slot)
        self.max_model_len = int(min(max_model_len or 2048, limit))
        if self.max_model_len < 16:
            raise ConfigError(f"max_model_len={self.max_model_len} leaves no room to generate")
        self.max_batch, self.decode_chunk, self.seed = max_batch, decode_chunk, seed
        self.spec = None
        if spec is not None or draft is not None:
            backend = self._spec_backend(draft, spec)
        else:
            # Slack rows: a cycle may run past a request's end before the host sees it.
            backend = PlainBackend(self.config, self.params, max_batch,
                                   self.max_model_len + 2 * decode_chunk, n_steps=decode_chunk,
                                   seed=seed)
        self.engine = Engine(backend, max_model_len=self.max_model_len,
                             vocab_size=self.config.vocab_size, eos_ids=self._eos_ids(),
                             chunk=512, detokenize=self.tokenizer.decode)
        self._inbox: dict = {}

    def _load_draft(self, draft: Optional[str]):
        from jaxspec.loading import eagle_ckpt
        if draft in (None, "default"):
            return eagle_ckpt.load_default_head(self.config, dtype=self.dtype)
        return eagle_ckpt.load_eagle1(draft, self.config, dtype=self.dtype)

    def _spec_backend(self, draft, spec):
        """draft: None/'default' (the shipped head for the default model), a checkpoint path,
        or a draft params pytree. spec: a SpecConfig or a preset name ('naive', 'chain', 'tree')."""
        from jaxspec.spec.config import resolve_spec
        spec = resolve_spec(spec if spec is not None else "chain")
        if draft is None or isinstance(draft, str):
            draft = self._load_draft(draft)
        self.spec = spec
        # Rows for the speculative tokens of the cycles that may run past a request's end.
        return SpecBackend(self.config, self.params, draft, spec, self.max_batch,
                           self.max_model_len + 2 * spec.max_emit, seed=self.seed)

    # -- input handling ------------------------------------------------------------------
    def _encode(self, prompt: Prompt) -> List[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
            ids = self.tokenizer.apply_chat_template(list(prompt))
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids out of range [0, {self.config.vocab_size}): {bad[:5]}")
        else:
            raise TypeError(f"a prompt is a string, a chat (list of messages) or a list of token "
                            f"ids; got {type(prompt).__name__}")
        if not ids:
            raise ValueError("empty prompt: it encodes to no tokens")
        return ids

    def _check_fits(self, ids: List[int], sp: SamplingParams, i: int):
        if len(ids) + sp.max_tokens > self.max_model_len:
            raise ValueError(
                f"request {i}: prompt of {len(ids)} tokens + max_tokens={sp.max_tokens} exceeds "
                f"the context of {self.max_model_len} tokens (max_model_len)")

    def _eos_ids(self) -> set:
        return set(self.tokenizer.eos_token_ids) | set(self.config.eos_token_ids)

    # -- generation ----------------------------------------------------------------------
    def _normalize(self, prompts, sampling_params):
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], (dict, int))):
            prompts = [prompts]
        if not prompts:
            raise ValueError("no prompts given")
        sps = sampling_params if isinstance(sampling_params, (list, tuple)) else \
            [sampling_params or SamplingParams()] * len(prompts)
        if len(sps) != len(prompts):
            raise ValueError(f"{len(sps)} sampling params for {len(prompts)} prompts")
        encoded = [self._encode(p) for p in prompts]
        for i, (ids, sp) in enumerate(zip(encoded, sps)):
            self._check_fits(ids, sp, i)
        return encoded, list(sps)

    def _submit(self, encoded, sps, request_ids=None) -> list:
        """Adds the requests to the engine; all or none (a failure aborts the ones added)."""
        added = []
        try:
            for i, (ids, sp) in enumerate(zip(encoded, sps)):
                rid = None if request_ids is None else request_ids[i]
                added.append(self.engine.add_request(ids, sp, request_id=rid))
        except Exception:
            for rid in added:
                self.engine.abort(rid)
                self.engine.finished_requests.pop(rid, None)
            raise
        return added

    def _pump(self):
        """One engine step; deltas are filed per request for whoever consumes them."""
        for d in self.engine.step():
            self._inbox.setdefault(d.request_id, []).append(d)

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None
                 ) -> List[RequestOutput]:
        """Generates for each prompt. All requests are validated before any work starts.
        request_id of each output is its index in `prompts`."""
        encoded, sps = self._normalize(prompts, sampling_params)
        ids = self._submit(encoded, sps)
        pending = set(ids)
        while pending:
            self._pump()
            pending -= {i for i in pending if i in self.engine.finished_requests}
        outs = []
        for i, rid in enumerate(ids):
            self._inbox.pop(rid, None)
            outs.append(self._output(i, self.engine.pop_finished(rid)))
        return outs

    def stream(self, prompts: Union[Prompt, Sequence[Prompt]],
               sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
               request_ids: Optional[Sequence[Any]] = None) -> Iterator[StreamDelta]:
        """Yields StreamDelta(request_id, token_ids, text, finished, finish_reason, logprobs) as
        tokens come: per request, the deltas concatenate to the final output (tokens past a stop are
        never sent; text is held back while it could still become a stop string). request_ids
        (unique, default: the engine's) may be passed to `abort` while iterating."""
        encoded, sps = self._normalize(prompts, sampling_params)
        if request_ids is not None and len(request_ids) != len(encoded):
            raise ValueError(f"{len(request_ids)} request ids for {len(encoded)} prompts")
        ids = self._submit(encoded, sps, request_ids)
        return self._stream(ids)

    def _stream(self, ids) -> Iterator[StreamDelta]:
        pending = set(ids)
        try:
            while pending:
                self._pump()
                for rid in ids:
                    for d in self._inbox.pop(rid, ()):
                        yield d
                        if d.finished:
                            pending.discard(rid)
                            self.engine.finished_requests.pop(rid, None)
        finally:   # a consumer that stops early leaves nothing running
            for rid in pending:
                self.engine.abort(rid)
                self.engine.finished_requests.pop(rid, None)
                self._inbox.pop(rid, None)

    def abort(self, request_id) -> bool:
        """Ends a streaming request; its stream ends with finish_reason 'abort'."""
        return self.engine.abort(request_id)

    def _output(self, index: int, r) -> RequestOutput:
        latency = (r.t_finish or r.t_arrival) - r.t_arrival
        ttft = (r.t_first or r.t_finish or r.t_arrival) - r.t_arrival
        return RequestOutput(
            request_id=index, prompt_token_ids=r.prompt, token_ids=r.output, text=r.text,
            finish_reason=r.finish_reason,
            metrics={"ttft_s": ttft, "latency_s": latency, "retracts": r.retracts,
                     "tokens_per_s": len(r.output) / max(latency, 1e-9)},
            accept_lens=r.accept_lens if self.spec is not None else None, logprobs=r.logprobs)
