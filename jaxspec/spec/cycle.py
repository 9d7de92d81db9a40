"""THE speculative cycle: one jitted, static-shape function.

    draft (steps 1..S-1) -> tree -> verify (one target forward over N nodes) -> greedy accept
    -> compaction (accepted target KV rows into place) -> draft catch-up (= next cycle's step 0)

State is a pytree donated to the jitted cycle, so the caches are updated in place; all counts are
arrays, so a second call with new values reuses the compiled executable. Nothing in the cycle
reads a value back to the host.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.config import ModelConfig
from jaxspec.kv import KVCache, init_cache
from jaxspec.models import llama
from jaxspec.spec import draft as draft_lib
from jaxspec.spec.config import SpecConfig
from jaxspec.spec.tree import build_tree
from jaxspec.spec.verify import emitted_tokens, greedy_accept
from pallas_kernels.kv_compact import kv_compact


@struct.dataclass
class SpecState:
    """Per-slot device state between cycles.

    target      KVCache [L, B, Hkv, T, D]; lens = L, the committed rows (the root is at L)
    draft_k/v   [1, B, Hkv, T, D] draft KV; draft row t sits at position t, so its length is L too
    root        [B] the last emitted token (no target KV yet)
    seed        DraftSeed: the root's top-k children, their log-probs, the root row's draft hidden
    """
    target: KVCache
    draft_k: jax.Array
    draft_v: jax.Array
    root: jax.Array
    seed: draft_lib.DraftSeed


class CycleOut(NamedTuple):
    tokens: jax.Array      # [B, S+1] emitted (accepted + bonus), -1 padded
    accept_len: jax.Array  # [B] accepted drafted tokens (0 for idle slots)


def init_state(cfg: ModelConfig, spec: SpecConfig, slots: int, max_len: int, dtype) -> SpecState:
    target = init_cache(cfg, slots, max_len, dtype)
    dshape = (1, slots, cfg.num_kv_heads, max_len, cfg.head_dim)
    k = spec.topk
    seed = draft_lib.DraftSeed(jnp.zeros((slots, k), jnp.int32), jnp.zeros((slots, k), jnp.float32),
                               jnp.zeros((slots, cfg.hidden_size), dtype))
    return SpecState(target, jnp.zeros(dshape, dtype), jnp.zeros(dshape, dtype),
                     jnp.zeros((slots,), jnp.int32), seed)


def prefill(params, draft_params, state: SpecState, tokens, prompt_lens, *, cfg: ModelConfig,
            spec: SpecConfig):
    """Target prefill + draft prefill over padded prompts.

    tokens [B, P] (padded), prompt_lens [B] (>= 1; 0 leaves a slot empty and idle).
    The root (first generated token) is the target's argmax at the last prompt position; the
    draft then catches up over rows (f_t, x_{t+1}) for t < P_b with x_{P_b} = root.
    Returns (state, root [B]).
    """
    b, p = tokens.shape
    zeros = jnp.zeros((b,), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32)[None], (b, p))
    hidden, k_new, v_new, _ = llama.forward(params, cfg, tokens, pos, state.target.k,
                                            state.target.v, zeros,
                                            llama.causal_mask(b, p, prompt_lens))
    tk, tv = kv_compact(state.target.k, state.target.v, k_new, v_new, zeros, pos, prompt_lens)
    feats = llama.final_norm(params, cfg, hidden)                           # EAGLE-1 features
    last = jnp.take_along_axis(feats, jnp.maximum(prompt_lens - 1, 0)[:, None, None], axis=1)
    root = jnp.argmax(llama.project_logits(params, last[:, 0]), axis=-1).astype(jnp.int32)
    shifted = jnp.concatenate([tokens[:, 1:], zeros[:, None]], axis=1)
    shifted = jnp.where(pos == (prompt_lens - 1)[:, None], root[:, None], shifted)
    dk, dv, seed = draft_lib.catch_up(params, draft_params, cfg, spec, state.draft_k,
                                      state.draft_v, zeros, feats, shifted, prompt_lens)
    return SpecState(KVCache(tk, tv, prompt_lens.astype(jnp.int32)), dk, dv, root, seed), root


def cycle(params, draft_params, state: SpecState, active, *, cfg: ModelConfig, spec: SpecConfig):
    """One speculative cycle for all slots. active [B] bool: idle slots change nothing.

    Returns (state, CycleOut).
    """
    s = spec.num_steps
    lens = state.target.lens
    cands = draft_lib.draft_tree(params, draft_params, cfg, spec, state.draft_k, state.draft_v,
                                 lens, state.seed)
    tree = build_tree(cands, state.root, spec)
    # Verify: a depth-d node sits at position L + d; the forward returns the tree's K/V and writes
    # nothing, so only the accepted rows are ever written (below).
    hidden, k_new, v_new, _ = llama.forward(params, cfg, tree.tokens, lens[:, None] + tree.depth,
                                            state.target.k, state.target.v, lens, tree.mask)
    feats = llama.final_norm(params, cfg, hidden)                           # [B, N, H]
    pred = jnp.argmax(llama.project_logits(params, feats), axis=-1).astype(jnp.int32)
    acc = greedy_accept(tree, pred, s)
    out = emitted_tokens(tree, acc)                                         # [B, S+1]
    n_live = jnp.where(active, acc.accept_len + 1, 0)
    tk, tv = kv_compact(state.target.k, state.target.v, k_new, v_new, lens, acc.path, n_live)
    # Catch-up rows: (feature of path node d, emitted token d) at position L + d, d <= accept_len.
    path_feats = jnp.take_along_axis(feats, acc.path[..., None], axis=1)   # [B, S+1, H]
    dk, dv, seed = draft_lib.catch_up(params, draft_params, cfg, spec, state.draft_k,
                                      state.draft_v, lens, path_feats, out, n_live)
    seed = jax.tree_util.tree_map(
        lambda new, old: jnp.where(active.reshape((-1,) + (1,) * (new.ndim - 1)), new, old),
        seed, state.seed)
    new_state = SpecState(KVCache(tk, tv, lens + n_live), dk, dv,
                          jnp.where(active, acc.bonus, state.root), seed)
    return new_state, CycleOut(jnp.where(active[:, None], out, -1),
                               jnp.where(active, acc.accept_len, 0))


@functools.lru_cache(maxsize=None)
def jit_cycle(cfg: ModelConfig, spec: SpecConfig):
    """cycle(params, draft_params, state, active) -> (state, CycleOut); the state is donated.

    One jitted function per (cfg, spec), so runners of the same shapes share executables."""
    return jax.jit(functools.partial(cycle, cfg=cfg, spec=spec), donate_argnums=(2,))


@functools.lru_cache(maxsize=None)
def jit_prefill(cfg: ModelConfig, spec: SpecConfig):
    """prefill(params, draft_params, state, tokens, prompt_lens) -> (state, root); state donated."""
    return jax.jit(functools.partial(prefill, cfg=cfg, spec=spec), donate_argnums=(2,))
