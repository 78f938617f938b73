"""Handles for collectives started with ``async_op=True``: one contract on every backend.

A ``Work`` stands for one call in flight; work on one communicator completes in issue order.

- ``is_completed()`` never blocks. It is True once the call has finished, device work included
  (the copies and NCCL kernels it queued on a CUDA stream), or has failed.
- ``wait(timeout=None)`` returns what the synchronous call would have returned, as soon as the
  caller can use it: the host waits for the call's host side, and for device arrays the
  caller's current CUDA stream is made to wait for the call's device work (the host does not
  wait for the device). With ``timeout`` it waits like ``synchronize(timeout)`` instead.
- ``synchronize(timeout=None)`` blocks the host until the call has finished, device work
  included, at most ``timeout`` seconds (default: the call's own deadline), and returns the same.
- ``result()`` is ``wait()``.

A failed call raises its error from ``wait``, ``synchronize`` and ``result``. A ``timeout``
that passes raises ``CollectiveTimeout`` and does not cancel the call, which keeps its own
deadline. Backends make the handles: ``FutureWork`` for calls a host thread runs (the host ring,
also on device arrays staged through host memory), ``EventWork`` (in the NCCL backend) for calls
on a CUDA stream, ``CompletedWork`` for calls that were done when issued.
"""

from __future__ import annotations

import abc
import concurrent.futures
import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

from gpucoll import cuda
from gpucoll.errors import CollectiveTimeout


class Work(abc.ABC):
    """One asynchronous call; see the module docstring for the contract."""

    _value: Any = None
    _label: str = "collective"

    def bind(self, value: Any, label: str | None = None) -> Work:
        """Set the object ``wait()`` returns once the call is done (and a name for messages)."""
        self._value = value
        if label is not None:
            self._label = label
        return self

    @abc.abstractmethod
    def is_completed(self) -> bool:
        """True once the call finished (device work included), successfully or not."""

    @abc.abstractmethod
    def _wait(self, timeout: float | None) -> bool:
        """Block until the call finished, device work included, for at most ``timeout``
        seconds (None: the call's own deadline); False if it is still running then.

        Raises the call's error when it failed.
        """

    def _order(self) -> None:
        """Make the result usable by the caller's next step (host calls: wait for them)."""
        self._finish(None)

    def wait(self, timeout: float | None = None) -> Any:
        """The call's result once the caller can use it (see the module docstring); with
        ``timeout``, ``synchronize(timeout)``."""
        if timeout is not None:
            return self.synchronize(timeout)
        self._order()
        return self._value

    def synchronize(self, timeout: float | None = None) -> Any:
        """Block the host until the call finished, device work included; return its result."""
        self._finish(timeout)
        return self._value

    def result(self) -> Any:
        """The call's result, waiting for it if needed (same as ``wait()``)."""
        return self.wait()

    def _finish(self, timeout: float | None) -> None:
        if not self._wait(timeout):
            raise CollectiveTimeout(
                f"{self._label} still running after waiting {timeout:g} s for it"
            )

    def __repr__(self) -> str:
        state = "completed" if self.is_completed() else "pending"
        return f"<{type(self).__name__} {self._label} {state}>"


def wait_event(event: Any, limit: float, failed: Callable[[], None] | None = None) -> bool:
    """Poll CUDA ``event`` until it has completed (True) or ``time.monotonic()`` passes
    ``limit`` (False); ``failed()`` raises when the work behind it was given up."""
    delay = 0.00002
    while True:
        if failed is not None:
            failed()
        if cuda.event_done(event):
            if failed is not None:
                failed()
            return True
        if time.monotonic() > limit:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.001)


@dataclasses.dataclass
class DeviceTail:
    """The device work a host-run call leaves behind on a stream: the event recorded after its
    last copy (None: none), and the call's deadline."""

    event: Any = None
    deadline: float = math.inf


class FutureWork(Work):
    """A call that a host thread runs: the thread calls ``run(call)``, callers ``wait()``.

    A call that queues device work (the staged ring's copies back to device memory) sets
    ``tail``; the call is complete once that work is.
    """

    def __init__(self) -> None:
        self._future: concurrent.futures.Future = concurrent.futures.Future()
        self.tail: DeviceTail | None = None
        # runs the call (and the calls queued before it) on a thread that waits for it with
        # no timeout, instead of that thread sleeping until another has run it
        self.helper: Callable[[], None] | None = None

    def run(self, call: Callable[[], Any]) -> None:
        """Run ``call`` on the current thread and record how it ended; never raises."""
        if not self._future.set_running_or_notify_cancel():
            return
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the waiting thread
            self._future.set_exception(exc)
        else:
            self._future.set_result(None)

    def fail(self, exc: BaseException) -> None:
        """Finish without running, e.g. when the backend was aborted before this call started
        (or while it was being started: then it ends with ``exc``)."""
        try:
            self._future.set_exception(exc)
        except concurrent.futures.InvalidStateError:  # it ended meanwhile
            pass

    def finished(self) -> bool:
        """Whether the host side has ended (device work aside), successfully or not."""
        return self._future.done()

    def _event(self) -> Any:
        """The device event the finished call left (None: no device work, or it failed)."""
        tail = self.tail
        if tail is None or self._future.exception() is not None:
            return None
        return tail.event

    def is_completed(self) -> bool:
        if not self._future.done():
            return False
        event = self._event()
        return event is None or cuda.event_done(event)

    def _host(self, timeout: float | None) -> bool:
        if timeout is None and self.helper is not None and not self.finished():
            self.helper()  # bounded by the calls' own deadlines, as waiting for them would be
        # not result(timeout): the call's own CollectiveTimeout is also a TimeoutError
        done, _ = concurrent.futures.wait([self._future], timeout)
        if not done:
            return False
        self._future.result()
        return True

    def _wait(self, timeout: float | None) -> bool:
        start = time.monotonic()
        if not self._host(timeout):
            return False
        event = self._event()
        if event is None:
            return True
        limit = self.tail.deadline if timeout is None else start + timeout
        if wait_event(event, limit):
            return True
        if timeout is None:
            raise CollectiveTimeout(f"{self._label}: its copies back to device memory did not "
                                    f"finish by the call's deadline")
        return False

    def _order(self) -> None:
        self._host(None)
        event = self._event()
        if event is not None:
            rt = cuda.runtime()
            rt.wait_event(rt.current_stream(), event)


class CompletedWork(Work):
    """A call that already finished when it was issued (e.g. a one-rank group's no-op)."""

    def is_completed(self) -> bool:
        return True

    def _wait(self, timeout: float | None) -> bool:
        return True

    def _order(self) -> None:
        pass


class Deferred(Work):
    """A call whose result it makes itself, once it runs (its size is known only then, as for
    the uneven collectives): ``inner`` is the call's own handle, and the call puts its result in
    ``box[0]``, which ``wait()`` and ``synchronize()`` return."""

    def __init__(self, inner: Work, box: list):
        self._inner, self._box = inner, box
        self._label = inner._label

    def is_completed(self) -> bool:
        return self._inner.is_completed()

    def _wait(self, timeout: float | None) -> bool:
        return self._inner._wait(timeout)

    def _order(self) -> None:
        self._inner._order()

    def wait(self, timeout: float | None = None) -> Any:
        self._inner.wait(timeout)
        return self._box[0]

    def synchronize(self, timeout: float | None = None) -> Any:
        self._inner.synchronize(timeout)
        return self._box[0]
