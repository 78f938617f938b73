"""SIGINT/SIGTERM/SIGHUP to the launcher become events in the job's queue, handled by its loop.

The handler only posts the signal (``SimpleQueue.put`` is safe in a signal handler), so the loop
decides: forward it to every rank the first time, kill them on a second Ctrl-C. SIGUSR1 arrives
the same way and asks the loop for a diagnosis of the job (``gpucoll doctor``); it stops nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import signal
from collections.abc import Iterator

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
DIAGNOSE = signal.SIGUSR1


@dataclasses.dataclass(frozen=True)
class Received:
    """A signal the launcher received."""

    signum: int

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


@contextlib.contextmanager
def signals_to(events: queue.SimpleQueue) -> Iterator[None]:
    """While active, each of :data:`FORWARDED` and :data:`DIAGNOSE` is put on ``events``
    instead of its default."""
    previous = {}
    handler = lambda signum, frame: events.put(Received(signum))
    try:
        for sig in (*FORWARDED, DIAGNOSE):
            previous[sig] = signal.signal(sig, handler)
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
