"""Split-K attention of wide query tiles over a slot's cached prefix, for Hopper (Mosaic GPU).

The tree-attention kernel's prefix part for tiles of 64+ query rows per KV head (N * G >= 64:
N >= 16 tree queries at G = 4). Those tiles are bound by arithmetic more than by bytes (at
N * G = 256 a KV byte feeds 256 FLOPs), where wgmma fed by TMA and warp specialisation (jax's
Mosaic GPU FlashAttention-3 example) outruns Triton's dots. This kernel is that design cut to
the tree's job:

  * one CTA per (row tile, prefix split, slot * KV head); `wgs` compute warpgroups of 64 query
    rows each, plus one warpgroup that only issues TMA copies of K and V blocks into a ring of
    `steps` shared-memory slots (warp specialisation). The row tiles are the grid's last axis,
    which Mosaic GPU launches fastest: the tiles of one (split, slot x KV head) read the same
    keys side by side, and L2 serves the second read;
  * with two compute warpgroups the producer refills a ring slot's keys as soon as both have
    taken their scores, before its values are free: the keys the faster one needs next do not
    wait for the slower one's PV product. With one, keys and values go together;
  * QK^T and PV are wgmma from shared memory, the online softmax in base 2 in registers; with
    two compute warpgroups a shared barrier staggers them so that one's softmax overlaps the
    other's matmuls;
  * the live prefix of slot b (rows < seq_lens[b]) is cut into `num_splits` chunks of whole
    key blocks at run time, as in the Triton kernel; only the last block of a chunk is masked;
  * with the tree (up to 64 new keys, in q's array after the query rows): split 0 takes one
    more key block, the tree's keys and values in the same ring, under the tree mask as an
    additive bias tile (where the prefix is split, before its prefix blocks, so that its copy
    goes out first rather than ending split 0 last; after them with one split); or, where the
    prefix's splits leave SMs idle, that block is a split of its own (`tree_split`);
  * the output is the Triton kernel's split partials, unnormalised o [BH, S, R, D] and the
    base-2 running max m and sum l [BH, S, R], merged by its combine pass (with the Triton
    kernel's tree part where the tree is not here), o written from registers; with the tree and
    one split, the rows normalised (through shared memory and TMA).

A key block is copied whole, so a chunk's last block may read rows past seq_lens[b] (still
inside the cache: the caller keeps T a multiple of the block); their scores are masked to
zero weight, which assumes, as a KV cache always holds, finite values there.

Semantics: `prefix_partials_reference`. Runs on Hopper through Mosaic GPU, and on a CPU in
Mosaic GPU's interpret mode (the tests).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._compat import MASK_VALUE

try:  # Mosaic GPU's Pallas API (Hopper); absent from some jaxlib builds
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover
    plgpu = None

ROWS = 64         # query rows of one compute warpgroup: wgmma's M
BLOCK_KV = 128    # keys per TMA copy (the example's best on the tree's shapes)
STEPS = 2         # ring slots: two of 128 keys fill shared memory next to the tiles
NUM_SMS = 132     # the H100's and the H200's
TREE_SPLIT_BLOCKS = 4   # `tree_split_pays`: prefix splits of at most this many key blocks
# `_short_splits`: one key block a split where that grid fills at most this share of the SMs:
# up to there the extra splits still fit the wave and halve each CTA's loop; past it their
# partials and the fuller wave cost as much as they save.
ONE_BLOCK_MAX_SM_SHARE = 0.5
# The kernel's named regions: Mosaic GPU's profiler times each one a warpgroup (`profile`);
# otherwise they only name the program's ops.
region = jax.named_scope


def prefix_partials_reference(q_rows, k_cache, v_cache, layer, seq_lens, *, scale_log2,
                              num_splits, block_kv, slots=None):
    """The kernel's outputs in jnp: q_rows [B, Hkv, R, D]; cache [L, Bc, Hkv, T, D].
    -> o [B * Hkv, S, R, D], m, l [B * Hkv, S, R] (f32; m in base-2 units of the scores)."""
    b, hkv, r, d = q_rows.shape
    t = k_cache.shape[3]
    kc = lax.dynamic_index_in_dim(k_cache, layer, 0, keepdims=False)
    vc = lax.dynamic_index_in_dim(v_cache, layer, 0, keepdims=False)
    if slots is not None:
        kc, vc = jnp.take(kc, slots, 0, mode="clip"), jnp.take(vc, slots, 0, mode="clip")
    f32 = jnp.float32
    s = jnp.einsum("bhrd,bhtd->bhrt", q_rows.astype(f32), kc.astype(f32)) * scale_log2
    seq = jnp.clip(seq_lens, 0, t)
    per_split = (seq + num_splits - 1) // num_splits
    chunk = (per_split + block_kv - 1) // block_kv * block_kv                     # [B]
    start = jnp.arange(num_splits)[None, :] * chunk[:, None]                     # [B, S]
    end = jnp.minimum(start + chunk[:, None], seq[:, None])
    pos = jnp.arange(t)
    live = (pos >= start[..., None]) & (pos < end[..., None])                    # [B, S, T]
    s = jnp.where(live[:, None, :, None, :], s[:, :, None], MASK_VALUE)          # [B,H,S,R,T]
    m = s.max(-1)
    p = jnp.where(live[:, None, :, None, :], jnp.exp2(s - m[..., None]), 0.0)
    o = jnp.einsum("bhsrt,bhtd->bhsrd", p, vc.astype(f32))
    return (o.reshape(b * hkv, num_splits, r, d), m.reshape(b * hkv, num_splits, r),
            p.sum(-1).reshape(b * hkv, num_splits, r))


def _bounds(seq_len, split, num_splits, block_kv):
    """[start, end) of this split's share of the live prefix, and its full and total blocks."""
    per_split = lax.div(seq_len + num_splits - 1, num_splits)
    chunk = lax.div(per_split + block_kv - 1, block_kv) * block_kv
    start = split * chunk
    end = jnp.minimum(start + chunk, seq_len)
    span = jnp.maximum(end - start, 0)
    return start, end, lax.div(span, block_kv), lax.div(span + block_kv - 1, block_kv)


def _kernel(layer_ref, seq_ref, *refs, scale_log2, num_splits, block_kv, steps, wgs,
            indirect, tree, interpret, tree_split_index, tree_row0, tree_first):
    slots_ref, refs = (refs[0], refs[1:]) if indirect else (None, refs)
    q_ref, k_ref, v_ref = refs[:3]
    # With the tree: its bias here, its keys, then values, in q's rows after `tree_row0`.
    bias_ref = refs[3] if tree else None
    outs, scoped = refs[4 if tree else 3:-1], refs[-1]
    (q_smem, k_smem, v_smem, ml_smem, bias_smem), *barriers = scoped
    ready, consumed, sched = barriers
    k_ready, v_ready, q_ready = ready
    k_free, v_free = consumed
    num_kv_heads, t_max = k_ref.shape[2], k_ref.shape[3]
    rt, split, bh = lax.axis_index("rt"), lax.axis_index("split"), lax.axis_index("bh")
    b, h = lax.div(bh, num_kv_heads), lax.rem(bh, num_kv_heads)
    slot = jnp.minimum(jnp.maximum(slots_ref[b], 0), k_ref.shape[1] - 1) if indirect else b
    layer = layer_ref[0]
    seq_len = jnp.minimum(jnp.maximum(seq_ref[b], 0), t_max)
    start, end, full_blocks, blocks = _bounds(seq_len, split, num_splits, block_kv)
    # With the tree, split `tree_split_index` takes one block more: the new keys (NT <= the
    # ring's rows) under the additive mask `bias` [B, R, NT], after its prefix blocks (none
    # where it is the split past the prefix's, whose `_bounds` are empty), or with `tree_first`
    # before them: `lead` steps (0 or 1) come before the prefix's blocks.
    total = blocks + (split == tree_split_index).astype(jnp.int32) if tree else blocks
    lead = total - blocks if tree and tree_first else None

    def prefix_block(i):   # the prefix block of ring step i (the program unchanged without lead)
        return i if lead is None else i - lead
    tree_keys = bias_ref.shape[2] if tree else 0
    # The first rows of q_ref that hold the tree's keys and values.
    new_rows = (tree_row0, tree_row0 + tree_keys)
    wg = lax.axis_index("wg")
    dtype = q_smem.dtype

    def staggered():   # two compute warpgroups take turns on the tensor cores
        if wgs == 2:
            plgpu.barrier_arrive(sched)
            plgpu.barrier_wait(sched)

    def store(acc, m_i, l_i, row0, q_tile):   # a compute warpgroup's rows, o normalised or not
        rows = pl.ds(row0, ROWS)
        # One split: normalised, in the q tile the matmuls are done with, copied by TMA, which
        # beats storing these bf16 rows from registers.
        if len(outs) == 1:
            q_tile[...] = (acc / lax.broadcast_in_dim(l_i, acc.shape, [0])).astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_tile, outs[0].at[bh, rows])
            plgpu.wait_smem_to_gmem(0)
            return
        o_ref, m_ref, l_ref = outs
        # o (f32) from registers straight to global memory: staged in shared memory, the CTA
        # would wait for the TMA copy to read the tile. m and l, a row each, still go by TMA;
        # the CTA waits only until that copy has read them (the kernel's end makes the writes
        # visible).
        o_ref.at[bh, split, rows][...] = acc
        ml_smem.at[0, wg][...] = m_i
        ml_smem.at[1, wg][...] = l_i
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(ml_smem.at[0, wg], m_ref.at[bh, split, rows])
        plgpu.copy_smem_to_gmem(ml_smem.at[1, wg], l_ref.at[bh, split, rows])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    @pl.when(wg < wgs)
    def _compute():
        plgpu.set_max_registers(232 if wgs == 2 else 240, action="increase")
        row0 = (rt * wgs + wg) * ROWS
        q_tile = q_smem.at[wg]
        with region("q_wait"):
            plgpu.copy_gmem_to_smem(q_ref.at[b, h, pl.ds(row0, ROWS)], q_tile, q_ready.at[wg])
            if tree:   # every split loads it (8 KB): no barrier phase to keep apart by split
                plgpu.copy_gmem_to_smem(bias_ref.at[b, pl.ds(row0, ROWS)], bias_smem.at[wg],
                                        q_ready.at[wgs + wg])
                plgpu.barrier_wait(q_ready.at[wgs + wg])
            plgpu.barrier_wait(q_ready.at[wg])
        head_dim = q_tile.shape[-1]
        # Register layouts are the device's business; the interpreter has none.
        cast = (lambda x, layout: x) if interpret else plgpu.layout_cast
        carry = (cast(jnp.zeros((ROWS, head_dim), jnp.float32), plgpu.Layout.WGMMA),
                 cast(jnp.full((ROWS,), MASK_VALUE, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
                 cast(jnp.zeros((ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)))

        @pl.when(total > 0)
        def _():
            with region("k_wait"):
                plgpu.barrier_wait(k_ready.at[0])

        if wgs == 2:
            pl.when(wg == 1)(staggered)

        def wait_next_k(i):   # the next block's keys, before the tensor cores need them
            @pl.when(i + 1 < total)
            def _():
                with region("k_wait"):
                    plgpu.barrier_wait(k_ready.at[lax.rem(i + 1, steps)])

        def scores(keys):   # q k^T [ROWS, keys rows], f32
            if interpret:   # the interpreter's wgmma takes no transposed operand: jnp's dot
                s = jnp.dot(q_tile[...], keys[...].T, preferred_element_type=jnp.float32)
                staggered()
                return s

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_tile, plgpu.transpose_ref(keys, (1, 0)))
                staggered()
                return acc_ref[...]
            return pl.run_scoped(qk, plgpu.ACC((ROWS, keys.shape[0]), jnp.float32))

        def add_pv(acc, p16, values, i):   # acc + p v
            if interpret:
                acc = acc + jnp.dot(p16, values[...], preferred_element_type=jnp.float32)
                wait_next_k(i)
                return acc

            def pv(acc_ref):   # wgmma accumulates into acc's registers in place
                plgpu.wgmma(acc_ref, p16, values)
                wait_next_k(i)
            return pl.run_state(pv)(plgpu.ACC.init(acc))

        def softmax(s, i, m_i, masked):   # -> p (f32), the new running max, the rescale
            if masked:   # keys at or past the split's end weigh nothing
                key = (lax.broadcasted_iota(jnp.int32, (ROWS, block_kv), 1) if interpret else
                       plgpu.broadcasted_iota(jnp.int32, (ROWS, block_kv), 1,
                                              layout=plgpu.Layout.WGMMA))
                s = jnp.where(key + (start + i * block_kv) < end, s, MASK_VALUE)
            # The scale goes into the exponent (one FMA a score), not onto s first.
            m_next = jnp.maximum(m_i, s.max(axis=1) * scale_log2)
            alpha = jnp.exp2(m_i - m_next)
            p = jnp.exp2(s * scale_log2 - lax.broadcast_in_dim(m_next, s.shape, [0]))
            return p, m_next, alpha

        def step(i, carry, masked=False, new_keys=False):   # ring step i (prefix block i - lead)
            acc, m_i, l_i = carry
            ring = lax.rem(i, steps)
            new = pl.ds(0, tree_keys)
            with region("qk"):
                s = scores(k_smem.at[ring, new] if new_keys else k_smem.at[ring])
                plgpu.barrier_arrive(k_free.at[ring])
            with region("softmax"):
                if new_keys:   # the tree mask, as 0 or MASK_VALUE a score
                    s = s + bias_smem.at[wg][...].astype(jnp.float32)
                p, m_next, alpha = softmax(s, prefix_block(i), m_i, masked)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                l_i = l_i * alpha + p.sum(axis=1)
                p16 = p.astype(dtype)
                acc, l_i, m_next, p16 = lax.optimization_barrier((acc, l_i, m_next, p16))
            with region("v_wait"):
                if wgs == 2:
                    plgpu.barrier_arrive(sched)
                plgpu.barrier_wait(v_ready.at[ring])
                if wgs == 2:
                    plgpu.barrier_wait(sched)
            with region("pv"):
                acc = add_pv(acc, p16, v_smem.at[ring, new] if new_keys else v_smem.at[ring],
                             i)
                plgpu.barrier_arrive(v_free.at[ring])
            return acc, m_next, l_i

        if lead is None:
            carry = lax.fori_loop(0, full_blocks, step, carry)
            carry = lax.fori_loop(full_blocks, blocks, functools.partial(step, masked=True),
                                  carry)
            if tree:   # (a loop of 0 or 1 trips: split `tree_split_index` only)
                carry = lax.fori_loop(blocks, total, functools.partial(step, new_keys=True),
                                      carry)
        else:   # the tree's block first (0 or 1 trips), then the prefix's
            carry = lax.fori_loop(0, lead, functools.partial(step, new_keys=True), carry)
            carry = lax.fori_loop(lead, lead + full_blocks, step, carry)
            carry = lax.fori_loop(lead + full_blocks, total, functools.partial(step, masked=True),
                                  carry)
        acc, m_i, l_i = carry
        if wgs == 2:
            pl.when(wg == 0)(staggered)
        with region("store"):
            store(acc, m_i, l_i, row0, q_tile)

    @pl.when(wg == wgs)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")

        def fetch(i, ring, which=(0, 1)):   # step i's keys (0) and/or values (1) into `ring`
            copies = [(k_ref, q_ref, k_smem, k_ready, new_rows[0]),
                      (v_ref, q_ref, v_smem, v_ready, new_rows[1])]
            copies = [copies[w] for w in which]
            j = prefix_block(i)

            @pl.when((j < blocks) if lead is None else (i >= lead) & (j < blocks))
            def _():
                keys = (layer, slot, h, pl.ds(start + j * block_kv, block_kv))
                for src, _, dst, ready, _ in copies:
                    plgpu.copy_gmem_to_smem(src.at[keys], dst.at[ring], ready.at[ring])

            if tree:
                @pl.when(i == blocks if lead is None else i < lead)
                def _():
                    for _, src, dst, ready, row0 in copies:
                        plgpu.copy_gmem_to_smem(src.at[b, h, pl.ds(row0, tree_keys)],
                                                dst.at[ring, pl.ds(0, tree_keys)],
                                                ready.at[ring])

        with region("fetch"):
            for i in range(steps):
                pl.when(i < total)(functools.partial(fetch, i, i))

        # Two compute warpgroups: a block's keys are free after both took their scores, its
        # values only after the slower one's PV product, so the keys go first. One: both waits,
        # then both copies.
        refill_apart = wgs == 2
        @pl.loop(0, jnp.maximum(total - steps, 0))
        def _(i):
            ring = lax.rem(i, steps)
            with region("k_free"):
                plgpu.barrier_wait(k_free.at[ring])
            if refill_apart:
                fetch(i + steps, ring, (0,))
            with region("v_free"):
                plgpu.barrier_wait(v_free.at[ring])
            fetch(i + steps, ring, (1,) if refill_apart else (0, 1))

        # Observe each used slot's last release too: nothing is in flight when the CTA ends
        # (and the interpreter checks that every barrier phase was seen).
        for ring in range(steps):
            @pl.when(ring < total)
            def _():
                with region("drain"):
                    plgpu.barrier_wait(k_free.at[ring])
                    plgpu.barrier_wait(v_free.at[ring])


def on_hopper() -> bool:
    """Mosaic GPU's wgmma kernels need compute capability 9.x."""
    if plgpu is None or jax.default_backend() != "gpu":
        return False
    return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9")


def device_kind() -> str:
    """The first device's name as jax reports it ("NVIDIA H100 80GB HBM3", "NVIDIA H200"), for
    rules that differ between Hopper parts; "" without a GPU."""
    if jax.default_backend() != "gpu":
        return ""
    return str(getattr(jax.devices()[0], "device_kind", ""))


def _interpret_params():
    """Mosaic GPU's interpret mode (a CPU simulation of its threads, TMA and barriers)."""
    params = getattr(plgpu, "InterpretParams", None)
    if params is None:   # jax 0.10 keeps it private
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as params
    return params()


def warpgroups(rows) -> int:
    """Compute warpgroups a CTA: two (softmax and matmuls overlapped) where they split the
    rows evenly, else one; the grid has rows // (warpgroups * ROWS) row tiles."""
    return 2 if rows % (2 * ROWS) == 0 else 1


def padded_rows(rows) -> int:
    """Query rows rounded up to whole warpgroups (the kernel's rows are a multiple of ROWS)."""
    return -(-rows // ROWS) * ROWS


def grid_ctas(batch, num_kv_heads, rows, splits) -> int:
    """CTAs of the launch: row tiles x splits x (slot, KV head)."""
    return batch * num_kv_heads * (rows // (warpgroups(rows) * ROWS)) * splits


def default_splits(batch, num_kv_heads, rows, cache_len, block_kv, num_sms=NUM_SMS):
    """One CTA per SM (the ring and tiles take most of its shared memory): the fewest splits
    that fill at least 90% of the SMs and leave the last wave no more than 10% short, while a
    split keeps 4 key blocks; a ragged last wave costs nearly a whole one.
    Splits are whole key blocks, so only `active_splits` of them hold keys (at batch 1, N 16,
    8K, 15 splits of 5 blocks leave 2 of the 15 empty): the rule counts the busy ones.
    Prefixes too short to fill the SMs that way take splits of 2 blocks (`_short_splits`)."""
    cap = max(1, cache_len // (4 * block_kv))
    for splits in range(1, cap + 1):
        busy = active_splits(cache_len, splits, block_kv)
        total = grid_ctas(batch, num_kv_heads, rows, busy)
        waves = -(-total // num_sms)
        if total >= 0.9 * num_sms and total >= 0.9 * waves * num_sms:
            return splits
    return _short_splits(batch, num_kv_heads, rows, cache_len, block_kv, num_sms, cap)


def _short_splits(batch, num_kv_heads, rows, cache_len, block_kv, num_sms, cap) -> int:
    """Where splits of 4 key blocks leave SMs idle: the fewest splits of 2+ blocks with the
    most busy CTAs that still fit one wave (idle SMs cost more than shorter splits' extra
    partials; a second wave costs more than both). Splits of one block where even those keep
    the grid within half the SMs (`ONE_BLOCK_MAX_SM_SHARE`)."""
    blocks = -(-cache_len // block_kv)
    if grid_ctas(batch, num_kv_heads, rows, blocks) <= ONE_BLOCK_MAX_SM_SHARE * num_sms:
        return blocks
    best, best_busy = cap, grid_ctas(batch, num_kv_heads, rows, active_splits(cache_len, cap,
                                                                               block_kv))
    for splits in range(cap + 1, cache_len // (2 * block_kv) + 1):
        busy = grid_ctas(batch, num_kv_heads, rows, active_splits(cache_len, splits, block_kv))
        if best_busy < busy <= num_sms:
            best, best_busy = splits, busy
    return best


def tree_split_pays(batch, num_kv_heads, rows, length, num_splits, block_kv,
                    num_sms=NUM_SMS) -> bool:
    """Whether the tree's block goes to a split of its own (`prefix_partials_mgpu(tree_split=)`):
    where the SMs the prefix's splits leave idle take all of the tree's CTAs at once and a
    split holds few blocks, so split 0 no longer ends a block after the others. Where the tree's
    CTAs would wait for SMs, or splits are long, the extra block in split 0 costs less. With one
    split the tree stays in it (no combine to merge a second)."""
    if num_splits < 2:
        return False
    busy = grid_ctas(batch, num_kv_heads, rows, active_splits(length, num_splits, block_kv))
    return (_split_blocks(length, num_splits, block_kv) <= TREE_SPLIT_BLOCKS
            and busy + grid_ctas(batch, num_kv_heads, rows, 1) <= num_sms)


def _split_blocks(length, num_splits, block_kv) -> int:
    """Key blocks of a split (the last may hold fewer) as `_bounds` cuts `length` keys; 1 for
    none."""
    blocks = -(-length // block_kv)
    return -(-blocks // num_splits) if blocks else 1


def active_splits(length, num_splits, block_kv) -> int:
    """Splits that hold keys when `length` keys are cut as `_bounds` cuts them (whole blocks)."""
    blocks = -(-length // block_kv)
    return -(-blocks // _split_blocks(length, num_splits, block_kv))


@functools.partial(jax.jit, static_argnames=("scale_log2", "num_splits", "block_kv", "steps",
                                             "tree_split", "profile", "interpret"))
def prefix_partials_mgpu(q_rows, k_cache, v_cache, layer, seq_lens, slots=None, tree_bias=None,
                         *, scale_log2: float, num_splits: int, block_kv: int = BLOCK_KV,
                         steps: int = STEPS, tree_split: bool = False, profile: str = "",
                         interpret: bool = False):
    """Split partials of q_rows [B, Hkv, R, D] (R a multiple of 64) over the live prefix of
    each slot's cache [L, Bc, Hkv, T, D] (T a multiple of block_kv): o [B * Hkv, S, R, D],
    m, l [B * Hkv, S, R], f32. slots [B]: the cache slot of each row (None: row b is slot b).
    tree_bias [B, R, NT] in q's dtype (0 where row r sees new key j, else MASK_VALUE; NT a
    multiple of 64 up to block_kv): q_rows is [B, Hkv, R + 2 NT, D], the tree's NT keys, then
    its NT values, after the R query rows (one XLA fusion builds all three from the
    projection); split 0 attends to those keys too, and with one split the output is o
    normalised, [B * Hkv, R, D] in q's dtype.
    tree_split: the tree's block as a split of its own, after the prefix's (outputs of
    num_splits + 1 splits, never normalised), instead of one block more for split 0. Split 0
    otherwise ends last by that block; a split of its own runs beside it on SMs the prefix's
    splits leave idle (`tree_split_pays`).
    profile: a directory where Mosaic GPU's profiler writes each call's timeline of the
    kernel's named regions (`region`), a Chrome trace a call: every warpgroup's start by the
    GPU's global timer, its regions by the SM's clock (chrome://tracing or Perfetto reads it).
    Device only; the regions' timestamps cost a shared-memory store each."""
    b, hkv, r, d = q_rows.shape
    tree = tree_bias is not None
    tree_keys = tree_bias.shape[-1] if tree else 0
    r -= 2 * tree_keys
    t = k_cache.shape[3]
    if not scale_log2 > 0:   # the running max is taken before scaling
        raise ValueError(f"{scale_log2=} must be positive")
    if r % ROWS or t % block_kv or d % 64:
        raise ValueError(f"rows {r} must be a multiple of {ROWS}, cache length {t} of "
                         f"{block_kv=}, head dim {d} of 64")
    if tree and (tree_keys % 64 or not 0 < tree_keys <= block_kv
                 or tree_bias.shape != (b, r, tree_keys)):
        raise ValueError(f"tree keys {tree_keys} must be a multiple of 64 up to {block_kv=}, "
                         f"and the bias {tree_bias.shape} must be {(b, r, tree_keys)}")
    wgs = warpgroups(r)
    row_tiles = r // (wgs * ROWS)
    tree_split = tree_split and tree
    dtype = k_cache.dtype
    swizzle = plgpu.SwizzleTransform(128)
    tiles = (plgpu.TilingTransform((8, 64)), swizzle)
    ring = plgpu.SMEM((steps, block_kv, d), dtype, transforms=tiles)
    smem = (plgpu.SMEM((wgs, ROWS, d), dtype, transforms=tiles), ring, ring,
            plgpu.SMEM((2, wgs, ROWS), jnp.float32),
            plgpu.SMEM((wgs, ROWS, tree_keys), dtype, transforms=tiles) if tree else None)
    barriers = ((plgpu.Barrier(num_barriers=steps), plgpu.Barrier(num_barriers=steps),
                 plgpu.Barrier(num_barriers=2 * wgs)),
                (plgpu.Barrier(num_arrivals=wgs, num_barriers=steps),) * 2,
                plgpu.Barrier(num_arrivals=wgs))
    grid_splits = num_splits + tree_split
    indirect = slots is not None
    body = functools.partial(_kernel, scale_log2=scale_log2, num_splits=num_splits,
                             block_kv=block_kv, steps=steps, wgs=wgs, indirect=indirect,
                             tree=tree, interpret=interpret,
                             tree_split_index=num_splits if tree_split else 0,
                             tree_row0=r, tree_first=num_splits > 1)

    def entry(*refs):
        pl.run_scoped(lambda *scoped: body(*refs, scoped), smem, *barriers,
                      collective_axes="wg")

    f32 = jnp.float32
    if tree and grid_splits == 1:
        out_type = (jax.ShapeDtypeStruct((b * hkv, r, d), dtype),)
    else:
        out_type = (jax.ShapeDtypeStruct((b * hkv, grid_splits, r, d), f32),
                    jax.ShapeDtypeStruct((b * hkv, grid_splits, r), f32),
                    jax.ShapeDtypeStruct((b * hkv, grid_splits, r), f32))
    params = dict(interpret=_interpret_params()) if interpret else {}
    if profile:   # ranges a warpgroup: 6 a key block, the tree's too, and 8 more at most
        if interpret:
            raise ValueError("profile needs the device: interpret mode has no profiler")
        ranges = 8 + 6 * (_split_blocks(t, num_splits, block_kv) + 1)
        profile = dict(profile_space=ranges, profile_dir=profile)
    # The row tiles last: Pallas iterates a grid row-major and Mosaic GPU launches its last axis
    # fastest, so the tiles that read the same keys run side by side (the kernel finds its
    # coordinates by name).
    axes = (("split", grid_splits), ("bh", b * hkv), ("rt", row_tiles))
    call = plgpu.kernel(entry, out_type=out_type,
                        grid=tuple(x for _, x in axes),
                        grid_names=tuple(name for name, _ in axes), num_threads=wgs + 1,
                        thread_name="wg",
                        compiler_params=plgpu.CompilerParams(approx_math=True,
                                                             **(profile or {})), **params)
    slot_map = () if slots is None else (slots.astype(jnp.int32),)
    extra = (tree_bias.astype(dtype),) if tree else ()
    out = call(jnp.reshape(layer, (1,)).astype(jnp.int32), seq_lens.astype(jnp.int32),
               *slot_map, q_rows.astype(dtype), k_cache, v_cache, *extra)
    return out[0] if len(out) == 1 else out
