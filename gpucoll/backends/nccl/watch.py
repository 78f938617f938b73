"""Deadlines for work on CUDA streams: the watchdog, and event-backed Work.

NCCL calls return once enqueued, so a collective whose peer never shows up does not hang the
caller: it hangs the stream. Every call records an event after its work; the watchdog thread
polls the oldest one, and when it is not done by the call's deadline, NCCL reports an
asynchronous error, or a peer is found dead in the store, it fails the backend (which aborts
the NCCL communicator between calls, freeing the stream) with an error naming the op and rank.
Finished calls are retired in issue order, and with them the buffers they kept alive.

The thread also keeps this rank's position in the communicator's sequence of calls in the
store (``progress/{rank}``, when it changed, at most every half second), so that a rank whose
call times out can say which rank is behind and where.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

from gpucoll import cuda
from gpucoll.backends.nccl.driver import translate
from gpucoll.errors import CollectiveTimeout, GpucollError, PeerFailure
from gpucoll.progress import Progress, Waiting, diagnose
from gpucoll.work import Work, wait_event

POLL_MAX = 0.05  # seconds between polls of a pending event, at most
LINGER = 0.01  # seconds the watchdog keeps polling after its queue empties, before it idles
TICK = 0.5  # seconds between looks at the store (dead peers; this rank's position)
PROGRESS_KEY = "progress/{}"


@dataclasses.dataclass(slots=True)
class Pending:
    """One enqueued call: the event after it, its deadline, and what must outlive its work."""

    event: Any
    deadline: float
    opname: str
    timeout: float
    keep: Any = None


class Positions:
    """This rank's progress record, published in the group's store, and the diagnosis of
    where every rank is (read back from the store) when a call times out."""

    def __init__(self, store: Any, rank: int, size: int, progress: Progress):
        self.store, self.rank, self.size, self.progress = store, rank, size, progress
        self._sent = b""

    def publish(self) -> None:
        """Put this rank's record in the store if it changed since the last time."""
        data = self.progress.encode()
        if data != self._sent and self.store is not None:
            try:
                self.store.set(PROGRESS_KEY.format(self.rank), data)
                self._sent = data
            except Exception:  # noqa: BLE001 - a diagnosis aid: the store may be gone
                pass

    def diagnose(self) -> str:
        """Which rank is behind and where, from the records in the store."""
        self.publish()
        try:
            values = self.store.peek([PROGRESS_KEY.format(r) for r in range(self.size)])
        except Exception as exc:  # noqa: BLE001
            return f"the ranks' progress could not be read ({exc})"
        found = {r: Progress.decode(r, v) for r, v in enumerate(values) if v is not None}
        return diagnose(found, [r for r in range(self.size) if r not in found])


class Watchdog:
    """Polls the events of enqueued calls in issue order; calls ``on_fail(exc)`` once if one
    misses its deadline, ``check()`` (NCCL's async error query) raises, or ``liveness`` finds a
    peer that died."""

    def __init__(self, rank: int, size: int, check: Callable[[str], None],
                 on_fail: Callable[[GpucollError], None], liveness: Any = None,
                 positions: Positions | None = None):
        self.rank, self.size = rank, size
        self._check, self._on_fail = check, on_fail
        self._liveness, self._positions = liveness, positions
        self._pending: collections.deque[Pending] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._idle = True  # the thread waits for work (not polling): adding must wake it
        self._next_tick = self._next_look = 0.0
        self._notice = Waiting(f"rank {rank}")  # a call long unfinished says where ranks are
        self._noticed: Pending | None = None
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"gpucoll-nccl-watchdog-{rank}")
        self._thread.start()

    def add(self, item: Pending) -> None:
        # deque.append is atomic; the lock is taken only to wake an idle thread (the thread
        # sets _idle before it looks at the deque, so no item is missed)
        self._pending.append(item)
        if self._idle:
            with self._cond:
                self._cond.notify()

    def outstanding(self) -> list[Pending]:
        """The calls not yet seen complete, in issue order."""
        with self._cond:
            return list(self._pending)

    def clear(self) -> list[Pending]:
        """Forget every pending call; returns them."""
        with self._cond:
            pending = list(self._pending)
            self._pending.clear()
        return pending

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._pending.clear()
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        delay = 0.0005
        while True:
            with self._cond:
                if not self._pending and not self._closed:
                    # stay awake a moment first: calls in quick succession then add their
                    # events without waking this thread each time
                    self._cond.wait(LINGER)
                self._idle = True
                if not self._pending and not self._closed:
                    self._cond.wait(TICK)
                self._idle = False
                if self._closed:
                    return
                head = self._pending[0] if self._pending else None
            self._tick()
            if head is None:
                continue
            failure = self._inspect(head)
            if failure is not None:
                self.clear()
                self._on_fail(failure)
                continue
            with self._cond:
                if self._pending and self._pending[0] is head and not head.event.done:
                    self._cond.wait(delay)
                    delay = min(delay * 2, POLL_MAX)
                    continue
                self._retire()
            delay = 0.0005

    def _tick(self) -> None:
        """At most every TICK seconds: publish this rank's position."""
        now = time.monotonic()
        if now >= self._next_tick:
            self._next_tick = now + TICK
            if self._positions is not None:
                self._positions.publish()

    def _retire(self) -> None:
        """Drop every finished call at the head of the queue in one go (under the lock):
        one pass per wake-up, not one per call, keeps this thread off the callers' GIL."""
        pending = self._pending
        try:
            while pending and pending[0].event.done:
                pending.popleft()
        except Exception:  # noqa: BLE001 - _inspect reports it once that call is the head
            pass

    def _inspect(self, head: Pending) -> GpucollError | None:
        try:
            if head.event.done:
                return None
            self._check(head.opname)
        except GpucollError as exc:
            return exc
        except Exception as exc:  # noqa: BLE001 - CUDA errors from the event query
            return translate(exc, head.opname, self.rank, self.size)
        now = time.monotonic()
        if self._liveness is not None and now >= self._next_look:
            self._next_look = now + TICK
            try:  # a peer that closed may simply have finished first: only the dead count
                died = [r for r, how in self._liveness.gone().items()
                        if how != "closed" and r != self.rank]
                if died:
                    self._liveness.check(head.opname, died)
            except PeerFailure as exc:
                return exc
            except GpucollError:
                pass  # the store is gone: the deadline still holds
        if now > head.deadline:
            return self.expired(head)
        self._say_waiting(head, now)
        return None

    def _say_waiting(self, head: Pending, now: float) -> None:
        """Every GPUCOLL_WAIT_LOG seconds that ``head`` is unfinished, one line saying where
        the ranks are (``gpucoll.progress``)."""
        notice = self._notice
        if head is not self._noticed:
            self._noticed = head
            begun = head.deadline - head.timeout
            notice.restart(begun if begun == begun and begun < now else now)  # nan: no deadline
            notice.what = f"{head.opname} on rank {self.rank} of {self.size}"
            notice.timeout = head.timeout
        if now >= notice.due:
            notice.tick(lambda: f"(where the ranks are: {self._positions.diagnose()})"
                        if self._positions is not None else "for its peers", now)

    def expired(self, item: Pending) -> CollectiveTimeout:
        """The error for a call that missed its deadline, saying where every rank is."""
        why = f"; {self._positions.diagnose()}" if self._positions is not None else ""
        return CollectiveTimeout(
            f"{item.opname} on rank {self.rank} of {self.size} did not complete within "
            f"{item.timeout:g} s{why}; the NCCL communicator was aborted")


class EventWork(Work):
    """An NCCL call in flight on a stream, marked by the CUDA event recorded after it.

    ``wait()`` makes the caller's current stream wait for the call (the host does not block)
    and returns its result; ``synchronize()`` (or ``wait(timeout)``) blocks the host until it
    is done, bounded by the call's deadline; ``is_completed()`` queries the event.
    """

    def __init__(self, backend: Any, pending: Pending):
        self._backend = backend
        self._pending = pending

    def is_completed(self) -> bool:
        return self._backend.failure() is not None or bool(self._pending.event.done)

    def _order(self) -> None:
        self._backend.raise_failure()
        rt = cuda.runtime()
        rt.wait_event(rt.current_stream(), self._pending.event)

    def _wait(self, timeout: float | None) -> bool:
        p = self._pending
        limit = p.deadline if timeout is None else time.monotonic() + timeout
        if wait_event(p.event, limit, self._backend.raise_failure):
            return True
        if timeout is not None:
            return False
        self._backend.expire(p)  # as the watchdog would now (the first failure counts)
        self._backend.raise_failure()
        return True  # not reached: the backend has failed
