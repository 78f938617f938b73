"""Long waits say what they wait for: no wait is silent.

A wait that lasts longer than ``GPUCOLL_WAIT_LOG`` seconds (default 10) -- start-up, a store
wait, a collective on the host ring or on NCCL -- prints one line on stderr, and another every
interval while it lasts, naming the call, this rank, how long it has waited and whom for::

    gpucoll: start-up on rank 0 of 2: still waiting after 10 s for rank 1 (gives up at 300 s)

``GPUCOLL_WAIT_LOG=0`` silences the lines; a smaller number shortens the interval. Every wait
goes through one ``Waiting`` (``tick`` when it has not ended yet), so the rule and the format are
the same everywhere.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable

ENV = "GPUCOLL_WAIT_LOG"
DEFAULT_INTERVAL = 10.0


def interval(environ: dict[str, str] | None = None) -> float | None:
    """Seconds between lines about a long wait, from ``GPUCOLL_WAIT_LOG``; None: silenced.
    ValueError for a value that is not a number of seconds >= 0."""
    raw = (os.environ if environ is None else environ).get(ENV, "").strip()
    if not raw:
        return DEFAULT_INTERVAL
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not seconds >= 0 or math.isinf(seconds):
        raise ValueError(f"{ENV}={raw!r}: expected the seconds between lines about a long wait "
                         f"(a number >= 0; 0 silences them)")
    return seconds or None


def _interval_or_default() -> float | None:
    try:
        return interval()
    except ValueError:  # gpucoll.init reports a bad value; a wait never fails over it
        return DEFAULT_INTERVAL


class Waiting:
    """The lines about one wait: ``what`` (e.g. ``all_reduce on rank 0 of 4``) waited since
    ``start`` (time.monotonic), giving up after ``timeout`` seconds (None: not said)."""

    __slots__ = ("what", "start", "timeout", "every", "due")

    def __init__(self, what: str, timeout: float | None = None, start: float | None = None,
                 every: float | None | bool = True):
        self.what, self.timeout = what, timeout
        self.every = _interval_or_default() if every is True else every
        self.restart(time.monotonic() if start is None else start)

    def restart(self, start: float) -> None:
        """The wait (begun again) started at ``start``: the first line comes an interval later."""
        self.start = start
        self.due = start + self.every if self.every else math.inf

    def until_due(self, now: float) -> float:
        """Seconds until the next line is due (inf when silenced): the longest slice a waiter
        may block for before it should ``tick`` again."""
        return max(self.due - now, 0.0)

    def tick(self, detail: Callable[[], str], now: float | None = None) -> bool:
        """Print the line if one is due; ``detail()`` says whom the wait is for (called only
        then). True if a line was printed."""
        now = time.monotonic() if now is None else now
        if now < self.due:
            return False
        self.due = now + self.every
        limit = "" if self.timeout is None else f" (gives up at {_seconds(self.timeout)} s)"
        try:
            text = detail()
        except Exception as exc:  # noqa: BLE001 - the line must not break the wait
            text = f"(could not tell whom: {exc})"
        try:
            sys.stderr.write(f"gpucoll: {self.what}: still waiting after "
                             f"{_seconds(now - self.start)} s {text}{limit}\n")
            sys.stderr.flush()
        except (OSError, ValueError, AttributeError):  # stderr closed or gone
            pass
        return True


def _seconds(s: float) -> str:
    """``12`` for long spans, ``0.4`` for the short intervals tests use."""
    return f"{s:.0f}" if s >= 10 else f"{s:.1f}".removesuffix(".0")
