"""Invariants of the speculative cycle against from-scratch references.

After every cycle of a tree (topk > 1) the draft cache, the target cache and the draft seed equal
what an uncached recomputation over the committed sequence gives (so the catch-up read the
features of the accepted path's nodes, at the right positions); an accepted path that ends on the
cache's last row fills it exactly and touches nothing else; and the catch-up runs its MLP on
the last live row only (the dead-row skip is on)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from reference_runner import plain_greedy as reference_plain_greedy
from draft_models import agreeing_pair as _agreeing_pair
from jaxspec.config import ModelConfig
from jaxspec.kv import KVCache, init_cache
from jaxspec.models import eagle, llama
from jaxspec.spec import SpecConfig, init_state, jit_cycle
from jaxspec.spec import draft as draft_lib
from jaxspec.spec.cycle import cycle
from jaxspec.spec.tree import build_tree

CFG = ModelConfig(arch="LlamaForCausalLM", vocab_size=331, hidden_size=64, intermediate_size=96,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
# S + 1 = 5 catch-up rows, N = 10 verify rows, K = 3 rows a draft step: distinct row counts, so
# the jaxpr test can tell the catch-up's MLP from the others by its rows.
TREE = SpecConfig(4, 3, 10)
PROMPTS = [list(range(60, 80)), [5, 17, 42, 8, 99, 3, 7]]   # the longer one first (slot 0)
ROWS = 96         # cache rows of the probe run
CYCLES = 4
REF_ROWS = 64     # the from-scratch references run padded to this many rows (causal)


@functools.lru_cache(maxsize=None)
def agreeing_pair():
    return _agreeing_pair(CFG, scale=0.02, lm_head_scale=0.5)


@functools.lru_cache(maxsize=None)
def plain_greedy(prompt, n):
    """Plain greedy decoding, one token at a time through llama.forward with a KV cache."""
    return reference_plain_greedy(agreeing_pair()[0], CFG, prompt, n, ROWS)


@functools.partial(jax.jit, static_argnames="cfg")
def _from_scratch(params, head, cfg, seq, n):
    """seq [REF_ROWS]: the n committed tokens, then the root, then padding. Uncached and causal:
    the target's K/V of every row, and the draft over rows (f_t, seq[t + 1]) at position t:
    its K/V of every row and the hidden of row n - 1 (the root's row, which seeds the tree)."""
    pos = jnp.arange(REF_ROWS, dtype=jnp.int32)[None]
    empty = init_cache(cfg, 1, 8, jnp.float32)
    mask = llama.causal_mask(1, REF_ROWS)
    hid, tk, tv, _ = llama.forward(params, cfg, seq[None], pos, empty.k, empty.v, empty.lens,
                                   mask)
    feats = llama.final_norm(params, cfg, hid)
    succ = jnp.concatenate([seq[1:], seq[:1]])[None]
    dempty = jnp.zeros((1, 1, cfg.num_kv_heads, 8, cfg.head_dim), jnp.float32)
    dhid, dk, dv = eagle.forward(params, head, cfg, succ, feats, pos, dempty, dempty,
                                 jnp.zeros((1,), jnp.int32), mask)
    return tk[:, 0], tv[:, 0], dk[0, 0], dv[0, 0], dhid[0, n - 1]


def scratch(params, head, seq, root):
    """`_from_scratch` of the committed tokens seq and the root: target k, v [L, Hkv, n, D],
    draft k, v [Hkv, n, D], the root row's draft hidden [H], and its top-k children (tokens,
    log-probabilities) as the draft seed holds them (n = len(seq))."""
    n = len(seq)
    pad = np.zeros(REF_ROWS, np.int32)
    pad[:n + 1] = list(seq) + [root]
    tk, tv, dk, dv, hid = (np.asarray(x) for x in _from_scratch(params, head, CFG,
                                                                  jnp.asarray(pad), n))
    logp = np.asarray(jax.nn.log_softmax(eagle.logits(params, jnp.asarray(hid))))
    top = np.argsort(-logp, kind="stable")[:TREE.topk]
    return dict(tk=tk[:, :, :n], tv=tv[:, :, :n], dk=dk[:, :n], dv=dv[:, :n], hidden=hid,
                tokens=top.astype(np.int32), logp=logp[top].astype(np.float32))


def scratch_state(params, head, slots, rows):
    """A state of `slots` slots and `rows` cache rows whose slot j < len(PROMPTS) holds what
    a prefill of PROMPTS[j] leaves (its KV, its plain greedy first token as the root, the
    root row's draft seed), built from `scratch`; the other slots empty."""
    st = init_state(CFG, TREE, slots, rows, jnp.float32)
    tk, tv, dk, dv = (np.array(x) for x in (st.target.k, st.target.v, st.draft_k, st.draft_v))
    lens, roots = np.zeros(slots, np.int32), np.zeros(slots, np.int32)
    tok, logp, hid = (np.array(x) for x in (st.seed.tokens, st.seed.logp, st.seed.hidden))
    for j, prompt in enumerate(PROMPTS):
        n, roots[j] = len(prompt), plain_greedy(tuple(prompt), 1)[0]
        ref = scratch(params, head, prompt, int(roots[j]))
        tk[:, j, :, :n], tv[:, j, :, :n] = ref["tk"], ref["tv"]
        dk[0, j, :, :n], dv[0, j, :, :n] = ref["dk"], ref["dv"]
        lens[j], tok[j], logp[j], hid[j] = n, ref["tokens"], ref["logp"], ref["hidden"]
    put = jnp.asarray
    return st.replace(target=KVCache(put(tk), put(tv), put(lens)), draft_k=put(dk),
                      draft_v=put(dv), root=put(roots),
                      seed=st.seed._replace(tokens=put(tok), logp=put(logp), hidden=put(hid)))


def check_against_scratch(params, head, state, seqs, roots, slots):
    """The state's caches (rows below each slot's length), roots and seeds equal `scratch`
    over the slot's committed sequence seqs[j] and root roots[j]."""
    lens = np.asarray(state.target.lens)
    for j in slots:
        n = len(seqs[j])
        assert lens[j] == n and int(state.root[j]) == roots[j], j
        ref = scratch(params, head, seqs[j], roots[j])
        got = {"tk": np.asarray(state.target.k)[:, j, :, :n],
               "tv": np.asarray(state.target.v)[:, j, :, :n],
               "dk": np.asarray(state.draft_k)[0, j, :, :n],
               "dv": np.asarray(state.draft_v)[0, j, :, :n],
               "hidden": np.asarray(state.seed.hidden)[j],
               "logp": np.asarray(state.seed.logp)[j]}
        for name in got:
            np.testing.assert_allclose(got[name], ref[name], rtol=1e-4, atol=1e-4,
                                       err_msg=f"{name}, slot {j}")
        assert np.asarray(state.seed.tokens)[j].tolist() == ref["tokens"].tolist(), j


def _path_nodes(tree, emitted, slot):
    """Node indices of the accepted path whose tokens after the root are `emitted`."""
    tok, par = np.asarray(tree.tokens[slot]), np.asarray(tree.parent[slot])
    valid = np.asarray(tree.valid[slot])
    path = [0]
    for t in emitted:
        kids = [i for i in range(1, len(tok))
                if valid[i] and par[i] == path[-1] and tok[i] == t]
        assert len(kids) == 1, "siblings carry distinct tokens"
        path.append(kids[0])
    return path


@functools.lru_cache(maxsize=None)
def probe_run():
    """CYCLES tree cycles of PROMPTS over ROWS-row caches from `scratch_state`. Per cycle:
    (committed sequences, roots, emitted tokens, accept lengths, path node indices, state on
    the host); entry 0 is the state before the first cycle."""
    params, head = agreeing_pair()
    b = len(PROMPTS)
    state = scratch_state(params, head, b, ROWS)
    seqs, roots = [list(p) for p in PROMPTS], [int(r) for r in np.asarray(state.root)]
    tree_of = jax.jit(lambda st: build_tree(draft_lib.draft_tree(
        params, head, CFG, TREE, st.draft_k, st.draft_v, st.target.lens, st.seed), st.root,
        TREE))
    cyc = jit_cycle(CFG, TREE)
    runs = [([list(s) for s in seqs], list(roots), None, None, None,
             jax.tree_util.tree_map(np.array, state))]
    for _ in range(CYCLES):
        tree = tree_of(state)
        state, out = cyc(params, head, state, jnp.ones((b,), bool))
        toks_out, acc = np.asarray(out.tokens), np.asarray(out.accept_len)
        emitted, paths = [], []
        for j in range(b):
            em = [int(t) for t in toks_out[j, :acc[j] + 1]]
            paths.append(_path_nodes(tree, em[:-1], j))
            emitted.append(em)
            seqs[j] = seqs[j] + [roots[j]] + em[:-1]
            roots[j] = em[-1]
        runs.append(([list(s) for s in seqs], list(roots), emitted, acc.tolist(), paths,
                     jax.tree_util.tree_map(np.array, state)))
    return runs


def test_tree_cycles_keep_draft_and_target_state_equal_to_a_from_scratch_run():
    """EAGLE-1 head that reads its features (draft_models.agreeing_pair): after every tree
    cycle, the target KV, the draft KV and the draft seed of each slot equal an uncached
    recomputation over its committed tokens, and the emitted tokens are plain greedy's. The
    accepted paths skip tree nodes, so the catch-up had to gather their features."""
    params, head = agreeing_pair()
    runs = probe_run()
    for seqs, roots, _, _, _, state in runs[1:]:
        check_against_scratch(params, head, state, seqs, roots, range(len(PROMPTS)))
    for j, p in enumerate(PROMPTS):
        seqs, roots = runs[-1][0], runs[-1][1]
        got = seqs[j][len(p):] + [roots[j]]
        assert got == plain_greedy(tuple(p), len(got)), j
    paths = [path for r in runs[1:] for path in r[4]]
    assert any(path != list(range(len(path))) for path in paths), paths
    assert sum(a for r in runs[1:] for a in r[3]) >= 2 * CYCLES
    # The check reads the features: the same rows with the features zeroed differ.
    seqs, roots, state = runs[-1][0], runs[-1][1], runs[-1][5]
    n = len(seqs[0])
    blind = dict(head, fc=head["fc"].at[CFG.hidden_size:].set(0.0))
    dk_blind = scratch(params, blind, seqs[0], roots[0])["dk"]
    assert np.abs(dk_blind - state.draft_k[0, 0, :, :n]).max() > 1e-2


def test_accepted_path_ending_on_the_last_cache_row():
    """Caches of exactly as many rows as slot 0 commits after a cycle that accepts a whole path
    of S drafted tokens: the last accepted token's KV lands in the last row. The outputs are the
    probe's (and plain greedy's), both caches hold exactly the from-scratch rows (the last row
    included), the other live slot's rows past its length and the idle slot's caches stay
    zero."""
    params, head = agreeing_pair()
    runs = probe_run()
    full = [c for c in range(1, CYCLES + 1) if runs[c][3][0] == TREE.num_steps]
    assert full, "no cycle accepted a whole path"
    c = full[-1]
    rows = len(runs[c][0][0])                        # slot 0's committed rows after cycle c
    assert len(runs[c][0][1]) < rows
    state = scratch_state(params, head, len(PROMPTS) + 1, rows)      # slot 2 idle
    cyc = jit_cycle(CFG, TREE)
    active = jnp.array([True, True, False])
    for k in range(1, c + 1):
        state, out = cyc(params, head, state, active)
        acc = np.asarray(out.accept_len)
        assert acc[:2].tolist() == runs[k][3] and acc[2] == 0
        for j in range(2):
            assert np.asarray(out.tokens)[j, :acc[j] + 1].tolist() == runs[k][2][j]
    assert state.target.k.shape[3] == rows and int(state.target.lens[0]) == rows
    seqs, roots = runs[c][0], runs[c][1]
    check_against_scratch(params, head, state, seqs, roots, range(2))
    # slot 0's last row is live data, slot 1's rows past its length are still the zeros of init
    assert np.abs(np.asarray(state.target.k)[:, 0, :, rows - 1]).max() > 0
    assert np.abs(np.asarray(state.draft_k)[0, 0, :, rows - 1]).max() > 0
    n1 = len(seqs[1])
    assert not np.asarray(state.target.k)[:, 1, :, n1:].any()
    assert not np.asarray(state.draft_k)[0, 1, :, n1:].any()
    for leaf in (state.target.k, state.target.v, state.draft_k, state.draft_v):
        assert not np.asarray(leaf)[:, 2].any()
    got = seqs[0][len(PROMPTS[0]):] + [roots[0]]
    assert got == plain_greedy(tuple(PROMPTS[0]), len(got))


# ---------------------------------------------------------------- the catch-up's dead-row skip


def _rows_through(jaxpr, rhs, b):
    """Rows per slot of every product with a weight of shape `rhs` ([K, N] after the layer
    stack is sliced), searched through nested jaxprs."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            x, w = (v.aval.shape for v in eqn.invars[:2])
            if tuple(w[-2:]) == rhs and len(x) >= 2 and x[-1] == rhs[0]:
                found.append(int(np.prod(x[:-1])) // b)
        for p in eqn.params.values():
            for sub in (p if isinstance(p, (list, tuple)) else [p]):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += _rows_through(inner, rhs, b)
    return found


def _cycle_rows(spec, b=2):
    """{'o_proj': rows, 'mlp': rows} of the cycle's products with the attention output
    projection [Hq * D, H] and the MLP's down projection [F, H] (the target's and the
    draft's layers have the same shapes)."""
    params, head = agreeing_pair()
    state = jax.eval_shape(lambda: init_state(CFG, spec, b, 64, jnp.float32))
    f = functools.partial(cycle, cfg=CFG, spec=spec, greedy_only=True)
    jaxpr = jax.make_jaxpr(f)(params, head, state, jnp.ones((b,), bool)).jaxpr
    h = CFG.hidden_size
    return {"o_proj": _rows_through(jaxpr, (CFG.num_heads * CFG.head_dim, h), b),
            "mlp": _rows_through(jaxpr, (CFG.intermediate_size, h), b)}


def test_catch_up_runs_attention_output_and_mlp_on_the_last_live_row_only():
    """The cycle's attention output projections and MLPs run on N verify rows (target), K rows
    per draft step and one catch-up row per slot: the catch-up's S dead rows (of S + 1) only
    write draft KV. With the skip off, the catch-up runs them on all S + 1 rows, which this
    check sees."""
    s, k, n = TREE.num_steps, TREE.topk, TREE.num_draft_tokens
    for name, rows in _cycle_rows(TREE).items():
        assert sorted(set(rows)) == [1, k, n], (name, rows)
        assert rows.count(1) == 1, (name, rows)           # the catch-up's single layer
    for name, rows in _cycle_rows(SpecConfig(s, k, n, skip_dead_rows=False)).items():
        assert s + 1 in rows and 1 not in rows, (name, rows)
