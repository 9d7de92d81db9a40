"""The engine on one thread of its own; the event loop submits requests and reads their deltas.

The engine is synchronous and not thread-safe, so exactly one thread touches it. The event
loop's side only puts commands (add, drop, stop) on a queue, which the thread applies between
steps, and reads deltas from one asyncio queue per HTTP request; each step's deltas cross over
in one `loop.call_soon_threadsafe`. With nothing to run the thread blocks on the command queue.

Admission control is counted on the loop's side: at most the engine's slots plus `max_queue`
requests are accepted at once; past that a submission is refused (503), so the queue never
grows without bound. A caller that leaves (a client disconnect, a cancelled task) closes its
handle, which drops its unfinished requests from the engine and frees their slots.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

from jaxspec.engine import StreamDelta
from jaxspec.sampling import SamplingParams
from jaxspec.serve.errors import bad_request, overloaded, unavailable
from jaxspec.serve.metrics import ServerMetrics

log = logging.getLogger("jaxspec.serve")


class Handle:
    """The engine requests of one HTTP request (one per prompt): their deltas as (index,
    StreamDelta), in order. Close it when done: what has not finished is dropped."""

    def __init__(self, runner: "AsyncEngine", rids: List[str], t_arrival: float):
        self.rids, self.t_arrival = rids, t_arrival
        self.queue: asyncio.Queue = asyncio.Queue()
        self.added = asyncio.get_running_loop().create_future()
        self.open = set(range(len(rids)))
        self.closed = False
        self._runner = runner

    async def deltas(self):
        """Yields (index, delta) until every request has finished; raises what ended the
        engine, if it failed meanwhile."""
        while self.open:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            i, d = item
            if d.finished:
                self.open.discard(i)
            yield i, d

    def close(self):
        """Drops the unfinished requests and gives their places back (idempotent)."""
        if self.closed:
            return
        self.closed = True
        if self.open:
            self._runner.drop([self.rids[i] for i in sorted(self.open)])
            self.open = set()
        self._runner.release(len(self.rids))


class AsyncEngine:
    """llm's engine, driven by one background thread once `start` is called from the loop."""

    def __init__(self, llm, metrics: ServerMetrics, max_queue: int):
        self.engine = llm.engine
        self.metrics = metrics
        self.capacity = self.engine.slots + max_queue
        self.accepted = 0                  # loop side: requests accepted and not yet closed
        self.error: Optional[BaseException] = None
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._owner: Dict[str, Tuple[Handle, int]] = {}   # engine thread: live request -> handle
        self._queued = 0                   # requests submitted, not yet added (under _lock)
        self._lock = threading.Lock()
        self._stopping = False
        self._thread: Optional[threading.Thread] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    # ------------------------------------------------------------------ the loop's side
    def start(self):
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="jaxspec-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return (self._thread is not None and self._thread.is_alive() and self.error is None
                and not self._stopping)

    async def submit(self, prompts: Sequence[List[int]], sps: Sequence[SamplingParams], *,
                     request_id: str, stream: bool, t_arrival: float) -> Handle:
        """Queues one request per prompt; returns once the engine has taken them all (a
        ValueError of the engine is a 400, and none of them runs). 503 when full or stopping."""
        if not self.alive:
            raise unavailable("the engine is not running" + (
                f": {type(self.error).__name__}: {self.error}" if self.error else ""))
        n = len(prompts)
        if self.accepted + n > self.capacity:
            self.metrics.rejected("queue_full")
            raise overloaded(retry_after_s=1)
        self.accepted += n
        handle = Handle(self, [f"{request_id}-{i}" for i in range(n)], t_arrival)
        with self._lock:
            self._queued += n
        self._cmds.put(("add", handle, list(prompts), list(sps), stream))
        try:
            await handle.added
        except ValueError as e:
            handle.open = set()
            handle.close()
            raise bad_request(str(e)) from None
        except BaseException:
            handle.close()
            raise
        return handle

    def drop(self, rids: List[str]):
        self._cmds.put(("drop", rids))

    def release(self, n: int):
        self.accepted -= n

    async def stop(self, timeout: Optional[float] = None):
        """Aborts whatever still runs (its streams end with finish_reason 'abort') and ends the
        thread."""
        if self._thread is None:
            return
        self._stopping = True
        self._cmds.put(("stop",))
        await asyncio.to_thread(self._thread.join, timeout)

    def _fan_out(self, items):
        for handle, item in items:
            if not handle.closed:
                handle.queue.put_nowait(item)

    def _resolve(self, fut: asyncio.Future, error: Optional[BaseException]):
        if not fut.done():
            if error is None:
                fut.set_result(None)
            else:
                fut.set_exception(error)

    # ------------------------------------------------------------------ the engine thread
    def _run(self):
        try:
            while self._apply(block=not self.engine.has_work()):
                if self.engine.has_work():
                    self._deliver(self.engine.step())
                self._publish()
            self._finish_all()
        except BaseException as e:     # a bug of the engine: every caller hears of it
            log.exception("the engine failed")
            self.error = e
            self._fail_all(e)
        finally:
            self._publish()

    def _apply(self, block: bool) -> bool:
        """Applies the queued commands (waiting for one if block); False once told to stop."""
        try:
            cmd = self._cmds.get(block=block)
        except queue.Empty:
            return True
        while True:
            if cmd[0] == "stop":
                return False
            getattr(self, "_" + cmd[0])(*cmd[1:])
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return True

    def _add(self, handle: Handle, prompts, sps, stream: bool):
        added = []
        try:
            for rid, ids, sp in zip(handle.rids, prompts, sps):
                self.engine.add_request(ids, sp, request_id=rid, stream=stream)
                added.append(rid)
        except (TypeError, ValueError) as e:
            self.engine.drop(added)
            error: Optional[BaseException] = ValueError(str(e))
        else:
            error = None
            for i, rid in enumerate(added):
                self._owner[rid] = (handle, i)
            self.metrics.prompt_tokens.inc(sum(len(p) for p in prompts))
        finally:
            with self._lock:
                self._queued -= len(handle.rids)
        self._loop.call_soon_threadsafe(self._resolve, handle.added, error)

    def _drop(self, rids: List[str]):
        live = [rid for rid in rids if self._owner.pop(rid, None) is not None]
        if live:
            self.engine.drop(live)
            for _ in live:
                self.metrics.finished_abort()

    def _deliver(self, deltas: List[StreamDelta]):
        items, tokens = [], 0
        for d in deltas:
            own = self._owner.get(d.request_id)
            if own is None:
                continue
            tokens += len(d.token_ids)
            if d.finished:
                del self._owner[d.request_id]
                self._record(d.request_id, own[0])
            items.append((own[0], (own[1], d)))
        self.metrics.generation_tokens.inc(tokens)
        if items:
            self._loop.call_soon_threadsafe(self._fan_out, items)

    def _record(self, rid: str, handle: Handle):
        req = self.engine.finished_requests.pop(rid, None)
        if req is not None:
            self.metrics.finished(req.finish_reason, handle.t_arrival, req.t_first,
                                  req.t_finish or time.perf_counter(), len(req.output),
                                  req.accept_lens)

    def _publish(self):
        waiting = len(self.engine.waiting)
        self.metrics.running.set(len(self.engine.requests) - waiting)
        with self._lock:
            self.metrics.waiting.set(waiting + self._queued)

    def _finish_all(self):
        """At stop: aborts the live requests, delivers their last deltas, refuses the adds that
        came after the stop."""
        for rid in list(self._owner):
            self.engine.abort(rid)
        while self.engine.has_work():
            self._deliver(self.engine.step())
        self._refuse_queued(unavailable("the server is shutting down"))

    def _fail_all(self, error: BaseException):
        items = [(h, error) for h in {h for h, _ in self._owner.values()}]
        self._owner.clear()
        if items:
            self._loop.call_soon_threadsafe(self._fan_out, items)
        self._refuse_queued(unavailable(f"the engine failed: {type(error).__name__}: {error}"))

    def _refuse_queued(self, error: BaseException):
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                with self._lock:
                    self._queued -= len(cmd[1].rids)
                self._loop.call_soon_threadsafe(self._resolve, cmd[1].added, error)
