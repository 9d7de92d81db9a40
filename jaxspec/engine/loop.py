"""Continuous batching: the host loop that keeps the device busy while requests come and go.

One `step()`:
  1 admit     waiting requests into free slots (prefill chunks, dispatched, not waited on)
  2 budget    if the next cycle could need more KV rows than the budget, retract the most
              recently admitted requests (back to the head of the queue, resumed later by
              recomputing their prefix: prompt + the tokens already streamed)
  3 dispatch  cycle n+1 over all slots, `active` = what the host knew after reading cycle n-1
  4 read      everything dispatched before cycle n+1 (admissions' first tokens, cycle n):
              stop conditions, detokenizing, streaming; finished slots are freed
Steps 4 and then 1-2 of the next step run while the device works on cycle n+1 (JAX dispatch is
asynchronous). A slot that finished in cycle n runs in cycle n+1 too; its output is dropped:
every dispatched output carries the run ids of its slots, and a run that has finished, been
aborted or retracted no longer exists. That one extra cycle needs KV rows: each slot has 2E rows
of slack past max_model_len (E = tokens per cycle), which the budget counts as well.

KV budget: `kv_budget` rows in all (default: slots x max rows, never binding). A live slot
reserves its committed rows, plus E for each dispatched cycle not yet read, plus E for the cycle
about to go. Admission waits while the newcomer's prompt + E would not fit beside the running
requests; a request that alone could never fit is rejected when added.

Sampling: every request's parameters, rng key (PRNGKey(seed), else the engine's key folded with
the request's serial number) and token counts are written into its slot at admission, so greedy,
sampled, penalized and logprob requests share a batch and nothing recompiles. A retracted request
resumes where it stopped: its last token becomes the root again (nothing redrawn), its output is
counted for the penalties and its key is advanced past the draws it made, so its output is the
same as without the retract.
"""
from __future__ import annotations

import bisect
import collections
import dataclasses
import functools
import gc
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Union

import jax
import numpy as np

from jaxspec.sampling import (FULL, LEAN, VARIANTS, Features, SamplingParams, flat_params,
                              logprob_dicts, seed_key)
from jaxspec.spec.admit import AdmitArgs
from jaxspec.spec.admit_packed import build_pack

RequestId = Union[int, str]

# The most tokens one packed admission computes (`Engine(pack_max_tokens=)`): its activations
# and its [R, W, W] pack mask grow with it, and a larger pack only splits into more calls.
PACK_MAX_TOKENS = 32768


@dataclasses.dataclass
class StreamDelta:
    """What a step produced for one request: the new tokens and text since the last delta."""
    request_id: RequestId
    token_ids: List[int]
    text: str
    finished: bool
    finish_reason: Optional[str]      # "stop", "length", "abort" once finished
    logprobs: Optional[List[dict]] = None   # per new token {token: logprob}, when asked for


@dataclasses.dataclass
class Request:
    request_id: RequestId
    prompt: List[int]
    sp: SamplingParams
    stop_ids: frozenset
    stop: tuple                         # stop strings (cut from the text, never streamed)
    output: List[int] = dataclasses.field(default_factory=list)
    accept_lens: List[int] = dataclasses.field(default_factory=list)
    text: str = ""                      # final text once finished
    sent_text: int = 0                  # characters of text already streamed
    # Incremental detokenization (as vLLM): text of output[:read_offset], and where the last
    # decode window started; each step decodes only the tokens since then.
    detok_text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    decoder: Any = None                 # its incremental decoder (False: none, decode windows)
    finish_reason: Optional[str] = None
    retracts: int = 0
    t_arrival: float = 0.0
    t_first: Optional[float] = None
    t_finish: Optional[float] = None
    pending_tokens: List[int] = dataclasses.field(default_factory=list)  # not yet in a delta
    serial: int = 0                     # the engine's count of requests: unseeded rng keys
    logprobs: Optional[List[dict]] = None   # per output token, when sp.logprobs is set
    pending_logprobs: List[dict] = dataclasses.field(default_factory=list)
    seq: int = 0                        # add order: a step's deltas of running requests follow it
    # False: no deltas while it runs, one when it ends with all its tokens and text, so no step
    # builds a delta or detokenizes for this request (LLM.generate reads only the end)
    stream: bool = True

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class _Run:
    """One admission of a request into a slot; ends at finish, abort or retract."""
    run_id: int
    req: Request
    slot: int
    order: int                          # admission order: retract takes the largest


def freeze_startup_heap():
    """Collects, then freezes what is left (gc.freeze): Python's cyclic collector leaves those
    objects out of every later collection. A serving process holds millions of long-lived
    objects after warm-up (compiled programs, jit caches, tracing state); a full collection
    that walks them stalls the host while the device waits. vLLM freezes its startup heap the
    same way. Frozen objects are still freed when their last reference goes; reference cycles
    among them wait for the next call (which unfreezes and collects first, so an engine
    dropped before another one warms up does not keep its device buffers) or gc.unfreeze()."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def _stack(parts):
    """Per-device argument tuples (numpy leaves) -> one tuple with [devices, ...] leaves."""
    return jax.tree_util.tree_map(lambda *x: np.stack(x), *parts)


@dataclasses.dataclass
class EngineStats:
    cycles: int = 0
    admissions: int = 0                 # requests admitted (resumes included)
    prefill_chunks: int = 0             # admission dispatches
    retracts: int = 0
    host_s: float = 0.0                 # time in step() not spent waiting on the device
    wait_s: float = 0.0                 # time blocked reading device outputs
    dispatch_s: float = 0.0             # of host_s: in the backend's admit and cycle calls
    admit_dispatch_s: float = 0.0       # of dispatch_s: in the admission calls (a numpy
    #                                     argument makes one wait for the queued work)
    # admission dispatches by (slot bucket, chunk width, features, form: `admission_forms`):
    # what the device ran besides the cycles (bench/bench_engine.py times each shape to count
    # the device's whole load)
    admit_shapes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    call_sizes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    step_s: List[float] = dataclasses.field(default_factory=list)
    step_start: List[float] = dataclasses.field(default_factory=list)   # perf_counter at each
    # what each step dispatched, beside step_s: (admission calls, cycle call size or 0, short
    # build, seconds in the admission calls, in the cycle call, waiting on the device): a slow
    # step's record says which programs it ran and where its time went
    step_what: List[tuple] = dataclasses.field(default_factory=list)


def _buckets(smallest: int, largest: int, growth: int) -> List[int]:
    """smallest * growth**k below `largest`, then `largest`."""
    out = [smallest]
    while out[-1] * growth < largest:
        out.append(out[-1] * growth)
    return out + [largest] if out[-1] < largest else out


PACK_ROWS = ("pow2", "fine")


def _row_counts(r_max: int, ladder: str) -> List[int]:
    """Row counts of the multi-row packs, 2 .. r_max: powers of 2 ('pow2'), or with 3 * 2**k
    between them ('fine': 2, 3, 4, 6, 8, 12, ..), which pads a pack to at most 1.5x its rows
    instead of 2x, for one more program per doubling."""
    rows = _buckets(2, r_max, 2) if r_max > 1 else []
    if ladder == "fine":
        rows = sorted(set(rows) | {3 * r // 2 for r in rows if 3 * r // 2 < r_max})
    return rows


def _bucket(n: int, buckets: List[int]) -> int:
    """The smallest bucket >= n (n never exceeds the largest)."""
    return buckets[bisect.bisect_left(buckets, n)]


def _cycles_kept(accepts: List[int], kept: int) -> List[int]:
    """The accept lengths of the cycles whose tokens a request kept: accepts, those of a call's
    cycles in order (each emitted accept + 1 tokens); kept, the tokens taken (fewer when the
    request ended inside the call)."""
    out, total = [], 0
    for a in accepts:
        if total >= kept:
            break
        out.append(a)
        total += a + 1
    return out


class Engine:
    """backend: SpecBackend or PlainBackend. max_model_len: prompt + max_tokens per request.
    The backend's state has max_model_len + 2 * emit rows per slot.

    chunk: the longest prefill chunk. Admission shapes (one executable each): chunk widths
    min_chunk * bucket_growth**k below chunk, and chunk; slot counts bucket_growth**k below the
    slot count, and it. A chunk runs at the smallest width and slot count that hold it, padded:
    its cost grows with both, up to bucket_growth times the unpadded one. 4 (the default: 16,
    64, 256, 512 wide; 1, 4, 16, 64 slots) keeps warm-up short and costs little where prefill is
    cheap (a small model: a chunk's time is mostly reading the weights); 2 halves the worst
    padding for a model whose prefill is compute bound, for about twice the compilations.
    width_growth: the ratio of successive chunk widths alone (default bucket_growth). Short chat
    prompts sit between the default widths: MT-bench's (median 68 tokens in SmolLM2's template)
    run at 1.83x their tokens with widths 16, 64, 256, 512 and at 1.35x with 2 (16, 32, .., 512),
    which costs 2 more widths per slot bucket to compile, not the slot buckets' growth too.
    compile_workers: threads compiling the warm-up shapes. Default: the CPU count on an
    accelerator's host; 1 on the CPU backend, whose compilations share the cores with everything
    else (measured slower with 2 threads than with 1 on a 2-core machine).
    detokenize: token ids -> text (needed for text deltas and stop strings).
    stream_decoder: () -> a fresh incremental decoder (`feed(ids) -> str`, e.g.
    `Tokenizer.stream_decoder`) or None; running text then costs one step of it per new token
    instead of two decodes of a window per step. Its text must be a prefix of detokenize's.
    admit_interval: while slots are running, admit waiting requests only every this many steps
    (device calls; SGLang's --num-continuous-decode-steps). Each admission is a dispatch of its
    own whose host cost does not shrink with the requests it carries, so gathering newcomers
    saves host time per step where requests finish often (large batches) at the cost of slots
    idling up to admit_interval - 1 steps. An engine with nothing running admits at once.
    `LLM` passes `backends.default_admit_interval` unless told otherwise.
    pack_first_chunks: first chunks run packed (`spec.admit_packed`): an admission's newcomers
    end to end in one row of T tokens, T in min_chunk * 2**k up to pack_tokens (default 2 x
    chunk), or first-fit in R rows of pack_tokens (R = 2, 4, .. up to what every slot's first
    chunk needs, and at most pack_max_tokens tokens in all, by default PACK_MAX_TOKENS or one
    row: more newcomers take more packs; pack_rows 'fine' adds 3, 6, 12, .. rows),
    at most T / min_chunk requests in T tokens, instead of padded to the slot
    bucket and the longest prompt's width. False: the padded first-chunk form (bucket_growth,
    width_growth).
    """

    def __init__(self, backend, *, max_model_len: int, vocab_size: int, eos_ids: Iterable[int] = (),
                 kv_budget: Optional[int] = None, chunk: int = 512, min_chunk: int = 16,
                 bucket_growth: int = 4, compile_workers: Optional[int] = None,
                 detokenize: Optional[Callable[[List[int]], str]] = None,
                 admit_interval: int = 1, width_growth: Optional[int] = None,
                 stream_decoder: Optional[Callable[[], Any]] = None,
                 pack_first_chunks: bool = True, pack_tokens: Optional[int] = None,
                 pack_max_tokens: Optional[int] = None, pack_rows: str = "pow2"):
        self.backend = backend
        if admit_interval < 1:
            raise ValueError(f"admit_interval must be >= 1, got {admit_interval}")
        self.admit_interval = admit_interval
        self._since_admit = 0                              # cycles since the last admission
        self.slots, self.emit = backend.slots, backend.emit
        self.max_model_len, self.vocab_size = max_model_len, vocab_size
        if backend.max_len < max_model_len + 2 * self.emit:
            raise ValueError(f"backend rows per slot ({backend.max_len}) must be at least "
                             f"max_model_len + 2 * {self.emit}")
        self.eos_ids = frozenset(int(t) for t in eos_ids)
        self.kv_budget = kv_budget if kv_budget is not None else self.slots * backend.max_len
        width_growth = bucket_growth if width_growth is None else width_growth
        if not 1 <= min_chunk <= chunk or bucket_growth < 2 or width_growth < 2:
            raise ValueError(f"need 1 <= min_chunk ({min_chunk}) <= chunk ({chunk}), "
                             f"bucket_growth ({bucket_growth}) >= 2 and width_growth "
                             f"({width_growth}) >= 2")
        self.chunk, self.min_chunk = chunk, min_chunk
        self.widths = _buckets(min_chunk, chunk, width_growth)
        self.slot_buckets = _buckets(1, self.slots, bucket_growth)
        # An admission call's rows are one device's newcomers (`_prefill`): on a data-parallel
        # backend at most its share of the slots, so no form wider than that is compiled.
        self.admit_slots = getattr(backend, "replica_slots", self.slots)
        self.admit_buckets = _buckets(1, self.admit_slots, bucket_growth)
        self.pack_first_chunks = pack_first_chunks
        pack_tokens = 2 * chunk if pack_tokens is None else pack_tokens
        if pack_tokens < chunk:
            raise ValueError(f"pack_tokens ({pack_tokens}) must be >= chunk ({chunk})")
        if pack_max_tokens is None:
            pack_max_tokens = max(PACK_MAX_TOKENS, pack_tokens)
        if pack_max_tokens < pack_tokens:
            raise ValueError(f"pack_max_tokens ({pack_max_tokens}) must be >= pack_tokens "
                             f"({pack_tokens})")
        self.pack_tokens = pack_tokens
        # First-fit leaves at most one row with fewer than pack_tokens // chunk first chunks, so
        # r_max rows (a power of 2) hold every slot's first chunk; at most pack_max_tokens in
        # all (more newcomers: more packs).
        per_row = max(1, pack_tokens // chunk)
        r_max = 1 << (-(-self.admit_slots // per_row) - 1).bit_length()
        r_max = min(r_max, 1 << ((pack_max_tokens // pack_tokens).bit_length() - 1))
        if pack_rows not in PACK_ROWS:
            raise ValueError(f"pack_rows must be one of {PACK_ROWS}, got {pack_rows!r}")
        self.pack_sizes = _buckets(min_chunk, pack_tokens, 2) + \
            [pack_tokens * r for r in _row_counts(r_max, pack_rows)]
        self.compile_workers = compile_workers or (
            1 if jax.default_backend() == "cpu" else os.cpu_count() or 1)
        self.detokenize = detokenize
        self.stream_decoder = stream_decoder if detokenize is not None else None
        self.state = backend.init_state()
        self.waiting: collections.deque = collections.deque()
        self.requests: Dict[RequestId, Request] = {}       # live: waiting or running
        self.slot_run: List[Optional[int]] = [None] * self.slots
        self.live = np.zeros(self.slots, bool)             # slot_run[s] is not None
        self.runs: Dict[int, _Run] = {}
        self.rows = np.zeros(self.slots, np.int64)         # reserved KV rows (0 when free)
        # Tokens a slot's run may still emit beyond its output and the least its calls in
        # flight will bring (backend.min_emit per call): at <= 0 its end by max_tokens is
        # certain, so it runs no further cycle (the host learns it a call late).
        self.left = np.zeros(self.slots, np.int64)
        self._logprob_runs = 0                             # live runs that asked for logprobs
        self._full_runs = 0                                # live runs that need the FULL cycle
        self._device_outputs = jax.default_backend() != "cpu"
        self.device_masks = True        # False: pass the active mask as numpy (benchmarks)
        self.pending: collections.deque = collections.deque()
        self._next_run = 0
        self._next_id = 0
        self._serial = 0
        self._order = 0
        self._deltas: List[StreamDelta] = []
        self.finished_requests: Dict[RequestId, Request] = {}   # until popped
        self.stats = EngineStats()

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: Sequence[int], sp: Optional[SamplingParams] = None, *,
                    request_id: Optional[RequestId] = None, stop: Sequence[str] = (),
                    stream: bool = True) -> RequestId:
        """Queues a request; raises ValueError (and changes nothing) if it can never run.
        stream=False: no deltas while it runs, one when it ends with all its tokens and text.
        That spares the host a delta and two detokenizations per request per step (batch 64:
        64 deltas and 128 decodes a call); its stop strings are still checked as tokens come."""
        sp = sp if sp is not None else SamplingParams()
        if not isinstance(sp, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(sp).__name__}")
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("empty prompt")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        if len(prompt) + sp.max_tokens > self.max_model_len:
            raise ValueError(f"prompt of {len(prompt)} tokens + max_tokens={sp.max_tokens} "
                             f"exceeds the context of {self.max_model_len} tokens (max_model_len)")
        need = len(prompt) + sp.max_tokens + 2 * self.emit
        if need > self.kv_budget:
            raise ValueError(f"prompt of {len(prompt)} tokens + max_tokens={sp.max_tokens} needs "
                             f"{need} KV rows, more than the budget of {self.kv_budget}")
        stop = tuple(stop) + tuple(getattr(sp, "stop", None) or ())
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {stop!r}")
        if stop and self.detokenize is None:
            raise ValueError("stop strings need a detokenizer")
        if request_id is None:
            while self._next_id in self.requests:
                self._next_id += 1
            request_id, self._next_id = self._next_id, self._next_id + 1
        elif request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        stop_ids = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(self.eos_ids))
        req = Request(request_id, prompt, sp, frozenset(stop_ids), stop,
                      t_arrival=time.perf_counter(), serial=self._serial % 2**31,
                      logprobs=[] if sp.logprobs is not None else None, seq=self._serial,
                      stream=stream)
        self._serial += 1
        self.requests[request_id] = req
        self.waiting.append(req)
        return request_id

    def abort(self, request_id: RequestId) -> bool:
        """Ends a waiting or running request; its stream ends with finish_reason 'abort'.
        False if there is no such live request."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        if req in self.waiting:
            self.waiting.remove(req)
        for rid, run in list(self.runs.items()):
            if run.req is req:
                self._free(rid)
        self._finish(req, "abort")
        return True

    def drop(self, request_ids: Iterable[RequestId]):
        """Aborts requests whose caller has gone and forgets them: no finished record and no
        final delta is left behind for anyone to collect."""
        ids = set(request_ids)
        for rid in ids:
            self.abort(rid)
            self.finished_requests.pop(rid, None)
        self._deltas = [d for d in self._deltas if d.request_id not in ids]

    def has_work(self) -> bool:
        return bool(self.requests) or bool(self._deltas) or bool(self.pending)

    # ------------------------------------------------------------------ the loop
    def step(self, collect: bool = True) -> List[StreamDelta]:
        """Admits waiting requests, dispatches the next call, and reads the outputs of all calls
        in flight but the newest. collect=False reads none: the host is free at once for other
        work while the device runs (LLM.generate encodes its later prompts then); the next
        step reads them all."""
        t0 = time.perf_counter()
        st = self.stats
        wait0, admits0, admit_s0 = st.wait_s, st.prefill_chunks, st.admit_dispatch_s
        self._admit()
        self._fit_budget()
        keep, what, cycle_s = 0, (0, False), 0.0
        active = self.live & (self.left > 0)
        if active.any():
            mask = self.backend.device_mask(active) if self.device_masks else active
            t = time.perf_counter()
            # LEAN (no sampling, penalty or logprob code) while every live request is greedy and
            # plain; a slot that leaves keeps its rows (idle), so LEAN stays exact for the rest.
            features = FULL if self._full_runs else LEAN
            size = self.backend.call_size(int(np.count_nonzero(active)))
            short = self._short(size)
            what = (size, short)
            self.state, out = self.backend.cycle(self.state, mask, features, size=size,
                                                 short=short)
            self._prefetch(out)
            cycle_s = time.perf_counter() - t
            st.dispatch_s += cycle_s
            emit, min_emit = self.backend.emits(size)
            st.call_sizes[size] += 1
            self.pending.append(("cycle", out, list(self.slot_run), size))
            self.rows[active] += emit
            self.left[active] -= min_emit
            st.cycles += 1
            keep = 1
        while collect and len(self.pending) > keep:
            self._absorb(self.pending.popleft())
        out, self._deltas = self._deltas, []
        dt = time.perf_counter() - t0
        st.step_s.append(dt)
        st.step_start.append(t0)
        st.step_what.append((st.prefill_chunks - admits0,) + what + (
            st.admit_dispatch_s - admit_s0, cycle_s, st.wait_s - wait0))
        st.host_s += dt - (st.wait_s - wait0)
        return out

    def _short(self, size: int) -> bool:
        """Whether the next call of `size` may run the backend's short build: every live slot
        stays within short_rows rows to the call's end (rows are reserved ahead, so this holds
        while calls are in flight). Only speed depends on the choice."""
        limit = self.backend.short_rows
        if not limit or not self.live.any():
            return False
        return int(self.rows[self.live].max()) + self.backend.emits(size)[0] <= limit

    def drain(self) -> Iterable[StreamDelta]:
        """Steps until every request has finished, yielding deltas as they come."""
        while self.has_work():
            yield from self.step()

    def admission_shapes(self) -> List[tuple]:
        """(slot count, chunk width) of every padded bucket: the padded first-chunk form's
        shapes (`pack_first_chunks=False`); `admission_forms` lists what warm-up compiles."""
        return [(a, w) for a in self.admit_buckets for w in self.widths]

    def pack_requests(self, size: int) -> int:
        """The most requests a pack of `size` tokens holds (its per-request arrays' size)."""
        return min(self.admit_slots, max(1, size // self.min_chunk))

    def pack_shape(self, size: int) -> tuple:
        """(rows, width) of a pack of `size` tokens (one of pack_sizes)."""
        return max(1, size // self.pack_tokens), min(size, self.pack_tokens)

    def admission_forms(self) -> List[tuple]:
        """(requests, tokens a row, form) of every admission program. First chunks: packed
        (form "packed": one row of T tokens for pack_requests(T) requests) or padded (form
        True: every (slot bucket, width) pair). Later chunks (prompts longer than a chunk) are
        always a whole chunk wide, so their general form (False) is compiled once per slot
        count."""
        first = ([(self.pack_requests(t), t, "packed") for t in self.pack_sizes]
                 if self.pack_first_chunks else
                 [(a, w, True) for a, w in self.admission_shapes()])
        return first + [(a, self.chunk, False) for a in self.admit_buckets]

    def padding_admission(self, a: int, w: int, form, features: Features,
                          on_device: bool = False):
        """call(state, lower=False) of the admission program (a, w, form) on padding arguments
        (every row dropped: the state stays as it was); stacked per device on a data-parallel
        backend. on_device (one replica): the arguments placed on the device once, so that
        repeated calls (a benchmark's) neither copy them nor wait for the copy."""
        args = self._pack_args(([], [], 0), w) if form == "packed" else \
            self._chunk_args([], 0 if form else 1, a, w)
        if on_device and self.replicas == 1:
            args = jax.device_put(args)
        return self._admission(form, [args] * self.replicas, features)

    def _admission(self, form, parts, features: Features):
        """call(state, lower=False) of the admission program of `form` (True / False: a padded
        first / later chunk; "packed") on parts[d], device d's arguments: the backend's own
        call on one device, stacked per device on a data-parallel backend."""
        be = self.backend
        if self.replicas > 1:
            args = _stack(parts)
            return lambda state, lower=False: be.admit_stacked(form, state, *args,
                                                               features=features, lower=lower)
        args, = parts
        if form == "packed":
            return lambda state, lower=False: be.admit_packed(state, *args, features=features,
                                                              lower=lower)
        return lambda state, lower=False: be.admit(state, *args, features=features, first=form,
                                                   lower=lower)

    def warmup(self, variants: Sequence[Features] = VARIANTS, execute: Optional[bool] = None,
               freeze_heap: Optional[bool] = None):
        """Compiles the cycle and every admission bucket ahead of time, concurrently (XLA
        compiles without the GIL), so serving never compiles. Tracing stays on this thread;
        each shape's compilation starts as soon as it is traced.
        variants: the program variants to compile (`sampling.Features`; `Features.of` of the
        requests to come). A request that needs another compiles it on its first use. The
        key-advance programs serve only sampled requests, so they come with FULL.
        execute: then run every program once on idle or padding arguments (nothing changes).
        The first run of an executable on a GPU loads its module and builds its CUDA graphs;
        left to serving, that lands on the first requests of each admission shape (on the
        H100 a first pass of a batch-64 run went 27% slower than the two after it,
        bench/RESULTS.md). Default: on accelerators; on the CPU only one idle cycle runs.
        freeze_heap: then `freeze_startup_heap` (default: as execute). What exists now lives
        as long as the engine; a full garbage collection that walks it paused batch-64 passes
        by 0.27-0.39 s on the H200 (bench/RESULTS.md, eighteenth set)."""
        variants = tuple(dict.fromkeys(variants))
        if not variants or any(f not in VARIANTS for f in variants):
            raise ValueError(f"variants must be a non-empty selection of {VARIANTS}, "
                             f"got {variants}")
        programs = self._programs(variants)
        be = self.backend
        with ThreadPoolExecutor(self.compile_workers) as pool:
            jobs, copies = [], []
            for call in programs:
                key, low = call(self.state, lower=True)
                copies.append(be.copies_of(key))
                jobs += [(key, pool.submit(low.compile)) for _ in range(copies[-1])]
            for key, job in jobs:
                be.add_executable(key, job.result())
        seed_key(0)   # compiles the host's seeded-key derivation
        if execute is None:
            execute = jax.default_backend() != "cpu"
        runs = list(zip(programs, copies)) if execute else [(programs[0], 1)]
        for call, n in runs:
            for _ in range(n):               # each copy once: the dispatcher takes turns
                out = call(self.state)
                self.state = out[0] if isinstance(out, tuple) else out
        jax.block_until_ready(self.state)
        if execute if freeze_heap is None else freeze_heap:   # the default follows execute
            freeze_startup_heap()

    def _programs(self, variants) -> List[Callable]:
        """Every program serving may run, each as call(state, lower=False): the backend call on
        idle or padding arguments, which leaves the state as it was. Cycles first (the CPU runs
        only the first: one idle cycle); admissions largest first (they compile longest)."""
        be, idle = self.backend, np.zeros(self.slots, bool)
        shorts = (False, True) if be.short_rows else (False,)
        calls = [functools.partial(be.cycle, active=idle, features=f, size=k, short=s)
                 for f in variants for k in be.sizes for s in shorts]
        for a, w, form in sorted(self.admission_forms(),
                                 key=lambda s: -s[1] * (1 if s[2] == "packed" else s[0])):
            calls += [self.padding_admission(a, w, form, f) for f in variants]
        for a in self.slot_buckets if FULL in variants else ():
            calls.append(functools.partial(be.advance_keys, slot_idx=np.full(a, self.slots,
                                                                             np.int32),
                                           advance=np.zeros(a, np.int32)))
        return calls

    # ------------------------------------------------------------------ admission
    def _need(self) -> int:
        """Rows the live slots may hold once the next cycle has run."""
        return int(self.rows.sum()) + self.emit * int(np.count_nonzero(self.live))

    def _admit(self):
        if not self.waiting:
            return
        if self.live.any() and self._since_admit + 1 < self.admit_interval:
            self._since_admit += 1
            return
        self._since_admit = 0
        free = np.flatnonzero(~self.live).tolist()
        batch = []
        need = self._need()
        while free and self.waiting:
            req = self.waiting[0]
            ids = req.prompt + req.output
            cost = len(ids) + self.emit
            if need + cost > self.kv_budget and (need > 0 or batch):
                break
            self.waiting.popleft()
            slot = free.pop(0)
            run_id = self._next_run
            self._next_run += 1
            self.runs[run_id] = _Run(run_id, req, slot, self._order)
            self._order += 1
            self.slot_run[slot] = run_id
            self.live[slot] = True
            self._logprob_runs += req.logprobs is not None
            self._full_runs += Features.of([req.sp]) is FULL
            self.rows[slot] = len(ids)
            self.left[slot] = req.sp.max_tokens - len(req.output)
            need += cost
            batch.append((run_id, slot, req))
            self.stats.admissions += 1
        if batch:
            self._prefill(batch)

    def _admit_rows(self, req: Request):
        """(token ids to prefill, AdmitArgs fields, key advance) of one request. A resumed
        request (output so far) is prefilled up to its last token, which is given back as the
        root; its key advance is the splits its earlier run made past the first draw."""
        sp, out = req.sp, req.output
        f, i = flat_params(sp)
        fields = dict(n_prompt=len(req.prompt), samp_f=f, samp_i=i,
                      key=seed_key(sp.seed) if sp.seed is not None else np.zeros(2, np.uint32),
                      serial=-1 if sp.seed is not None else req.serial, root=-1)
        if not out:
            return req.prompt, fields, 0
        fields.update(root=out[-1])
        return (req.prompt + out[:-1], fields,
                self.backend.key_advances(len(out), len(req.accept_lens)))

    def _prefill(self, batch):
        """Dispatches the prefill chunks of newly admitted runs, all requests' chunk k together
        (first chunks packed, `pack_first_chunks`), with the admission variant their sampling
        needs; then moves the keys of resumed requests that sample past their earlier draws.
        On a data-parallel backend each device's newcomers (the rows of its slots) are admitted
        on their own and the devices' calls of one shape stacked into one ([devices, ...]
        arguments split over the devices), each device's part at the largest's shape: every
        device prefills only its own newcomers, one dispatch a chunk, with nothing to wait for.
        (A call with every device's rows made each prefill all of them: two H200s spent 9.6 ms
        more than one on an admission of 64 newcomers a GPU, bench/RESULTS.md, fortieth set.)"""
        rows_all = [(rid, slot) + self._admit_rows(req) for rid, slot, req in batch]
        features = Features.of([req.sp for _, _, req in batch])
        per = self.admit_slots
        mine = [[r for r in rows_all if r[1] // per == d] for d in range(self.replicas)]
        k = 0
        if self.pack_first_chunks:
            packs = [self._packs(m) for m in mine]
            for j in range(max(map(len, packs))):
                group = [p[j] if j < len(p) else ([], [], 0) for p in packs]
                t = max(map(self._pack_size, group))
                self._dispatch_groups([g[0] for g in group], t, "packed", features,
                                      [self._pack_args(g, t) for g in group])
            k = 1
        while any(groups := [self._chunk_rows(m, k) for m in mine]):
            shapes = [self._chunk_shape(g, k) for g in groups if g]
            a, width = max(s[0] for s in shapes), max(s[1] for s in shapes)
            self._dispatch_groups(groups, width, k == 0, features,
                                  [self._chunk_args(g, k, a, width) for g in groups])
            k += 1
        self._advance_resumed([(slot, adv) for (_, slot, _, _, adv), (_, _, req)
                               in zip(rows_all, batch) if adv > 0 and req.sp.temperature > 0])

    def _packs(self, rows) -> List[tuple]:
        """rows in order, first-fit into rows of at most pack_tokens first-chunk tokens: groups
        (rows, the pack row of each, pack rows used), one admission each."""
        w, r_max = self.pack_tokens, self.pack_shape(self.pack_sizes[-1])[0]
        a_max = self.pack_requests(self.pack_sizes[-1])
        out, cur, row_of, fill = [], [], [], []
        for r in rows:
            n = min(self.chunk, len(r[2]))
            i = next((k for k, f in enumerate(fill) if f + n <= w), len(fill))
            if (i == len(fill) == r_max) or len(cur) == a_max:
                out.append((cur, row_of, len(fill)))
                cur, row_of, fill, i = [], [], [], 0
            if i == len(fill):
                fill.append(0)
            fill[i] += n
            cur.append(r)
            row_of.append(i)
        return out + [(cur, row_of, len(fill))] if cur else out

    def _chunk_rows(self, rows, k: int):
        """The rows with a k-th prefill chunk."""
        return [r for r in rows if len(r[2]) > k * self.chunk]

    def _chunk_shape(self, rows, k: int) -> tuple:
        """(slot bucket, width) of the k-th chunks of `rows`: a first chunk (padded form) as
        wide as the width bucket of the longest; a later chunk a whole chunk wide (one general
        form per slot count)."""
        width = self.chunk if k else _bucket(max(min(self.chunk, len(r[2])) for r in rows),
                                             self.widths)
        return _bucket(len(rows), self.admit_buckets), width

    def _chunk_args(self, rows, k: int, a: int, width: int):
        """(slot_idx, tokens, start, n_valid, next_tok, AdmitArgs) of the k-th chunks of `rows`
        at slot bucket a and `width` (padding rows after them)."""
        start = k * self.chunk
        n_valid = [min(self.chunk, len(ids) - start) for _, _, ids, _, _ in rows]
        tokens = np.zeros((a, width), np.int32)
        starts = np.zeros(a, np.int32)
        starts[:len(rows)] = start
        slot_idx, nv, nxt, adm = self._admit_args(a, rows, n_valid, start)
        for i, ((_, _, ids, _, _), n) in enumerate(zip(rows, n_valid)):
            tokens[i, :n] = ids[start:start + n]
        return slot_idx, tokens, starts, nv, nxt, adm

    def _pack_size(self, group) -> int:
        """The smallest pack size (of pack_sizes) that holds a `_packs` group."""
        rows, _, used = group
        need = (sum(min(self.chunk, len(r[2])) for r in rows) if used <= 1
                else used * self.pack_tokens)
        return next(s for s in self.pack_sizes
                    if s >= need and self.pack_requests(s) >= len(rows))

    def _pack_args(self, group, t: int):
        """(slot_idx, tokens, lay, n_valid, next_tok, AdmitArgs) of a `_packs` group packed at
        size t (>= its `_pack_size`)."""
        rows, row_of, _ = group
        chunks = [ids[:self.chunk] for _, _, ids, _, _ in rows]
        a = self.pack_requests(t)
        tokens, lay = build_pack(chunks, row_of, *self.pack_shape(t), a)
        slot_idx, nv, nxt, adm = self._admit_args(a, rows, list(map(len, chunks)), 0)
        return slot_idx, tokens, lay, nv, nxt, adm

    @property
    def replicas(self) -> int:
        """Devices the backend's slots are split over (`parallel.dp_engine`), else 1."""
        return self.slots // self.admit_slots

    def _dispatch_groups(self, groups, width: int, form, features, parts):
        """One admission call: groups[d] device d's rows, parts[d] its arguments (`_admission`);
        filed under (slot count, width, features, form)."""
        a = len(parts[0][0])
        ids = [rid for g in groups for rid in [r[0] for r in g] + [-1] * (a - len(g))]
        call = self._admission(form, parts, features)
        self._dispatch_admit(ids, (a, width, features, form), lambda: call(self.state))

    def _admit_args(self, a: int, rows, n_valid, start: int):
        """(slot_idx, n_valid, next_tok, AdmitArgs) of an admission of `a` request rows: the
        rows' chunks from `start`, then padding (slot index B, nothing valid)."""
        slot_idx = np.full(a, self.slots, np.int32)
        nv = np.zeros(a, np.int32)
        nxt = np.full(a, -1, np.int32)
        adm = AdmitArgs.host(a)
        for i, ((_, slot, ids, fields, _), n) in enumerate(zip(rows, n_valid)):
            slot_idx[i], nv[i] = slot, n
            if start + n < len(ids):
                nxt[i] = ids[start + n]
            for name, value in fields.items():
                getattr(adm, name)[i] = value
        return slot_idx, nv, nxt, adm

    def _dispatch_admit(self, run_ids, shape: tuple, call):
        """Runs one admission call (-> state, first tokens) and files its output: run_ids[i]
        is the run of its i-th first token (-1 or a run gone: dropped when read)."""
        t = time.perf_counter()
        self.state, first = call()
        self._prefetch(first)
        dt = time.perf_counter() - t
        self.stats.dispatch_s += dt
        self.stats.admit_dispatch_s += dt
        self.stats.prefill_chunks += 1
        self.stats.admit_shapes[shape] += 1
        self.pending.append(("admit", first, run_ids, None))

    def _advance_resumed(self, moved):
        """moved: (slot, key advance) of resumed requests that sample (greedy ones never read
        their key). Rare (a retracted sampling request): one call, at a slot bucket."""
        if not moved:
            return
        a = _bucket(len(moved), self.slot_buckets)
        idx, adv = np.full(a, self.slots, np.int32), np.zeros(a, np.int32)
        idx[:len(moved)], adv[:len(moved)] = zip(*moved)
        self.state = self.backend.advance_keys(self.state, idx, adv)

    # ------------------------------------------------------------------ retract
    def _fit_budget(self):
        while self._need() > self.kv_budget:
            live = [rid for rid in self.slot_run if rid is not None]   # rare: a list is fine
            if len(live) <= 1:
                return  # one request alone always fits (checked when it was added)
            victim = max(live, key=lambda rid: self.runs[rid].order)
            req = self.runs[victim].req
            self._free(victim)
            req.retracts += 1
            self.stats.retracts += 1
            # Resumed by recomputing prompt + the tokens streamed so far; outputs of its cycles
            # in flight are dropped (its run id is gone), so nothing is streamed twice.
            self.waiting.appendleft(req)

    def _free(self, run_id: int):
        run = self.runs.pop(run_id)
        self.slot_run[run.slot] = None
        self.live[run.slot] = False
        self._logprob_runs -= run.req.logprobs is not None
        self._full_runs -= Features.of([run.req.sp]) is FULL
        self.rows[run.slot] = 0

    # ------------------------------------------------------------------ reading outputs
    def _wants_logprobs(self, runs) -> bool:
        return self._logprob_runs > 0 and any(
            rid is not None and rid in self.runs and self.runs[rid].req.logprobs is not None
            for rid in runs)

    def _prefetch(self, out):
        """Starts the device->host copies of what the host will read (tokens, accept lengths,
        and logprobs while a live run asked for them) as soon as the device has them, so the
        read a step later finds them on the host instead of making a round trip per array.
        On the CPU the outputs are in host memory already: nothing to start."""
        if not self._device_outputs:
            return
        arrays = [out.tokens, getattr(out, "accept", None)]
        if self._logprob_runs:
            arrays += [out.logprob, out.top_ids, out.top_logprobs]
        for x in arrays:
            if x is not None and hasattr(x, "copy_to_host_async"):
                x.copy_to_host_async()

    def _absorb(self, item):
        kind, dev, runs, size = item          # size: a cycle's call size (None: admission)
        t = time.perf_counter()
        # Logprobs cross to the host only when a request in this batch asked for them.
        lp = None
        if self._wants_logprobs(runs):
            lp = [np.asarray(x) for x in (dev.logprob, dev.top_ids, dev.top_logprobs)]
        toks = np.asarray(dev.tokens)
        acc = None if kind == "admit" or dev.accept is None else np.asarray(dev.accept)
        self.stats.wait_s += time.perf_counter() - t
        touched: List[Request] = []
        if kind == "admit":
            for i, (rid, tok) in enumerate(zip(runs, toks.tolist())):
                if tok >= 0 and rid in self.runs:
                    touched.append(self.runs[rid].req)
                    self.left[self.runs[rid].slot] -= 1
                    self._take(self.runs[rid], [tok],
                               None if lp is None else [x[i:i + 1] for x in lp])
        else:
            # One pass over the block in numpy; Python only per live slot, never per token.
            # Emitted tokens come first in a row, -1 after them.
            n_got = np.count_nonzero(toks >= 0, axis=1)
            # (a live slot with no token sat this call out: its end was already certain)
            slots = [s for s, rid in enumerate(runs)
                     if rid is not None and rid in self.runs and n_got[s]]
            emit, min_emit = self.backend.emits(size)
            self.rows[slots] -= emit - n_got[slots]        # rows actually written
            rows, n_got = toks.tolist(), n_got.tolist()
            # [B] (one cycle per call) or [B, cycles]: per slot, a list of the call's cycles
            acc = None if acc is None else acc.reshape(len(acc), -1).tolist()
            for slot in slots:
                run = self.runs[runs[slot]]
                req = run.req
                touched.append(req)
                n, before = n_got[slot], len(req.output)
                self._take(run, rows[slot][:n],
                           None if lp is None else [x[slot][:n] for x in lp])
                kept = len(req.output) - before
                self.left[slot] += min_emit - kept     # the guess, then the fact
                if acc is not None:
                    req.accept_lens += _cycles_kept(acc[slot], kept)
        self._flush(touched)

    def _take(self, run: _Run, tokens: List[int], lp=None):
        """lp: (logprob [n], top_ids [n, k], top_logprobs [n, k]) of the tokens, or None.
        Tokens up to the first that ends the request are kept: a stop token, max_tokens, or
        (checked token by token) a stop string."""
        req = run.req
        if req.t_first is None:
            req.t_first = time.perf_counter()
        if req.stop:
            return self._take_each(run, tokens, lp)
        n = len(tokens)
        reason = None
        room = req.sp.max_tokens - len(req.output)      # >= 1 while running
        if not req.stop_ids.isdisjoint(tokens):
            n = next(i for i, t in enumerate(tokens) if t in req.stop_ids) + 1
            reason = "stop"
        if room <= n and (reason is None or room < n):
            n, reason = room, "length"
        kept = tokens[:n] if n < len(tokens) else tokens
        req.output += kept
        req.pending_tokens += kept
        if req.logprobs is not None:
            d = logprob_dicts(kept, lp[0][:n], lp[1][:n], lp[2][:n], req.sp.logprobs)
            req.logprobs += d
            req.pending_logprobs += d
        if reason:
            # The rest of the accepted chain is dropped: never streamed.
            self._free(run.run_id)
            self._finish(req, reason)

    def _take_each(self, run: _Run, tokens: List[int], lp=None):
        """_take for a request with stop strings: the text is checked after every token."""
        req = run.req
        for i, tok in enumerate(tokens):
            req.output.append(tok)
            req.pending_tokens.append(tok)
            if req.logprobs is not None:
                d = logprob_dicts([tok], lp[0][i:i + 1], lp[1][i:i + 1], lp[2][i:i + 1],
                                  req.sp.logprobs)
                req.logprobs += d
                req.pending_logprobs += d
            if tok in req.stop_ids:
                reason = "stop"
            elif len(req.output) >= req.sp.max_tokens:
                reason = "length"
            else:
                reason = self._stop_string(req)
            if reason:
                self._free(run.run_id)
                self._finish(req, reason)
                return

    def _stop_string(self, req: Request) -> Optional[str]:
        if not req.stop:
            return None
        text = self._text_so_far(req)
        window = max(len(s) for s in req.stop) + 16   # a new token adds few characters
        tail = text[max(0, len(text) - window):]
        return "stop" if any(s in tail for s in req.stop) else None

    def _text_so_far(self, req: Request) -> str:
        """Text of req.output, O(new tokens) per call: through the request's incremental
        decoder when the engine has one, else by decoding only the tokens since the last call
        plus the one before them (byte-level BPE and SentencePiece merge across that boundary).
        Either way an incomplete UTF-8 character at the end is held back until its bytes
        arrive."""
        ids = req.output
        if req.read_offset >= len(ids):
            return req.detok_text
        if req.decoder is None:
            req.decoder = (self.stream_decoder() if self.stream_decoder else None) or False
        if req.decoder:
            req.detok_text += req.decoder.feed(ids[req.read_offset:])
            req.read_offset = len(ids)
        else:
            prefix = self.detokenize(ids[req.prefix_offset:req.read_offset])
            new = self.detokenize(ids[req.prefix_offset:])
            if len(new) > len(prefix) and not new.endswith("\ufffd"):
                req.detok_text += new[len(prefix):]
                req.prefix_offset, req.read_offset = req.read_offset, len(ids)
        return req.detok_text

    def _finish(self, req: Request, reason: str):
        req.finish_reason = reason
        req.t_finish = time.perf_counter()
        self.requests.pop(req.request_id, None)
        if self.detokenize is not None:
            text = self.detokenize(req.output)
            if reason == "stop" and req.stop:
                cut = [text.find(s) for s in req.stop if s in text]
                text = text[:min(cut)] if cut else text
            req.text = text
        self.finished_requests[req.request_id] = req
        self._delta(req)

    def pop_finished(self, request_id: RequestId) -> Request:
        return self.finished_requests.pop(request_id)

    def _flush(self, touched: List[Request]):
        """Deltas of the running requests that got tokens, in the order they were added."""
        live = [r for r in touched if r.stream and r.pending_tokens and not r.finished]
        live.sort(key=lambda r: r.seq)
        for req in live:
            self._delta(req)

    def _delta(self, req: Request):
        """A delta of a finished request, or of a running one that streams (`_flush`)."""
        text = ""
        if self.detokenize is not None:
            if req.finished:
                full = req.text
            else:
                full = self._text_so_far(req)
                hold = max((len(s) for s in req.stop), default=1) - 1  # a stop string may grow
                full = full[:max(req.sent_text, len(full) - hold)]
            text, req.sent_text = full[req.sent_text:], max(req.sent_text, len(full))
        lps = req.pending_logprobs if req.logprobs is not None else None
        self._deltas.append(StreamDelta(req.request_id, req.pending_tokens, text, req.finished,
                                        req.finish_reason, lps))
        req.pending_tokens, req.pending_logprobs = [], []
