"""A smaller draft vocabulary for EAGLE-1 heads: the draft scores only the most frequent tokens.

An EAGLE-1 head projects through the target's lm_head, all V rows of it, once per draft
forward (the catch-up and each draft step). For a small target at large batch that matrix is
the costliest thing the draft reads (SmolLM2: 49,152 x 576, 57 MB a forward). FR-Spec
(frequency-ranked speculative sampling) keeps only the columns of the K most frequent tokens;
the draft then proposes only those, and the verify, which is unchanged, still decides every
token against the target's full distribution. So the output stays exactly the target's
(greedy, and sampled: the tree's acceptance reads only target probabilities), and only tokens
outside the K can no longer be drafted.

    ids = load_ranking(path, cfg.vocab_size)[:K]        # target ids, most frequent first
    draft_params = restrict(params, draft_params, ids)   # adds draft_lm_head [H, K], draft_ids

`draft._children` projects through `draft_lm_head` and maps the picks back through
`draft_ids` when the head has them. EAGLE-3 heads have their own draft vocabulary already.
`restrict(..., context=E)` makes the last E of the K each slot's own: the last E distinct tokens
of its own prompt and output outside the other K - E (`spec.context_vocab`): the topic's rare
words.

Rankings are built from a corpus's token counts (`rank_tokens`; `python -m
jaxspec.spec.draft_vocab` counts the answers of ShareGPT first turns) and stored as a
safetensors file with one int32 tensor `ids` (no pickle): a permutation of a prefix of the
vocabulary's ids, checked on load.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Iterable, Optional

import numpy as np

from jaxspec.config import ConfigError
from jaxspec.loading.common import WeightsError


def rank_tokens(token_arrays: Iterable[np.ndarray], vocab_size: int) -> np.ndarray:
    """[V] int32: every target id, by count in token_arrays (most frequent first; ties by id,
    so the ranking is deterministic)."""
    counts = np.zeros(vocab_size, np.int64)
    for ids in token_arrays:
        ids = np.asarray(ids, np.int64).ravel()
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(f"token ids must be in [0, {vocab_size})")
        counts += np.bincount(ids, minlength=vocab_size)
    return np.lexsort((np.arange(vocab_size), -counts)).astype(np.int32)


def _ids_ok(ids: np.ndarray, vocab_size: int) -> bool:
    """ids is 1..V distinct target ids in [0, V), one axis."""
    return (ids.ndim == 1 and 0 < len(ids) <= vocab_size and ids.min() >= 0
            and ids.max() < vocab_size and len(np.unique(ids)) == len(ids))


def save_ranking(path, ids: np.ndarray) -> None:
    from safetensors.numpy import save_file
    save_file({"ids": np.ascontiguousarray(ids, np.int32)}, str(path))


def load_ranking(path, vocab_size: int) -> np.ndarray:
    """The ranking file's ids [n] int32 (n <= V), checked: distinct ids in [0, V)."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"token ranking file {str(path)!r} does not exist")
    try:
        flat = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise WeightsError(f"{path}: not a readable safetensors file ({e})") from e
    if set(flat) != {"ids"}:
        raise WeightsError(f"{path}: expected one tensor 'ids', found {sorted(flat)}")
    ids = flat["ids"]
    if ids.ndim != 1 or ids.dtype != np.int32:
        raise WeightsError(f"{path}: tensor 'ids' must be 1-D int32, got {ids.dtype} "
                           f"{tuple(ids.shape)}")
    if not _ids_ok(ids, vocab_size):
        repeats = 0 < len(ids) and len(np.unique(ids)) != len(ids)
        raise WeightsError(f"{path}: 'ids' repeats a token id" if repeats else
                           f"{path}: 'ids' must hold 1..{vocab_size} ids in [0, {vocab_size})")
    return ids


def restrict(params, draft_params, ids, context: int = 0):
    """EAGLE-1 draft params that draft only the target ids `ids` [K] (distinct): the target
    lm_head's K columns (`draft_lm_head` [H, K]) and the ids (`draft_ids` [K] int32). context
    = E > 0 makes the last E of the K each slot's own (`context_vocab`: `draft_in_vocab` [V]
    bool marks the K - E fixed ids, `draft_context` [E] int32 holds a fresh slot's ids, the
    ranking's last E)."""
    import jax.numpy as jnp
    from jaxspec.models.eagle3 import is_eagle3
    if is_eagle3(draft_params):
        raise ConfigError("an EAGLE-3 head has its own draft vocabulary; draft_vocab applies to "
                          "EAGLE-1 heads")
    if isinstance(context, bool) or not isinstance(context, (int, np.integer)) or context < 0:
        raise ConfigError(f"the context vocabulary must be an int >= 0, got {context!r}")
    ids = np.asarray(ids, np.int32)
    w = params["lm_head"] if "lm_head" in params else params["embed"].T     # [H, V]
    if not _ids_ok(ids, w.shape[1]):
        raise ConfigError(f"draft vocabulary ids must be 1..{w.shape[1]} distinct ids in "
                          f"[0, {w.shape[1]})")
    out = dict(draft_params, draft_lm_head=jnp.take(w, jnp.asarray(ids), axis=1),
               draft_ids=jnp.asarray(ids))
    if context and len(ids) < w.shape[1]:
        if context >= len(ids):
            raise ConfigError(f"the context vocabulary ({context}) must be smaller than the "
                              f"draft vocabulary ({len(ids)}) it is part of")
        fixed = len(ids) - int(context)
        in_vocab = np.zeros(w.shape[1], bool)
        in_vocab[ids[:fixed]] = True
        # a fresh slot's context: the ranking's last E of the K, the rarest oldest (first out)
        out.update(draft_in_vocab=jnp.asarray(in_vocab),
                   draft_context=jnp.asarray(ids[fixed:][::-1].copy()))
    return out


def ranking_path(cfg, ranking=None) -> Path:
    """The ranking file to cut a head of target `cfg` with: `ranking`, else the one shipped
    beside the default head, which ranks only the default model's tokens."""
    from jaxspec.loading import eagle_ckpt
    if ranking is not None:
        return Path(ranking)
    if not eagle_ckpt.matches_default_target(cfg):
        raise ConfigError("draft_vocab needs a token ranking for this model: pass "
                          "draft_vocab_ranking (see jaxspec.spec.draft_vocab)")
    return eagle_ckpt.default_ranking_path()


def restrict_top(params, draft_params, cfg, k: int, ranking=None, context: int = 0):
    """draft_params cut to the k most frequent tokens of the ranking (`ranking_path`), with a
    context vocabulary of `context` ids a slot (`restrict`)."""
    return restrict(params, draft_params, load_ranking(ranking_path(cfg, ranking),
                                                       cfg.vocab_size)[:k], context)


def restricted_size(draft_params) -> Optional[int]:
    """K of a restricted EAGLE-1 head, None for a full one (or an EAGLE-3 head)."""
    ids = draft_params.get("draft_ids") if isinstance(draft_params, dict) else None
    return None if ids is None else int(ids.shape[0])


def _questions(a, tok) -> list:
    """First-turn questions of ShareGPT (the package, or --prompts' jsonl of chats) that fit in
    --max-prompt-tokens, as chats."""
    import json
    if a.prompts:
        with open(a.prompts) as fh:
            return [json.loads(line)["chat"] for line in fh if line.strip()][:a.questions]
    from jaxspec.train.data import first_turns, iter_sharegpt
    out = []
    for q, _ in first_turns(iter_sharegpt()):
        if len(tok.encode(q)) <= a.max_prompt_tokens:
            out.append([{"role": "user", "content": q}])
            if len(out) == a.questions:
                break
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description="Ranks the target's tokens by their count in a corpus and writes the ranking "
                    "file: the answers of ShareGPT first turns (--source answers), or the "
                    "target's own greedy answers to ShareGPT first-turn questions (--source "
                    "target: what the draft has to predict; needs an accelerator to be quick).")
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=None, help="whose tokenizer counts (default: SmolLM2)")
    ap.add_argument("--source", choices=("answers", "target"), default="answers")
    ap.add_argument("--conversations", type=int, default=20000,
                    help="answers: ShareGPT conversations read")
    ap.add_argument("--questions", type=int, default=4096, help="target: questions answered")
    ap.add_argument("--prompts", default=None,
                    help="target: a jsonl of {'chat': [...]} rows instead of the package")
    ap.add_argument("--save-prompts", default=None,
                    help="target: write the questions as such a jsonl and stop")
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=256, help="target: tokens per answer")
    ap.add_argument("--batch", type=int, default=256)
    a = ap.parse_args(argv)
    from jaxspec.weights import load_model
    cfg, _, tok = load_model(a.model)
    if a.source == "answers":
        from jaxspec.train.data import first_turns, iter_sharegpt
        answers = [ans for _, ans in first_turns(iter_sharegpt(limit=a.conversations))]
        arrays = [np.asarray(x, np.int64)
                  for x in tok.encode_batch(answers, add_special_tokens=False)]
    else:
        chats = _questions(a, tok)
        if a.save_prompts:
            import json
            Path(a.save_prompts).write_text("".join(json.dumps({"chat": c}) + "\n"
                                                    for c in chats))
            print(f"{len(chats)} questions -> {a.save_prompts}")
            return 0
        from jaxspec import LLM, SamplingParams
        # (the LLM loads the weights again, from the conversion cache load_model filled)
        llm = LLM(a.model, max_batch=a.batch, max_model_len=a.max_prompt_tokens + a.max_tokens + 64)
        outs = llm.generate(chats, SamplingParams(max_tokens=a.max_tokens))
        arrays = [np.asarray(o.token_ids, np.int64) for o in outs]
    ids = rank_tokens(arrays, cfg.vocab_size)
    save_ranking(a.out, ids)
    total = sum(len(x) for x in arrays)
    counts = np.bincount(np.concatenate(arrays), minlength=cfg.vocab_size)[ids]
    cover = {k: float(counts[:k].sum() / total) for k in (4096, 8192, 16384, 32768)}
    print(f"{len(arrays)} texts, {total} tokens -> {a.out}; share of the tokens inside the "
          "top K: " + ", ".join(f"{k}: {c:.4f}" for k, c in cover.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
