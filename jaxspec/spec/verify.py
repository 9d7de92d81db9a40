"""Accepting a verified tree: which path the target agrees with, and what the slot emits.

Greedy: node i is accepted when its token equals the target's argmax at its parent and its parent
is accepted; the deepest accepted node `a` ends the path, accept_len = depth[a], and the bonus token
is the target's argmax at `a`.

Sampling (lossless tree speculative sampling against the target only): walk from the root; at
node c, one coin u ~ U[0, 1) against the running mass of c's children in node order under the
target's processed distribution q_c; the first child whose running mass exceeds u is accepted and
the walk continues from it. If none is, the bonus is drawn from q_c with the children's tokens
removed (the residual); at a leaf (or depth S) from q_c itself. This is inverse-CDF sampling of q_c
with the children placed first, so every emitted token has exactly the target's distribution,
and no draft probabilities are needed. Both return the same (accept_len, path, bonus) triple, so
the rest of the cycle does not change.
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


def path_tokens(tree: Tree, num_steps: int):
    """-> (tokens [B, N, S], live [B, N, S]): the tokens on the path from the root (excluded) to
    each node (included), deepest first; what row i's penalties must count besides the slot's."""
    ptr = jnp.broadcast_to(jnp.arange(tree.tokens.shape[1], dtype=jnp.int32)[None],
                           tree.tokens.shape)
    toks, live = [], []
    for _ in range(num_steps):
        toks.append(jnp.take_along_axis(tree.tokens, ptr, axis=1))
        live.append(jnp.take_along_axis(tree.depth, ptr, axis=1) > 0)
        ptr = jnp.take_along_axis(tree.parent, ptr, axis=1)
    return jnp.stack(toks, -1), jnp.stack(live, -1) & tree.valid[..., None]


def sample_accept(tree: Tree, logq, coins, bonus_keys, num_steps: int) -> Accept:
    """logq [B, N, V] processed target log-probabilities after each node; coins [B, S] ~ U[0, 1);
    bonus_keys [B, 2] -> Accept. S unrolled rounds, one coin per depth."""
    b, n, v = logq.shape
    bi = jnp.arange(b)[:, None]
    node = jnp.arange(n, dtype=jnp.int32)[None]
    # q_parent(token) of every node: the probability that its parent's distribution draws it.
    q_tok = jnp.exp(logq.reshape(b, n * v)[bi, tree.parent * v + tree.tokens])     # [B, N]
    is_cand = tree.valid & (node > 0)
    cur = jnp.zeros((b,), jnp.int32)
    alive = jnp.ones((b,), bool)
    path = jnp.zeros((b, num_steps + 1), jnp.int32)
    for d in range(num_steps):
        kids = is_cand & (tree.parent == cur[:, None]) & alive[:, None]
        mass = jnp.cumsum(jnp.where(kids, q_tok, 0.0), axis=1)
        # strict: a child of probability 0 is never accepted, whatever the coin
        hit = kids & (coins[:, d:d + 1] < mass)
        took = jnp.any(hit, axis=1)
        nxt = jnp.argmax(hit, axis=1).astype(jnp.int32)                      # first hit
        cur = jnp.where(took, nxt, cur)
        path = path.at[:, d + 1].set(jnp.where(took, nxt, 0))
        alive = alive & took
    accept_len = jnp.take_along_axis(tree.depth, cur[:, None], axis=1)[:, 0]
    # Residual: the stopping node's children were all tried (none at a leaf or at depth S).
    kids = is_cand & (tree.parent == cur[:, None])
    tried = jnp.zeros((b, v), bool).at[bi, jnp.where(kids, tree.tokens, v)].set(True, mode="drop")
    lq = jnp.take_along_axis(logq, cur[:, None, None], axis=1)[:, 0]          # [B, V]
    resid = jnp.where(tried, -jnp.inf, lq)
    # The residual holds mass 1 - (tried mass) > u - (tried mass) >= 0; should rounding leave it
    # empty, q_c itself is the closest draw.
    resid = jnp.where(jnp.any(resid > -jnp.inf, axis=1, keepdims=True), resid, lq)
    bonus = jax.vmap(jax.random.categorical)(bonus_keys, resid)
    return Accept(accept_len.astype(jnp.int32), path, bonus.astype(jnp.int32))


def select_accept(use_second, first: Accept, second: Accept) -> Accept:
    """Per slot: second where use_second [B], else first."""
    return Accept(*(jnp.where(use_second.reshape((-1,) + (1,) * (a.ndim - 1)), b2, a)
                    for a, b2 in zip(first, second)))


def emitted_tokens(tree: Tree, acc: Accept):
    """[B, S+1]: the accepted tokens after the root, then the bonus, padded with -1."""
    s1 = acc.path.shape[1]
    d = jnp.arange(s1, dtype=jnp.int32)[None]
    nxt = jnp.take_along_axis(tree.tokens, jnp.roll(acc.path, -1, axis=1), axis=1)
    out = jnp.where(d < acc.accept_len[:, None], nxt, -1)
    return jnp.where(d == acc.accept_len[:, None], acc.bonus[:, None], out)
