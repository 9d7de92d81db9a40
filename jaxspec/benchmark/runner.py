"""Plain vs speculative decoding over batch sizes, through the public `LLM` API only.

Each (batch size, mode) gets its own `LLM` with `max_batch` = the batch size, so the engine never
runs more requests at once than the batch being measured. A warm-up pass over the same prompts
(few tokens) compiles the prefill buckets and the cycle before the timed pass.
"""
from __future__ import annotations

import collections
import dataclasses
import gc
import statistics
import time
from typing import Any, Dict, List, Optional, Sequence, Union

from jaxspec.config import ConfigError

WARMUP_TOKENS = 8
# --spec's name for the tree shape `LLM()` picks when given none (`defaults.spec`): it depends
# on the batch size, so it is resolved per run.
DEFAULT_SPEC = "default"


@dataclasses.dataclass(frozen=True)
class Mode:
    """A decoding mode: plain (spec None) or speculative with a SpecConfig (or DEFAULT_SPEC: the
    LLM's default shape at each batch size), run cycles_per_call cycles per device call
    (`EngineConfig.cycles_per_call`; None: the run's), drafting draft_vocab tokens
    (`DraftConfig.draft_vocab`; None: the run's) and context_vocab context tokens a slot
    (`DraftConfig.draft_context_vocab`; None: the run's)."""
    label: str
    spec: Any = None
    cycles_per_call: Optional[int] = None
    draft_vocab: Optional[int] = None
    context_vocab: Optional[int] = None

    def spec_at(self, batch: int):
        """The SpecConfig run at `batch` (None for plain)."""
        if self.spec != DEFAULT_SPEC:
            return self.spec
        from jaxspec import defaults
        from jaxspec.spec.config import resolve_spec
        return resolve_spec(defaults.spec(batch))

    def describe(self, batch: Optional[int] = None) -> Optional[dict]:
        """The config; its shape and cycles_per_call at `batch` (None if left to the default
        and no batch is given; `as_run` puts in what a run resolved)."""
        if self.spec is None:
            return None
        if self.spec == DEFAULT_SPEC and batch is None:
            return {"num_steps": None, "topk": None, "num_draft_tokens": None,
                    "cycles_per_call": self.cycles_per_call, "draft_vocab": self.draft_vocab,
                    "context_vocab": self.context_vocab}
        s = self.spec_at(batch)
        k = self.cycles_per_call
        if k is None and batch is not None:
            from jaxspec import defaults
            k = defaults.cycles_per_call(batch)
        return {"num_steps": s.num_steps, "topk": s.topk, "num_draft_tokens": s.num_draft_tokens,
                "cycles_per_call": k, "draft_vocab": self.draft_vocab,
                "context_vocab": self.context_vocab}


PLAIN = Mode("plain")


def parse_specs(text: str) -> List[Mode]:
    """'chain,tree,3x1x4,chain:4,default': presets, num_steps x topk x num_draft_tokens, or
    'default' (the shape `LLM()` picks at each batch size), each with an optional ':K' for K
    cycles per device call (`cycles_per_call`) and an optional '@V' for a draft vocabulary of
    V tokens (0: all; `draft_vocab`), itself with an optional '+E' for E of those V a slot's
    context tokens (`draft_context_vocab`; 0: none), e.g. 'chain:4@16384', '4x8x32:2@16384+0'."""
    from jaxspec.spec.config import PRESETS, resolve_spec
    modes = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        rest, at, vocab = item.partition("@")
        vocab, plus, ctx = vocab.partition("+")
        ctx = _optional_int(ctx, plus, 0, f"--spec {item!r}: '+E' must be a context vocabulary "
                                          "size >= 0 (0: none)")
        vocab = _optional_int(vocab, at, 0, f"--spec {item!r}: '@V' must be a draft vocabulary "
                                            "size >= 0 (0: the whole vocabulary)")
        name, colon, k = rest.partition(":")
        k = _optional_int(k, colon, 1, f"--spec {item!r}: ':K' must be a positive number of "
                                       "cycles per call")
        try:
            spec = DEFAULT_SPEC if name == DEFAULT_SPEC else resolve_spec(name)
        except ConfigError:
            raise ConfigError(f"--spec {item!r}: a preset ({', '.join(PRESETS)}), "
                              f"STEPSxTOPKxTOKENS such as 3x1x4, or '{DEFAULT_SPEC}', "
                              "optionally ':K'") from None
        modes.append(Mode(item, spec, k, vocab, ctx))
    if len({m.label for m in modes}) != len(modes):
        raise ConfigError(f"--spec {text!r} names a config twice")
    return modes


def _optional_int(text: str, given: str, minimum: int, error: str) -> Optional[int]:
    """int(text) when its separator was `given`, else None; ConfigError(error) when it is not
    an int >= minimum."""
    if not given:
        return None
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise ConfigError(error)
    return value


class Target:
    """The model under test and its draft; builds one LLM per (batch size, mode).

    engine: the run's EngineConfig (its max_batch is set per batch size; a mode's ':K' sets
    cycles_per_call); draft_config: its DraftConfig (a mode's '@V+E' sets draft_vocab and
    draft_context_vocab). The rest goes to every LLM as is: with data_parallel, `batch` is the
    slots of each replica; dtype None is the loader's default (bf16 on GPU, fp32 on CPU)."""

    def __init__(self, model: Optional[str], draft: Optional[str], engine=None,
                 draft_config=None, *, dtype: Optional[str] = None, data_parallel: int = 1,
                 tensor_parallel: int = 1, data_parallel_impl: str = "shard_map"):
        from jaxspec.engine import EngineConfig
        from jaxspec.spec.config import DraftConfig
        self.model, self.draft_arg = model, draft
        self.engine = engine or EngineConfig()
        self.draft_config = draft_config or DraftConfig()
        self.common = dict(data_parallel=data_parallel, tensor_parallel=tensor_parallel,
                           dtype=dtype, data_parallel_impl=data_parallel_impl)
        self._draft_params = None
        self.config = None
        self.tokenizer = None
        self.param_dtype = None
        self.max_model_len = None       # as the first LLM resolved it (capped by the model)

    @property
    def draft_label(self) -> str:
        if self.draft_arg in (None, "default"):
            return "shipped head"
        if self.draft_arg == "random":
            return "RANDOM head (untrained: accept lengths say nothing about a real head)"
        return self.draft_arg

    def llm(self, batch: int, mode: Mode):
        import jax

        from jaxspec import LLM
        engine = self.engine.replace(max_batch=batch)
        if mode.spec is None:
            llm = LLM(self.model, engine=engine, draft_config=self.draft_config, **self.common)
            self.config, self.tokenizer = llm.config, llm.tokenizer
            self.param_dtype = jax.tree_util.tree_leaves(llm.params)[0].dtype
            self.max_model_len = llm.max_model_len
            return llm
        if mode.cycles_per_call is not None:
            engine = engine.replace(cycles_per_call=mode.cycles_per_call)
        dconf = self.draft_config
        for field, value in (("draft_vocab", mode.draft_vocab),
                             ("draft_context_vocab", mode.context_vocab)):
            if value is not None:
                dconf = dataclasses.replace(dconf, **{field: value})
        draft = self.draft_arg
        if draft == "random":
            draft = self._random_draft()
        try:
            return LLM(self.model, draft=draft, spec=mode.spec_at(batch), engine=engine,
                       draft_config=dconf, **self.common)
        except (ValueError, FileNotFoundError) as e:
            raise SystemExit(f"cannot load the draft head ({e}); pass --draft PATH, or "
                             "--draft random to time the cycle with an untrained head") from None

    def _random_draft(self):
        if self._draft_params is None:
            import jax

            from jaxspec.models.eagle import init_eagle_params
            if self.config is None:
                raise RuntimeError("build a plain LLM first (its config sizes the random head)")
            self._draft_params = init_eagle_params(self.config,
                                                   jax.random.PRNGKey(self.engine.seed),
                                                   dtype=self.param_dtype)
        return self._draft_params


def warm(llm, chats, sp, freeze_heap: Optional[bool] = None):
    """Compiles what the timed pass will use: the engine's own warm-up when the API has one
    (only the program variants `sp` needs; freeze_heap goes to it), then the same prompts with
    few tokens (the prefill buckets they fall in)."""
    if hasattr(llm, "warmup"):
        llm.warmup(sp, freeze_heap=freeze_heap)
    llm.generate(chats, dataclasses.replace(sp, max_tokens=min(sp.max_tokens, WARMUP_TOKENS)))


class GcClock:
    """Seconds Python's cyclic garbage collector ran while the block ran (gc.callbacks), and
    its collections per generation: a full collection over a large heap is a pause the GPU
    waits through, and it lands in whichever pass it falls in."""

    def __enter__(self):
        self.seconds, self.collections, self._t = 0.0, [0, 0, 0], None
        gc.callbacks.append(self._on_gc)
        return self

    def _on_gc(self, phase, info):
        if phase == "start":
            self._t = time.perf_counter()
        elif self._t is not None:
            self.seconds += time.perf_counter() - self._t
            self.collections[info["generation"]] += 1

    def __exit__(self, *exc):
        gc.callbacks.remove(self._on_gc)


def _engine_counts(llm) -> Optional[dict]:
    """The engine's running totals (None without an engine: a test's stand-in, peers)."""
    st = getattr(getattr(llm, "engine", None), "stats", None)
    if st is None:
        return None
    return {"device_calls": sum(st.call_sizes.values()), "admit_calls": st.prefill_chunks,
            "host_s": st.host_s, "dispatch_s": st.dispatch_s,
            "admit_dispatch_s": st.admit_dispatch_s, "wait_s": st.wait_s,
            "steps": len(st.step_s)}


def _pass_record(clock: GcClock, llm, before: Optional[dict], span=None) -> dict:
    """One timed pass: garbage collection, and what the engine did in it (device calls,
    admission dispatches, host seconds and the part of them in the backend's calls, wait
    seconds, its slowest step) to tell a slow pass's cause. span: the pass's (start, end)
    perf_counter times, to tell how much of it lay outside the engine's steps."""
    rec = {"gc_s": round(clock.seconds, 4), "full": clock.collections[2]}
    after = _engine_counts(llm)
    if before is not None and after is not None:
        rec.update({k: round(after[k] - before[k], 4) for k in after})
        steps = llm.engine.stats.step_s[before["steps"]:]
        rec["max_step_ms"] = round(1e3 * max(steps), 2) if steps else None
        rec["slowest_steps"] = _slowest_steps(llm.engine.stats, before["steps"])
        if span is not None and steps:
            rec.update(_outside_steps(llm.engine.stats, before["steps"], *span))
    return rec


def _outside_steps(stats, first: int, t0: float, t1: float) -> dict:
    """Seconds of the pass [t0, t1] outside the engine's steps from step `first` on: before
    the first (generate's encoding, checks and submission), between steps (the caller's loop)
    and after the last (collecting the outputs). The device idles in the first and may in the
    others."""
    starts, secs = stats.step_start[first:], stats.step_s[first:]
    between = sum(b - (a + s) for a, s, b in zip(starts, secs, starts[1:]))
    return {"pass_s": round(t1 - t0, 4), "before_steps_s": round(starts[0] - t0, 4),
            "between_steps_s": round(between, 4),
            "after_steps_s": round(t1 - (starts[-1] + secs[-1]), 4)}


def _slowest_steps(stats, first: int, n: int = 5) -> List[dict]:
    """The n slowest steps from step `first` on: their index in the pass, milliseconds, and
    what they dispatched (admission calls, the cycle call's size, whether the short build ran),
    where their time went (milliseconds in the admission calls, in the cycle call, waiting on
    the device, and the rest of the step's host work), next to the pass's median step."""
    steps, what = stats.step_s[first:], stats.step_what[first:]
    if not steps:
        return []
    median = statistics.median(steps)
    top = sorted(range(len(steps)), key=lambda i: -steps[i])[:n]
    out = []
    for i in top:
        admits, size, short, admit_s, cycle_s, wait_s = what[i]
        out.append({"step": i, "ms": round(1e3 * steps[i], 2), "median_ms": round(1e3 * median, 2),
                    "admits": admits, "call_size": size, "short": short,
                    "admit_ms": round(1e3 * admit_s, 2), "cycle_ms": round(1e3 * cycle_s, 2),
                    "wait_ms": round(1e3 * wait_s, 2),
                    "other_ms": round(1e3 * (steps[i] - admit_s - cycle_s - wait_s), 2)})
    return out


def timed_generate(llm, chats, sp, repeats: int = 1, gc_runs: Optional[list] = None):
    """-> (outputs, seconds, shapes compiled during the timed passes (0 once warmed up),
    tokens/s of every pass). With repeats > 1 the prompts run that many times back to back and
    the pass with the median tokens/s is the one returned: a pass of a second or two at a
    large batch moves by tens of percent when one stretch of it runs slow. gc_runs, if given,
    gets a record of each pass (`_pass_record`): garbage-collection seconds and full
    (generation 2) collections, and the engine's calls, host time and slowest step."""
    before = llm.compilations() if hasattr(llm, "compilations") else 0
    passes = []
    for _ in range(repeats):
        counts = _engine_counts(llm)
        with GcClock() as clock:
            t0 = time.perf_counter()
            outs = llm.generate(chats, sp)
            t1 = time.perf_counter()
            secs = t1 - t0
        if gc_runs is not None:
            gc_runs.append(_pass_record(clock, llm, counts, (t0, t1)))
        passes.append((sum(len(o.token_ids) for o in outs) / secs if secs > 0 else 0.0,
                       outs, secs))
    rates = [p[0] for p in passes]
    _, outs, secs = sorted(passes, key=lambda p: p[0])[(len(passes) - 1) // 2]
    return outs, secs, (llm.compilations() if hasattr(llm, "compilations") else 0) - before, rates


def as_run(row: dict, llm) -> dict:
    """Puts into a `summarize` row what the run's LLM resolved: the engine's options
    ('engine': every EngineConfig field, its defaults filled in; 'admit_interval'), and for a
    speculative run its shape, cycles per call and draft vocabulary."""
    cfg = llm.engine_config
    row["engine"] = dataclasses.asdict(cfg)
    row["admit_interval"] = cfg.admit_interval
    if row["spec"] is not None:
        s = llm.spec
        row["spec"].update(num_steps=s.num_steps, topk=s.topk,
                           num_draft_tokens=s.num_draft_tokens,
                           cycles_per_call=cfg.cycles_per_call, draft_vocab=draft_vocab_of(llm),
                           context_vocab=context_vocab_of(llm))
    return row


def draft_vocab_of(llm) -> Optional[int]:
    """How many tokens the LLM's speculative engine drafts from (0: all), None for a plain
    one."""
    from jaxspec.spec.draft_vocab import restricted_size
    draft = _engine_draft(llm)
    return None if draft is None else (restricted_size(draft) or 0)


def context_vocab_of(llm) -> Optional[int]:
    """The context vocabulary a slot of the LLM's speculative engine drafts (0: none), None for
    a plain one."""
    from jaxspec.spec.context_vocab import size
    draft = _engine_draft(llm)
    return None if draft is None else size(draft)


def _engine_draft(llm):
    backend = getattr(getattr(llm, "engine", None), "backend", None)
    return getattr(backend, "draft_params", None)


def summarize(mode: Mode, batch: int, outs, secs: float, draft_label: str) -> dict:
    """One table row: throughput, accept length (tokens per cycle, bonus included) and its
    histogram, per-request latencies (all requests are submitted at once, so TTFT and latency
    include the wait for a free slot when there are more requests than the batch size)."""
    ntok = sum(len(o.token_ids) for o in outs)
    taus = [a + 1 for o in outs for a in (o.accept_lens or [])]
    capped = [o for o in outs if o.finish_reason == "length"]
    row = {"mode": mode.label, "batch": batch, "spec": mode.describe(batch),
           "draft": draft_label if mode.spec is not None else None,
           "requests": len(outs), "tokens": ntok, "seconds": secs,
           "tokens_per_s": ntok / secs if secs > 0 else 0.0,
           "accept_len": statistics.fmean(taus) if taus else None,
           "accept_hist": (_hist(taus, mode.spec_at(batch).max_emit) if mode.spec is not None
                           else None),
           "cycles": len(taus) if mode.spec is not None else None,
           # Requests cut at max_tokens, and the accept length apart for them and for the
           # requests that ended by themselves (EOS or a stop): a long greedy answer that never
           # ends often loops, which a draft predicts well.
           "capped": len(capped) / len(outs) if outs else 0.0,
           "looping": sum(map(loops, (o.token_ids for o in outs))) / len(outs) if outs else 0.0,
           "accept_len_capped": _mean_tau(capped),
           "accept_len_ended": _mean_tau([o for o in outs if o.finish_reason != "length"]),
           "mean_ttft_s": statistics.fmean(o.metrics["ttft_s"] for o in outs),
           "mean_latency_s": statistics.fmean(o.metrics["latency_s"] for o in outs)}
    return row


LOOP_WINDOW = 16     # tokens in a window that repeat_share compares
LOOPING = 0.5        # a request whose repeat_share is at least this counts as looping


def repeat_share(ids: Sequence[int], window: int = LOOP_WINDOW) -> float:
    """Share of the windows of `window` consecutive tokens that occur more than once in ids: 0
    for text that never repeats itself, near 1 for an answer stuck in a loop."""
    grams = [tuple(ids[i:i + window]) for i in range(len(ids) - window + 1)]
    if not grams:
        return 0.0
    counts = collections.Counter(grams)
    return sum(counts[g] > 1 for g in grams) / len(grams)


def loops(ids: Sequence[int]) -> bool:
    """Whether an answer is stuck in a loop (repeat_share at least LOOPING)."""
    return repeat_share(ids) >= LOOPING


def _mean_tau(outs) -> Optional[float]:
    """Mean tokens per cycle (accepted + bonus) over these requests' cycles; None: no cycle."""
    taus = [a + 1 for o in outs for a in (o.accept_lens or [])]
    return statistics.fmean(taus) if taus else None


def _hist(values: Sequence[int], top: int) -> List[int]:
    """Counts of 1..top."""
    h = [0] * top
    for v in values:
        h[min(max(v, 1), top) - 1] += 1
    return h


def per_request(prompts, outs) -> List[dict]:
    return [{"id": p["id"], "category": p.get("category", ""), "tokens": len(o.token_ids),
             "latency_s": o.metrics["latency_s"], "ttft_s": o.metrics["ttft_s"],
             "accept_lens": list(o.accept_lens) if o.accept_lens is not None else None,
             "finish_reason": o.finish_reason, "repeat_share": repeat_share(o.token_ids)}
            for p, o in zip(prompts, outs)]


def categories(prompts, runs: Dict[str, List[dict]]) -> List[dict]:
    """Per category at one batch size: each mode's request throughput (tokens / latency summed
    over the category's requests), accept length, and speedup over plain."""
    cats = sorted({p.get("category") or "-" for p in prompts})
    table = []
    for c in cats:
        row = {"category": c, "requests": sum((p.get("category") or "-") == c for p in prompts)}
        base = None
        for label, reqs in runs.items():
            sel = [r for r in reqs if (r["category"] or "-") == c]
            tps = sum(r["tokens"] for r in sel) / max(sum(r["latency_s"] for r in sel), 1e-9)
            taus = [a + 1 for r in sel for a in (r["accept_lens"] or [])]
            if label == PLAIN.label:
                base = tps
            row[label] = {"tokens_per_s": tps,
                          "accept_len": statistics.fmean(taus) if taus else None,
                          "speedup": tps / base if base else None}
        table.append(row)
    return table


def agreement(a, b) -> float:
    """Fraction of requests whose token ids are identical."""
    same = sum(x.token_ids == y.token_ids for x, y in zip(a, b))
    return same / max(len(a), 1)


EQUAL = "equal"


def first_difference(ref: Sequence[int], got: Sequence[int]) -> Union[int, str]:
    """Index of the first token where `got` differs from `ref`, or EQUAL. When one sequence
    is a strict prefix of the other, they differ at the shorter length."""
    ref, got = list(ref), list(got)
    if ref == got:
        return EQUAL
    n = min(len(ref), len(got))
    return next((i for i in range(n) if ref[i] != got[i]), n)


def divergence(ref: Sequence[Sequence[int]], got: Sequence[Sequence[int]]) -> dict:
    """How far each request's `got` tokens (speculative) follow its `ref` tokens (plain).

    A yes/no equality hides where outputs part: in bf16 the verify forward (many tokens at once)
    and a decode step (one token) sum in a different order, a near-tie argmax can flip, and
    greedy decoding follows a different path from there. Per request: `first_diff`, the index of
    the first differing token or EQUAL; its common prefix is that index (the whole output when
    equal). Over requests: `equals_plain` (fraction fully equal), `prefix_mean` and
    `prefix_median` (common-prefix length in tokens), and `prefix_token_frac` (common-prefix
    tokens over all tokens `got` emitted)."""
    first = [first_difference(a, b) for a, b in zip(ref, got)]
    prefix = [len(b) if f == EQUAL else f for f, b in zip(first, got)]
    emitted = sum(len(b) for b in got[:len(first)])
    return {"first_diff": first,
            "equals_plain": sum(f == EQUAL for f in first) / len(first) if first else None,
            "prefix_mean": statistics.fmean(prefix) if prefix else None,
            "prefix_median": statistics.median(prefix) if prefix else None,
            "prefix_token_frac": sum(prefix) / emitted if emitted else None}


def fit_prompts(tokenizer, prompts, max_tokens: int, max_model_len: int,
                min_prompt_tokens: int = 0, limit: Optional[int] = None):
    """(the first `limit` prompts that fit in max_model_len with max_tokens and have at least
    min_prompt_tokens tokens, how many of those looked at were dropped)."""
    keep, seen = [], 0
    for p in prompts:
        if limit and len(keep) >= limit:
            break
        seen += 1
        n = len(tokenizer.apply_chat_template(list(p["chat"])))
        if min_prompt_tokens <= n and n + max_tokens <= max_model_len:
            keep.append(p)
    return keep, seen - len(keep)
