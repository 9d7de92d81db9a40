"""The public API, in the style of vLLM: `LLM(...).generate(prompts, SamplingParams(...))`,
`LLM.stream(...)` and `LLM.abort(request_id)`, all on the continuous-batching engine."""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Iterator, List, Optional, Sequence, Union

import jax

from jaxspec import compile_cache
from jaxspec.config import ConfigError
from jaxspec.engine import Engine, PlainBackend, SpecBackend, StreamDelta
from jaxspec.engine.loop import PACK_ROWS
from jaxspec.engine.backends import (default_admit_interval, default_cycles_per_call,
                                     default_prefill_chunk,
                                     default_spec)
from jaxspec.kv import kv_bytes_per_token
from jaxspec.sampling import VARIANTS, Features, SamplingParams, apply_stop_strings

Chat = List[dict]
Prompt = Union[str, Chat, Sequence[int]]

# Draft vocabulary of the shipped head when none is asked for (`LLM(draft_vocab=)`; 0: all).
# Measured on the H100 with the shipped ranking (bench/RESULTS.md, twentieth set): at batch 64
# on MT-bench chain:4 ran 1.37-1.41x plain against 1.30-1.34x with all 49,152 tokens (tau
# 2.09 against 2.12); 8,192 and 4,096 lost more acceptance (2.03, 1.98) than they saved. At
# batch 1 the tree 6x8x40 ran 3-5% faster (tau 3.46 against 3.62) and a forced
# chain 2% slower; held-out ShareGPT at batch 64, dominated by prefill, did not change.
DEFAULT_DRAFT_VOCAB = 16384
# How many of a cut head's K drafted tokens are each request's context (`LLM(draft_context_vocab=)`,
# `spec.context_vocab`) when none is asked for: 256 at max_batch 1 on a GPU, else none
# (`default_context_vocab`). On the H200 (bench/RESULTS.md, thirty-fourth set), MT-bench, 16,384
# drafted: batch-1 4x8x32:2 tau 3.27 -> 3.40 for 30 us more a cycle (1.136 -> 1.166 ms), 2.553x
# / 2.567x plain against 2.548x / 2.549x without (both orders); both turns chain tau 2.500 ->
# 2.565, tree 4.321 -> 4.544. At batch 64 (default 3x2x4:4) tau 2.24 -> 2.29 but 1.42x plain
# against 1.45x: the slots' gathered rows cost more than the tau returns.
DEFAULT_CONTEXT_VOCAB = 256


def default_context_vocab(slots: int) -> int:
    """The context vocabulary when none is asked for: DEFAULT_CONTEXT_VOCAB for one slot on a
    GPU, else 0 (as `engine.default_spec`, which picks the batch-1 tree there)."""
    return DEFAULT_CONTEXT_VOCAB if slots == 1 and jax.default_backend() == "gpu" else 0


def _check_size(name: str, value, zero: str) -> None:
    """ConfigError unless value is None or an int >= 0 (bools refused); zero: what 0 means."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ConfigError(f"{name} must be an int >= 0 (0: {zero}), got {value!r}")


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


def _prompt_kind(prompt: Prompt) -> str:
    """'text', 'chat' or 'ids'; TypeError for anything else."""
    if isinstance(prompt, str):
        return "text"
    if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
        return "chat"
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
        return "ids"
    raise TypeError(f"a prompt is a string, a chat (list of messages) or a list of token ids; "
                    f"got {type(prompt).__name__}")


class LLM:
    """A target model (and later a draft head) ready to generate.

    model: None (the default SmolLM2-135M-Instruct GGUF), an HF model directory, or a .gguf file.
    max_batch: slots decoded together. max_model_len: per-slot context (prompt + output).
    kv_budget_gb: if given, max_model_len is derived from it (and capped by the model's limit).
    data_parallel: replicas over local devices, max_batch slots each. data_parallel_impl:
    "engine" (the default; `parallel.dp_engine`: one continuous-batching engine over every
    replica's slots, each device running the one-device programs on its own slots through a
    jit of shard_map, which is what jax.pmap itself lowers to; stream, abort and retract work
    as on one device) or "pmap" (`parallel.data_parallel`: groups of requests decoded in
    lockstep per replica with jax.pmap, no streaming). On two H200s at 64 slots a GPU the
    engine scaled 1.92-1.94x over one GPU with requests flowing and 1.87-1.99x draining one
    batch (bench/RESULTS.md, forty-first set); in one call beside pmap it gave 1.3-3.1x pmap's
    tokens/s, and pmap scaled 1.26-1.77x, each group waiting for its longest request (fortieth
    set).
    admit_interval: the engine admits newcomers every this many device calls while others run
    (`Engine(admit_interval=)`; 1 admits at once). None: `engine.default_admit_interval` (on a
    GPU 3 for a speculative engine of 64+ slots, 2 for 32+, else 1).
    cycles_per_call: speculative cycles per device call (`SpecBackend(cycles_per_call=)`, the
    speculative counterpart of decode_chunk): more amortize the host's cost per call where it
    exceeds a cycle's device time (large batches of a small model). None:
    `engine.default_cycles_per_call(max_batch)` (on a GPU 4 for max_batch > 1, 2 for 1; 1 on a
    CPU). An engine of several slots runs one cycle a call while a single slot is active;
    max_batch=1 runs the number given.
    prefill_width_growth: ratio of successive prefill chunk widths (`Engine(width_growth=)`): 4
    runs chunks 16, 64, 256 or 512 wide; 2 pads short chat prompts less (16, 32, .., 512) for
    more programs to compile at warm-up.
    prefill_slot_growth: ratio of successive prefill slot counts (`Engine(bucket_growth=)`): 4
    runs a chunk over 1, 4, 16 or 64 slots (up to max_batch), padding the newcomers it admits
    together up to the next; 2 (1, 2, 4, .., 64) pads less for more programs to compile.
    prefill_packing: the first chunks of an admission's newcomers run end to end in one row
    (`Engine(pack_first_chunks=)`; packs of 16, 32, .., 2 x prefill_chunk tokens) instead of
    padded to a slot count and their longest prompt's width. The growth options above then
    shape only later chunks (prompts longer than prefill_chunk) and the padded form (False).
    prefill_pack_tokens: the widest pack row (`Engine(pack_tokens=)`, >= prefill_chunk; None:
    2 x prefill_chunk). Attention inside a row costs its width squared; more first chunks
    than a row takes go first-fit into 2, 4, .. rows of this width.
    prefill_pack_rows: 'pow2' (2, 4, 8, .. rows) or 'fine' (2, 3, 4, 6, 8, 12, ..): the row
    counts a pack is padded to (`Engine(pack_rows=)`); 'fine' pads a pack to at most 1.5x its
    rows, for one more program per doubling.
    prefill_chunk: the widest prefill chunk (`Engine(chunk=)`, capped at max_model_len); a
    longer prompt is prefilled in chunks this wide, one device call each. Wider chunks mean
    fewer calls for long prompts, each with its own host cost, for one more width to compile.
    None: `engine.default_prefill_chunk` (2048 on a GPU, 512 elsewhere).
    draft_vocab: an EAGLE-1 head drafts only the K most frequent tokens of a ranking
    (`spec.draft_vocab`, FR-Spec): the draft's lm_head reads K columns instead of V; the output
    is unchanged, only tokens outside the K are never drafted. 0: the whole vocabulary. None:
    the shipped head's measured default (`DEFAULT_DRAFT_VOCAB`), else the whole vocabulary.
    draft_vocab_ranking: the ranking file (`spec.draft_vocab.save_ranking`); None: the one
    shipped beside the default head (needed for a draft_vocab > 0 with another head).
    draft_context_vocab: with a cut draft vocabulary, the last E of its K are each request's
    own: the last E distinct tokens of its prompt and output outside the other K - E
    (`spec.context_vocab`: the topic's rare words, which a frequency cut misses). None:
    `default_context_vocab(max_batch)` with a cut vocabulary (256 at max_batch 1 on a GPU, else
    none).
    submit_slice: `generate` encodes, checks and submits its prompts this many at a time, the
    device running the slices before while the next one encodes. None: max(64, max_batch)
    (a slice of 64 chats encodes in about 7 ms on an H100's host, against a call of 6-17 ms at
    batch 64).
    """

    def __init__(self, model: Optional[str] = None, *, dtype=None, max_batch: int = 8,
                 max_model_len: Optional[int] = None, kv_budget_gb: Optional[float] = None,
                 decode_chunk: int = 16, seed: int = 0, layer_layout: Optional[str] = None,
                 draft: Any = None, spec: Any = None, data_parallel: int = 1,
                 tensor_parallel: int = 1, data_parallel_impl: str = "engine",
                 admit_interval: Optional[int] = None, cycles_per_call: Optional[int] = None,
                 prefill_width_growth: int = 4, prefill_chunk: Optional[int] = None,
                 prefill_slot_growth: int = 4, prefill_packing: bool = True,
                 prefill_pack_tokens: Optional[int] = None, prefill_pack_rows: str = "pow2",
                 draft_vocab: Optional[int] = None,
                 draft_vocab_ranking: Optional[str] = None, submit_slice: Optional[int] = None,
                 draft_context_vocab: Optional[int] = None):
        from jaxspec.weights import load_model
        if max_batch <= 0:
            raise ConfigError(f"max_batch must be positive, got {max_batch}")
        if data_parallel < 1 or tensor_parallel < 1:
            raise ConfigError(f"data_parallel={data_parallel} and tensor_parallel="
                              f"{tensor_parallel} must be >= 1")
        if data_parallel > 1 and tensor_parallel > 1:
            raise ConfigError("data_parallel and tensor_parallel together (a 2-D mesh) are not "
                              "supported: choose one")
        if admit_interval is not None and admit_interval < 1:
            raise ConfigError(f"admit_interval must be >= 1, got {admit_interval}")
        if submit_slice is not None and submit_slice < 1:
            raise ConfigError(f"submit_slice must be >= 1, got {submit_slice}")
        if prefill_width_growth < 2:
            raise ConfigError(f"prefill_width_growth must be >= 2, got {prefill_width_growth}")
        if prefill_slot_growth < 2:
            raise ConfigError(f"prefill_slot_growth must be >= 2, got {prefill_slot_growth}")
        if prefill_chunk is None:
            prefill_chunk = default_prefill_chunk()
        if prefill_pack_tokens is not None and prefill_pack_tokens < prefill_chunk:
            raise ConfigError(f"prefill_pack_tokens ({prefill_pack_tokens}) must be >= "
                              f"prefill_chunk ({prefill_chunk})")
        if prefill_chunk < 16:
            raise ConfigError(f"prefill_chunk must be >= 16, got {prefill_chunk}")
        if prefill_pack_rows not in PACK_ROWS:
            raise ConfigError(f"prefill_pack_rows must be one of {PACK_ROWS}, got "
                              f"{prefill_pack_rows!r}")
        _check_size("draft_vocab", draft_vocab, "the whole vocabulary")
        _check_size("draft_context_vocab", draft_context_vocab, "none")
        self.draft_vocab, self.draft_vocab_ranking = draft_vocab, draft_vocab_ranking
        self.draft_context_vocab = draft_context_vocab
        if cycles_per_call is not None and cycles_per_call < 1:
            raise ConfigError(f"cycles_per_call must be >= 1, got {cycles_per_call}")
        self.cycles_per_call = cycles_per_call or default_cycles_per_call(max_batch)
        if data_parallel_impl not in ("pmap", "engine"):
            raise ConfigError(f"data_parallel_impl must be 'pmap' or 'engine', got "
                              f"{data_parallel_impl!r}")
        self.data_parallel, self.mesh = data_parallel, None
        compile_cache.enable()
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
        self.submit_slice = submit_slice or max(64, max_batch)
        self.spec = None
        self.dp_runner = None   # data parallel: one batch runner over pmap replicas
        if tensor_parallel > 1:
            from jaxspec.parallel.tensor_parallel import make_mesh, shard_params
            self.mesh = make_mesh(tensor_parallel)
            self.params = shard_params(self.params, self.config, self.mesh)
        if data_parallel > 1 and data_parallel_impl == "pmap":
            if (cycles_per_call or 1) > 1:
                raise ConfigError("cycles_per_call > 1 needs the engine: use "
                                  "data_parallel_impl='engine'")
            self._init_data_parallel(draft, spec)
            return
        slots = max_batch * data_parallel
        if spec is not None or draft is not None:
            backend = self._spec_backend(draft, spec, slots)
        else:
            # Slack rows: a cycle may run past a request's end before the host sees it.
            backend = PlainBackend(self.config, self.params, slots,
                                   self.max_model_len + 2 * decode_chunk, n_steps=decode_chunk,
                                   seed=seed)
        if self.mesh is not None:
            from jaxspec.parallel.tensor_parallel import shard_backend
            shard_backend(backend, self.config, self.mesh)
        if data_parallel > 1:
            from jaxspec.parallel.data_parallel import local_devices
            from jaxspec.parallel.dp_engine import data_parallel_backend
            data_parallel_backend(backend, local_devices(data_parallel))
        if admit_interval is None:
            admit_interval = default_admit_interval(slots, self.spec is not None)
        self.engine = Engine(backend, max_model_len=self.max_model_len,
                             vocab_size=self.config.vocab_size, eos_ids=self._eos_ids(),
                             chunk=min(prefill_chunk, self.max_model_len),
                             detokenize=self.tokenizer.decode,
                             admit_interval=admit_interval, width_growth=prefill_width_growth,
                             bucket_growth=prefill_slot_growth,
                             pack_first_chunks=prefill_packing,
                             pack_tokens=prefill_pack_tokens, pack_rows=prefill_pack_rows,
                             stream_decoder=getattr(self.tokenizer, "stream_decoder", None))
        self._inbox: dict = {}

    def _load_draft(self, draft: Optional[str]):
        from jaxspec.loading import eagle_ckpt
        if draft in (None, "default"):
            return eagle_ckpt.load_default_head(self.config, dtype=self.dtype)
        # EAGLE-1 or EAGLE-3, told apart by config.json or the tensor names
        return eagle_ckpt.load_draft(draft, self.config, dtype=self.dtype)

    def _resolve_spec(self, draft, spec):
        """draft: None/'default' (the shipped head for the default model), a checkpoint path
        (a public EAGLE-1 or EAGLE-3 head), or draft params (an EAGLE-1 dict or an
        `eagle3.Eagle3Head`). spec: a SpecConfig, a preset name ('naive', 'chain', 'tree') or
        'STEPSxTOPKxTOKENS'; None: `engine.default_spec(max_batch)` ('4x8x32' on a GPU at
        max_batch 1, '3x2x4' there from max_batch 16, else 'chain')."""
        from jaxspec.models.eagle3 import is_eagle3
        from jaxspec.spec.config import resolve_spec
        self.spec = resolve_spec(spec if spec is not None else default_spec(self.max_batch))
        shipped = draft in (None, "default")
        if draft is None or isinstance(draft, (str, os.PathLike)):
            draft = self._load_draft(None if draft is None else str(draft))
        draft = self._restrict_vocab(draft, shipped)
        if is_eagle3(draft) and self.mesh is not None:
            raise ConfigError("tensor_parallel > 1 with an EAGLE-3 head is not supported yet; "
                              "use an EAGLE-1 head or tensor_parallel=1")
        if self.mesh is not None:
            from jaxspec.parallel.tensor_parallel import shard_draft_params
            draft = shard_draft_params(draft, self.config, self.mesh)
        return draft, self.spec

    def _restrict_vocab(self, draft, shipped: bool):
        """draft with its vocabulary cut to draft_vocab tokens (see the class docstring)."""
        from jaxspec.models.eagle3 import is_eagle3
        from jaxspec.spec import draft_vocab as dv
        k = self.draft_vocab
        context = self.draft_context_vocab
        if k is None:
            k = DEFAULT_DRAFT_VOCAB if shipped and not is_eagle3(draft) else 0
        path = None
        if 0 < k < self.config.vocab_size:
            path = dv.ranking_path(self.config, self.draft_vocab_ranking)
            if self.draft_vocab is None and self.draft_vocab_ranking is None and not path.is_file():
                path = None   # a head shipped without its ranking: the whole vocabulary
        if path is None:
            if context:         # asked for (the default is none without a cut)
                raise ConfigError(f"draft_context_vocab={context} needs a draft that scores a "
                                  "cut vocabulary (draft_vocab > 0, an EAGLE-1 head and its "
                                  "ranking); this one scores every token")
            return draft
        if context is None:         # the default, where the cut leaves room for it (and not
            # under tensor parallelism, whose sharded draft vocabulary it was never measured on)
            context = default_context_vocab(self.max_batch)
            context = context if context < k and self.mesh is None else 0
        return dv.restrict_top(self.params, draft, self.config, k, path, context=context)

    def _init_data_parallel(self, draft, spec):
        """Replicas over local devices with jax.pmap, max_batch slots each; generate() spreads
        requests over them group by group (no continuous batching across replicas)."""
        from jaxspec.parallel import data_parallel as dp
        if spec is not None or draft is not None:
            draft, spec = self._resolve_spec(draft, spec)
            self.dp_runner = dp.DataParallelSpecRunner(
                self.config, self.params, draft, spec, slots=self.max_batch,
                max_len=self.max_model_len + 2 * spec.max_emit, replicas=self.data_parallel,
                seed=self.seed)
        else:
            self.dp_runner = dp.DataParallelPlainRunner(
                self.config, self.params, slots=self.max_batch,
                max_len=self.max_model_len + 2 * self.decode_chunk, replicas=self.data_parallel,
                decode_chunk=self.decode_chunk, seed=self.seed)
        self.engine = None

    def _spec_backend(self, draft, spec, slots: int):
        draft, spec = self._resolve_spec(draft, spec)
        # Rows for the speculative tokens of the cycles that may run past a request's end.
        return SpecBackend(self.config, self.params, draft, spec, slots,
                           self.max_model_len + 2 * spec.max_emit * self.cycles_per_call,
                           seed=self.seed, cycles_per_call=self.cycles_per_call)

    # -- input handling ------------------------------------------------------------------
    def warmup(self, sampling: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
               freeze_heap: Optional[bool] = None):
        """Compiles everything serving will run (the cycle and every admission bucket) now,
        ahead of time, so the first requests do not wait on compilation. Optional: without it,
        each shape compiles on its first use.
        sampling: the parameters of the requests to come, when known: only the program variants
        they need are compiled (all greedy without penalties or logprobs: half of them).
        freeze_heap: then leave the objects alive now out of Python's garbage collections
        (`jaxspec.engine.freeze_startup_heap`; default: on accelerators), so that no full
        collection walks them mid-serving."""
        if self.dp_runner is not None:
            return
        sps = [sampling] if isinstance(sampling, SamplingParams) else list(sampling or [])
        variants = tuple(Features.of([sp]) for sp in sps) or VARIANTS
        self.engine.warmup(variants, freeze_heap=freeze_heap)

    def compilations(self) -> int:
        """Calls so far that found no executable compiled ahead of time (each such shape
        compiles on its first use); after `warmup`, anything above 0 is a missed shape."""
        return 0 if self.dp_runner is not None else self.engine.backend.jit_calls

    def _encode_all(self, prompts: Sequence[Prompt], kinds: Sequence[str],
                    first: int = 0) -> List[List[int]]:
        """Token ids of each prompt (kinds: `_prompt_kind` of each; first: the index of
        prompts[0] in the caller's list, for errors). Texts and chats go to the tokenizer as one
        batch each, which it encodes on several threads: encoding 384 chats one by one took
        about 85 ms of a batch-64 pass in which the device waited (bench/RESULTS.md, eighteenth
        set)."""
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
        needs no encoding done."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], (dict, int))):
            prompts = [prompts]
        if not prompts:
            raise ValueError("no prompts given")
        sps = sampling_params if isinstance(sampling_params, (list, tuple)) else \
            [sampling_params or SamplingParams()] * len(prompts)
        if len(sps) != len(prompts):
            raise ValueError(f"{len(sps)} sampling params for {len(prompts)} prompts")
        kinds = [_prompt_kind(p) for p in prompts]
        self._check_ids(prompts, kinds)
        return list(prompts), kinds, list(sps)

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
        """Generates for each prompt; request_id of each output is its index in `prompts`.
        Every request is checked before generate returns anything: a bad one raises (ValueError,
        naming it), and any of the others already started is aborted; requests of other callers
        carry on. Prompts past the first slice (`submit_slice`) are encoded and checked a slice
        at a time while the device already runs the first ones: encoding 384 chats took 30-40
        ms of a batch-64 pass in which the device idled (bench/RESULTS.md, twenty-third set)."""
        prompts, kinds, sps = self._requests(prompts, sampling_params)
        if self.dp_runner is not None:
            return self._generate_data_parallel(self._encoded(prompts, kinds, sps), sps)
        ids: List[Any] = []
        step = self.submit_slice
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
            outs.append(self._output(i, self.engine.pop_finished(rid)))
        return outs

    def _generate_data_parallel(self, encoded, sps) -> List[RequestOutput]:
        t0 = time.perf_counter()
        if self.spec is not None:
            res = self.dp_runner.generate(encoded, sps, eos_ids=tuple(self._eos_ids()),
                                          detokenize=self.tokenizer.decode)
        else:
            res = self.dp_runner.generate(encoded, sps, [self._stop_ids(sp) for sp in sps])
        latency = time.perf_counter() - t0
        outs = []
        for i, (ids, sp, r) in enumerate(zip(encoded, sps, res)):
            text, hit = apply_stop_strings(self.tokenizer.decode(r.token_ids), sp.stop)
            outs.append(RequestOutput(
                request_id=i, prompt_token_ids=ids, token_ids=r.token_ids, text=text,
                finish_reason="stop" if hit else r.finish_reason,
                metrics={"latency_s": latency, "tokens_per_s": len(r.token_ids) / latency},
                accept_lens=getattr(r, "accept_lens", None),
                logprobs=getattr(r, "logprobs", None)))
        return outs

    def _stop_ids(self, sp: SamplingParams) -> set:
        ids = set(sp.stop_token_ids)
        return ids if sp.ignore_eos else ids | self._eos_ids()

    def stream(self, prompts: Union[Prompt, Sequence[Prompt]],
               sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
               request_ids: Optional[Sequence[Any]] = None) -> Iterator[StreamDelta]:
        """Yields StreamDelta(request_id, token_ids, text, finished, finish_reason, logprobs) as
        tokens come: per request, the deltas concatenate to the final output (tokens past a stop are
        never sent; text is held back while it could still become a stop string). request_ids
        (unique, default: the engine's) may be passed to `abort` while iterating."""
        if self.dp_runner is not None:
            raise ValueError("stream() runs on the continuous-batching engine; "
                             "data_parallel_impl='pmap' uses batch runners: use generate(), "
                             "or data_parallel_impl='engine' (the default)")
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
            self._drop(pending)

    def abort(self, request_id) -> bool:
        """Ends a streaming request; its stream ends with finish_reason 'abort'."""
        return self.engine.abort(request_id) if self.engine is not None else False

    def _output(self, index: int, r) -> RequestOutput:
        latency = (r.t_finish or r.t_arrival) - r.t_arrival
        ttft = (r.t_first or r.t_finish or r.t_arrival) - r.t_arrival
        return RequestOutput(
            request_id=index, prompt_token_ids=r.prompt, token_ids=r.output, text=r.text,
            finish_reason=r.finish_reason,
            metrics={"ttft_s": ttft, "latency_s": latency, "retracts": r.retracts,
                     "tokens_per_s": len(r.output) / max(latency, 1e-9)},
            accept_lens=r.accept_lens if self.spec is not None else None, logprobs=r.logprobs)
