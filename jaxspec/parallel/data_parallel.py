"""Data parallel: one replica of the target and the draft per local device, `jax.pmap`.

Each replica owns `slots` slots; a group of up to `replicas * slots` requests is spread evenly
over the replicas, prefilled and decoded in lockstep (one pmapped call per cycle for all of them),
and the results come back in input order. Per-replica state is stacked on a leading device axis
[D, ...]; the weights are put on every device once (a replicated sharding) and passed with
`in_axes=None`, so no call copies them again.

Why pmap: it is what the users run, and since jax 0.8 `jax.pmap` is itself a jit of a shard_map
over a one-axis mesh, so it is the jit-with-sharding program anyway, without a mesh to manage. The
replicas never communicate: there is no collective in the compiled program.

Every replica runs the same compiled function as the single-device runners (`spec.cycle.cycle`,
`decode.sample_steps`), so greedy outputs equal theirs token for token.
"""
from __future__ import annotations

import functools
import time
from typing import Callable, List, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxspec.config import ConfigError, ModelConfig
from jaxspec.decode import Generation, finish, first_token, prefill_bucket, prefill_chunk, \
    sample_steps
from jaxspec.engine.backends import MaskCache
from jaxspec.kv import init_cache
from jaxspec.sampling import (VARIANTS, Features, SamplingParams, SlotSampling, TokenCounts,
                              logprob_dicts, slot_keys)
from jaxspec.spec.config import SpecConfig, check_vocab, resolve_spec
from jaxspec.spec import context_vocab
from jaxspec.spec.cycle import cycle, init_state, prefill
from jaxspec.spec.runner import SpecResult, _Request, check_requests, prompt_bucket

AXIS = "replica"


def local_devices(replicas: Optional[int] = None) -> Tuple[jax.Device, ...]:
    """The first `replicas` local devices (all of them when None)."""
    devs = jax.local_devices()
    n = len(devs) if replicas is None else replicas
    if not 1 <= n <= len(devs):
        raise ConfigError(f"data_parallel={n} needs that many local devices; "
                          f"{len(devs)} available ({devs[0].platform})")
    return tuple(devs[:n])


def replicate(tree, devices: Sequence[jax.Device]):
    """One copy of every leaf on each device (a fully replicated sharding): pmapped calls with
    in_axes=None read it in place."""
    mesh = Mesh(np.asarray(devices), (AXIS,))
    return jax.device_put(tree, NamedSharding(mesh, P()))


@functools.lru_cache(maxsize=None)
def sharded_put(devices: Tuple[jax.Device, ...]):
    """Host arrays [D, ...] (a pytree) -> arrays split over `devices` on the leading axis, as a
    pmapped call takes them. A numpy argument to the call itself would be copied inside it, and
    on the GPU that copy waits for the work already queued (`engine.backends.MaskCache`)."""
    return jax.pmap(lambda x: x, AXIS, devices=devices)


def spread(indices: Sequence[int], replicas: int, slots: int) -> List[List[List[int]]]:
    """Groups of at most replicas * slots requests, each split as evenly as possible over the
    replicas: -> groups[g][replica] = request indices (contiguous, in order)."""
    per_group = replicas * slots
    out = []
    for g in range(0, len(indices), per_group):
        chunk = list(indices[g:g + per_group])
        out.append([list(x) for x in np.array_split(np.asarray(chunk, np.int64), replicas)])
    return out


def _stack(trees):
    return jax.tree_util.tree_map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *trees)


# ---------------------------------------------------------------------------------- speculative


@functools.lru_cache(maxsize=None)
def pmap_spec(cfg: ModelConfig, spec: SpecConfig, devices: Tuple[jax.Device, ...],
              slots: int, max_len: int, dtype, context: int = 0):
    """(init, prefill, cycle) pmapped over `devices`; weights in_axes=None, state donated.

    init(dummy [D]) -> state [D, ...]
    prefill(params, draft, state, tokens [D, B, P], lens [D, B], sampling [D, B], keys [D, B, 2])
    cycle[features](params, draft, state, active [D, B]): one per `sampling.VARIANTS`
    """
    init = jax.pmap(lambda _: init_state(cfg, spec, slots, max_len, dtype, context=context), AXIS,
                    devices=devices)
    pre = jax.pmap(functools.partial(prefill, cfg=cfg, spec=spec, with_logprobs=True), AXIS,
                   in_axes=(None, None, 0, 0, 0, 0, 0), donate_argnums=(2,), devices=devices)
    cyc = {f: jax.pmap(functools.partial(cycle, cfg=cfg, spec=spec, features=f), AXIS,
                       in_axes=(None, None, 0, 0), donate_argnums=(2,), devices=devices)
           for f in VARIANTS}
    return init, pre, cyc


class DataParallelSpecRunner:
    """`SpecRunner` over `replicas` local devices, `slots` slots each (same `generate`; max_len
    leaves room for 2 * spec.max_emit rows past prompt + max_tokens)."""

    def __init__(self, cfg: ModelConfig, params, draft_params, spec: Union[SpecConfig, str],
                 slots: int, max_len: int, replicas: Optional[int] = None, seed: int = 0):
        self.spec = resolve_spec(spec)
        check_vocab(self.spec, cfg.vocab_size)
        if slots < 1:
            raise ConfigError(f"slots={slots} must be >= 1")
        self.devices = local_devices(replicas)
        self.cfg, self.slots, self.max_len = cfg, slots, max_len
        self.dtype = params["embed"].dtype
        self.params = replicate(params, self.devices)
        self.draft_params = replicate(draft_params, self.devices)
        self._init, self._prefill, self._cycle = pmap_spec(
            cfg, self.spec, self.devices, slots, max_len, jnp.dtype(self.dtype),
            context_vocab.size(draft_params))
        self._state = None
        self.key = jax.random.PRNGKey(seed)
        self._active = MaskCache(sharded_put(self.devices))    # [D, B] masks on the devices

    @property
    def replicas(self) -> int:
        return len(self.devices)

    def generate(self, prompts: Sequence[Sequence[int]],
                 sampling: Sequence[Union[SamplingParams, int]], eos_ids: Tuple[int, ...] = (),
                 detokenize: Optional[Callable[[List[int]], str]] = None) -> List[SpecResult]:
        # Two cycles' rows of slack: the last useful one and the overlap cycle after it.
        sps = check_requests(prompts, sampling, self.max_len, 2 * self.spec.max_emit)
        results: List[Optional[SpecResult]] = [None] * len(prompts)
        for group in spread(range(len(prompts)), self.replicas, self.slots):
            reqs = self._run_group([[prompts[i] for i in g] for g in group],
                                   [[sps[i] for i in g] for g in group], set(eos_ids), detokenize)
            for g, rs in zip(group, reqs):
                for i, r in zip(g, rs):
                    results[i] = r.result()
        return results

    def _run_group(self, prompts, sps, eos, detokenize) -> List[List[_Request]]:
        """prompts[r], sps[r]: the requests of replica r (at most `slots` each)."""
        d, b = self.replicas, self.slots
        p = prompt_bucket(max(len(x) for xs in prompts for x in xs), self.max_len)
        tokens = np.zeros((d, b, p), np.int32)
        lens = np.zeros((d, b), np.int32)
        for r, xs in enumerate(prompts):
            for j, x in enumerate(xs):
                tokens[r, j, :len(x)] = x
                lens[r, j] = len(x)
        if self._state is None:
            self._state = self._init(np.zeros((d,), np.int32))
        self.key, *subs = jax.random.split(self.key, d + 1)
        sampling = _stack([SlotSampling.from_params(sps[r], b) for r in range(d)])
        keys = np.stack([np.asarray(slot_keys(sps[r], b, subs[r])) for r in range(d)])
        self._state, first = self._prefill(self.params, self.draft_params, self._state, tokens,
                                           lens, sampling, keys)
        reqs = [[_Request(sp, eos, detokenize) for sp in sps[r]] for r in range(d)]
        first = jax.device_get(first)
        for r in range(d):
            for j, req in enumerate(reqs[r]):
                req.absorb([first.tokens[r, j]], [first.logprob[r, j]], [first.top_ids[r, j]],
                           [first.top_logprobs[r, j]])
        # Cycle n+1 is dispatched before cycle n's tokens are read, so the device never waits on
        # the host; a slot that finishes in cycle n runs one more cycle, whose tokens are dropped
        # (its rows are the slack counted in `generate`).
        pending = None
        run_cycle = self._cycle[Features.of([sp for r in sps for sp in r])]
        while True:
            active = np.array([[j < len(reqs[r]) and reqs[r][j].reason is None
                                for j in range(b)] for r in range(d)])
            nxt = None
            if active.any():
                self._state, co = run_cycle(self.params, self.draft_params, self._state,
                                            self._active(active))
                nxt = (co, active)
            elif pending is None:
                break
            if pending is not None:
                _absorb_cycle(reqs, *pending)
            pending = nxt
        return reqs


def _absorb_cycle(reqs, co, active):
    co = jax.device_get(co)
    for r, j in zip(*np.nonzero(active)):
        req, k = reqs[r][j], int(co.accept_len[r, j]) + 1
        if req.reason is not None:      # finished in the cycle before: an overlap cycle
            continue
        req.accepts.append(k - 1)
        req.absorb(co.tokens[r, j, :k], co.logprob[r, j, :k], co.top_ids[r, j, :k],
                   co.top_logprobs[r, j, :k])


# ---------------------------------------------------------------------------------------- plain


@functools.lru_cache(maxsize=None)
def pmap_plain(cfg: ModelConfig, devices: Tuple[jax.Device, ...], slots: int, max_len: int,
               dtype, n_steps: int):
    """(init, prefill_chunk, first_token, sample_steps) of `decode`, pmapped over `devices`."""
    init = jax.pmap(lambda _: init_cache(cfg, slots, max_len, dtype), AXIS, devices=devices)
    pre = jax.pmap(lambda params, cache, toks, n: prefill_chunk(params, cfg, cache, toks, n),
                   AXIS, in_axes=(None, 0, 0, 0), donate_argnums=(1,), devices=devices)
    first = jax.pmap(lambda params, h, sp, hist, keys: first_token(params, cfg, h, sp, hist, keys),
                     AXIS, in_axes=(None, 0, 0, 0, 0), devices=devices)
    steps = jax.pmap(lambda params, cache, tok, sp, hist, keys: sample_steps(
        params, cfg, cache, tok, sp, hist, keys, n_steps=n_steps),
        AXIS, in_axes=(None, 0, 0, 0, 0, 0), donate_argnums=(1, 4), devices=devices)
    return init, pre, first, steps


class DataParallelPlainRunner:
    """`decode.PlainRunner` over `replicas` local devices, `slots` slots each (same `generate`)."""

    def __init__(self, cfg: ModelConfig, params, slots: int, max_len: int,
                 replicas: Optional[int] = None, *, prefill_chunk_size: int = 512,
                 decode_chunk: int = 16, seed: int = 0):
        if slots < 1:
            raise ConfigError(f"slots={slots} must be >= 1")
        self.devices = local_devices(replicas)
        self.cfg, self.slots, self.max_len = cfg, slots, max_len
        self.prefill_chunk_size, self.decode_chunk = prefill_chunk_size, decode_chunk
        dtype = jnp.dtype(params["embed"].dtype)
        self.params = replicate(params, self.devices)
        self._init, self._prefill, self._first, self._steps = pmap_plain(
            cfg, self.devices, slots, max_len, dtype, decode_chunk)
        self.key = jax.random.PRNGKey(seed)

    @property
    def replicas(self) -> int:
        return len(self.devices)

    def generate(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams],
                 stop_ids: Sequence[set]) -> List[Generation]:
        """As PlainRunner.generate, for any number of prompts (groups of replicas * slots)."""
        out: List[Optional[Generation]] = [None] * len(prompts)
        for group in spread(range(len(prompts)), self.replicas, self.slots):
            gens = self._run_group([[prompts[i] for i in g] for g in group],
                                   [[params[i] for i in g] for g in group],
                                   [[stop_ids[i] for i in g] for g in group])
            for g, gs in zip(group, gens):
                for i, x in zip(g, gs):
                    out[i] = x
        return out

    def _prefill_all(self, prompts):
        d, b, c = self.replicas, self.slots, self.prefill_chunk_size
        cache = self._init(np.zeros((d,), np.int32))
        lens = np.zeros((d, b), np.int64)
        for r, xs in enumerate(prompts):
            lens[r, :len(xs)] = [len(x) for x in xs]
        width = prefill_bucket(int(lens.max()), c)
        last = None
        for start in range(0, int(lens.max()), width):
            toks = np.zeros((d, b, width), np.int32)
            for r, xs in enumerate(prompts):
                for j, x in enumerate(xs):
                    seg = x[start:start + width]
                    toks[r, j, :len(seg)] = seg
            n_valid = np.clip(lens - start, 0, width).astype(np.int32)
            cache, h = self._prefill(self.params, cache, toks, n_valid)
            last = h if last is None else jnp.where((n_valid > 0)[..., None], h, last)
        return cache, last

    def _run_group(self, prompts, params, stop_ids) -> List[List[Generation]]:
        t0 = time.perf_counter()
        d, b = self.replicas, self.slots
        sp = sharded_put(self.devices)(_stack([SlotSampling.from_params(params[r], b)
                                               for r in range(d)]))
        self.key, *subs = jax.random.split(self.key, d + 1)
        keys = np.stack([np.asarray(slot_keys(params[r], b, subs[r])) for r in range(d)])
        hist = _stack([_prompt_counts(prompts[r], b, self.cfg.vocab_size) for r in range(d)])
        cache, last = self._prefill_all(prompts)
        em, hist, keys = self._first(self.params, last, sp, hist, keys)
        tok = em.tokens
        first = jax.device_get(jax.tree_util.tree_map(lambda x: x[..., None], em))
        ttft = time.perf_counter() - t0
        flat = [(r, j) for r in range(d) for j in range(len(prompts[r]))]
        streams = {rj: [] for rj in flat}
        lps = {rj: [] for rj in flat}
        done = {}

        def absorb(o):
            for r, j in flat:
                if (r, j) in done:
                    continue
                streams[r, j].extend(o.tokens[r, j].tolist())
                p = params[r][j]
                if p.logprobs is not None:
                    lps[r, j] += logprob_dicts(o.tokens[r, j], o.logprob[r, j], o.top_ids[r, j],
                                               o.top_logprobs[r, j], p.logprobs)
                toks, reason = finish(streams[r, j], p.max_tokens, stop_ids[r][j])
                if reason:
                    lp = lps[r, j][:len(toks)] if p.logprobs is not None else None
                    done[r, j] = Generation(toks, reason, ttft, time.perf_counter() - t0, lp)

        absorb(first)
        pending = []
        while len(done) < len(flat):
            cache, hist, keys, o = self._steps(self.params, cache, tok, sp, hist, keys)
            tok = o.tokens[..., -1]
            pending.append(o)
            if len(pending) > 1:   # read the previous chunk while this one runs
                absorb(jax.device_get(pending.pop(0)))
            elif len(done) < len(flat) and len(pending) == 1 and _last_chunk(streams, done,
                                                                              params, flat,
                                                                              self.decode_chunk):
                absorb(jax.device_get(pending.pop(0)))
        return [[done[r, j] for j in range(len(prompts[r]))] for r in range(d)]


def _last_chunk(streams, done, params, flat, chunk) -> bool:
    """Every unfinished stream reaches max_tokens with the chunk in flight: read it now rather
    than dispatch one more."""
    return all(len(streams[r, j]) + chunk >= params[r][j].max_tokens
               for r, j in flat if (r, j) not in done)


def _prompt_counts(prompts, slots: int, vocab: int) -> TokenCounts:
    toks = np.zeros((slots, max((len(x) for x in prompts), default=1)), np.int32)
    lens = np.zeros((slots,), np.int32)
    for j, x in enumerate(prompts):
        toks[j, :len(x)] = x
        lens[j] = len(x)
    return TokenCounts.from_prompts(jnp.asarray(toks), jnp.asarray(lens), vocab)
