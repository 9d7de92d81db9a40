"""THE speculative cycle: one jitted, static-shape function.

    draft (steps 1..S-1) -> tree -> verify (one target forward over N nodes) -> accept (greedy
    or tree speculative sampling, per slot) -> compaction (accepted target KV rows into place)
    -> draft catch-up (= next cycle's step 0)

Sampling parameters, per-slot rng keys and the penalties' token counts are part of the state, so
mixed greedy/sampled batches and new parameters never recompile. The softmax, sort and coins of
sampling run only when some slot samples; the penalties only when some slot has one; logprobs
only when some slot asked for them. Either the host says so at trace time (`features`, one
executable per variant: what the engine runs) or the cycle tests device flags under lax.cond.

State is a pytree donated to the jitted cycle, so the caches are updated in place; all counts are
arrays, so a second call with new values reuses the compiled executable. Nothing in the cycle
reads a value back to the host.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.config import ModelConfig
from jaxspec.kv import KVCache, init_cache
from jaxspec.models import llama
from jaxspec.spec import context_vocab
from jaxspec.spec import draft as draft_lib
from jaxspec.spec.config import SpecConfig
from jaxspec.spec.tree import build_tree
from jaxspec.sampling import (MAX_LOGPROBS, Features, SlotSampling, TokenCounts,
                              apply_tree_penalties, cond, no_logprobs, processed_logprobs,
                              split_slot_keys, token_logprobs)
from jaxspec.spec.verify import (emitted_tokens, greedy_accept, path_tokens, sample_accept,
                                 select_accept)
from jaxspec.xla_options import gemm_choice, jit
from pallas_kernels.kv_compact import kv_compact


@struct.dataclass
class SpecState:
    """Per-slot device state between cycles.

    target      KVCache [L, B, Hkv, T, D]; lens = L, the committed rows (the root is at L)
    draft_k/v   [1, B, Hkv, T, D] draft KV; draft row t sits at position t, so its length is L too
    root        [B] the last emitted token (no target KV yet)
    seed        DraftSeed: the root's top-k children, their log-probs, the root row's draft hidden
    sampling    SlotSampling: per-slot parameters ([B] arrays)
    rng         [B, 2] uint32 per-slot rng keys
    history     TokenCounts: prompt tokens seen and output counts (the root included) [B, V]
    """
    target: KVCache
    draft_k: jax.Array
    draft_v: jax.Array
    root: jax.Array
    seed: draft_lib.DraftSeed
    sampling: SlotSampling
    rng: jax.Array
    history: TokenCounts


class CycleOut(NamedTuple):
    tokens: jax.Array        # [B, S+1] emitted (accepted + bonus), -1 padded
    accept_len: jax.Array    # [B] accepted drafted tokens (0 for idle slots)
    logprob: jax.Array       # [B, S+1] of each emitted token (zeros unless a slot asked);
                             # [B, 0] from a variant without logprobs (LEAN: no_logprobs)
    top_ids: jax.Array       # [B, S+1, k] best alternatives, k = min(MAX_LOGPROBS, V)
    top_logprobs: jax.Array  # [B, S+1, k]


def init_state(cfg: ModelConfig, spec: SpecConfig, slots: int, max_len: int, dtype,
               draft_params=None, context: Optional[int] = None) -> SpecState:
    """draft_params: sizes the draft cache and hidden for a head whose layer is not shaped like
    the target's (an EAGLE-3 head with its own head count), and the context vocabulary
    (`context_vocab`); None: the target's shapes, no context vocabulary. context: the context
    vocabulary's size E when draft_params are not at hand (None: the head's)."""
    target = init_cache(cfg, slots, max_len, dtype)
    dcfg = cfg if draft_params is None else draft_lib.layer_config(cfg, draft_params)
    dshape = (1, slots, dcfg.num_kv_heads, max_len, dcfg.head_dim)
    k = spec.topk
    if context is None:
        context = context_vocab.size(draft_params)
    seed = draft_lib.DraftSeed(jnp.zeros((slots, k), jnp.int32), jnp.zeros((slots, k), jnp.float32),
                               jnp.zeros((slots, dcfg.hidden_size), dtype),
                               context_vocab.empty(slots, context))
    return SpecState(target, jnp.zeros(dshape, dtype), jnp.zeros(dshape, dtype),
                     jnp.zeros((slots,), jnp.int32), seed, SlotSampling.greedy(slots),
                     jnp.zeros((slots, 2), jnp.uint32), TokenCounts.zeros(slots, cfg.vocab_size))


def _penalized(logits, sp: SlotSampling, penalize):
    """Runs the penalty only when some slot has one (the logits pass through otherwise)."""
    return cond(sp.any_penalty(), penalize, lambda: logits)


def cycle(params, draft_params, state: SpecState, active, *, cfg: ModelConfig, spec: SpecConfig,
          greedy_only: bool = False, features: Optional[Features] = None):
    """One speculative cycle for all slots. active [B] bool: idle slots change nothing.

    greedy_only: every slot is greedy and wants no logprobs, so no sampling or logprob code is
    compiled (the penalties still apply). features (static; None: tested on the device with
    lax.cond): what the host knows the batch uses, so the cycle has no conditional (see
    `sampling.Features`). Returns (state, CycleOut).
    """
    s = spec.num_steps
    lens, hist = state.target.lens, state.history
    sp = state.sampling.with_features(features)
    cands = draft_lib.draft_tree(params, draft_params, cfg, spec, state.draft_k, state.draft_v,
                                 lens, state.seed)
    tree = build_tree(cands, state.root, spec)
    # Verify: a depth-d node sits at position L + d; the forward returns the tree's K/V and writes
    # nothing, so only the accepted rows are ever written (below).
    hidden, k_new, v_new, captured = llama.forward(
        params, cfg, tree.tokens, lens[:, None] + tree.depth, state.target.k, state.target.v,
        lens, tree.mask, draft_lib.capture_layers(draft_params))
    normed = llama.final_norm(params, cfg, hidden)                          # [B, N, H]
    feats = draft_lib.target_features(draft_params, normed, captured)       # [B, N, H or 3H]
    logits = llama.project_logits(params, normed, cfg)                      # [B, N, V]
    # Row i sees the committed counts plus the tokens on its own path (no [B, N, V] counts).
    logits = _penalized(logits, sp, lambda: apply_tree_penalties(logits, sp, hist,
                                                                 *path_tokens(tree, s)))
    pred = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    acc = greedy_accept(tree, pred, s)
    rng = state.rng
    # Keys advance only where a slot may sample: a LEAN batch's greedy slots never read them
    # (a resumed request's key advance counts FULL cycles, the only ones a sampling slot runs).
    if not greedy_only and (features is None or features.sampled):
        rng_next, coin_keys, bonus_keys = split_slot_keys(rng, 3)

        def sampled(_):
            logq = processed_logprobs(logits, sp)
            coins = jax.vmap(lambda k: jax.random.uniform(k, (s,)))(coin_keys)
            return select_accept(sp.temperature > 0, acc,
                                 sample_accept(tree, logq, coins, bonus_keys, s))

        acc = cond(sp.any_sampled(), sampled, lambda _: acc, None)
        rng = jnp.where(active[:, None], rng_next, rng)
    out = emitted_tokens(tree, acc)                                         # [B, S+1]
    live = active[:, None] & (jnp.arange(s + 1)[None] <= acc.accept_len[:, None])
    if features is not None and not features.logprobs:
        lp = no_logprobs(out.shape[0])
    elif greedy_only:
        k = min(MAX_LOGPROBS, cfg.vocab_size)
        lp = (jnp.zeros(out.shape, jnp.float32), jnp.zeros(out.shape + (k,), jnp.int32),
              jnp.zeros(out.shape + (k,), jnp.float32))
    else:
        # The emitted token d was drawn from path node d's distribution (the bonus from the last
        # one's, not from the residual), so its logprob reads that row.
        rows = jnp.take_along_axis(logits, acc.path[..., None], axis=1)      # [B, S+1, V]
        lp = token_logprobs(rows, sp, out, MAX_LOGPROBS)
    n_live = jnp.where(active, acc.accept_len + 1, 0)
    tk, tv = kv_compact(state.target.k, state.target.v, k_new, v_new, lens, acc.path, n_live)
    # Catch-up rows: (feature of path node d, emitted token d) at position L + d, d <= accept_len.
    path_feats = jnp.take_along_axis(feats, acc.path[..., None], axis=1)   # [B, S+1, F]
    dk, dv, seed = draft_lib.catch_up(params, draft_params, cfg, spec, state.draft_k,
                                      state.draft_v, lens, path_feats, out, n_live,
                                      ctx=state.seed.ctx)
    seed = jax.tree_util.tree_map(
        lambda new, old: jnp.where(active.reshape((-1,) + (1,) * (new.ndim - 1)), new, old),
        seed, state.seed)
    # The counts feed only the penalties: a batch without them (LEAN) leaves them as they are;
    # a request with a penalty runs every cycle FULL, and admission rebuilds a slot's counts.
    if features is None or features.penalty:
        hist = hist.add(out, live)
    new_state = SpecState(KVCache(tk, tv, lens + n_live), dk, dv,
                          jnp.where(active, acc.bonus, state.root), seed, state.sampling, rng,
                          hist)
    return new_state, CycleOut(jnp.where(active[:, None], out, -1),
                               jnp.where(active, acc.accept_len, 0), *lp)


# Slots from which several cycles a call run as a loop rather than unrolled (`cycles`).
LOOP_MIN_SLOTS = 64


def cycles(params, draft_params, state: SpecState, active, *, n_cycles: int, loop: bool = False,
           **kw):
    """n_cycles cycles back to back in one program (vLLM's multi-step scheduling): the host pays
    its per-call cost (argument handling, reading the outputs) once for all of them.

    loop=False: the cycles are unrolled into one program, which XLA runs as one CUDA graph whose
    nodes the host updates (their temporaries move between calls) and launches every call.
    loop=True: a `lax.scan` over one cycle, as plain decoding runs its steps; the host launches
    the body's graph once an iteration. At large batches the loop takes host time off each
    call for the same device time; at small ones it runs slower. `jit_cycle` picks the loop
    from LOOP_MIN_SLOTS slots. The layers' weights are sliced inside the body, where XLA reads
    the slices in place: sliced once before the loop, all of them are copied every call.

    Returns (state, CycleOut) with tokens, logprob, top_* [B, n_cycles * (S+1), ...] (each slot's
    emitted tokens first, in order, -1 after them, as one cycle's) and accept_len [B, n_cycles].
    n_cycles == 1 is `cycle` itself (accept_len [B])."""
    if n_cycles == 1:
        return cycle(params, draft_params, state, active, **kw)
    if loop:
        state, outs = jax.lax.scan(lambda st, _: cycle(params, draft_params, st, active, **kw),
                                   state, None, length=n_cycles)
        outs = [CycleOut(*(x[i] for x in outs)) for i in range(n_cycles)]
    else:
        outs = []
        for _ in range(n_cycles):
            state, out = cycle(params, draft_params, state, active, **kw)
            outs.append(out)
    tokens = jnp.concatenate([o.tokens for o in outs], axis=1)
    order = jnp.argsort(tokens < 0, axis=1, stable=True)       # emitted first, order kept

    def gather(x):
        if x.shape[1] == 0:        # no logprobs (`no_logprobs`)
            return x
        idx = order.reshape(order.shape + (1,) * (x.ndim - 2))
        return jnp.take_along_axis(x, idx, axis=1)

    cat = [gather(jnp.concatenate(xs, axis=1)) for xs in zip(*(o[2:] for o in outs))]
    return state, CycleOut(gather(tokens), jnp.stack([o.accept_len for o in outs], axis=1), *cat)


def jit_cycle(cfg: ModelConfig, spec: SpecConfig, greedy_only: bool = False,
              features: Optional[Features] = None, n_cycles: int = 1,
              slots: Optional[int] = None, loop: Optional[bool] = None):
    """cycle(params, draft_params, state, active) -> (state, CycleOut); the state is donated.
    n_cycles > 1: `cycles` (that many per call). slots: the state's slots when the caller
    knows them (they choose the GEMMs, `xla_options`, and whether the cycles loop). loop: the
    cycles as a loop or unrolled (None: a loop from LOOP_MIN_SLOTS slots).

    One jitted function per (cfg, spec, greedy_only, features, n_cycles, slots, loop, GEMM
    rule), so runners of the same shapes share executables."""
    if loop is None:
        loop = slots is not None and slots >= LOOP_MIN_SLOTS
    return _jit_cycle(cfg, spec, greedy_only, features, n_cycles, slots, loop, gemm_choice())


@functools.lru_cache(maxsize=None)
def _jit_cycle(cfg, spec, greedy_only, features, n_cycles, slots, loop, _gemm):
    # The smallest products have one row per slot (the draft's lm_head at topk 1, catch-up).
    return jit(functools.partial(cycles, cfg=cfg, spec=spec, greedy_only=greedy_only,
                                 features=features, n_cycles=n_cycles, loop=loop), rows=slots,
               donate_argnums=(2,))


jit_cycle.cache_clear = _jit_cycle.cache_clear
