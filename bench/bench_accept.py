"""Acceptance of a draft head: mean tokens per speculative cycle (accepted + bonus, "tau") on the
MT-bench questions (first turn, chat template, greedy), per speculation preset.

    python -m bench.bench_accept [--model M] [--head H.safetensors] [--presets chain tree]
        [--questions 80] [--max-new 256] [--draft-vocab K] [--out results.json] [--agreement]

--head defaults to the shipped head of the default model. The answers come from the engine
(`jaxspec.build.build_engine`, greedy); tau depends only on the head and the target, not on the
batch: all questions run at once.
--draft-vocab K (EAGLE-1 heads) drafts only the ranking's K most frequent tokens, as
`LLM(draft_vocab=K)` does (the ranking shipped beside the default head, or --ranking); the
default 0 drafts the whole vocabulary. With it, --context-vocab E makes the last E of the K each
slot's own: the last E distinct tokens of its prompt and output outside the other K - E
(`spec.context_vocab`; unless given, the LLM's default for one request on a GPU, 256; 0: none). A head's tau under the cut can rank heads differently
from its tau over the whole vocabulary.

--turns 2 runs MT-bench as EAGLE's evaluation does: each question's second turn follows its
first with the first turn's answer in the chat (each preset answers its own first turns), and
tau is over the cycles of both turns; the output also gives tau per turn.

--agreement (EAGLE-1 heads): where a chain's acceptance is lost, per MT-bench category. Over
the chain preset's answers, the target's teacher-forced features and the head's chained
training passes (`train.loss.draft_forward_ttt`) say, position by position, whether each draft
step proposes the target's token; walking each answer cycle by cycle with those flags
(`simulate_chain`) must give the measured accept lengths, and the flags' mean is the head's
agreement with the target on that kind of text.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Callable, Dict, List, Sequence

import numpy as np

def mt_bench_questions(path=None, n: int = 80) -> List[str]:
    """First turns of MT-bench: from `path` (a jsonl in the MT-bench layout) or the packaged copy."""
    return [turns[0] for turns in mt_bench_turns(path, n)]


def mt_bench_turns(path=None, n: int = 80) -> List[List[str]]:
    """Every turn of the first n MT-bench questions (two each), from `path` or the packaged
    copy."""
    if path is None:
        from jaxspec.datasets import mt_bench
        return [r["turns"] for r in mt_bench(limit=n)]
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [list(r["turns"]) for r in rows[:n]]


def follow_up(tok, first_turns: Sequence[str], later: Sequence[str]) -> Callable:
    """Builds a second turn's prompts from first-turn results: the chat of each question's
    first turn, the answer as the assistant's message (its text without special tokens, as far
    as max_new let it run) and the next user turn, in the chat template."""
    def prompts(results) -> List[List[int]]:
        return tok.apply_chat_templates([
            [{"role": "user", "content": q},
             {"role": "assistant", "content": tok.decode(r.token_ids, skip_special_tokens=True)},
             {"role": "user", "content": q2}]
            for q, q2, r in zip(first_turns, later, results)])
    return prompts


def measure_acceptance(cfg, params, draft, prompts: Sequence[Sequence[int]], presets=("chain", "tree"),
                       max_new: int = 256, max_slots: int = 0, runners=None,
                       next_turns: Sequence[Callable] = ()) -> Dict[str, dict]:
    """{preset: {tau, looping, tau_unlooped, cycles, tokens, wall_s, accept_hist}} from the
    engine, greedy (looping, tau_unlooped: `loop_split`). presets: names or STEPSxTOPKxTOKENS
    (as jaxspec-bench --spec). tau is over every cycle of every request: the engine records a
    request's cycles up to the one that ended it (`RequestOutput.accept_lens`).

    runners: a dict kept by the caller to reuse engines (their compiled programs) across heads
    of one shape. next_turns: for each later turn, a function of the previous turn's results
    giving its prompts (`follow_up`); the figures then cover every turn's cycles, and 'turns'
    holds each turn's own (tau, cycles, tokens)."""
    from jaxspec.benchmark.runner import parse_specs

    out = {}
    for name, spec in ((m.label, m.spec) for m in parse_specs(",".join(presets))):
        t0 = time.perf_counter()
        turns = [answers(cfg, params, draft, spec, prompts, max_new, max_slots, runners)]
        for make in next_turns:
            turns.append(answers(cfg, params, draft, spec, make(turns[-1]), max_new, max_slots,
                                 runners))
        wall = time.perf_counter() - t0
        res = [r for turn in turns for r in turn]
        out[name] = {**_turn_figures(res), **loop_split(res), "wall_s": round(wall, 2),
                     "accept_hist": np.bincount(_accepts(res),
                                                minlength=spec.num_steps + 1).tolist(),
                     "spec": [spec.num_steps, spec.topk, spec.num_draft_tokens]}
        if next_turns:
            out[name]["turns"] = [_turn_figures(turn) for turn in turns]
    return out


def answers(cfg, params, draft, spec, prompts, max_new: int, max_slots: int = 0,
            runners=None, sampling=None) -> list:
    """One turn: the engine's RequestOutputs for `prompts` (token ids), in order, each cut at
    max_new tokens or after an EOS of cfg; greedy, or per prompt `sampling` (SamplingParams,
    their max_tokens at most max_new). max_slots: the engine's slots (0: one per prompt; fewer
    run the rest as slots free up, which leaves greedy outputs as they are). runners: engines
    by (spec, slots, rows, the draft's shapes), reused with this draft."""
    from jaxspec.sampling import SamplingParams

    engine = _engine(cfg, params, draft, spec, max_slots or len(prompts),
                     _model_len(prompts, max_new), runners)
    sps = sampling or [SamplingParams(temperature=0.0, max_tokens=max_new)] * len(prompts)
    ids = [engine.add_request(p, sp, stream=False) for p, sp in zip(prompts, sps)]
    for _ in engine.drain():
        pass
    return [engine.pop_finished(i).output_record(i, speculative=True) for i in ids]


def _engine(cfg, params, draft, spec, slots: int, max_len: int, runners):
    """A speculative engine over `draft` (from `runners` when one of the same spec, slots, rows
    and draft shapes was built before: only its draft weights change)."""
    import jax

    from jaxspec.build import build_engine
    from jaxspec.engine import EngineConfig
    from jaxspec.spec.config import resolve_spec

    spec = resolve_spec(spec)
    leaves, tree = jax.tree_util.tree_flatten(draft)
    key = (spec, slots, max_len, str(tree),
           tuple((tuple(x.shape), str(x.dtype)) for x in leaves))
    engine = None if runners is None else runners.get(key)
    if engine is not None:
        be = engine.backend
        be.draft_params = be.placement.weights(be.params, draft)[1]
        return engine
    engine = build_engine(cfg, params, EngineConfig(max_batch=slots, max_model_len=max_len),
                          draft=draft, spec=spec, eos_ids=cfg.eos_token_ids)
    if runners is not None:
        runners[key] = engine
    return engine


def _accepts(res) -> np.ndarray:
    """Every cycle's accepted draft tokens over the results (`answers`), in order."""
    return np.concatenate([np.asarray(r.accept_lens, np.int64) for r in res])


def _turn_figures(res) -> dict:
    """tau (accepted + bonus per cycle), cycles and emitted tokens of the results (`answers`)."""
    acc = _accepts(res)
    return {"tau": float((acc + 1).mean()), "cycles": int(acc.size),
            "tokens": int(sum(len(r.token_ids) for r in res))}


def chain_agreement(cfg, params, draft, seqs: Sequence[Sequence[int]], steps: int,
                    width: int = 0) -> List[np.ndarray]:
    """Per sequence (prompt + answer ids) a bool array [steps, T]: [k, t] = the head's pass k at
    row t (reading token t + 1 and pass k - 1's feature of t; pass 0 the target's) proposes
    token t + 2. Sequences are zero-padded to one width (causal: the padding changes nothing
    before it), so the two programs compile once."""
    import jax.numpy as jnp

    from jaxspec.models import llama
    from jaxspec.train.loss import draft_forward_ttt, target_features

    width = width or _round_up(max(len(s) for s in seqs), 128)
    dtype = params["embed"].dtype
    out = []
    for seq in seqs:
        t = len(seq)
        padded = np.zeros((1, width), np.int32)
        padded[0, :t] = seq
        row = jnp.asarray(padded)
        feats = target_features(params, cfg, row)
        preds = draft_forward_ttt(params, draft, cfg, row, feats.astype(dtype), steps)
        guess = np.asarray(jnp.argmax(llama.project_logits(params, preds.astype(dtype)), -1))
        flags = np.zeros((steps, t), bool)
        flags[:, :t - 2] = guess[:, 0, :t - 2] == np.asarray(seq[2:])[None]
        out.append(flags)
    return out


def simulate_chain(flags: np.ndarray, prompt_len: int) -> List[int]:
    """Accept lengths of greedy chain cycles over one answer from `chain_agreement` flags: the
    cycle whose root (last emitted token) is token r accepts step k's draft (token r + 1 + k)
    while flags[j, r - 1 + j] hold for j <= k; the next root is r + accepted + 1. The flags end
    with the answer, so where the runner's last cycle accepted drafts past an answer cut at
    max_tokens, that cycle simulates shorter."""
    steps, t = flags.shape
    root, out = prompt_len, []
    while root < t - 1:
        acc = 0
        while acc < steps and root + 1 + acc < t and flags[acc, root - 1 + acc]:
            acc += 1
        out.append(acc)
        root += acc + 1
    return out


def agreement_table(cfg, params, draft, prompts, results, categories, steps: int) -> Dict[str, dict]:
    """{category (and "all"): measured and simulated tau, cycles, the first step's agreement
    over all answer tokens and at cycle starts} for one chain preset's results (`answers`)."""
    seqs = [list(p) + list(r.token_ids) for p, r in zip(prompts, results)]
    groups: Dict[str, Dict[str, list]] = {}
    for cat, p, r, flags in zip(categories, prompts, results,
                                chain_agreement(cfg, params, draft, seqs, steps)):
        sim = simulate_chain(flags, len(p))
        roots = np.cumsum([len(p)] + [a + 1 for a in sim[:-1]])
        seen = {"real": list(r.accept_lens), "sim": sim, "first": list(flags[0, len(p) - 1:-2]),
                "start": [flags[0, x - 1] for x in roots if x + 1 < flags.shape[1]]}
        for key in (cat, "all"):
            g = groups.setdefault(key, {name: [] for name in seen})
            for name, vals in seen.items():
                g[name] += vals
    return {k: {"tau": float(np.mean(g["real"]) + 1), "tau_simulated": float(np.mean(g["sim"]) + 1),
                "cycles": len(g["real"]), "cycles_simulated": len(g["sim"]),
                "agreement": float(np.mean(g["first"])), "agreement_at_starts": float(np.mean(g["start"]))}
            for k, g in groups.items()}


def loop_split(res) -> dict:
    """Of results (token_ids, accept_lens each): the share of requests whose answer
    loops (`runner.loops`) and tau over the others. A greedy answer stuck in a loop is easy to
    draft, so at long --max-new the plain tau says more about loops than about the head;
    tau_unlooped is the figure to compare heads by."""
    from jaxspec.benchmark.runner import loops
    looping = [loops(r.token_ids) for r in res]
    rest = [a + 1 for r, loop in zip(res, looping) if not loop for a in r.accept_lens]
    return {"looping": sum(looping) / len(res) if res else 0.0,
            "tau_unlooped": float(np.mean(rest)) if rest else None}


def _model_len(prompts, max_new: int) -> int:
    """max_model_len for these prompts: the longest prompt and the new tokens, rounded up to
    128 (so that turns of similar lengths share an engine)."""
    return _round_up(max(len(p) for p in prompts) + max_new, 128)


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def main(argv=None) -> int:
    from jaxspec.loading.eagle_ckpt import load_default_head, load_draft
    from jaxspec.weights import load_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--head", default=None, help="draft head: our .safetensors, or a public EAGLE-1/EAGLE-3 checkpoint "
                    "(default: the shipped head)")
    ap.add_argument("--presets", nargs="+", default=["chain", "tree"],
                    help="preset names or STEPSxTOPKxTOKENS, e.g. chain 5x1x6 4x2x8")
    ap.add_argument("--questions", type=int, default=80)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--draft-vocab", type=int, default=0,
                    help="EAGLE-1 heads: draft only the K most frequent tokens (0: all)")
    ap.add_argument("--ranking", default=None,
                    help="token ranking for --draft-vocab (default: the shipped head's)")
    ap.add_argument("--context-vocab", type=int, default=None,
                    help="with --draft-vocab: how many of the K are each slot's context tokens "
                         "(`LLM(draft_context_vocab=)`; default: the LLM's at "
                         "max_batch 1 on a GPU, 0: none)")
    ap.add_argument("--turns", type=int, choices=(1, 2), default=1,
                    help="2: also each question's second turn, after its first turn's answer "
                         "(EAGLE's MT-bench evaluation); tau over both turns' cycles")
    ap.add_argument("--max-slots", type=int, default=0,
                    help="the engine's slots (0: every question at once); fewer bound memory, "
                         "not tau")
    ap.add_argument("--out", default=None)
    ap.add_argument("--agreement", action="store_true",
                    help="per category: the chain's tau measured and simulated from the head's "
                         "teacher-forced agreement with the target (EAGLE-1 heads)")
    a = ap.parse_args(argv)
    if a.draft_vocab < 0:
        ap.error(f"--draft-vocab must be >= 0 (0: the whole vocabulary), got {a.draft_vocab}")
    if a.context_vocab is not None and a.context_vocab < 0:
        ap.error(f"--context-vocab must be >= 0 (0: none), got {a.context_vocab}")
    if a.context_vocab and not a.draft_vocab:
        ap.error("--context-vocab needs --draft-vocab K: the context adds to a cut vocabulary")
    if a.draft_vocab and a.agreement:
        ap.error("--agreement simulates the head's full-vocabulary passes; drop --draft-vocab")
    if a.max_slots < 0:
        ap.error(f"--max-slots must be >= 0 (0: every question at once), got {a.max_slots}")
    if a.turns > 1 and a.agreement:
        ap.error("--agreement measures first turns only; drop --turns")
    cfg, params, tok = load_model(a.model)
    dtype = params["embed"].dtype
    draft = load_draft(a.head, cfg, dtype) if a.head else load_default_head(cfg, dtype)
    if 0 < a.draft_vocab < cfg.vocab_size:
        from jaxspec import defaults
        from jaxspec.spec.draft_vocab import restrict_top
        # default: the LLM's for one request on a GPU (the measure here is a request's tau)
        ctx = defaults.CONTEXT_VOCAB if a.context_vocab is None else a.context_vocab
        ctx = ctx if a.context_vocab is not None or ctx < a.draft_vocab else 0
        draft = restrict_top(params, draft, cfg, a.draft_vocab, a.ranking, context=ctx)
    turns = mt_bench_turns(n=a.questions)
    firsts = [t[0] for t in turns]
    prompts = tok.apply_chat_templates([[{"role": "user", "content": q}] for q in firsts])
    if a.agreement:
        return _print_agreement(cfg, params, draft, prompts, a)
    later = [follow_up(tok, firsts, [t[1] for t in turns])] if a.turns > 1 else []
    res = measure_acceptance(cfg, params, draft, prompts, a.presets, a.max_new, a.max_slots,
                             next_turns=later)
    print(f"{'preset':8s} {'(S,K,N)':12s} {'tau':>6s} {'looping':>7s} {'tau, rest':>9s} "
          f"{'cycles':>7s} {'tokens':>7s} {'wall_s':>7s}  per turn")
    for name, r in res.items():
        rest = "-" if r["tau_unlooped"] is None else f"{r['tau_unlooped']:.3f}"
        each = " / ".join(f"{t['tau']:.3f}" for t in r.get("turns", ()))
        print(f"{name:8s} {str(tuple(r['spec'])):12s} {r['tau']:6.3f} {r['looping']:7.0%} "
              f"{rest:>9s} {r['cycles']:7d} {r['tokens']:7d} {r['wall_s']:7.1f}  {each}")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


def _print_agreement(cfg, params, draft, prompts, a) -> int:
    from jaxspec.datasets import mt_bench
    from jaxspec.spec.config import resolve_spec

    if not isinstance(draft, dict):
        raise SystemExit("--agreement needs an EAGLE-1 head (its training passes simulate it)")
    spec = resolve_spec("chain")
    res = answers(cfg, params, draft, spec, prompts, a.max_new, a.max_slots)
    cats = [r["category"] for r in mt_bench(limit=a.questions)]
    table = agreement_table(cfg, params, draft, prompts, res, cats, spec.num_steps)
    print(f"{'category':11s} {'tau':>6s} {'tau sim':>7s} {'cycles':>7s} {'agree':>6s} {'at starts':>9s}")
    for cat, r in table.items():
        print(f"{cat:11s} {r['tau']:6.3f} {r['tau_simulated']:7.3f} {r['cycles']:7d} "
              f"{r['agreement']:6.3f} {r['agreement_at_starts']:9.3f}")
    if a.out:
        Path(a.out).write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
