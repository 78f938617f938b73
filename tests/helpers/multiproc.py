"""The one way tests start several ranks: ``spawn(fn, n, *args)``.

Each rank is a fresh process (forkserver) running ``fn(rank, n, *args)``. The helper returns the
ranks' results in rank order, or raises with every failing rank's traceback under a header
``### rank R of N``. It never leaves anything behind: ranks still running at the deadline are
killed, and once they exit nothing they made may remain (names and environments carry a per-call
prefix): no shared-memory segment in /dev/shm, no process (a rank's forked child included), no
Unix socket of the ranks' meshes.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import signal
import time
import traceback
import uuid
from collections.abc import Callable
from typing import Any

SHM_DIR = "/dev/shm"
_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["numpy"])


@dataclasses.dataclass
class Outcome:
    """What became of one rank: a value, an exception, or a bare exit code."""

    rank: int
    value: Any = None
    error: BaseException | None = None
    trace: str = ""
    exitcode: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.exitcode == 0


class RanksFailed(AssertionError):
    def __init__(self, outcomes: list[Outcome], reason: str):
        self.outcomes = outcomes
        parts = [reason]
        for o in outcomes:
            if not o.ok:
                what = o.trace or f"exit code {o.exitcode}"
                parts.append(f"### rank {o.rank} of {len(outcomes)}\n{what}")
        super().__init__("\n".join(parts))


def _child(fn: Callable, rank: int, n: int, args: tuple, env: dict, conn) -> None:
    os.setpgid(0, 0)  # a group of its own: whatever the rank forks can be found (and killed)
    os.environ.update(env)
    try:
        value = fn(rank, n, *args)
        conn.send(("ok", value, None, ""))
    except BaseException as exc:  # noqa: BLE001 - everything travels back to the parent
        trace = traceback.format_exc()
        try:
            conn.send(("err", None, exc, trace))
        except Exception:  # the exception itself would not pickle
            conn.send(("err", None, RuntimeError(f"{type(exc).__name__}: {exc}"), trace))
    finally:
        conn.close()


def shm_leftovers(prefix: str) -> list[str]:
    try:
        return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(prefix))
    except FileNotFoundError:
        return []


def process_leftovers(groups: set[int]) -> list[int]:
    """Processes still alive in the ranks' process groups (each rank leads its own)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) in groups:  # state, ppid, pgrp
            found.append(int(entry))
    return found


def socket_leftovers(prefix: str) -> list[str]:
    """Unix sockets whose (abstract) name starts with the spawn's prefix."""
    try:
        with open("/proc/net/unix") as f:
            lines = f.read().splitlines()[1:]
    except OSError:
        return []
    names = [line.split()[-1] for line in lines if len(line.split()) > 7]
    return sorted(name for name in names if name.lstrip("@").startswith(prefix))


def _leftovers(prefix: str, groups: set[int], grace: float = 5.0) -> str:
    """What the ranks left behind (empty if nothing); stray processes get ``grace`` seconds
    to exit on their own, then are killed."""
    deadline = time.monotonic() + grace
    while process_leftovers(groups) and time.monotonic() < deadline:
        time.sleep(0.05)
    problems = []
    procs = process_leftovers(groups)
    for pid in procs:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    if procs:
        problems.append(f"processes left running: {procs}")
    socks = socket_leftovers(prefix)
    if socks:
        problems.append(f"sockets left open: {socks}")
    shm = shm_leftovers(prefix)
    for name in shm:
        os.unlink(os.path.join(SHM_DIR, name))
    if shm:
        problems.append(f"shared memory left behind by the ranks: {shm}")
    return "; ".join(problems)


def spawn(
    fn: Callable,
    n: int,
    *args: Any,
    timeout: float = 60.0,
    check: bool = True,
    env: dict[str, str] | None = None,
    kill: dict[int, float] | None = None,
) -> list:
    """Run ``fn(rank, n, *args)`` in ``n`` processes; return values (or Outcomes if not check).

    ``kill={rank: seconds}`` SIGKILLs that rank after the delay, for failure tests. ``fn`` must
    be importable (a module-level function) and its result picklable.
    """
    prefix = f"gpucoll-t{uuid.uuid4().hex[:10]}"
    child_env = {"GPUCOLL_SHM_PREFIX": prefix, **(env or {})}
    procs, pipes = [], []
    for rank in range(n):
        parent_end, child_end = _CTX.Pipe(duplex=False)
        p = _CTX.Process(target=_child, args=(fn, rank, n, args, child_env, child_end))
        p.start()
        child_end.close()
        procs.append(p)
        pipes.append(parent_end)
    try:
        outcomes = _collect(procs, pipes, timeout, kill or {})
    finally:
        _reap(procs)
    leftovers = _leftovers(prefix, {p.pid for p in procs})
    if leftovers:
        raise AssertionError(leftovers)
    if not check:
        return outcomes
    failed = [o for o in outcomes if not o.ok]
    if failed:
        raise RanksFailed(outcomes, f"{len(failed)} of {n} ranks failed")
    return [o.value for o in outcomes]


def _collect(procs, pipes, timeout: float, kill: dict[int, float]) -> list[Outcome]:
    start = time.monotonic()
    outcomes = [Outcome(rank) for rank in range(len(procs))]
    pending = set(range(len(procs)))
    killed: set[int] = set()
    while pending:
        now = time.monotonic() - start
        for rank, delay in kill.items():
            if rank not in killed and now >= delay:
                os.kill(procs[rank].pid, signal.SIGKILL)
                killed.add(rank)
        if now > timeout:
            for rank in pending:
                outcomes[rank].trace = f"still running after the {timeout:.0f} s deadline"
                outcomes[rank].exitcode = -9
            raise RanksFailed(outcomes, f"ranks {sorted(pending)} did not finish in {timeout} s")
        ready = mp.connection.wait([pipes[r] for r in pending] +
                                   [procs[r].sentinel for r in pending], timeout=0.05)
        for rank in list(pending):
            if pipes[rank] in ready:
                _read(pipes[rank], outcomes[rank])
            if pipes[rank] in ready or procs[rank].sentinel in ready:
                procs[rank].join(timeout=10)
                if procs[rank].exitcode is None:  # sent a result but hangs on exit
                    procs[rank].kill()
                    procs[rank].join()
                outcomes[rank].exitcode = procs[rank].exitcode
                pending.discard(rank)
    return outcomes


def _read(pipe, outcome: Outcome) -> None:
    try:
        status, value, error, trace = pipe.recv()
    except (EOFError, OSError):
        return
    outcome.value, outcome.error, outcome.trace = value, error, trace


def _reap(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=10)
