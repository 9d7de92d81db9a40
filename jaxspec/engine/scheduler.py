"""Scheduling on the host: which request runs in which slot, the KV budget and retract.

Requests wait in arrival order; each admission takes waiting requests into free slots while
their KV rows fit the budget. A slot's run ends at finish, abort or retract; run ids are never
reused, so an output that comes back for a run that no longer exists is dropped.

KV budget: `kv_budget` rows in all. A live slot reserves its committed rows, plus E (tokens per
call) for each dispatched call not yet read, plus E for the call about to go. When the next call
could need more, the most recently admitted requests are retracted: back to the head of the
queue, resumed later by recomputing their prefix (prompt + the tokens already produced).
`left` tracks what a slot may still emit beyond the least its calls in flight will bring: at
<= 0 its end by max_tokens is certain, and it runs no further call.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Dict, List, Optional

import numpy as np

from jaxspec.engine.request import Request
from jaxspec.sampling import FULL, Features


@dataclasses.dataclass
class Run:
    """One admission of a request into a slot; ends at finish, abort or retract."""
    run_id: int
    req: Request
    slot: int
    order: int                          # admission order: retract takes the largest


class Scheduler:
    def __init__(self, slots: int, emit: int, kv_budget: int, admit_interval: int):
        self.slots, self.emit, self.kv_budget = slots, emit, kv_budget
        self.admit_interval = admit_interval
        self.waiting: collections.deque = collections.deque()
        self.runs: Dict[int, Run] = {}
        self.slot_run: List[Optional[int]] = [None] * slots
        self.live = np.zeros(slots, bool)              # slot_run[s] is not None
        self.rows = np.zeros(slots, np.int64)          # reserved KV rows (0 when free)
        self.left = np.zeros(slots, np.int64)
        self.logprob_runs = 0                          # live runs that asked for logprobs
        self.full_runs = 0                             # live runs that need the FULL variant
        self._since_admit = 0
        self._next_run = 0
        self._order = 0

    def need(self) -> int:
        """Rows the live slots may hold once the next call has run."""
        return int(self.rows.sum()) + self.emit * int(np.count_nonzero(self.live))

    def admit(self) -> List[Run]:
        """Waiting requests moved into free slots, in order, while they fit the budget (one
        always fits an empty engine); none between admit_interval calls while others run."""
        if not self.waiting:
            return []
        if self.live.any() and self._since_admit + 1 < self.admit_interval:
            self._since_admit += 1
            return []
        self._since_admit = 0
        free = np.flatnonzero(~self.live).tolist()
        batch: List[Run] = []
        need = self.need()
        while free and self.waiting:
            req = self.waiting[0]
            prefix = len(req.prompt) + len(req.output)
            cost = prefix + self.emit
            if need + cost > self.kv_budget and (need > 0 or batch):
                break
            self.waiting.popleft()
            run = self._start(req, free.pop(0), prefix)
            need += cost
            batch.append(run)
        return batch

    def _start(self, req: Request, slot: int, prefix: int) -> Run:
        run = Run(self._next_run, req, slot, self._order)
        self._next_run += 1
        self._order += 1
        self.runs[run.run_id] = run
        self.slot_run[slot] = run.run_id
        self.live[slot] = True
        self.logprob_runs += req.logprobs is not None
        self.full_runs += Features.of([req.sp]) is FULL
        self.rows[slot] = prefix
        self.left[slot] = req.sp.max_tokens - len(req.output)
        return run

    def free(self, run_id: int) -> Request:
        run = self.runs.pop(run_id)
        self.slot_run[run.slot] = None
        self.live[run.slot] = False
        self.logprob_runs -= run.req.logprobs is not None
        self.full_runs -= Features.of([run.req.sp]) is FULL
        self.rows[run.slot] = 0
        return run.req

    def retract(self) -> List[Request]:
        """Retracts the newest runs while the next call could exceed the budget; they go back
        to the head of the queue. One request alone always fits (checked when it was added)."""
        out = []
        while self.need() > self.kv_budget:
            live = [rid for rid in self.slot_run if rid is not None]   # rare: a list is fine
            if len(live) <= 1:
                break
            req = self.free(max(live, key=lambda rid: self.runs[rid].order))
            req.retracts += 1
            self.waiting.appendleft(req)
            out.append(req)
        return out

    def remove(self, req: Request):
        """Takes a request out wherever it is (waiting or running)."""
        if req in self.waiting:
            self.waiting.remove(req)
        for rid, run in list(self.runs.items()):
            if run.req is req:
                self.free(rid)

    def active(self) -> np.ndarray:
        """[B] the slots the next call runs: live and not certain to have ended."""
        return self.live & (self.left > 0)

    def dispatched(self, active: np.ndarray, emit: int, min_emit: int):
        """Books a call over `active`: its rows reserved, the least it brings counted."""
        self.rows[active] += emit
        self.left[active] -= min_emit

    def run_of(self, run_id) -> Optional[Run]:
        return None if run_id is None else self.runs.get(run_id)
