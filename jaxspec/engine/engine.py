"""The engine: continuous batching over a backend's static set of slots.

One `step()`:
  admit     waiting requests into free slots (`scheduler`), their prefill dispatched
            (`prefill_plan`, `admission`), not waited on
  retract   if the next call could need more KV rows than the budget, the newest requests
  dispatch  the next call over the active slots
  read      every output dispatched before that call: tokens into their requests (`output`),
            finished slots freed, stream deltas
The read of call n runs while the device works on call n+1 (JAX dispatch is asynchronous). A
slot that finished in call n runs in call n+1 too; its output is dropped: every dispatched output
carries the run ids of its slots, and a run that has ended no longer exists. That one extra call
needs KV rows: each slot has 2E rows of slack past max_model_len (E = tokens per call).

Sampling: every request's parameters, rng key (PRNGKey(seed), else the engine's key folded with
the request's serial number) and token counts are written into its slot at admission, so greedy,
sampled, penalized and logprob requests share a batch and nothing recompiles. A retracted
request resumes where it stopped (its last token the root again, its key advanced past its
draws), so its output is the same as without the retract.
"""
from __future__ import annotations

import collections
import functools
import time
from typing import Dict, Iterable, List, Optional, Sequence

import jax
import numpy as np

from jaxspec.engine import compile as compile_lib
from jaxspec.engine.config import EngineConfig
from jaxspec.engine.output import OutputProcessor
from jaxspec.engine.prefill_plan import PrefillPlanner, bucket, buckets
from jaxspec.engine.request import Request, RequestId, StreamDelta
from jaxspec.engine.scheduler import Scheduler
from jaxspec.engine.stats import EngineStats
from jaxspec.sampling import FULL, LEAN, VARIANTS, Features, SamplingParams, flat_params, \
    seed_key


class Engine:
    """backend: SpecBackend or PlainBackend, with max_model_len + 2 * emit rows per slot.
    config: its options (None fields take their defaults; max_model_len defaults to what the
    backend's rows hold; max_batch is the backend's slots per replica). detokenize /
    stream_decoder: see `output`."""

    def __init__(self, backend, config: EngineConfig = EngineConfig(), *, vocab_size: int,
                 eos_ids: Iterable[int] = (), detokenize=None, stream_decoder=None):
        self.slots, self.emit = backend.slots, backend.emit
        # the backend's slots are what runs: max_batch follows them (the defaults read it)
        config = config.replace(max_batch=self.slots // backend.replicas).resolved(
            slots=self.slots, speculative=backend.spec is not None,
            model_limit=backend.max_len - 2 * self.emit)
        self.backend, self.config = backend, config
        self.max_model_len, self.vocab_size = config.max_model_len, vocab_size
        if backend.max_len < config.max_model_len + 2 * self.emit:
            raise ValueError(f"backend rows per slot ({backend.max_len}) must be at least "
                             f"max_model_len + 2 * {self.emit}")
        self.eos_ids = frozenset(int(t) for t in eos_ids)
        budget = config.kv_budget or self.slots * backend.max_len
        self.scheduler = Scheduler(self.slots, self.emit, budget, config.admit_interval or 1)
        self.planner = PrefillPlanner(config, self.slots, backend.replicas)
        # key-advance calls (resumed sampling requests) over all slots: their slot counts
        self.advance_buckets = buckets(1, self.slots, config.slot_growth)
        self.output = OutputProcessor(detokenize, stream_decoder)
        self.state = backend.init_state()
        self.requests: Dict[RequestId, Request] = {}       # live: waiting or running
        self.finished_requests: Dict[RequestId, Request] = {}   # until popped
        self.pending: collections.deque = collections.deque()
        self.stats = EngineStats()
        self._deltas: List[StreamDelta] = []
        self._device_outputs = jax.default_backend() != "cpu"
        self._next_id = self._serial = 0

    @property
    def kv_budget(self) -> int:
        return self.scheduler.kv_budget

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: Sequence[int], sp: Optional[SamplingParams] = None, *,
                    request_id: Optional[RequestId] = None, stop: Sequence[str] = (),
                    stream: bool = True) -> RequestId:
        """Queues a request; raises ValueError (and changes nothing) if it can never run.
        stream=False: no deltas while it runs, one when it ends with all its tokens and text
        (no per-step detokenization for it)."""
        sp = sp if sp is not None else SamplingParams()
        if not isinstance(sp, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(sp).__name__}")
        prompt = [int(t) for t in prompt]
        self._check(prompt, sp)
        stop = tuple(stop) + tuple(sp.stop or ())
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {stop!r}")
        if stop and self.output.detokenize is None:
            raise ValueError("stop strings need a detokenizer")
        request_id = self._new_id(request_id)
        stop_ids = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(self.eos_ids))
        req = Request(request_id, prompt, sp, frozenset(stop_ids), stop,
                      serial=self._serial % 2**31, seq=self._serial, stream=stream,
                      logprobs=[] if sp.logprobs is not None else None,
                      t_arrival=time.perf_counter())
        self._serial += 1
        self.requests[request_id] = req
        self.scheduler.waiting.append(req)
        return request_id

    def _check(self, prompt: List[int], sp: SamplingParams):
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

    def _new_id(self, request_id) -> RequestId:
        if request_id is None:
            while self._next_id in self.requests:
                self._next_id += 1
            request_id, self._next_id = self._next_id, self._next_id + 1
        elif request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        return request_id

    def abort(self, request_id: RequestId) -> bool:
        """Ends a waiting or running request; its stream ends with finish_reason 'abort'.
        False if there is no such live request."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        self.scheduler.remove(req)
        self._finish(req, "abort")
        return True

    def drop(self, request_ids: Iterable[RequestId]):
        """Aborts requests whose caller has gone and forgets them (no record, no delta)."""
        ids = set(request_ids)
        for rid in ids:
            self.abort(rid)
            self.finished_requests.pop(rid, None)
        self._deltas = [d for d in self._deltas if d.request_id not in ids]

    def pop_finished(self, request_id: RequestId) -> Request:
        return self.finished_requests.pop(request_id)

    def has_work(self) -> bool:
        return bool(self.requests) or bool(self._deltas) or bool(self.pending)

    @property
    def waiting(self):
        return self.scheduler.waiting

    # ------------------------------------------------------------------ the loop
    def step(self, collect: bool = True) -> List[StreamDelta]:
        """Admits, retracts, dispatches the next call, and reads the outputs of all calls in
        flight but the newest (none with collect=False: the host is free at once)."""
        with self.stats.step(self):
            self._prefill(self.scheduler.admit())
            self.stats.retracts += len(self.scheduler.retract())
            keep = self._dispatch_cycle()
            while collect and len(self.pending) > keep:
                self._absorb(*self.pending.popleft())
            out, self._deltas = self._deltas, []
        return out

    def drain(self) -> Iterable[StreamDelta]:
        """Steps until every request has finished, yielding deltas as they come."""
        while self.has_work():
            yield from self.step()

    def _dispatch_cycle(self) -> int:
        """Dispatches the next call over the active slots; 1 if one went, else 0."""
        sch, be = self.scheduler, self.backend
        active = sch.active()
        if not active.any():
            return 0
        # LEAN (no sampling, penalty or logprob code) while every live request is greedy and
        # plain; a slot that leaves keeps its rows, so LEAN stays exact for the others.
        features = FULL if sch.full_runs else LEAN
        size = be.call_size(int(np.count_nonzero(active)))
        short = self._short(size)
        with self.stats.timed("cycle", (size, short)):
            self.state, out = be.cycle(self.state, be.placement.put_mask(active), features,
                                       size=size, short=short)
            self._prefetch(out)
        self.pending.append(("cycle", out, list(sch.slot_run), size))
        sch.dispatched(active, *be.emits(size))
        return 1

    def _short(self, size: int) -> bool:
        """Whether the call may run the short build: every live slot stays within short_rows
        rows to the call's end (rows are reserved ahead). Only speed depends on it."""
        limit, sch = self.backend.short_rows, self.scheduler
        if not limit or not sch.live.any():
            return False
        return int(sch.rows[sch.live].max()) + self.backend.emits(size)[0] <= limit

    # ------------------------------------------------------------------ admission
    def _prefill(self, runs):
        """Dispatches the prefill of newly admitted runs, with the variant their sampling
        needs; then moves the keys of resumed requests that sample past their earlier draws."""
        if not runs:
            return
        self.stats.admissions += len(runs)
        rows = [(run.run_id, run.slot) + self._admit_row(run.req) for run in runs]
        features = Features.of([run.req.sp for run in runs])
        for adm in self.planner.plan([r[:4] for r in rows]):
            with self.stats.timed("admit", adm.shape + (features, adm.form)):
                self.state, first = self.backend.admit(self.state, adm.form, adm.parts,
                                                       features=features)
                self._prefetch(first)
            self.pending.append(("admit", first, adm.run_ids, None))
        self._advance_resumed([(r[1], r[4]) for r, run in zip(rows, runs)
                               if r[4] > 0 and run.req.sp.temperature > 0])

    def _admit_row(self, req: Request):
        """(token ids to prefill, AdmitArgs fields, key advance) of one request. A resumed
        request is prefilled up to its last token, which is given back as the root."""
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

    def _advance_resumed(self, moved):
        """moved: (slot, key advance) of resumed requests that sample. Rare: one call."""
        if not moved:
            return
        a = bucket(len(moved), self.advance_buckets)
        idx, adv = np.full(a, self.slots, np.int32), np.zeros(a, np.int32)
        idx[:len(moved)], adv[:len(moved)] = zip(*moved)
        self.state = self.backend.advance_keys(self.state, idx, adv)

    # ------------------------------------------------------------------ reading outputs
    def _prefetch(self, out):
        """Starts the device->host copies of what the host will read (tokens, accept lengths,
        logprobs while a live run asked for them), so the read a step later finds them there.
        On the CPU the outputs are in host memory already."""
        if not self._device_outputs:
            return
        arrays = [out.tokens, getattr(out, "accept", None)]
        if self.scheduler.logprob_runs:
            arrays += [out.logprob, out.top_ids, out.top_logprobs]
        for x in arrays:
            if x is not None and hasattr(x, "copy_to_host_async"):
                x.copy_to_host_async()

    def _absorb(self, kind: str, dev, run_ids, size):
        """Reads one dispatched output: tokens into the runs still alive."""
        be, sch = self.backend, self.scheduler
        with self.stats.waiting():
            runs = [sch.run_of(rid) for rid in run_ids]
            lp = None
            if sch.logprob_runs and any(r and r.req.logprobs is not None for r in runs):
                lp = [be.host(x) for x in (dev.logprob, dev.top_ids, dev.top_logprobs)]
            toks = be.host(dev.tokens)
            acc = None if kind == "admit" or dev.accept is None else be.host(dev.accept)
        touched = []
        if kind == "admit":
            for i, (run, tok) in enumerate(zip(runs, toks.tolist())):
                if tok >= 0 and run:
                    touched.append(run.req)
                    sch.left[run.slot] -= 1
                    self._take(run, [tok], None if lp is None else [x[i:i + 1] for x in lp])
        else:
            # One pass over the block in numpy; Python only per live slot, never per token.
            n_got = np.count_nonzero(toks >= 0, axis=1)
            slots = [s for s, run in enumerate(runs) if run and n_got[s]]
            emit, min_emit = be.emits(size)
            sch.rows[slots] -= emit - n_got[slots]        # rows actually written
            rows, n_got = toks.tolist(), n_got.tolist()
            acc = None if acc is None else acc.reshape(len(acc), -1).tolist()
            for slot in slots:
                run = runs[slot]
                touched.append(run.req)
                before = len(run.req.output)
                self._take(run, rows[slot][:n_got[slot]],
                           None if lp is None else [x[slot][:n_got[slot]] for x in lp])
                kept = len(run.req.output) - before
                sch.left[slot] += min_emit - kept     # the guess, then the fact
                if acc is not None:
                    run.req.accept_lens += _cycles_kept(acc[slot], kept)
        live = sorted((r for r in touched if r.stream and r.pending_tokens and not r.finished),
                      key=lambda r: r.seq)
        self._deltas += [self.output.delta(r) for r in live]

    def _take(self, run, tokens, lp):
        reason = self.output.take(run.req, tokens, lp)
        if reason:
            self.scheduler.free(run.run_id)
            self._finish(run.req, reason)

    def _finish(self, req: Request, reason: str):
        self.output.finish(req, reason)
        self.requests.pop(req.request_id, None)
        self.finished_requests[req.request_id] = req
        self._deltas.append(self.output.delta(req))

    # ------------------------------------------------------------------ warm-up
    def warmup(self, variants: Sequence[Features] = VARIANTS, execute: Optional[bool] = None,
               freeze_heap: Optional[bool] = None):
        """Compiles every program serving may run ahead of time, so serving never compiles.
        variants: the `sampling.Features` variants to compile (a request that needs another
        compiles it on first use). execute: then run each once on idle or padding arguments
        (default: on accelerators, where a first run loads modules and builds CUDA graphs).
        freeze_heap: then `compile.freeze_startup_heap` (default: as execute)."""
        variants = compile_lib.check_variants(variants)
        execute = jax.default_backend() != "cpu" if execute is None else execute
        self.state = compile_lib.warmup(self.programs(variants), self.backend, self.state,
                                        self.config.compile_workers or 1, execute)
        if execute if freeze_heap is None else freeze_heap:
            compile_lib.freeze_startup_heap()

    def programs(self, variants) -> list:
        """Every program serving may run, each as call(state, lower=False) on idle or padding
        arguments. Cycles first (the CPU runs only the first); admissions largest first."""
        be, idle = self.backend, np.zeros(self.slots, bool)
        shorts = (False, True) if be.short_rows else (False,)
        calls = [functools.partial(be.cycle, active=be.placement.put_mask(idle), features=f,
                                   size=k, short=s)
                 for f in variants for k in be.sizes for s in shorts]
        for a, w, form in self.planner.forms():
            adm = self.planner.padding(a, w, form)
            calls += [functools.partial(be.admit, form=form, parts=adm.parts, features=f)
                      for f in variants]
        for a in self.advance_buckets if FULL in variants else ():
            calls.append(functools.partial(be.advance_keys,
                                           slot_idx=np.full(a, self.slots, np.int32),
                                           advance=np.zeros(a, np.int32)))
        return calls


def _cycles_kept(accepts: List[int], kept: int) -> List[int]:
    """The accept lengths of the cycles whose tokens a request kept (each cycle emitted accept
    + 1 tokens; fewer kept when the request ended inside the call)."""
    out, total = [], 0
    for a in accepts:
        if total >= kept:
            break
        out.append(a)
        total += a + 1
    return out
