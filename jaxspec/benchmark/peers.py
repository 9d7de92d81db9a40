"""Peer baselines in the same run: HF transformers greedy with a static cache, and its
prompt-lookup decoding, on the same prompt token ids, batch 1, timed like jaxspec (wall clock
over the whole prompt set, after a warm-up request)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import List, Optional


def available(force_cpu: bool) -> Optional[str]:
    """None if the peers can run (torch with CUDA, or CPU when asked), else why not."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if torch.cuda.is_available() or force_cpu:
        return None
    return "no CUDA device (name them with --peers to run them on the CPU)"


def load_hf(model: Optional[str], dtype: Optional[str] = None):
    """HF transformers' model for a jaxspec model argument (HF dir or .gguf; None: default),
    in `dtype` ('bfloat16', 'float32'; None: bf16 on CUDA, fp32 on CPU, as jaxspec loads)."""
    import torch
    from transformers import AutoModelForCausalLM

    from jaxspec.weights import default_model_path
    p = Path(model) if model else default_model_path()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype is None:
        dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    else:
        dtype = getattr(torch, dtype)
    if p.is_dir():
        m = AutoModelForCausalLM.from_pretrained(str(p), dtype=dtype)
    else:
        try:
            m = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=dtype)
        except ValueError as e:
            if "accelerate" not in str(e):
                raise
            m = _gguf_without_accelerate(p, dtype)
    return m.to(dev).eval()


def _gguf_without_accelerate(path: Path, dtype):
    """What `from_pretrained(gguf_file=...)` does, minus its hard requirement on `accelerate`."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    return model


PEERS = {
    # transformers' own fast path: a static cache, with the decode step compiled by generate
    # itself (torch.compile, mode reduce-overhead: CUDA graphs). The cache is sized by the
    # first call's prompt + max_new_tokens and never shrinks, so `run_peer` warms up on the
    # longest prompt: every later prompt reuses that cache and the compiled step. (Sized per
    # prompt, a 16-prompt MT-bench run recompiled for each and did not finish in 400 s.)
    "hf-compiled": dict(cache_implementation="static"),
    # the same static cache, eager
    "hf-static": dict(cache_implementation="static", disable_compile=True),
    "hf-pld": dict(prompt_lookup_num_tokens=10),
}


def _generate(model, ids: List[int], max_tokens: int, eos: List[int], kw: dict) -> List[int]:
    import torch
    x = torch.tensor([ids], device=model.device)
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                         do_sample=False, eos_token_id=eos or None,
                         pad_token_id=(eos or [0])[0], **kw)
    return out[0, len(ids):].tolist()


def run_peer(model, name: str, prompt_ids: List[List[int]], max_tokens: int,
             eos: List[int]) -> dict:
    """Tokens/s over the prompts (batch 1) and the generated ids."""
    import torch
    kw = PEERS[name]
    compiles = kw.get("cache_implementation") == "static" and not kw.get("disable_compile")
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    with torch.inference_mode():
        # compiled peer: the longest prompt at full length, so the static cache is sized once
        # for every prompt and compiled before the clock starts
        longest = max(prompt_ids, key=len)
        _generate(model, longest, max_tokens if compiles else min(max_tokens, 8), eos, kw)
        sync()
        # whether generate compiled its decode step (transformers does so only on an
        # accelerator, and only from the versions that have auto-compilation)
        compiled = compiles and getattr(model, "_compiled_call", None) is not None
        t0 = time.perf_counter()
        outs = [_generate(model, ids, max_tokens, eos, kw) for ids in prompt_ids]
        sync()
        secs = time.perf_counter() - t0
    outs = [_cut_at_eos(o, eos) for o in outs]
    ntok = sum(len(o) for o in outs)
    return {"mode": name, "batch": 1, "requests": len(outs), "tokens": ntok, "seconds": secs,
            "tokens_per_s": ntok / secs if secs > 0 else 0.0, "token_ids": outs,
            "compiled": compiled}


def _cut_at_eos(ids: List[int], eos: List[int]) -> List[int]:
    for i, t in enumerate(ids):
        if t in eos:
            return ids[:i + 1]
    return ids
