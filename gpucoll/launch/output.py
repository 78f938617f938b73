"""Rank output, line by line: ``[rank 3] ...`` on the launcher's stdout or stderr.

Each pipe is drained by its own thread, as bytes (binary-safe). Complete lines are written in one
call under a lock shared by every rank, so lines of different ranks never mix; a rank's partial
writes wait until their line is complete (or its output ends). With ``--tee`` every line also
goes, unprefixed, to that rank's log file. A rank may draw a progress line straight onto the
launcher's terminal (named to it in ``GPUCOLL_TTY``): on a terminal each line written here
first clears the line the cursor is on, so such a bar never splits a rank's line.
"""

from __future__ import annotations

import collections
import os
import threading
from typing import BinaryIO

MAX_LINE = 1 << 16  # a longer line is cut so a rank cannot buffer without bound
TAIL_LINES = 20  # stderr lines kept per rank for the failure report
TAIL_WIDTH = 400  # characters of each such line shown in the report
ERASE_LINE = b"\r\x1b[K"  # carriage return, clear to the end of the line
TTY_ENV = "GPUCOLL_TTY"


class Console:
    """Where prefixed lines go: the launcher's stdout and stderr, one writer at a time."""

    def __init__(self, stdout: BinaryIO, stderr: BinaryIO):
        self.streams = {"stdout": stdout, "stderr": stderr}
        self.ttys = {name: _tty_path(s) for name, s in self.streams.items()}
        self.lock = threading.Lock()

    def terminal_env(self) -> dict[str, str]:
        """``GPUCOLL_TTY``: the terminal the launcher's stderr shows, where a rank may draw a
        progress line directly (its own stderr is a pipe); empty when stderr is no terminal."""
        tty = self.ttys["stderr"]
        return {TTY_ENV: tty} if tty else {}

    def write(self, stream: str, data: bytes) -> None:
        out = self.streams[stream]
        if self.ttys[stream]:
            data = ERASE_LINE + data
        with self.lock:
            try:
                out.write(data)
                out.flush()
            except (BrokenPipeError, ValueError):
                pass  # nobody reads any more (e.g. `| head`); keep draining the ranks


def _tty_path(stream: BinaryIO) -> str | None:
    try:
        fd = stream.fileno()
        return os.ttyname(fd) if os.isatty(fd) else None
    except (OSError, ValueError, AttributeError):  # no file descriptor (tests pass BytesIO)
        return None


class RankOutput:
    """Pumps one rank's stdout and stderr to the console (and its log), keeping a stderr tail."""

    def __init__(self, rank: int, console: Console, log_path: str | None = None):
        self.rank = rank
        self.prefix = f"[rank {rank}] ".encode()
        self.console = console
        self.tail: collections.deque[bytes] = collections.deque(maxlen=TAIL_LINES)
        self.log = open(log_path, "wb") if log_path else None  # closed in join()
        self.log_lock = threading.Lock()
        self.threads: list[threading.Thread] = []

    def start(self, stream: str, fd: int) -> None:
        """Drain ``fd`` (a pipe the rank writes as ``stream``) until the rank closes it."""
        t = threading.Thread(target=self._pump, args=(stream, fd),
                             name=f"gpucoll-out-{self.rank}-{stream}", daemon=True)
        t.start()
        self.threads.append(t)

    def join(self, timeout: float) -> None:
        """Wait for the pipes to reach their end (the rank and its children have exited)."""
        for t in self.threads:
            t.join(timeout)
        if self.log is not None:
            with self.log_lock:
                self.log.close()

    def last_stderr(self) -> list[str]:
        """The rank's last stderr lines as text, each cut to :data:`TAIL_WIDTH` characters."""
        lines = [line.decode(errors="replace") for line in self.tail]
        return [t if len(t) <= TAIL_WIDTH else t[:TAIL_WIDTH] + " [...]" for t in lines]

    def _pump(self, stream: str, fd: int) -> None:
        pending = b""
        try:
            while chunk := os.read(fd, 1 << 16):
                lines = (pending + chunk).split(b"\n")
                pending = lines.pop()
                while len(pending) >= MAX_LINE:
                    lines.append(pending[:MAX_LINE])
                    pending = pending[MAX_LINE:]
                for line in lines:
                    self._emit(stream, line)
        except OSError:
            pass
        finally:
            if pending:
                self._emit(stream, pending)
            os.close(fd)

    def _emit(self, stream: str, line: bytes) -> None:
        self.console.write(stream, self.prefix + line + b"\n")
        if stream == "stderr":
            self.tail.append(line)
        if self.log is not None:
            with self.log_lock:
                if not self.log.closed:
                    self.log.write(line + b"\n")
                    self.log.flush()
