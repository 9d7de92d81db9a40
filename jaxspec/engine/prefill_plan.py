"""Prefill planning on the host: which admission calls carry an admission's newcomers.

Every call has one of a few static shapes (one executable each, compiled at warm-up):
  "packed"  first chunks laid end to end: one row of T tokens, T = min_chunk * 2**k up to
            pack_tokens, for at most T / min_chunk requests; or first-fit into R rows of
            pack_tokens (R = 2, 4, .. or with pack_rows 'fine' also 3, 6, 12, ..), at most
            pack_max_tokens tokens in all (more newcomers take more packs)
  "chunk"   A requests x C tokens: later chunks of prompts longer than prefill_chunk, a whole
            chunk wide, A a slot bucket (1, slot_growth, slot_growth**2, .. up to the
            replica's slots); with packing off also first chunks, C the width bucket
            (min_chunk * width_growth**k) of the longest
A call's shape pads its rows: the cost grows with the padding, up to the growth factor.
Under data parallelism each replica's newcomers are planned on their own and the replicas'
calls of one shape made one call (each replica's part at the largest's shape).

A row is (run_id, slot, token ids to prefill, AdmitArgs fields); a call is an `Admission`.
"""
from __future__ import annotations

import bisect
from typing import List, NamedTuple, Sequence

import numpy as np

from jaxspec.engine.admission import AdmitArgs, PackLayout
from jaxspec.engine.config import EngineConfig


class Admission(NamedTuple):
    form: str                 # "chunk" or "packed"
    shape: tuple              # (requests a replica, tokens a row) : the program's shape
    parts: list               # per replica: (slot_idx, tokens, where, n_valid, next_tok, adm)
    run_ids: list             # per request row, replica after replica (-1: padding)


def buckets(smallest: int, largest: int, growth: int) -> List[int]:
    """smallest * growth**k below `largest`, then `largest`."""
    out = [smallest]
    while out[-1] * growth < largest:
        out.append(out[-1] * growth)
    return out + [largest] if out[-1] < largest else out


def bucket(n: int, sizes: List[int]) -> int:
    """The smallest size >= n (n never exceeds the largest)."""
    return sizes[bisect.bisect_left(sizes, n)]


def build_pack(chunks: Sequence[Sequence[int]], row_of: Sequence[int], rows: int, width: int,
               a: int):
    """numpy (tokens [R, W], PackLayout) of chunks (request j's tokens, in row row_of[j], after
    the requests before it in that row) for a pack of `a` requests; requests len(chunks)..a-1
    are padding."""
    tokens = np.zeros((rows, width), np.int32)
    seg = np.full((rows, width), a, np.int32)
    pos = np.tile(np.arange(width, dtype=np.int32), (rows, 1))
    last = np.zeros(a, np.int32)
    cursor = [0] * rows
    for j, (ids, r) in enumerate(zip(chunks, row_of)):
        c, n = cursor[r], len(ids)
        if c + n > width:
            raise ValueError(f"row {r} of a {width}-token pack cannot take {n} more tokens")
        tokens[r, c:c + n], seg[r, c:c + n], pos[r, c:c + n] = ids, j, np.arange(n)
        last[j] = r * width + c + n - 1
        cursor[r] = c + n
    return tokens, PackLayout(seg, pos, last)


class PrefillPlanner:
    """cfg: the resolved EngineConfig; slots: every replica's slots in all."""

    def __init__(self, cfg: EngineConfig, slots: int, replicas: int):
        self.cfg, self.slots, self.replicas = cfg, slots, replicas
        self.chunk, self.min_chunk = cfg.prefill_chunk, cfg.min_chunk
        self.per = slots // replicas
        self.widths = buckets(cfg.min_chunk, self.chunk, cfg.width_growth)
        self.slot_buckets = buckets(1, self.per, cfg.slot_growth)
        self.pack_tokens = cfg.pack_tokens
        # First-fit leaves at most one row with fewer than pack_tokens // chunk first chunks,
        # so r_max rows (a power of 2) hold every slot's first chunk.
        per_row = max(1, cfg.pack_tokens // self.chunk)
        r_max = 1 << (-(-self.per // per_row) - 1).bit_length()
        r_max = min(r_max, 1 << ((cfg.pack_max_tokens // cfg.pack_tokens).bit_length() - 1))
        rows = buckets(2, r_max, 2) if r_max > 1 else []
        if cfg.pack_rows == "fine":
            rows = sorted(set(rows) | {3 * r // 2 for r in rows if 3 * r // 2 < r_max})
        self.pack_sizes = buckets(cfg.min_chunk, cfg.pack_tokens, 2) + \
            [cfg.pack_tokens * r for r in rows]

    # ---------------------------------------------------------------- shapes
    def pack_requests(self, size: int) -> int:
        """The most requests a pack of `size` tokens holds."""
        return min(self.per, max(1, size // self.min_chunk))

    def pack_shape(self, size: int) -> tuple:
        """(rows, width) of a pack of `size` tokens (one of pack_sizes)."""
        return max(1, size // self.pack_tokens), min(size, self.pack_tokens)

    def forms(self) -> List[tuple]:
        """(requests, tokens a row, form) of every admission program, largest first."""
        first = ([(self.pack_requests(t), t, "packed") for t in self.pack_sizes]
                 if self.cfg.packing else
                 [(a, w, "chunk") for a in self.slot_buckets for w in self.widths])
        out = list(dict.fromkeys(first + [(a, self.chunk, "chunk") for a in self.slot_buckets]))
        return sorted(out, key=lambda s: -s[1] * (1 if s[2] == "packed" else s[0]))

    def padding(self, a: int, w: int, form: str):
        """An admission of shape (a, w) whose rows are all padding (it changes nothing)."""
        part = self._pack_args(([], [], 0), w) if form == "packed" else \
            self._chunk_args([], 1, a, w)
        return Admission(form, (a, w), [part] * self.replicas, [-1] * a * self.replicas)

    # ---------------------------------------------------------------- planning
    def plan(self, rows) -> List[Admission]:
        """The admission calls of newcomer rows (any replica's), in the order they must run:
        first chunks (packed or padded), then each later chunk k of the prompts that have one."""
        mine = [[r for r in rows if r[1] // self.per == d] for d in range(self.replicas)]
        out, k = [], 0
        if self.cfg.packing:
            packs = [self._packs(m) for m in mine]
            for j in range(max(map(len, packs))):
                group = [p[j] if j < len(p) else ([], [], 0) for p in packs]
                t = max(map(self._pack_size, group))
                out.append(self._admission("packed", [g[0] for g in group], t,
                                           [self._pack_args(g, t) for g in group]))
            k = 1
        while any(groups := [[r for r in m if len(r[2]) > k * self.chunk] for m in mine]):
            shapes = [self._chunk_shape(g, k) for g in groups if g]
            a, width = max(s[0] for s in shapes), max(s[1] for s in shapes)
            out.append(self._admission("chunk", groups, width,
                                       [self._chunk_args(g, k, a, width) for g in groups]))
            k += 1
        return out

    def _admission(self, form, groups, width, parts) -> Admission:
        a = len(parts[0][0])
        ids = [rid for g in groups for rid in [r[0] for r in g] + [-1] * (a - len(g))]
        return Admission(form, (a, width), parts, ids)

    def _packs(self, rows) -> List[tuple]:
        """rows in order, first-fit into rows of at most pack_tokens first-chunk tokens: groups
        (rows, the pack row of each, pack rows used), one admission each."""
        w, r_max = self.pack_tokens, self.pack_shape(self.pack_sizes[-1])[0]
        a_max = self.pack_requests(self.pack_sizes[-1])
        out, cur, row_of, fill = [], [], [], []
        for r in rows:
            n = min(self.chunk, len(r[2]))
            i = next((k for k, f in enumerate(fill) if f + n <= w), len(fill))
            if (i == len(fill) == r_max) or len(cur) == a_max:
                out.append((cur, row_of, len(fill)))
                cur, row_of, fill, i = [], [], [], 0
            if i == len(fill):
                fill.append(0)
            fill[i] += n
            cur.append(r)
            row_of.append(i)
        return out + [(cur, row_of, len(fill))] if cur else out

    def _pack_size(self, group) -> int:
        """The smallest pack size that holds a `_packs` group."""
        rows, _, used = group
        need = (sum(min(self.chunk, len(r[2])) for r in rows) if used <= 1
                else used * self.pack_tokens)
        return next(s for s in self.pack_sizes
                    if s >= need and self.pack_requests(s) >= len(rows))

    def _pack_args(self, group, t: int):
        rows, row_of, _ = group
        chunks = [ids[:self.chunk] for _, _, ids, _ in rows]
        a = self.pack_requests(t)
        tokens, lay = build_pack(chunks, row_of, *self.pack_shape(t), a)
        slot_idx, nv, nxt, adm = self._rows_args(a, rows, list(map(len, chunks)), 0)
        return slot_idx, tokens, lay, nv, nxt, adm

    def _chunk_shape(self, rows, k: int) -> tuple:
        """(slot bucket, width) of the k-th chunks of `rows`: a first chunk as wide as the
        width bucket of the longest, a later chunk a whole chunk wide."""
        width = self.chunk if k else bucket(max(min(self.chunk, len(r[2])) for r in rows),
                                            self.widths)
        return bucket(len(rows), self.slot_buckets), width

    def _chunk_args(self, rows, k: int, a: int, width: int):
        start = k * self.chunk
        n_valid = [min(self.chunk, len(ids) - start) for _, _, ids, _ in rows]
        tokens = np.zeros((a, width), np.int32)
        starts = np.zeros(a, np.int32)
        starts[:len(rows)] = start
        slot_idx, nv, nxt, adm = self._rows_args(a, rows, n_valid, start)
        for i, ((_, _, ids, _), n) in enumerate(zip(rows, n_valid)):
            tokens[i, :n] = ids[start:start + n]
        return slot_idx, tokens, starts, nv, nxt, adm

    def _rows_args(self, a: int, rows, n_valid, start: int):
        """(slot_idx, n_valid, next_tok, AdmitArgs) of `a` request rows: the rows' chunks from
        `start`, then padding (slot index B, nothing valid)."""
        slot_idx = np.full(a, self.slots, np.int32)
        nv = np.zeros(a, np.int32)
        nxt = np.full(a, -1, np.int32)
        adm = AdmitArgs.host(a)
        for i, ((_, slot, ids, fields), n) in enumerate(zip(rows, n_valid)):
            slot_idx[i], nv[i] = slot, n
            if start + n < len(ids):
                nxt[i] = ids[start + n]
            for name, value in fields.items():
                getattr(adm, name)[i] = value
        return slot_idx, nv, nxt, adm
