"""Shared benchmark helpers: model shapes, copy bandwidth, timing."""
from __future__ import annotations

import json
import os
import statistics
import time

import jax
import jax.numpy as jnp

from jaxspec.config import ModelConfig

LLAMA3_8B = ModelConfig(arch="LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
                        intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                        head_dim=128, rope_theta=500000.0, max_position_embeddings=8192)
SMOLLM2_135M = ModelConfig(arch="LlamaForCausalLM", vocab_size=49152, hidden_size=576,
                           intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                           head_dim=64, rope_theta=100000.0, max_position_embeddings=8192,
                           tie_word_embeddings=True)
SHAPES = {"llama3-8b": LLAMA3_8B, "smollm2-135m": SMOLLM2_135M}


def timed(step, carry, n, repeats, reset=None):
    """Median over `repeats` of (n back-to-back dispatches, blocked at the end) / n, in ms."""
    carry = step(reset(carry) if reset else carry)   # warm (compiles)
    jax.block_until_ready(carry)
    ts = []
    for _ in range(repeats):
        if reset:
            carry = reset(carry)
            jax.block_until_ready(carry)
        t0 = time.perf_counter()
        for _ in range(n):
            carry = step(carry)
        jax.block_until_ready(carry)
        ts.append((time.perf_counter() - t0) / n * 1e3)
    return statistics.median(ts), carry


def copy_bandwidth(nbytes: int = 2 << 30, n: int = 20, repeats: int = 5) -> float:
    """Bytes read + written per second by a large elementwise copy: n back-to-back donated
    dispatches per timing (one sync per repeat, so no per-call sync latency), median of repeats.
    Every bytes floor in bench/ divides by this one figure."""
    x = jnp.zeros((nbytes // 2,), jnp.bfloat16)
    f = jax.jit(lambda a: a + jnp.bfloat16(1), donate_argnums=0)
    ms, _ = timed(f, x, n, repeats)
    return 2 * (nbytes // 2) * 2 / (ms / 1e3)


def param_bytes(params) -> int:
    return sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(params))


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def write_json(name: str, obj) -> None:
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, name), "w") as f:
            json.dump(obj, f, indent=1)


def set_kernel_defaults(pairs) -> dict:
    """Sets module defaults before any program is traced, so one process times the cycle as it
    runs with another default (the forty-seventh set's A/B runs). Each pair is "NAME=VALUE",
    VALUE a Python literal, NAME one of tree_attention's `_MOSAIC_*` constants, "topk.NAME"
    for an upper-case constant of jaxspec.spec.topk (its top-k policy) or "vocab_topk.NAME"
    for one of pallas_kernels.vocab_topk (the top-k kernel's form). -> the settings, by the
    names given."""
    import ast

    from jaxspec.spec import topk
    from pallas_kernels import tree_attention as ta
    from pallas_kernels import vocab_topk
    known = {k: (ta, k) for k in vars(ta) if k.startswith("_MOSAIC_")}
    for prefix, module in (("topk", topk), ("vocab_topk", vocab_topk)):
        known.update({f"{prefix}.{k}": (module, k) for k in vars(module) if k.isupper()})
    done = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or name not in known:
            raise ValueError(f"--kernel-default {pair!r}: expected NAME=VALUE, NAME in "
                             f"{sorted(known)}")
        try:
            done[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise ValueError(f"--kernel-default {pair!r}: {value!r} is not a Python literal")
        setattr(*known[name], done[name])
    return done


def add_kernel_default(ap) -> None:
    """`--kernel-default NAME=VALUE` on a benchmark's parser (`set_kernel_defaults`)."""
    ap.add_argument("--kernel-default", action="append", default=[], metavar="NAME=VALUE",
                    help="a tree_attention _MOSAIC_* default, topk.NAME (the "
                         "top-k policy) or vocab_topk.NAME (the top-k kernel), for this run "
                         "(repeatable)")


def apply_kernel_defaults(args) -> dict:
    """`set_kernel_defaults` of the parsed `--kernel-default` pairs, announced on stdout."""
    settings = set_kernel_defaults(args.kernel_default)
    if settings:
        print(f"# kernel defaults: {settings}")
    return settings


def device_name() -> str:
    d = jax.devices()[0]
    return f"{d.platform}:{getattr(d, 'device_kind', '?')}"
