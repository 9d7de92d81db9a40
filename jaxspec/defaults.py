"""The tuned defaults: what jaxspec picks when an option is left unset.

Each default states its rule and the reason in a line or two; the measurements that decided
them are in docs/performance.md ("Engine defaults"). Options set explicitly always win. Only
the device kind and the engine's size enter: the same request gets the same defaults anywhere.
"""
from __future__ import annotations

from typing import Optional

import jax

MAX_BATCH = 8                 # slots per replica
MAX_MODEL_LEN = 2048          # tokens per slot (prompt + output), capped by the model's limit
DECODE_STEPS = 16             # plain decode steps per device call: the host's cost per call
#                               is paid once for all of them
MIN_CHUNK = 16                # the narrowest prefill chunk and pack
SLOT_GROWTH = 4               # admission slot counts 1, 4, 16, 64: few programs to compile
WIDTH_GROWTH = 4              # chunk widths 16, 64, 256, ..: few programs to compile
PACK_MAX_TOKENS = 32768       # the most tokens one packed admission computes: its activations
#                               and [R, W, W] mask grow with it; a larger pack only splits
DRAFT_VOCAB = 16384           # tokens the shipped EAGLE-1 head drafts from (FR-Spec): its
#                               lm_head reads K columns instead of V, at almost the same tau
CONTEXT_VOCAB = 256           # of those, each request's own recent tokens (batch 1, GPU)
SHORT_ROWS = 512              # rows under which cycles run a build with fewer attention splits
SHORT_MIN_SLOTS = 64          # ... for speculative engines from this many slots
WIDE_CHAIN_MIN_SLOTS = 16     # slots from which the default tree drafts 2 wide
GPU_PREFILL_CHUNK = 2048      # long prompts in fewer, wider calls on a GPU
CPU_PREFILL_CHUNK = 512       # a CPU gains nothing from wider chunks but programs to compile


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def spec(slots: int) -> str:
    """The tree shape: on a GPU '4x8x32' at one slot (a cycle is latency bound, a wide tree
    costs about what the chain does), '3x2x4' (the chain's 4 tokens chosen from a 2-wide draft)
    from WIDE_CHAIN_MIN_SLOTS slots, else the chain, whose verify does the least work; a CPU
    pays for every tree token: the chain."""
    if not on_gpu():
        return "chain"
    if slots == 1:
        return "4x8x32"
    return "3x2x4" if slots >= WIDE_CHAIN_MIN_SLOTS else "chain"


def max_batch() -> int:
    """`LLM`'s slots per replica when none are asked for: MAX_BATCH on a GPU (a step reads the
    weights once for all its slots); 1 on a CPU, which computes every slot whether it holds a
    request or not, so idle slots slow the one request down by about their number
    (bench/RESULTS.md#cpu)."""
    return MAX_BATCH if on_gpu() else 1


def cycles_per_call(slots: int) -> int:
    """Speculative cycles per device call: on a GPU 4 for several slots and 2 for one, so the
    host's cost per call hides behind the device's work; a CPU runs the cycles on the host
    itself, with nothing to overlap: 1."""
    if not on_gpu():
        return 1
    return 4 if slots > 1 else 2


def admit_interval(slots: int, speculative: bool) -> int:
    """Device calls between admissions while requests run: on a GPU 3 for a speculative engine
    of 64+ slots and 2 from 32 (each admission is a dispatch whose host cost does not shrink
    with the requests it carries, and at large batches requests finish in most calls), else 1."""
    if not speculative or not on_gpu():
        return 1
    return 3 if slots >= 64 else 2 if slots >= 32 else 1


def prefill_chunk() -> int:
    """The widest prefill chunk: GPU_PREFILL_CHUNK on a GPU, CPU_PREFILL_CHUNK elsewhere."""
    return GPU_PREFILL_CHUNK if on_gpu() else CPU_PREFILL_CHUNK


def short_rows(slots: int, plain: bool = False, max_len: Optional[int] = None) -> int:
    """Rows per slot under which calls run a second build sized for that many rows (fewer
    attention splits, no combine kernel): SHORT_ROWS on a GPU for speculative engines of
    SHORT_MIN_SLOTS+ slots and for plain decoding at one slot; 0 (none) elsewhere, and for a
    cache no longer than the bound (its full build is already sized for it)."""
    if not on_gpu() or (max_len is not None and max_len <= SHORT_ROWS):
        return 0
    return SHORT_ROWS if slots >= SHORT_MIN_SLOTS or (plain and slots == 1) else 0


def context_vocab(slots: int) -> int:
    """A cut draft vocabulary's per-request part: CONTEXT_VOCAB at one slot on a GPU (where the
    batch-1 tree runs), none elsewhere (at large batches the gathered rows cost more than the
    acceptance they return)."""
    return CONTEXT_VOCAB if slots == 1 and on_gpu() else 0


def layer_layout() -> str:
    """'unrolled' on a GPU (static slices of the stacked weights, read in place), 'scan' on a
    CPU (a loop compiles much faster)."""
    return "unrolled" if on_gpu() else "scan"


def compile_workers() -> int:
    """Threads compiling warm-up programs: the CPU count beside an accelerator; 1 on the CPU
    backend, whose compilations share the cores with everything else."""
    import os
    return 1 if jax.default_backend() == "cpu" else os.cpu_count() or 1
