"""The public API, in the style of vLLM: `LLM(...).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import dataclasses
import time
from typing import Any, List, Optional, Sequence, Union

import jax
import jax.numpy as jnp

from jaxspec.config import ConfigError
from jaxspec.decode import PlainRunner
from jaxspec.kv import init_cache, kv_bytes_per_token
from jaxspec.sampling import SamplingParams

Chat = List[dict]
Prompt = Union[str, Chat, Sequence[int]]


@dataclasses.dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: List[int]
    token_ids: List[int]
    text: str
    finish_reason: str                 # "stop" or "length"
    metrics: dict                      # ttft_s, latency_s, tokens_per_s
    accept_lens: Optional[List[int]] = None   # speculative runs: accepted tokens per cycle


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
        # Slack rows: a decode chunk may run past a request's end before the host sees it.
        cache = init_cache(self.config, max_batch, self.max_model_len + 2 * decode_chunk, self.dtype)
        self.runner = PlainRunner(self.config, self.params, cache, decode_chunk=decode_chunk,
                                  seed=seed)
        self.max_batch = max_batch
        self.spec_runner = None
        if spec is not None or draft is not None:
            self._init_spec(draft, spec)

    def _load_draft(self, draft: Optional[str]):
        from jaxspec.loading import eagle_ckpt
        if draft in (None, "default"):
            return eagle_ckpt.load_default_head(self.config, dtype=self.dtype)
        return eagle_ckpt.load_eagle1(draft, self.config, dtype=self.dtype)

    def _init_spec(self, draft, spec):
        """draft: None/'default' (the shipped head for the default model), a checkpoint path,
        or a draft params pytree. spec: a SpecConfig or a preset name ('naive', 'chain', 'tree')."""
        from jaxspec.spec.config import resolve_spec
        from jaxspec.spec.runner import SpecRunner
        spec = resolve_spec(spec if spec is not None else "chain")
        if draft is None or isinstance(draft, str):
            draft = self._load_draft(draft)
        self.spec = spec
        # Rows for one cycle's worth of speculative tokens past a request's end.
        self.spec_runner = SpecRunner(self.config, self.params, draft, spec, self.max_batch,
                                      self.max_model_len + spec.num_steps + 1)

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

    def _stop_ids(self, sp: SamplingParams) -> set:
        ids = set(sp.stop_token_ids)
        if not sp.ignore_eos:
            ids |= set(self.tokenizer.eos_token_ids) | set(self.config.eos_token_ids)
        return ids

    # -- generation ----------------------------------------------------------------------
    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None
                 ) -> List[RequestOutput]:
        """Generates for each prompt. All requests are validated before any work starts."""
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
        if self.spec_runner is not None:
            return self._generate_spec(encoded, sps)
        outputs: List[RequestOutput] = []
        for start in range(0, len(encoded), self.max_batch):
            ids, sp = encoded[start:start + self.max_batch], sps[start:start + self.max_batch]
            gens = self.runner.generate(ids, sp, [self._stop_ids(s) for s in sp])
            for j, g in enumerate(gens):
                outputs.append(RequestOutput(
                    request_id=start + j, prompt_token_ids=ids[j], token_ids=g.token_ids,
                    text=self.tokenizer.decode(g.token_ids), finish_reason=g.finish_reason,
                    metrics={"ttft_s": g.ttft_s, "latency_s": g.latency_s,
                             "tokens_per_s": len(g.token_ids) / max(g.latency_s, 1e-9)}))
        return outputs

    def _generate_spec(self, encoded, sps) -> List[RequestOutput]:
        if any(sp.temperature > 0 for sp in sps):
            raise ValueError("speculative decoding is greedy only in this version: use "
                             "temperature=0, or an LLM without spec= to sample")
        stop = set().union(*(self._stop_ids(sp) for sp in sps))
        if any(self._stop_ids(sp) != stop for sp in sps):
            raise ValueError("speculative batches need the same stop tokens for every request")
        t0 = time.perf_counter()
        results = self.spec_runner.generate(encoded, [sp.max_tokens for sp in sps], tuple(stop))
        dt = time.perf_counter() - t0
        return [RequestOutput(
            request_id=i, prompt_token_ids=ids, token_ids=r.token_ids,
            text=self.tokenizer.decode(r.token_ids), finish_reason=r.finish_reason,
            metrics={"latency_s": dt, "tokens_per_s": len(r.token_ids) / max(dt, 1e-9)},
            accept_lens=r.accept_lens) for i, (ids, r) in enumerate(zip(encoded, results))]
