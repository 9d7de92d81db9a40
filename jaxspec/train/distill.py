"""Self-distillation data: the target's own greedy answers to the training prompts, generated
with jaxspec's plain batched decoding (on-device multi-step decode)."""
from __future__ import annotations

import time
from typing import List, Optional, Sequence

import jax

from jaxspec.config import ModelConfig
from jaxspec.decode import PlainRunner
from jaxspec.kv import init_cache
from jaxspec.sampling import SamplingParams


def generate_responses(cfg: ModelConfig, params, prompts: Sequence[Sequence[int]], max_new: int,
                       batch: int = 256, decode_chunk: int = 32, progress: bool = True,
                       max_seconds: Optional[float] = None) -> List[List[int]]:
    """Greedy responses (EOS included when reached, else cut at max_new) for the prompts, in
    order; with max_seconds, stops starting new batches after that long (fewer responses).

    params: the target's params; on GPU pass the unrolled layout (llama.unstack_layers), which
    decodes much faster than the stacked one under lax.scan.
    """
    from tqdm.auto import tqdm

    max_prompt = max(len(p) for p in prompts)
    dtype = jax.tree_util.tree_leaves(params)[0].dtype
    # Slack rows: a decode chunk may run past a slot's end before the host sees it.
    cache = init_cache(cfg, batch, max_prompt + max_new + 2 * decode_chunk + 16, dtype)
    runner = PlainRunner(cfg, params, cache, decode_chunk=decode_chunk)
    sp = SamplingParams(temperature=0.0, max_tokens=max_new)
    stop = set(cfg.eos_token_ids)
    out: List[List[int]] = []
    t0 = time.perf_counter()
    for i in tqdm(range(0, len(prompts), batch), disable=not progress, desc="self-distill"):
        if max_seconds is not None and time.perf_counter() - t0 > max_seconds:
            break
        group = prompts[i:i + batch]
        gens = runner.generate(group, [sp] * len(group), [stop] * len(group))
        out += [g.token_ids for g in gens]
    if progress:
        n = sum(len(r) for r in out)
        print(f"generated {n} tokens for {len(out)} prompts in {time.perf_counter() - t0:.1f}s")
    return out
