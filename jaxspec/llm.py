"""The public API, in the style of vLLM: `LLM(...).generate(prompts, SamplingParams(...))`,
`LLM.chat(messages)`, `LLM.stream(...)` and `LLM.abort(request_id)`, all on the one engine."""
from __future__ import annotations

import dataclasses
from typing import Any, Iterator, List, Optional, Sequence, Union

from jaxspec import compile_cache, defaults
from jaxspec.build import build_engine
from jaxspec.config import ConfigError
from jaxspec.engine import EngineConfig, RequestOutput, StreamDelta
from jaxspec.kv import kv_bytes_per_token
from jaxspec.sampling import VARIANTS, Features, SamplingParams
from jaxspec.spec.config import DraftConfig

Chat = List[dict]
Prompt = Union[str, Chat, Sequence[int]]

_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}
_DRAFT_FIELDS = {f.name for f in dataclasses.fields(DraftConfig)}


def _prompt_kind(prompt: Prompt) -> str:
    """'text', 'chat' or 'ids'; for anything else a TypeError (a ValueError for a malformed
    message) that says what a prompt may be and what was given."""
    import numpy as np

    from jaxspec.tokenizer import check_messages
    if isinstance(prompt, str):
        return "text"
    if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
        check_messages(prompt)
        return "chat"
    if isinstance(prompt, (list, tuple)) and all(
            isinstance(t, (int, np.integer)) and not isinstance(t, (bool, np.bool_))
            for t in prompt):
        return "ids"
    forms = ("a prompt is a string, a chat (a list of {'role': ..., 'content': ...} message "
             "dicts) or a list of token ids")
    if isinstance(prompt, dict):
        raise TypeError(f"{forms}; got one message (a dict): a chat is a list of them, "
                        f"[{{'role': 'user', 'content': ...}}]")
    if isinstance(prompt, (list, tuple)):
        kinds = sorted({type(t).__name__ for t in prompt})
        got = f"a {type(prompt).__name__} of {', '.join(kinds)}"
    else:
        got = f"{type(prompt).__name__} {prompt!r}"[:100]
    raise TypeError(f"{forms}; got {got}")


def _split_options(options: dict, engine: Optional[EngineConfig],
                   draft_config: Optional[DraftConfig]):
    """Keyword options -> (EngineConfig, DraftConfig): each keyword is a field of one of them."""
    unknown = set(options) - _ENGINE_FIELDS - _DRAFT_FIELDS
    if unknown:
        raise ConfigError(f"unknown option(s) {', '.join(sorted(unknown))}: LLM takes model, "
                          "draft, spec, dtype, kv_budget_gb, data_parallel, data_parallel_impl, "
                          "tensor_parallel, engine, draft_config, and the fields of "
                          "jaxspec.EngineConfig and jaxspec.DraftConfig")
    if engine is None and "max_batch" not in options:
        options = dict(options, max_batch=defaults.max_batch())
    engine = (engine or EngineConfig()).replace(
        **{k: v for k, v in options.items() if k in _ENGINE_FIELDS})
    draft_config = dataclasses.replace(draft_config or DraftConfig(), **{
        k: v for k, v in options.items() if k in _DRAFT_FIELDS})
    return engine, draft_config


class LLM:
    """A target model, optionally with a draft head, ready to generate.

    model: None (the default SmolLM2-135M-Instruct GGUF), an HF model directory or a .gguf file.
    draft: None (plain decoding, unless spec is given), "default" (the shipped head of the
    default model), a checkpoint (an EAGLE-1 or EAGLE-3 head, file or directory) or params.
    spec: a SpecConfig, a preset ('naive', 'chain', 'tree') or 'STEPSxTOPKxTOKENS'; None with a
    draft: `defaults.spec(max_batch)`.
    dtype: the weights' dtype (default: the loader's). kv_budget_gb: derive max_model_len from
    a KV memory budget (capped by the model's limit).
    data_parallel: replicas over local devices, max_batch slots each, one engine over all of
    them; data_parallel_impl: 'shard_map' (default) or 'pmap', the same programs either way.
    tensor_parallel: weights and KV caches sharded over that many devices.
    engine: an EngineConfig; draft_config: a DraftConfig. Any field of either may also be given
    as a keyword (max_batch=64, prefill_chunk=512, draft_vocab=0, ...).
    """

    def __init__(self, model: Optional[str] = None, draft: Any = None, spec: Any = None, *,
                 dtype=None, kv_budget_gb: Optional[float] = None, data_parallel: int = 1,
                 data_parallel_impl: str = "shard_map", tensor_parallel: int = 1,
                 engine: Optional[EngineConfig] = None,
                 draft_config: Optional[DraftConfig] = None, **options):
        from jaxspec.weights import load_model
        econf, dconf = _split_options(options, engine, draft_config)
        compile_cache.enable()
        self.config, self.params, self.tokenizer = load_model(model, dtype=dtype)
        if kv_budget_gb is not None:
            per_slot = int(kv_budget_gb * 2**30) // (
                econf.max_batch * kv_bytes_per_token(self.config, self._dtype()))
            per_slot = min(per_slot, self.config.max_position_embeddings)
            econf = econf.replace(max_model_len=min(econf.max_model_len or per_slot, per_slot))
        self.engine = build_engine(self.config, self.params, econf, draft=draft, spec=spec,
                                   dcfg=dconf, eos_ids=self._eos_ids(), tokenizer=self.tokenizer,
                                   data_parallel=data_parallel, tensor_parallel=tensor_parallel,
                                   data_parallel_impl=data_parallel_impl)
        self.engine_config = self.engine.config
        self.max_model_len = self.engine_config.max_model_len
        self.max_batch = self.engine_config.max_batch
        self.spec = getattr(self.engine.backend, "spec", None)
        self._inbox: dict = {}

    def _dtype(self):
        import jax
        return jax.tree_util.tree_leaves(self.params)[0].dtype

    def warmup(self, sampling: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
               freeze_heap: Optional[bool] = None):
        """Compiles everything serving will run now, so no request waits on compilation.
        sampling: the parameters of the requests to come, when known: only the program variants
        they need are compiled. freeze_heap: see `Engine.warmup` (default: on accelerators)."""
        sps = [sampling] if isinstance(sampling, SamplingParams) else list(sampling or [])
        variants = tuple(Features.of([sp]) for sp in sps) or VARIANTS
        self.engine.warmup(variants, freeze_heap=freeze_heap)

    def compilations(self) -> int:
        """Calls so far that found no executable compiled ahead of time; after `warmup`,
        anything above 0 is a missed shape."""
        return self.engine.backend.jit_calls

    def _encode_all(self, prompts: Sequence[Prompt], kinds: Sequence[str],
                    first: int = 0) -> List[List[int]]:
        """Token ids of each prompt (kinds: `_prompt_kind` of each; first: the index of
        prompts[0] in the caller's list, for errors). Texts and chats go to the tokenizer as one
        batch each, which it encodes on several threads, so the device does not wait on a
        Python loop of single encodes."""
        out: List[Optional[List[int]]] = [None] * len(prompts)
        for kind, encode in (("text", self.tokenizer.encode_batch),
                             ("chat", self.tokenizer.apply_chat_templates)):
            idx = [i for i, k in enumerate(kinds) if k == kind]
            for i, ids in zip(idx, encode([prompts[i] for i in idx])):
                out[i] = ids
        for i, kind in enumerate(kinds):
            if kind == "ids":
                out[i] = list(prompts[i])
            if not out[i]:
                raise ValueError(f"request {first + i}: empty prompt: it encodes to no tokens")
        return out

    def _check_ids(self, prompts: Sequence[Prompt], kinds: Sequence[str]):
        """Token-id prompts must lie in the vocabulary (cheap: checked before any encoding)."""
        for i, (p, kind) in enumerate(zip(prompts, kinds)):
            bad = [t for t in p if not 0 <= t < self.config.vocab_size] if kind == "ids" else ()
            if bad:
                raise ValueError(f"request {i}: prompt token ids out of range [0, "
                                 f"{self.config.vocab_size}): {bad[:5]}")

    def _check_fits(self, ids: List[int], sp: SamplingParams, i: int):
        if len(ids) + sp.max_tokens > self.max_model_len:
            raise ValueError(
                f"request {i}: prompt of {len(ids)} tokens + max_tokens={sp.max_tokens} exceeds "
                f"the context of {self.max_model_len} tokens (max_model_len)")

    def _eos_ids(self) -> set:
        return set(self.tokenizer.eos_token_ids) | set(self.config.eos_token_ids)

    # -- generation ----------------------------------------------------------------------
    def _requests(self, prompts, sampling_params):
        """(prompts as a list, their kinds, one SamplingParams each), with every check that
        needs no encoding done: a wrong type is a TypeError naming the argument (and the
        request) and what it takes, raised before any work."""
        one = isinstance(prompts, (str, dict)) or (
            isinstance(prompts, (list, tuple)) and prompts
            and not isinstance(prompts[0], (str, list, tuple)))
        if one:                  # a string, a chat, token ids (or one bad prompt, named below)
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            try:
                _prompt_kind(prompts)
            except TypeError as e:
                raise TypeError(f"prompts must be one prompt or a list of them: {e}") from None
        if not prompts:
            raise ValueError("no prompts given")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sps = [sampling_params or SamplingParams()] * len(prompts)
        else:
            sps = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else None
        if sps is None or not all(isinstance(sp, SamplingParams) for sp in sps):
            got = sampling_params if sps is None else next(
                sp for sp in sps if not isinstance(sp, SamplingParams))
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them (one "
                            f"per prompt), got {type(got).__name__}")
        if len(sps) != len(prompts):
            raise ValueError(f"{len(sps)} sampling params for {len(prompts)} prompts")
        kinds = []
        for i, p in enumerate(prompts):
            try:
                kinds.append(_prompt_kind(p))
            except (TypeError, ValueError) as e:
                raise type(e)(f"request {i}: {e}" if len(prompts) > 1 else str(e)) from None
        self._check_ids(prompts, kinds)
        return list(prompts), kinds, sps

    def _encoded(self, prompts, kinds, sps, first: int = 0) -> List[List[int]]:
        """Token ids of prompts, each checked to fit the context with its max_tokens."""
        encoded = self._encode_all(prompts, kinds, first)
        for i, (ids, sp) in enumerate(zip(encoded, sps)):
            self._check_fits(ids, sp, first + i)
        return encoded

    def _normalize(self, prompts, sampling_params):
        prompts, kinds, sps = self._requests(prompts, sampling_params)
        return self._encoded(prompts, kinds, sps), sps

    def _submit(self, encoded, sps, request_ids=None, stream: bool = True) -> list:
        """Adds the requests to the engine; all or none (a failure aborts the ones added).
        stream=False (generate): no deltas until a request ends (Engine.add_request)."""
        added = []
        try:
            for i, (ids, sp) in enumerate(zip(encoded, sps)):
                rid = None if request_ids is None else request_ids[i]
                added.append(self.engine.add_request(ids, sp, request_id=rid,
                                                     stream=stream))
        except Exception:
            self.engine.drop(added)
            raise
        return added

    def _pump(self, collect: bool = True):
        """One engine step; deltas are filed per request for whoever consumes them.
        collect=False: dispatch only (Engine.step)."""
        for d in self.engine.step(collect):
            self._inbox.setdefault(d.request_id, []).append(d)

    def _drop(self, ids):
        """Aborts requests whose caller has gone (a generate that failed part way, a stream left
        early) and forgets them and their deltas."""
        self.engine.drop(ids)
        for rid in ids:
            self._inbox.pop(rid, None)

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None
                 ) -> List[RequestOutput]:
        """Generates for each prompt (a string and token ids as given, a chat through the chat
        template); request_id of each output is its index in `prompts`. Every request is
        checked before generate returns anything: a bad one raises (naming it), and any of the
        others already started is aborted; requests of other callers carry on. Prompts are
        encoded and submitted `submit_slice` at a time while the device runs the ones before."""
        prompts, kinds, sps = self._requests(prompts, sampling_params)
        ids: List[Any] = []
        step = self.engine_config.submit_slice
        try:
            for lo in range(0, len(prompts), step):
                if ids:     # the device starts on the slices before while this one encodes
                    self._pump(collect=False)
                part = slice(lo, lo + step)
                encoded = self._encoded(prompts[part], kinds[part], sps[part], first=lo)
                ids += self._submit(encoded, sps[part], stream=False)
        except BaseException:
            self._drop(ids)
            raise
        pending = set(ids)
        while pending:
            self._pump()
            pending -= {i for i in pending if i in self.engine.finished_requests}
        outs = []
        for i, rid in enumerate(ids):
            self._inbox.pop(rid, None)
            outs.append(self.engine.pop_finished(rid).output_record(i, self.spec is not None))
        return outs

    def chat(self, messages: Union[Chat, Sequence[Chat]],
             sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None
             ) -> List[RequestOutput]:
        """generate() for one conversation (a list of {"role", "content"} messages) or a list
        of them, each through the model's chat template."""
        from jaxspec.tokenizer import check_messages
        if isinstance(messages, dict):
            raise TypeError("messages: a conversation is a list of {'role': ..., 'content': ...} "
                            "message dicts, got one message (a dict): wrap it in a list")
        if not isinstance(messages, (list, tuple)):
            raise TypeError(f"messages must be a conversation (a list of "
                            f"{{'role': ..., 'content': ...}} message dicts) or a list of them, "
                            f"got {type(messages).__name__} {messages!r}"[:300])
        if not messages:
            raise ValueError("messages: no conversation given")
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        for i, conv in enumerate(convs):
            check_messages(conv, f"chat {i}" if len(convs) > 1 else "chat")
        return self.generate(convs, sampling_params)

    def stream(self, prompts: Union[Prompt, Sequence[Prompt]],
               sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
               request_ids: Optional[Sequence[Any]] = None) -> Iterator[StreamDelta]:
        """Yields StreamDelta(request_id, token_ids, text, finished, finish_reason, logprobs) as
        tokens come: per request, the deltas concatenate to the final output (tokens past a stop are
        never sent; text is held back while it could still become a stop string), and the last
        one carries the whole request as `output` (the RequestOutput `generate` would return,
        request_id its stream's). request_ids (unique, default: the engine's) may be passed to
        `abort` while iterating."""
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
                        if d.finished:
                            pending.discard(rid)
                            req = self.engine.finished_requests.pop(rid, None)
                            if req is not None:
                                d = dataclasses.replace(d, output=req.output_record(
                                    rid, self.spec is not None))
                        yield d
        finally:   # a consumer that stops early leaves nothing running
            self._drop(pending)

    def abort(self, request_id) -> bool:
        """Ends a streaming request; its stream ends with finish_reason 'abort'."""
        return self.engine.abort(request_id)
