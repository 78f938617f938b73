"""`gpucoll bench` run from a shell: measure the ceilings, start each library's ranks, show all.

gpucoll's and gloo's ranks are started through ``gpucoll run`` (which also sets torchrun's
environment), mpi's through ``mpirun``. Each job's rank 0 appends events to a file this process
follows, so table lines appear as they are measured. A job that writes nothing new for longer
than one collective's timeout (plus start-up) is stopped: nothing waits forever.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from gpucoll import cuda
from gpucoll.bench import ceilings, peers
from gpucoll.bench.engine import case_total
from gpucoll.bench.libraries import machine
from gpucoll.bench.memory import device_available
from gpucoll.bench.options import BenchOptions, rank_argv
from gpucoll.bench.progress import Progress
from gpucoll.bench.session import Console, replay

STARTUP_S = 60.0  # allowance for imports and rendezvous before the first event
POLL_S = 0.1


def default_ranks() -> int:
    """Every visible GPU when CuPy can use them, else 2 ranks on the host ring."""
    return cuda.runtime().device_count() or 2


def command(library: str, nranks: int, opts: BenchOptions, results: str) -> list[str]:
    """The command that starts ``nranks`` ranks of ``library``'s sweep."""
    ranks = ["-m", "gpucoll.bench", *rank_argv(opts), "--library", library,
             "--results", results]
    if library == "mpi":
        root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
        return ["mpirun", *root, "--oversubscribe", "-n", str(nranks), sys.executable, *ranks]
    return [sys.executable, "-m", "gpucoll.run", "-n", str(nranks), *ranks]


def job_env(opts: BenchOptions) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # one core per rank for every library
    if opts.transport != "auto":
        env["GPUCOLL_TRANSPORT"] = opts.transport
    return env


class Follower:
    """Reads the complete lines appended to a file since the last call."""

    def __init__(self, path: str):
        self.path, self.offset, self.partial = path, 0, ""

    def lines(self) -> list[str]:
        try:
            with open(self.path) as f:
                f.seek(self.offset)
                data = f.read()
                self.offset = f.tell()
        except FileNotFoundError:
            return []
        text = self.partial + data
        *complete, self.partial = text.split("\n")
        return [line for line in complete if line.strip()]


def run_job(library: str, nranks: int, opts: BenchOptions, console: Console) -> None:
    """Start one library's ranks, show their results live, and stop them if they stall."""
    with tempfile.TemporaryDirectory(prefix="gpucoll-bench-") as tmp:
        results = os.path.join(tmp, "events.jsonl")
        proc = subprocess.Popen(command(library, nranks, opts, results), env=job_env(opts),
                                stdout=sys.stderr, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        follower = Follower(results)
        try:
            state = _follow(proc, follower, console, opts.timeout + STARTUP_S)
        finally:  # a stall, Ctrl-C or any error here: the job (its own session) must not linger
            if proc.poll() is None:
                _stop(proc)
        code = proc.wait()
        for line in follower.lines():
            _feed(line, console, state)
    _conclude(library, nranks, code, state, console)


def _follow(proc: subprocess.Popen, follower: Follower, console: Console,
            stall_s: float) -> dict[str, Any]:
    state: dict[str, Any] = {"start": False, "finish": False, "stalled": False}
    last = time.monotonic()
    while proc.poll() is None:
        lines = follower.lines()
        for line in lines:
            _feed(line, console, state)
        console.progress.tick()
        if lines:
            last = time.monotonic()
        elif time.monotonic() - last > stall_s:
            state["stalled"] = True
            break
        time.sleep(POLL_S)
    return state


def _feed(line: str, console: Console, state: dict[str, Any]) -> None:
    state[replay(line, console)] = True


def _conclude(library: str, nranks: int, code: int, state: dict[str, Any],
              console: Console) -> None:
    why = (f"no result for {console.opts.timeout + STARTUP_S:.0f} s; stopped" if state["stalled"]
           else f"the ranks exited with status {code}")
    if not state["start"]:
        console.fail(library, nranks, why)
    elif not state["finish"]:
        console.finish(why)
    elif code != 0 and not console.runs[-1].get("error"):
        console.runs[-1]["error"] = why
        console.print(f"# error: {why}")


def _stop(proc: subprocess.Popen) -> None:
    """End the job we started: its whole process group, politely first."""
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def main(opts: BenchOptions, argv: list[str]) -> int:
    nranks = opts.ranks or default_ranks()
    console = Console(opts, argv, progress=Progress(0, opts.progress))
    device = device_available()
    console.machine(machine(), ceilings.measure(device) if opts.ceilings else [])
    for library in ("gpucoll", *opts.peers):
        reason = None if library == "gpucoll" else peers.available(library)
        if reason is not None:
            console.fail(library, nranks, reason)
            continue
        console.progress.restart(case_total(opts, nranks))
        run_job(library, nranks, opts, console)
    return console.close()
