"""Static-batch reference runners for the tests: a group of prompts prefilled together in one
call, then calls over every slot until each request has stopped. Independent of the engine's
scheduling (no admission while others run, no retract, no packing), so the engine's outputs can
be checked against them; the device programs are the backends' own.

    SpecRunner(cfg, params, draft, spec, max_slots, max_len).generate(prompts, sampling)
    PlainRunner(cfg, params, max_slots, max_len).generate(prompts, sampling)
    prefill(cfg, spec, params, draft, state, tokens, lens) -> (state, root)

A runner keeps its last group's final state (`runner.state`) for tests that inspect it.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import List, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decode import init_plain_state, plain_cycle
from jaxspec.engine.admission import AdmitArgs, jit_admissions
from jaxspec.models import llama
from jaxspec.sampling import FULL, SamplingParams, flat_params, logprob_dicts, seed_key
from jaxspec.spec.config import check_vocab, resolve_spec
from jaxspec.spec.cycle import init_state, jit_cycle
from jaxspec.spec.draft import check_head
from jaxspec.xla_options import jit
from pallas_kernels.kv_compact import kv_compact


@dataclasses.dataclass
class Result:
    token_ids: List[int]
    finish_reason: str                  # "stop" (stop token included, or stop string), "length"
    accept_lens: List[int] = dataclasses.field(default_factory=list)
    logprobs: Optional[List[dict]] = None
    text: Optional[str] = None          # cut at a stop string (when stop strings are checked)


def _key(seed: int):
    k = jax.random.PRNGKey(seed)
    return jax.random.key_data(k) if jnp.issubdtype(k.dtype, jax.dtypes.prng_key) else k


def _admit_args(prompts, sps, slots: int):
    """(slot_idx, tokens, start, n_valid, next_tok, AdmitArgs) of one first-chunk admission of
    every prompt (row i in slot i; padding rows slot B); unseeded requests get serial i."""
    width = -(-max(len(p) for p in prompts) // 16) * 16
    tokens = np.zeros((slots, width), np.int32)
    slot_idx = np.full(slots, slots, np.int32)
    n_valid = np.zeros(slots, np.int32)
    adm = AdmitArgs.host(slots)
    for i, (p, sp) in enumerate(zip(prompts, sps)):
        tokens[i, :len(p)], slot_idx[i], n_valid[i] = p, i, len(p)
        adm.n_prompt[i] = len(p)
        _set_sampling(adm, i, sp)
    return (slot_idx, tokens, np.zeros(slots, np.int32), n_valid, np.full(slots, -1, np.int32),
            adm)


def _set_sampling(adm: AdmitArgs, i: int, sp: SamplingParams):
    """Row i of host AdmitArgs takes sp's parameters and key (unseeded: serial i)."""
    adm.samp_f[i], adm.samp_i[i] = flat_params(sp)
    if sp.seed is not None:
        adm.key[i], adm.serial[i] = seed_key(sp.seed), -1
    else:
        adm.serial[i] = i


class _Runner:
    def _setup(self, cfg, params, draft, spec, max_slots: int, max_len: int, seed: int):
        self.cfg, self.params, self.draft = cfg, params, draft
        self.slots, self.max_len = max_slots, max_len
        self.dtype = params["embed"].dtype
        admits, _, _ = jit_admissions(cfg, spec, max_slots, max_len, self.dtype)
        self._admit = admits[FULL, "chunk"]
        self.key = _key(seed)
        self.state = None

    def generate(self, prompts, sampling, eos_ids=(), detokenize=None) -> List[Result]:
        """sampling: per prompt, SamplingParams or an int (max_tokens, greedy). A request stops
        after one of eos_ids (unless ignore_eos) or its stop_token_ids, at max_tokens, or (with
        detokenize) at one of its stop strings."""
        sps = [SamplingParams(max_tokens=s) if isinstance(s, int) else s for s in sampling]
        out = []
        for i in range(0, len(prompts), self.slots):
            out += self._group(prompts[i:i + self.slots], sps[i:i + self.slots], set(eos_ids),
                               detokenize)
        return out

    def _group(self, prompts, sps, eos, detokenize) -> List[Result]:
        state = self._init()
        args = jax.tree_util.tree_map(jnp.asarray, _admit_args(prompts, sps, self.slots))
        state, first = self._admit(self.params, self.draft, state, *args, self.key)
        reqs = [_Req(sp, set(sp.stop_token_ids) | (set() if sp.ignore_eos else eos), detokenize)
                for sp in sps]
        lp = [np.asarray(x)[:, None] for x in (first.logprob, first.top_ids, first.top_logprobs)]
        for i, r in enumerate(reqs):
            r.take([int(first.tokens[i])], [x[i] for x in lp], None)
        while not all(r.done for r in reqs):
            active = np.array([i < len(reqs) and not reqs[i].done for i in range(self.slots)])
            state, out = self._cycle(self.params, self.draft, state, jnp.asarray(active))
            toks = np.asarray(out.tokens)
            lps = [np.asarray(x) for x in (out.logprob, out.top_ids, out.top_logprobs)]
            acc = getattr(out, "accept_len", None)
            for i in np.flatnonzero(active):
                got = toks[i][toks[i] >= 0].tolist()
                reqs[i].take(got, [x[i] for x in lps],
                             None if acc is None else int(np.asarray(acc)[i]))
        self.state = state
        return [r.result() for r in reqs]


class _Req:
    def __init__(self, sp: SamplingParams, stop_ids, detokenize):
        self.sp, self.stop_ids, self.detok = sp, stop_ids, detokenize
        self.tokens, self.accepts, self.lps = [], [], []
        self.reason, self.text = None, None

    @property
    def done(self) -> bool:
        return self.reason is not None

    def take(self, tokens, lp, accept):
        if accept is not None:
            self.accepts.append(accept)
        for j, t in enumerate(tokens):
            self.tokens.append(t)
            if self.sp.logprobs is not None:
                self.lps += logprob_dicts([t], lp[0][j:j + 1], lp[1][j:j + 1], lp[2][j:j + 1],
                                          self.sp.logprobs)
            if t in self.stop_ids:
                self.reason = "stop"
            elif len(self.tokens) >= self.sp.max_tokens:
                self.reason = "length"
            elif self.detok and self.sp.stop:
                text = self.detok(self.tokens)
                hits = [text.find(s) for s in self.sp.stop if s in text]
                if hits:
                    self.reason, self.text = "stop", text[:min(hits)]
            if self.reason:
                return

    def result(self) -> Result:
        text = self.text
        if text is None and self.detok is not None:
            text = self.detok(self.tokens)
        return Result(self.tokens, self.reason, self.accepts,
                      self.lps if self.sp.logprobs is not None else None, text)


class SpecRunner(_Runner):
    """Speculative decoding, one cycle a call."""

    def __init__(self, cfg, params, draft, spec, max_slots: int, max_len: int, seed: int = 0):
        self.spec = resolve_spec(spec)
        check_vocab(self.spec, cfg.vocab_size)
        check_head(cfg, self.spec, draft)
        self._setup(cfg, params, draft, self.spec, max_slots, max_len, seed)
        self._cycle = jit_cycle(cfg, self.spec)

    def _init(self):
        return init_state(self.cfg, self.spec, self.slots, self.max_len, self.dtype, self.draft)


class PlainRunner(_Runner):
    """Plain decoding, decode_steps steps a call."""

    def __init__(self, cfg, params, max_slots: int, max_len: int, decode_steps: int = 4,
                 seed: int = 0):
        self._setup(cfg, params, None, None, max_slots, max_len, seed)
        self._cycle = _plain_program(cfg, decode_steps)

    def _init(self):
        return init_plain_state(self.cfg, self.slots, self.max_len, self.dtype)


@functools.lru_cache(maxsize=None)
def _plain_program(cfg, n_steps: int):
    return jit(functools.partial(plain_cycle, cfg=cfg, n_steps=n_steps), donate_argnums=(2,))


def prefill(cfg, spec, params, draft, state, tokens, lens, features=FULL, sampling=None,
            emitted=False):
    """Every slot's prompt (tokens [B, P], lens [B]; 0: an empty slot) prefilled into `state`
    in one admission: -> (state, root [B]), or (state, Emitted [B]) with emitted=True.
    sampling: per slot, SamplingParams (None: greedy); a seeded one draws from PRNGKey(seed),
    an unseeded one from the engine key 0 folded with its slot index."""
    b = tokens.shape[0]
    lens = np.asarray(lens, np.int32)
    slot_idx = np.where(lens > 0, np.arange(b), b).astype(np.int32)
    adm = AdmitArgs.host(b, n_prompt=lens)
    for i, sp in enumerate(sampling or ()):
        _set_sampling(adm, i, sp)
    admits, _, _ = jit_admissions(cfg, spec, b, state.target.k.shape[3],
                                  params["embed"].dtype)
    state, first = admits[features, "chunk"](params, draft, state, jnp.asarray(slot_idx),
                                             jnp.asarray(tokens), jnp.zeros(b, jnp.int32),
                                             jnp.asarray(lens), jnp.full(b, -1, jnp.int32),
                                             jax.tree_util.tree_map(jnp.asarray, adm), _key(0))
    return state, (first if emitted else first.tokens)


@functools.partial(jax.jit, static_argnames="cfg")
def plain_step(params, cfg, k, v, lens, tok):
    """One token per slot (tok [B]) through the target with a KV cache (k, v, lens): -> (k, v,
    lens + 1, logits [B, V]). The plainest reference decoding there is."""
    b = tok.shape[0]
    h, kn, vn, _ = llama.forward(params, cfg, tok[:, None], lens[:, None], k, v, lens,
                                 jnp.ones((b, 1, 1), bool))
    k, v = kv_compact(k, v, kn, vn, lens, jnp.zeros((b, 1), jnp.int32), jnp.ones((b,), jnp.int32))
    return k, v, lens + 1, llama.lm_head(params, cfg, h[:, 0])


def plain_greedy(params, cfg, prompt, n: int, max_len: int):
    """n greedy tokens after `prompt`, one at a time through `plain_step` (batch 1)."""
    c = init_plain_state(cfg, 1, max_len, params["embed"].dtype).target
    k, v, lens = c.k, c.v, c.lens
    for t in prompt:
        k, v, lens, logits = plain_step(params, cfg, k, v, lens, jnp.array([t], jnp.int32))
    out = []
    for _ in range(n):
        out.append(int(jnp.argmax(logits[0])))
        k, v, lens, logits = plain_step(params, cfg, k, v, lens,
                                        jnp.array([out[-1]], jnp.int32))
    return out


class CompileCounter:
    """Counts XLA compilations (any function) while `on`, including those a persistent
    compilation cache answers (scripts/test.sh shares one between the suite's processes)."""

    def __init__(self):
        self.n, self.on = 0, False
        jax.monitoring.register_event_duration_secs_listener(self._event)
        jax.monitoring.register_event_listener(self._hit)

    def _event(self, name, _dur, **_kw):
        if self.on and name == "/jax/core/compile/backend_compile_duration":
            self.n += 1

    def _hit(self, name, **_kw):
        if self.on and name == "/jax/compilation_cache/cache_hits":
            self.n += 1


def serve(engine, prompts, sps, arrive, abort_at, max_steps: int = 5000):
    """Request i added at step arrive[i] (and aborted at abort_at[i] if it is there), stepped
    until all end; asserts no delta follows a request's final one. -> (engine ids by index,
    streamed tokens and final reason by engine id)."""
    arrive = np.asarray(arrive)
    streams, finals, ids, step = {}, {}, {}, 0
    while len(ids) < len(prompts) or engine.has_work():
        for i in np.flatnonzero(arrive == step):
            ids[int(i)] = engine.add_request(prompts[i], sps[i])
        for i, at in abort_at.items():
            if at == step and i in ids:
                engine.abort(ids[i])
        for d in engine.step():
            assert d.request_id not in finals, "delta after the final one"
            streams.setdefault(d.request_id, []).extend(d.token_ids)
            if d.finished:
                finals[d.request_id] = d.finish_reason
        step += 1
        assert step < max_steps
    return ids, streams, finals
