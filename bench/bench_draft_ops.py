"""The ops at the vocab end of a tree draft step, timed one by one (Llama-3-8B shape, batch 1).

A draft step projects K = 10 frontier rows through the lm_head to [1, K, V] fp32 logits, takes
their top-k (`top_children`: top_k + one logsumexp), then ranks the K*K cumulative scores. Timed
here, each alone:
  (a) lm_head    [1, K, H] x [H, V] bf16 -> fp32 logits (effective GB/s of weights + logits)
  (b) lax_top_k  jax.lax.top_k of [1, K, V] fp32, k = K
  (c) logsumexp  over [1, K, V]
  (d) two_stage  jaxspec.spec.topk.top_k at each chunk bound (plus the row padded to a
                 multiple of 4096, the layout the balanced chunks avoid)
  (d') chunk_max  jaxspec.spec.topk.top_k_by_chunk_max at widths 64, 128, 256 (the default
                 of vocab_top_k), and with its two small top-ks as sorts (chunk_max_sort)
  (d'') pallas    pallas_kernels.vocab_topk at chunk widths and warps, one launch and two
  (e) approx_max_k  recall_target 0.95 (TPU-oriented: other backends lower it to an exact TopK)
  (f) top_children  draft.top_children on the logits with each top-k above, and lm_head +
                 top_children from the hidden rows, as a draft step runs them
  (g) cum_top_k  jax.lax.top_k of the [1, K*K] cumulative scores, k = K
  (h) tree_choice  the tree's N - 1 tokens of its candidates ([B, 510] at 6x10x60), in index
                 order: top_k_indices_in_order by lax.top_k and a sort, and by pairwise ranks
Each timing is the median over repeats of `calls` back-to-back dispatches of one executable that
runs the op `inner` times on distinct inputs, chained through optimization barriers (no launch
gap from Python, no fusing or merging of the copies), divided by `inner`. Every top-k variant is
also checked against lax.top_k on the device (values and indices), and the compiled HLO is
scanned for the TopK implementation XLA picked (custom call / sort).

    PYTHONPATH=$PWD python -m bench.bench_draft_ops            # GPU, Llama-3-8B shape
    PYTHONPATH=$PWD python -m bench.bench_draft_ops --vocab 32000  # an EAGLE-3 draft vocabulary
    PYTHONPATH=$PWD python -m bench.bench_draft_ops --tiny     # any backend, small V: smoke check
JSON goes to $OUT/bench_draft_ops.json when OUT is set; the last line printed is the same JSON.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import LLAMA3_8B, copy_bandwidth, device_name, timed, write_json  # noqa: E402
from jaxspec.models import eagle  # noqa: E402
from jaxspec.spec import SpecConfig  # noqa: E402
from jaxspec.spec import draft as draft_lib  # noqa: E402
from jaxspec.spec import topk as topk_lib  # noqa: E402
from pallas_kernels import vocab_topk as pallas_topk  # noqa: E402

CHUNKS = (1024, 2048, 4096, 8192, 16384)
TINY_H, TINY_V = 256, 8192


def chained(op, inputs):
    """op applied to each of `inputs` in turn; each call waits on the previous one's result
    (an optimization barrier: no compute, but XLA may neither fuse nor merge the copies)."""
    outs, prev = [], None
    for x in inputs:
        if prev is not None:
            prev, x = jax.lax.optimization_barrier((prev, x))
        prev = op(*x)
        outs.append(prev)
    return outs


def hlo_topk_impl(compiled_text: str) -> dict:
    """Counts of what XLA lowered the top-k to: custom calls by target, sorts, custom fusions."""
    found = re.findall(r'custom_call_target="([^"]+)"', compiled_text)
    out = {f"call:{t}": found.count(t) for t in sorted(set(found))}
    for name, pat in (("sort", r"\bsort\("), ("custom_fusion", r"kind=kCustom")):
        n = len(re.findall(pat, compiled_text))
        if n:
            out[name] = n
    return out


def time_op(op, inputs, calls, repeats):
    """(ms per op, compiled HLO text): `inputs` is a list of `inner` argument tuples."""
    f = jax.jit(functools.partial(chained, op)).lower(inputs).compile()
    ms, _ = timed(lambda _: f(inputs), None, calls, repeats)
    return ms / len(inputs), f.as_text()


def exact_vs_lax(fn, x, k, repeats: int = 8):
    """Whether fn equals lax.top_k in values and indices, on the device: on x, on x rounded to
    quarters (ties across chunks), and on 64 rows of fresh values; each `repeats` times (a
    kernel whose programs exchange results must not race)."""
    f, ref = jax.jit(fn, static_argnums=1), jax.jit(jax.lax.top_k, static_argnums=1)
    wide = jax.random.normal(jax.random.PRNGKey(3), (64, x.shape[-1]), x.dtype)
    for arr in (x, jnp.round(x * 4) / 4, wide):
        want = [np.asarray(w) for w in ref(arr, k)]
        for _ in range(repeats):
            got = f(arr, k)
            if not all(np.array_equal(np.asarray(g), w) for g, w in zip(got, want)):
                return False
    return True


def recall_vs_lax(fn, x, k):
    """Mean fraction of lax.top_k's indices that fn(x, k) also returns."""
    got = np.asarray(jax.jit(fn, static_argnums=1)(x, k)[1]).reshape(-1, k)
    want = np.asarray(jax.jit(jax.lax.top_k, static_argnums=1)(x, k)[1]).reshape(-1, k)
    return float(np.mean([len(set(g) & set(w)) / k for g, w in zip(got, want)]))


def project(w, x):
    """x [B, K, H] bf16, w [H, V] bf16 -> fp32 logits [B, K, V]: the draft's lm_head."""
    return eagle.logits({"lm_head": w}, x)


def approx(x, k):
    return jax.lax.approx_max_k(x, k, recall_target=0.95)


def padded_two_stage(x, k, chunk=4096):
    """The layout balanced chunks avoid: the row padded with -inf to a multiple of `chunk`."""
    v = x.shape[-1]
    pad = -(-v // chunk) * chunk - v
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)], constant_values=-jnp.inf)
    return topk_lib.top_k(x, k, chunk=chunk)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help=f"H={TINY_H}, V={TINY_V} (CPU check)")
    ap.add_argument("--topk", type=int, default=10, help="K: rows and k (default 10)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=None,
                    help="V (default Llama-3's 128256; 32000 is an EAGLE-3 draft vocabulary)")
    ap.add_argument("--chunks", default=None, help="comma-separated chunk bounds")
    ap.add_argument("--inner", type=int, default=None, help="op copies per dispatch")
    ap.add_argument("--calls", type=int, default=None, help="dispatches per repeat")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--only", default=".*", help="a regex: the top-k variants it names")
    ap.add_argument("--cands", type=int, default=510,
                    help="(h) candidates of the tree's choice (510: a 6x10x60 tree)")
    ap.add_argument("--tree-tokens", type=int, default=60, help="(h) N: the tree's tokens")
    a = ap.parse_args(argv)
    h, v = (TINY_H, TINY_V) if a.tiny else (LLAMA3_8B.hidden_size, LLAMA3_8B.vocab_size)
    v = a.vocab or v
    b, kk = a.batch, a.topk
    chunks = tuple(int(c) for c in a.chunks.split(",")) if a.chunks else CHUNKS
    inner = a.inner or (4 if a.tiny else 16)
    calls = a.calls or (3 if a.tiny else 10)
    repeats = a.repeats or (3 if a.tiny else 7)
    spec = SpecConfig(num_steps=2, topk=kk, num_draft_tokens=kk + 1)

    key = jax.random.PRNGKey(0)
    kw, kh, kl, kc = jax.random.split(key, 4)
    w = (0.02 * jax.random.normal(kw, (h, v), jnp.float32)).astype(jnp.bfloat16)
    # The weight is an argument of every copy (one buffer), never closed over: a closure would
    # bake 1 GB into the executable as a constant.
    hidden = [(w, x) for x in jax.random.normal(kh, (inner, b, kk, h), jnp.bfloat16)]
    # Logits as a draft step sees them: the projection of random hidden rows (a realistic spread
    # of values and ties), one distinct array per inner copy.
    logits = [(project(w, x),) for w, x in hidden]
    cum = [(x,) for x in jax.random.normal(kc, (inner, b, kk * kk), jnp.float32)]
    jax.block_until_ready((hidden, logits, cum))

    if os.environ.get("OUT"):
        os.makedirs(os.environ["OUT"], exist_ok=True)
    bw = copy_bandwidth((64 << 20) if a.tiny else (2 << 30), calls, repeats)
    logit_b = b * kk * v * 4
    res = {"device": device_name(), "jax": jax.__version__, "backend": jax.default_backend(),
           "shape": {"batch": b, "rows": kk, "k": kk, "hidden": h, "vocab": v},
           "inner": inner, "calls": calls, "repeats": repeats, "copy_bw_GBps": bw / 1e9,
           "policy": {"default_chunk": topk_lib.DEFAULT_CHUNK,
                      "two_stage_min_vocab": topk_lib.TWO_STAGE_MIN_VOCAB,
                      "two_stage_here": topk_lib.use_two_stage(v, kk)},
           "ops": []}
    print(f"# {res['device']} jax {jax.__version__}; [{b}, {kk}, {v}] fp32 logits, H {h}; copy "
          f"{bw / 1e9:.0f} GB/s; {inner} copies per dispatch", flush=True)

    def record(name, op, inputs, nbytes, scan_hlo=False, **extra):
        ms, text = time_op(op, inputs, calls, repeats)
        row = {"op": name, "ms": ms, "GBps": nbytes / (ms / 1e3) / 1e9, **extra}
        if scan_hlo:
            row["hlo"] = hlo_topk_impl(text)
        res["ops"].append(row)
        print("# " + json.dumps(row), flush=True)
        write_json("bench_draft_ops.json", res)
        return row

    x0 = logits[0][0]
    # (a) the lm_head: weights + hidden in, fp32 logits out
    head_b = h * v * 2 + b * kk * h * 2 + logit_b
    record("lm_head", project, hidden, head_b)
    # (b), (d), (e): the top-k variants, each checked against lax on this device
    variants = {"lax_top_k": jax.lax.top_k}
    for c in chunks:
        variants[f"two_stage_c{c}"] = functools.partial(topk_lib.top_k, chunk=c)
    for w in (64, 128, 256):
        variants[f"chunk_max_w{w}"] = functools.partial(topk_lib.top_k_by_chunk_max, width=w,
                                                        small="top_k")
    variants["chunk_max_sort"] = functools.partial(topk_lib.top_k_by_chunk_max, small="sort")
    variants["chunk_max_rank"] = functools.partial(topk_lib.top_k_by_chunk_max, small="rank")
    on_cpu = jax.default_backend() != "gpu"
    # the kernel at its default (one launch or two by the row's chunks) at chunk widths and
    # warps, then both ways at the default width
    forms = [(c, w, None) for c, w in ((2048, 4), (4096, 4), (4096, 8), (8192, 8))]
    forms += [(pallas_topk.CHUNK, 4, f) for f in (True, False)]
    for c, warps, fused in forms:
        tag = "" if fused is None else f"_{'one' if fused else 'two'}"
        variants[f"pallas_c{c}_w{warps}{tag}"] = functools.partial(
            pallas_topk.vocab_top_k_pallas, chunk=c, num_warps=warps,
            fused=fused, interpret=on_cpu)
    variants["two_stage_pad4096"] = padded_two_stage
    variants["approx_max_k_r0.95"] = approx
    variants = {n: f for n, f in variants.items() if re.search(a.only, n)}
    for name, fn in variants.items():
        extra = {}
        if name.startswith("two_stage_c"):
            n, w = topk_lib.chunk_layout(v, int(name[len("two_stage_c"):]))
            extra = {"chunks": n, "width": w}
        if name.startswith("approx"):
            extra["recall"] = recall_vs_lax(fn, x0, kk)
        else:
            extra["exact"] = exact_vs_lax(fn, x0, kk)
        record(name, lambda x, fn=fn: fn(x, kk), logits, logit_b, scan_hlo=True, **extra)
    # (c) the logsumexp of top_children
    record("logsumexp", lambda x: jax.nn.logsumexp(x, axis=-1, keepdims=True), logits, logit_b)
    # (f) top_children with each top-k, from the logits and from the hidden rows
    for name, fn in variants.items():
        with mock.patch.object(topk_lib, "vocab_top_k", fn):
            record(f"top_children[{name}]", lambda x: draft_lib.top_children(x, spec), logits,
                   logit_b, scan_hlo=True)
            record(f"lm_head+top_children[{name}]",
                   lambda w, x: draft_lib.top_children(project(w, x), spec), hidden,
                   head_b, scan_hlo=True)
    res["top_children_default_policy"] = record(
        "top_children[policy]", lambda x: draft_lib.top_children(x, spec), logits, logit_b,
        scan_hlo=True)["ms"]
    # (g) the K*K cumulative top-k
    record("cum_top_k", lambda x: jax.lax.top_k(x, kk), cum, b * kk * kk * 4, scan_hlo=True)
    # (h) the tree's choice of its N - 1 tokens among the candidates, in index order
    cands = [(x,) for x in jax.random.normal(kc, (inner, b, a.cands), jnp.float32)]
    picks = a.tree_tokens - 1
    want = np.sort(np.asarray(jax.lax.top_k(cands[0][0], picks)[1]), axis=-1)
    for by_rank in (False, True):
        fn = functools.partial(topk_lib.top_k_indices_in_order, k=picks, by_rank=by_rank)
        got = np.asarray(jax.jit(fn)(cands[0][0]))
        record(f"tree_choice[{'rank' if by_rank else 'lax'}]", fn, cands, b * a.cands * 4,
               scan_hlo=True, exact=bool(np.array_equal(got, want)))

    print(f"\n{res['device']}  [{b}, {kk}, {v}] fp32, H {h}  copy {bw / 1e9:.0f} GB/s  "
          f"(lm_head floor {head_b / bw * 1e3:.3f} ms)")
    print(f"{'op':44s} {'ms':>9s} {'GB/s':>8s}  notes")
    for row in res["ops"]:
        notes = []
        if "exact" in row:
            notes.append("exact" if row["exact"] else "MISMATCH vs lax.top_k")
        if "recall" in row:
            notes.append(f"recall {row['recall']:.3f}")
        if "chunks" in row:
            notes.append(f"{row['chunks']} x {row['width']}")
        if row.get("hlo"):
            notes.append(" ".join(f"{k}={n}" for k, n in row["hlo"].items()))
        print(f"{row['op']:44s} {row['ms']:9.4f} {row['GBps']:8.1f}  {'; '.join(notes)}")
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
