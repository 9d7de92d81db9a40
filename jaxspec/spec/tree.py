"""The verified tree: the N-1 best candidates plus the root, parents before children."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.spec import topk as topk_lib
from jaxspec.spec.config import SpecConfig
from jaxspec.spec.draft import Candidates


class Tree(NamedTuple):
    tokens: jax.Array  # [B, N] int32, node 0 = root
    parent: jax.Array  # [B, N] int32, parent node (root: 0)
    depth: jax.Array   # [B, N] int32, root 0; a depth-d node is verified at position L + d
    mask: jax.Array    # [B, N, N] bool, tree_mask[i, j] = j is i or an ancestor of i
    valid: jax.Array   # [B, N] bool, False only for a node whose parent was not chosen


def candidate_depths(spec: SpecConfig) -> np.ndarray:
    """[C] static depth of each candidate slot (generation order: depth 1, then one per step)."""
    k = spec.topk
    return np.concatenate([np.ones(k, np.int32)] +
                          [np.full(k * k, d, np.int32) for d in range(2, spec.num_steps + 1)])


def build_tree(cands: Candidates, root, spec: SpecConfig) -> Tree:
    """cands from `draft_tree`, root [B] -> Tree of N = num_draft_tokens nodes."""
    b, c = cands.tokens.shape
    n = spec.num_draft_tokens
    if spec.topk == 1:
        # A chain: the best N-1 candidates are the N-1 shallowest (scores never rise with
        # depth), so no scores are needed.
        sel = jnp.broadcast_to(jnp.arange(n - 1, dtype=jnp.int32)[None], (b, n - 1))
    else:
        # lax.top_k's set: the lower index first on ties, so a parent (lower index, score >= its
        # child's) always wins against its own child. Candidates are generated depth by depth,
        # so index order puts parents first.
        sel = topk_lib.top_k_indices_in_order(cands.scores, n - 1)
    bidx = jnp.arange(b)[:, None]
    node_of = jnp.full((b, c), -1, jnp.int32).at[bidx, sel].set(
        jnp.arange(1, n, dtype=jnp.int32)[None])
    pc = jnp.take_along_axis(cands.parent, sel, axis=1)
    pnode = jnp.where(pc < 0, 0, jnp.take_along_axis(node_of, jnp.maximum(pc, 0), axis=1))
    valid = jnp.concatenate([jnp.ones((b, 1), bool), pnode >= 0], axis=1)
    parent = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), jnp.maximum(pnode, 0)], axis=1)
    depth = jnp.concatenate([jnp.zeros((b, 1), jnp.int32),
                             jnp.asarray(candidate_depths(spec))[sel]], axis=1)
    tokens = jnp.concatenate([root[:, None].astype(jnp.int32),
                              jnp.take_along_axis(cands.tokens, sel, axis=1)], axis=1)
    return Tree(tokens, parent, depth, ancestor_mask(parent, spec.num_steps), valid)


def ancestor_mask(parent, max_depth: int):
    """parent [B, N] (root's parent = 0) -> [B, N, N] self + ancestors, in max_depth rounds."""
    b, n = parent.shape
    eye = jnp.eye(n, dtype=bool)
    mask = jnp.broadcast_to(eye[None], (b, n, n))
    ptr = parent
    for _ in range(max_depth):
        mask = mask | eye[ptr]
        ptr = jnp.take_along_axis(parent, ptr, axis=1)
    return mask
