"""Running ``python -m gpucoll run`` as a subprocess in tests, with deadlines and cleanup."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator

import pytest


def write_script(directory, body: str, name: str = "job.py") -> str:
    """A rank script made from ``body`` (dedented) in ``directory``; returns its path."""
    path = os.path.join(str(directory), name)
    with open(path, "w") as f:
        f.write(textwrap.dedent(body))
    return path


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


class Launcher:
    """A launcher started in its own session; its stdout lines are collected as they come."""

    def __init__(self, args: list[str], cwd, env: dict[str, str] | None = None):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpucoll", "run", *args], cwd=str(cwd),
            # the launcher's own files (flight-recorder dumps) go under the test's directory
            env={**os.environ, "TMPDIR": str(cwd), **(env or {})}, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True)
        self.lines = {"stdout": queue.SimpleQueue(), "stderr": queue.SimpleQueue()}
        self.stdout: list[bytes] = []
        self.stderr: list[bytes] = []
        self._threads = [
            threading.Thread(target=self._drain, args=(self.proc.stdout, self.stdout, "stdout"),
                             daemon=True),
            threading.Thread(target=self._drain, args=(self.proc.stderr, self.stderr, "stderr"),
                             daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _drain(self, pipe, sink: list[bytes], stream: str) -> None:
        for line in pipe:
            sink.append(line)
            self.lines[stream].put(line)

    def wait_for_lines(self, pattern: str, count: int, timeout: float = 60.0,
                       stream: str = "stdout") -> list[str]:
        """Block until ``count`` lines of ``stream`` match ``pattern``; fail at the deadline."""
        found: list[str] = []
        deadline = time.monotonic() + timeout
        while len(found) < count:
            left = deadline - time.monotonic()
            try:
                line = self.lines[stream].get(timeout=max(0.0, left))
            except queue.Empty:
                pytest.fail(f"only {len(found)} of {count} lines matching {pattern!r} "
                            f"within {timeout} s; output:\n{self.text()}")
            text = line.decode(errors="replace").rstrip("\n")
            if re.search(pattern, text):
                found.append(text)
        return found

    def send(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def finish(self, timeout: float = 60.0) -> int:
        """The launcher's exit code; the test fails (and everything is killed) at the deadline."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"launcher still running after {timeout} s; output:\n{self.text()}")
        for t in self._threads:
            t.join(10)
        return code

    def kill(self) -> None:
        # Ranks die with the launcher (they are set to receive SIGKILL when it dies).
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)

    def out(self) -> str:
        return b"".join(self.stdout).decode(errors="replace")

    def err(self) -> str:
        return b"".join(self.stderr).decode(errors="replace")

    def text(self) -> str:
        return f"--- stdout\n{self.out()}--- stderr\n{self.err()}"


@contextlib.contextmanager
def launching(cwd) -> Iterator[Callable[..., Launcher]]:
    """Yield ``start(args, env=None) -> Launcher`` (run in ``cwd``); every launcher is gone after.

    A test file's fixture wraps this: ``with launching(tmp_path) as start: yield start``.
    """
    started: list[Launcher] = []

    def start(args: list[str], env: dict[str, str] | None = None) -> Launcher:
        launcher = Launcher(args, cwd, env)
        started.append(launcher)
        return launcher

    try:
        yield start
    finally:
        for launcher in started:
            if launcher.proc.poll() is None:
                launcher.kill()
