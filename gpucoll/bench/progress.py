"""A one-line progress bar for long sweeps, drawn on the terminal of the process that shows it.

From a shell that terminal is stderr. Rank 0 of a job started by ``gpucoll run`` has only pipes
(the launcher prefixes and forwards its lines), so the launcher names its own terminal in
``GPUCOLL_TTY`` and the bar is drawn there directly, in place; the launcher clears the line
before each line it forwards, so the bar never splits one. By default the bar shows on a
terminal only, once the sweep has run a few seconds; ``--progress`` shows it at once (on a
stream that is no terminal, as one line per finished table line).
"""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO

from gpucoll.launch.supervisor import TTY_ENV

WIDTH = 28
AUTO_DELAY = 2.0  # seconds before an unrequested bar appears: short sweeps never flicker
REDRAW = 0.5  # seconds between redraws from tick()
ERASE = "\r\x1b[K"  # carriage return, then clear to the end of the line


def terminal() -> tuple[TextIO, bool]:
    """Where the bar goes: the launcher's terminal when it named one, else stderr.

    Returns the stream and whether this process opened it (and must close it).
    """
    path = os.environ.get(TTY_ENV)
    if path:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NOCTTY)
        except OSError:
            pass
        else:
            return os.fdopen(fd, "w"), True
    return sys.stderr, False


class Progress:
    """``step(label)`` after each table line, ``tick()`` in between, ``clear()`` before other
    output, ``close()`` at the end."""

    def __init__(self, total: int = 0, enabled: bool | None = None,
                 stream: TextIO | None = None):
        self.stream, self._owned = (stream, False) if stream is not None else terminal()
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())
        self.enabled = self.live if enabled is None else enabled
        self.delay = AUTO_DELAY if enabled is None else 0.0
        self.shown = False
        self.label = "starting"
        self.restart(total)

    def restart(self, total: int) -> None:
        """Count from zero towards ``total`` table lines (the next library's sweep)."""
        self.total, self.done, self.t0, self.drawn = total, 0, time.monotonic(), 0.0

    def step(self, label: str) -> None:
        self.done += 1
        self.label = label
        if not self.enabled:
            return
        if self.live:
            self._draw()
        else:
            self.stream.write(self.line(label) + "\n")
            self.stream.flush()

    def tick(self) -> None:
        """Redraw (elapsed time moves on) if the bar is live and was not drawn just now."""
        if self.enabled and self.live and time.monotonic() - self.drawn >= REDRAW:
            self._draw()

    def _draw(self) -> None:
        now = time.monotonic()
        if now - self.t0 < self.delay and not self.shown:
            return
        self.stream.write(ERASE + self.line(self.label))
        self.stream.flush()
        self.shown, self.drawn = True, now

    def line(self, label: str) -> str:
        frac = min(1.0, self.done / self.total) if self.total else 0.0
        filled = int(frac * WIDTH)
        elapsed = time.monotonic() - self.t0
        eta = f", ~{elapsed / frac - elapsed:.0f}s left" if frac > 0 else ""
        return (f"[{'#' * filled}{'.' * (WIDTH - filled)}] {self.done}/{self.total or '?'} "
                f"{label[:40]:<40} {elapsed:5.0f}s{eta}")

    def clear(self) -> None:
        """Erase the bar (before other output goes to the same terminal)."""
        if self.shown:
            self.stream.write(ERASE)
            self.stream.flush()
            self.shown = False
            self.drawn = 0.0

    def close(self) -> None:
        self.clear()
        if self._owned:
            self.stream.close()
            self._owned = False
