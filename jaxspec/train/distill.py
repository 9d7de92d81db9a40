"""Self-distillation data: the target's own greedy answers to the training prompts, generated
by jaxspec's engine with plain decoding, and prompts the target
writes itself (self-instruct, as in Magpie: sample what follows the chat template's opening of
a user turn), for text nearer to instruction benchmarks than a dataset's prompts."""
from __future__ import annotations

import time
from typing import List, Optional, Sequence, Tuple

import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.sampling import SamplingParams

_MARK = "\u2063jaxspec-query\u2063"   # a string no template writes by itself


def _engine(cfg: ModelConfig, params, batch: int, rows: int, decode_steps: int, seed: int = 0):
    """A plain engine of `batch` slots, each holding `rows` tokens."""
    from jaxspec.build import build_engine
    from jaxspec.engine import EngineConfig
    conf = EngineConfig(max_batch=batch, max_model_len=max(rows, 16), decode_steps=decode_steps,
                        seed=seed)
    return build_engine(cfg, params, conf, eos_ids=cfg.eos_token_ids)


def _run(engine, prompts, sps) -> List[List[int]]:
    """The engine's outputs for the prompts, in order."""
    ids = [engine.add_request(p, sp, stream=False) for p, sp in zip(prompts, sps)]
    for _ in engine.drain():
        pass
    return [engine.pop_finished(i).output for i in ids]


def generate_responses(cfg: ModelConfig, params, prompts: Sequence[Sequence[int]], max_new: int,
                       batch: int = 256, decode_steps: int = 32, progress: bool = True,
                       max_seconds: Optional[float] = None) -> List[List[int]]:
    """Greedy responses (EOS included when reached, else cut at max_new) for the prompts, in
    order; with max_seconds, stops starting new batches after that long (fewer responses).

    params: the target's params; on GPU pass the unrolled layout (llama.unstack_layers), which
    decodes much faster than the stacked one under lax.scan.
    """
    from tqdm.auto import tqdm

    engine = _engine(cfg, params, batch, max(len(p) for p in prompts) + max_new, decode_steps)
    sp = SamplingParams(temperature=0.0, max_tokens=max_new)
    out: List[List[int]] = []
    t0 = time.perf_counter()
    for i in tqdm(range(0, len(prompts), batch), disable=not progress, desc="self-distill"):
        if max_seconds is not None and time.perf_counter() - t0 > max_seconds:
            break
        group = prompts[i:i + batch]
        out += _run(engine, group, [sp] * len(group))
    if progress:
        n = sum(len(r) for r in out)
        print(f"generated {n} tokens for {len(out)} prompts in {time.perf_counter() - t0:.1f}s")
    return out


def query_prefix(tok) -> List[int]:
    """Tokens of the chat template up to where a user's message begins (system turn included
    when the template writes a default one): the "pre-query template" of Magpie."""
    text = tok.hf.apply_chat_template([{"role": "user", "content": _MARK}], tokenize=False,
                                      add_generation_prompt=False)
    if _MARK not in text:
        raise ValueError("the chat template does not write the user's message verbatim; "
                         "self-instruct prompts need one that does")
    return tok.encode(text[:text.index(_MARK)], add_special_tokens=False)


def self_instruct(cfg: ModelConfig, params, tok, n: int, *, max_query: int = 128,
                  max_prompt_len: int = 256, temperature: float = 1.0, top_p: float = 1.0,
                  min_chars: int = 16, seed: int = 0, batch: int = 256, decode_steps: int = 32,
                  max_seconds: Optional[float] = None, progress: bool = True
                  ) -> Tuple[List[str], List[List[int]], dict]:
    """Up to n user queries the target writes itself, and their chat-template prompts.

    Each slot samples (temperature, top_p; a per-draw seed from a generator seeded with
    `seed`, so a run is reproducible) what follows `query_prefix`. Kept: queries that the
    target ended itself (EOS within max_query tokens), of at least min_chars characters, each
    text once, whose rendered prompt has at most max_prompt_len tokens. Returns (queries,
    prompts, counts: drawn = kept + the dropped ones).
    """
    from tqdm.auto import tqdm

    if n < 1 or max_query < 1 or temperature <= 0 or not 0 < top_p <= 1:
        raise ValueError(f"self_instruct needs n >= 1, max_query >= 1, temperature > 0 and "
                         f"0 < top_p <= 1; got n={n}, max_query={max_query}, "
                         f"temperature={temperature}, top_p={top_p}")
    prefix = query_prefix(tok)
    engine = _engine(cfg, params, batch, len(prefix) + max_query, decode_steps, seed)
    stop = set(cfg.eos_token_ids)
    queries, prompts, seen = [], [], set()
    dropped = {"unfinished": 0, "short": 0, "repeated": 0, "long_prompt": 0}
    rng = np.random.default_rng(seed)
    t0, drawn = time.perf_counter(), 0
    bar = tqdm(total=n, disable=not progress, desc="self-instruct")
    while len(queries) < n and (max_seconds is None or time.perf_counter() - t0 < max_seconds):
        sps = [SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_query,
                              seed=int(s)) for s in rng.integers(0, 2 ** 31 - 1, batch)]
        for ids in _run(engine, [prefix] * batch, sps):
            drawn += 1
            if not ids or ids[-1] not in stop:
                dropped["unfinished"] += 1
                continue
            q = tok.decode(ids[:-1], skip_special_tokens=True).strip()
            key = " ".join(q.lower().split())
            if len(q) < min_chars:
                dropped["short"] += 1
            elif key in seen:
                dropped["repeated"] += 1
            else:
                p = tok.apply_chat_template([{"role": "user", "content": q}])
                if len(p) > max_prompt_len:
                    dropped["long_prompt"] += 1
                    continue
                seen.add(key)
                queries.append(q)
                prompts.append(p)
                bar.update(1)
            if len(queries) >= n:
                break
    bar.close()
    counts = {"drawn": drawn, "kept": len(queries), **dropped,
              "seconds": round(time.perf_counter() - t0, 1)}
    return queries, prompts, counts
