"""Handles for collectives started with ``async_op=True``.

A ``Work`` stands for one call in flight. ``wait()`` returns what the synchronous call would have
returned (the communicator binds that object when it issues the call) or raises the call's error.
Backends make the handles: ``FutureWork`` for calls a host thread runs, the CUDA-event kind in the
NCCL backend.
"""

from __future__ import annotations

import abc
import concurrent.futures
from collections.abc import Callable
from typing import Any

from gpucoll.errors import CollectiveTimeout


class Work(abc.ABC):
    """One asynchronous call; work on one communicator completes in issue order."""

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
        """True once the call finished, successfully or not; never blocks."""

    @abc.abstractmethod
    def _wait(self, timeout: float | None) -> bool:
        """Block up to ``timeout`` seconds (None: until done); False if still running.

        Raises the call's error when it failed.
        """

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the call completes and return its result, or raise its error.

        With ``timeout`` (seconds) raise ``CollectiveTimeout`` if it is still running then; the
        call itself keeps its own deadline and is not cancelled.
        """
        if not self._wait(timeout):
            raise CollectiveTimeout(
                f"{self._label} still running after waiting {timeout:g} s in Work.wait()"
            )
        return self._value

    def result(self) -> Any:
        """The call's result, waiting for it if needed (same as ``wait()``)."""
        return self.wait()

    def __repr__(self) -> str:
        state = "completed" if self.is_completed() else "pending"
        return f"<{type(self).__name__} {self._label} {state}>"


class FutureWork(Work):
    """A call that a host thread runs: the thread calls ``run(call)``, callers ``wait()``."""

    def __init__(self) -> None:
        self._future: concurrent.futures.Future = concurrent.futures.Future()

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
        """Finish without running, e.g. when the backend was aborted before this call started."""
        if self._future.set_running_or_notify_cancel():
            self._future.set_exception(exc)

    def is_completed(self) -> bool:
        return self._future.done()

    def _wait(self, timeout: float | None) -> bool:
        # not result(timeout): the call's own CollectiveTimeout is also a TimeoutError
        done, _ = concurrent.futures.wait([self._future], timeout)
        if not done:
            return False
        self._future.result()
        return True


class CompletedWork(Work):
    """A call that already finished when it was issued (e.g. a one-rank group's no-op)."""

    def is_completed(self) -> bool:
        return True

    def _wait(self, timeout: float | None) -> bool:
        return True


class Deferred(Work):
    """A call whose result it makes itself, once it runs (its size is known only then, as for
    the uneven collectives): ``inner`` is the call's own handle, and the call puts its result in
    ``box[0]``, which ``wait()`` returns."""

    def __init__(self, inner: Work, box: list):
        self._inner, self._box = inner, box
        self._label = inner._label

    def is_completed(self) -> bool:
        return self._inner.is_completed()

    def _wait(self, timeout: float | None) -> bool:
        return self._inner._wait(timeout)

    def wait(self, timeout: float | None = None) -> Any:
        self._inner.wait(timeout)
        return self._box[0]
