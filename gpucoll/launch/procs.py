"""One rank's process: started in its own process group, signalled as a group, reaped by a thread.

A process group per rank lets the launcher signal a rank together with anything it started, and
keeps the terminal's Ctrl-C away from the ranks (the launcher decides what they receive). On Linux
a rank is also killed if the launcher itself dies, so nothing outlives the job.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import os
import queue
import signal
import subprocess
import sys
import threading
import time

from gpucoll.launch.output import RankOutput

_PR_SET_PDEATHSIG = 1


def _die_with_parent_hook():
    """A preexec function making the child receive SIGKILL when the launcher dies (Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    # Resolved now, before any fork: the child only makes the call.
    return lambda: prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


_DIE_WITH_PARENT = _die_with_parent_hook()


def _preexec(cpus: frozenset[int] | None):
    """The child's set-up before it runs the rank: die with the launcher, and keep to ``cpus``
    (set before exec, so every thread the rank ever starts inherits it)."""
    if not cpus:
        return _DIE_WITH_PARENT
    die = _DIE_WITH_PARENT or (lambda: None)

    def setup() -> None:
        die()
        os.sched_setaffinity(0, cpus)

    return setup


@dataclasses.dataclass(frozen=True)
class Exit:
    """A rank that ended: its return code as Popen reports it (negative: killed by a signal)."""

    rank: int
    returncode: int
    time: float


class RankProcess:
    """A running rank with its output pumps; exits are posted to a queue shared by the job."""

    def __init__(self, rank: int, local_rank: int, output: RankOutput):
        self.rank = rank
        self.local_rank = local_rank
        self.output = output
        self.proc: subprocess.Popen | None = None
        self.started = 0.0

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def start(self, argv: list[str], env: dict[str, str], exits: queue.Queue,
              cpus: frozenset[int] | None = None) -> None:
        """Start the rank (pinned to ``cpus`` when given); its exit is put on ``exits`` as an
        :class:`Exit`."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            self.proc = subprocess.Popen(
                argv, env=env, stdin=subprocess.DEVNULL, stdout=out_w, stderr=err_w,
                start_new_session=True, preexec_fn=_preexec(cpus))
        except BaseException:
            for fd in (out_r, err_r):
                os.close(fd)
            raise
        finally:
            os.close(out_w)
            os.close(err_w)
        self.started = time.monotonic()
        self.output.start("stdout", out_r)
        self.output.start("stderr", err_r)
        threading.Thread(target=self._wait, args=(exits,), daemon=True,
                         name=f"gpucoll-wait-{self.rank}").start()

    def _wait(self, exits: queue.Queue) -> None:
        code = self.proc.wait()
        exits.put(Exit(self.rank, code, time.monotonic()))

    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the rank's whole process group (a no-op once it is gone)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
