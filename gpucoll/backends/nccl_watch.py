"""Deadlines for work on CUDA streams: the watchdog, NCCL errors, and event-backed Work.

NCCL calls return once enqueued, so a collective whose peer never shows up does not hang the
caller: it hangs the stream. The watchdog thread records an event after every call, polls the
oldest one, and when it is not done by the call's deadline (or NCCL reports an asynchronous
error) it aborts the communicator, which frees the stream, and fails every later use of the
backend with an error naming the op and rank.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

from gpucoll.errors import CollectiveTimeout, GpucollError, PeerFailure
from gpucoll.work import Work

# ncclResult_t (nccl.h)
NCCL_RESULT_NAMES = {
    1: "ncclUnhandledCudaError", 2: "ncclSystemError", 3: "ncclInternalError",
    4: "ncclInvalidArgument", 5: "ncclInvalidUsage", 6: "ncclRemoteError",
    7: "ncclInProgress", 8: "ncclTimeout",
}
NCCL_REMOTE_ERROR = 6
NCCL_TIMEOUT = 8
POLL_MAX = 0.05  # seconds between polls of a pending event, at most
LINGER = 0.01  # seconds the watchdog keeps polling after its queue empties, before it idles


class NcclFailure(GpucollError):
    """NCCL reported an error (``status`` is its ncclResult_t) for an op on a rank."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status

    def __reduce__(self):
        return (type(self), (str(self), self.status))


def translate(exc: BaseException, opname: str, rank: int, size: int) -> GpucollError:
    """The gpucoll error for an ``NcclError`` raised by ``opname`` on ``rank``."""
    status = getattr(exc, "status", None)
    what = NCCL_RESULT_NAMES.get(status, f"status {status}")
    message = f"{opname} on rank {rank} of {size}: NCCL failed ({what}): {exc}"
    if status == NCCL_REMOTE_ERROR:
        return PeerFailure(message)
    if status == NCCL_TIMEOUT:
        return CollectiveTimeout(message)
    return NcclFailure(message, status)


@dataclasses.dataclass(slots=True)
class Pending:
    """One enqueued call: the event after it, its deadline and buffers to keep alive."""

    event: Any
    deadline: float
    opname: str
    timeout: float
    keep: Any = None


class Watchdog:
    """Polls the events of enqueued calls in issue order; calls ``on_fail(exc)`` once if one
    misses its deadline or ``check()`` (NCCL's async error query) raises."""

    def __init__(self, rank: int, size: int, check: Callable[[str], None],
                 on_fail: Callable[[GpucollError], None]):
        self.rank, self.size = rank, size
        self._check, self._on_fail = check, on_fail
        self._pending: collections.deque[Pending] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._idle = True  # the thread waits for work (not polling): adding must wake it
        self._thread: threading.Thread | None = None

    def add(self, item: Pending) -> None:
        # deque.append is atomic; the lock is taken only to start or wake an idle thread
        # (the thread sets _idle before it looks at the deque, so no item is missed)
        self._pending.append(item)
        if self._idle:
            with self._cond:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, daemon=True,
                                                    name=f"gpucoll-nccl-watchdog-{self.rank}")
                    self._thread.start()
                self._cond.notify()

    def outstanding(self) -> int:
        with self._cond:
            return len(self._pending)

    def clear(self) -> None:
        with self._cond:
            self._pending.clear()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._pending.clear()
            self._cond.notify()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    def _run(self) -> None:
        delay = 0.0005
        while True:
            with self._cond:
                if not self._pending and not self._closed:
                    # stay awake a moment first: calls in quick succession then add their
                    # events without waking this thread each time
                    self._cond.wait(LINGER)
                self._idle = True
                while not self._pending and not self._closed:
                    self._cond.wait()
                self._idle = False
                if self._closed:
                    return
                head = self._pending[0]
            failure = self._inspect(head)
            if failure is not None:
                self.clear()
                self._on_fail(failure)
                continue
            with self._cond:
                if self._pending and self._pending[0] is head and not head.event.done():
                    self._cond.wait(delay)
                    delay = min(delay * 2, POLL_MAX)
                    continue
                self._retire()
            delay = 0.0005

    def _retire(self) -> None:
        """Drop every finished call at the head of the queue in one go (under the lock):
        one pass per wake-up, not one per call, keeps this thread off the callers' GIL."""
        pending = self._pending
        try:
            while pending and pending[0].event.done():
                pending.popleft()
        except Exception:  # noqa: BLE001 - _inspect reports it once that call is the head
            pass

    def _inspect(self, head: Pending) -> GpucollError | None:
        try:
            if head.event.done():
                return None
            self._check(head.opname)
        except GpucollError as exc:
            return exc
        except Exception as exc:  # noqa: BLE001 - CUDA errors from the event query
            return translate(exc, head.opname, self.rank, self.size)
        if time.monotonic() > head.deadline:
            return CollectiveTimeout(
                f"{head.opname} on rank {self.rank} of {self.size} did not complete within "
                f"{head.timeout:g} s; the NCCL communicator was aborted"
            )
        return None


class EventWork(Work):
    """An NCCL call in flight on a stream, marked by the CUDA event recorded after it.

    ``wait()`` makes the caller's current stream wait for the call (the host does not block)
    and returns its result; ``synchronize()`` blocks the host until it is done, bounded by the
    call's deadline; ``is_completed()`` queries the event.
    """

    def __init__(self, backend: Any, pending: Pending):
        self._backend = backend
        self._pending = pending

    def is_completed(self) -> bool:
        return self._backend.failure() is not None or self._pending.event.done()

    def wait(self, timeout: float | None = None) -> Any:
        """Order the current stream after the call; raise if the backend already failed."""
        self._backend.raise_failure()
        self._backend.stream_wait(self._pending.event)
        return self._value

    def synchronize(self, timeout: float | None = None) -> Any:
        """Block the host until the call is done (or its deadline passed) and return it."""
        return Work.wait(self, timeout)

    def _wait(self, timeout: float | None) -> bool:
        limit = self._pending.deadline if timeout is None else time.monotonic() + timeout
        delay = 0.00002
        while True:
            self._backend.raise_failure()
            if self._pending.event.done():
                self._backend.raise_failure()
                return True
            if time.monotonic() > limit:
                if timeout is not None:
                    return False
                # the watchdog aborts at the same deadline; give it a moment to name the cause
                time.sleep(POLL_MAX * 2)
                self._backend.raise_failure()
                raise CollectiveTimeout(
                    f"{self._pending.opname} did not complete within "
                    f"{self._pending.timeout:g} s"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.001)
