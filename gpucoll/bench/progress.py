"""A one-line progress bar on stderr for long sweeps (only on a terminal, or when asked)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

WIDTH = 28


class Progress:
    """``step(label)`` after each table line; ``close()`` erases the bar."""

    def __init__(self, total: int, enabled: bool | None = None, stream: TextIO | None = None):
        self.stream = stream or sys.stderr
        if enabled is None:
            enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.enabled, self.total, self.done = enabled and total > 0, total, 0
        self.t0 = time.monotonic()

    def restart(self, total: int) -> None:
        self.total, self.done, self.t0 = total, 0, time.monotonic()

    def step(self, label: str) -> None:
        self.done += 1
        if self.enabled:
            self.stream.write("\r" + self.line(label))
            self.stream.flush()

    def line(self, label: str) -> str:
        frac = min(1.0, self.done / self.total) if self.total else 1.0
        filled = int(frac * WIDTH)
        elapsed = time.monotonic() - self.t0
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        return (f"[{'#' * filled}{'.' * (WIDTH - filled)}] {self.done}/{self.total} "
                f"{label[:40]:<40} {elapsed:5.0f}s, ~{eta:.0f}s left")

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r" + " " * (WIDTH + 80) + "\r")
            self.stream.flush()
