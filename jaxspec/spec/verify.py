"""Accepting a verified tree: which path the target agrees with, and what the slot emits.

Greedy: node i is accepted when its token equals the target's argmax at its parent and its parent
is accepted; the deepest accepted node `a` ends the path, accept_len = depth[a], and the bonus token
is the target's argmax at `a`. A sampling verify (lossless tree speculative sampling) returns the
same (accept_len, path, bonus) triple from the target's processed distributions, so the rest of
the cycle does not change.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxspec.spec.tree import Tree


class Accept(NamedTuple):
    accept_len: jax.Array  # [B] int32 accepted drafted tokens (bonus excluded)
    path: jax.Array        # [B, S+1] int32 node index at depth d (d <= accept_len; pads 0)
    bonus: jax.Array       # [B] int32


def greedy_accept(tree: Tree, target_pred, num_steps: int) -> Accept:
    """target_pred [B, N] = the target's argmax after each node."""
    b, n = tree.tokens.shape
    match = (tree.tokens == jnp.take_along_axis(target_pred, tree.parent, axis=1)) & tree.valid
    match = match.at[:, 0].set(True)
    ok = jnp.zeros((b, n), bool).at[:, 0].set(True)
    for _ in range(num_steps):  # a path is at most num_steps deep
        ok = jnp.take_along_axis(ok, tree.parent, axis=1) & match
    # Siblings carry distinct tokens, so at most one child of a node matches: the ok nodes form
    # one path and each depth holds at most one of them.
    accept_len = jnp.max(jnp.where(ok, tree.depth, 0), axis=1)
    dst = jnp.where(ok, tree.depth, num_steps + 1)
    path = jnp.zeros((b, num_steps + 1), jnp.int32).at[jnp.arange(b)[:, None], dst].set(
        jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[None], (b, n)), mode="drop")
    last = jnp.take_along_axis(path, accept_len[:, None], axis=1)[:, 0]
    bonus = jnp.take_along_axis(target_pred, last[:, None], axis=1)[:, 0]
    return Accept(accept_len.astype(jnp.int32), path, bonus.astype(jnp.int32))


def emitted_tokens(tree: Tree, acc: Accept):
    """[B, S+1]: the accepted tokens after the root, then the bonus, padded with -1."""
    s1 = acc.path.shape[1]
    d = jnp.arange(s1, dtype=jnp.int32)[None]
    nxt = jnp.take_along_axis(tree.tokens, jnp.roll(acc.path, -1, axis=1), axis=1)
    out = jnp.where(d < acc.accept_len[:, None], nxt, -1)
    return jnp.where(d == acc.accept_len[:, None], acc.bonus[:, None], out)
