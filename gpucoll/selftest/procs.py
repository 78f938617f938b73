"""Running one self-check's ranks: fresh processes (spawned, so no CUDA state is inherited),
a store of their own on a free port, a deadline, and nothing left running afterwards."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from typing import Any

from gpucoll.store import TCPStore

_CTX = mp.get_context("spawn")


@dataclasses.dataclass
class Outcome:
    """What one rank returned (``value``), or why it did not (``error``; ``exitcode``)."""

    rank: int
    value: Any = None
    error: str = ""
    exitcode: int | None = None

    @property
    def ok(self) -> bool:
        return not self.error and self.exitcode == 0


def _rank(fn: Callable, rank: int, n: int, addr: str, args: tuple, env: dict[str, str],
          setup: Callable | None, conn: Any) -> None:
    os.environ.update(env)
    try:
        if setup is not None:
            arrays = setup(addr)
        else:
            from gpucoll.selftest.checks import CupyArrays

            arrays = CupyArrays()
        conn.send((fn(rank, n, addr, arrays, *args), ""))
    except BaseException as exc:  # noqa: BLE001 - reported in the parent
        conn.send((None, f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()


def run_ranks(fn: Callable, n: int, *args: Any, timeout: float, env: dict[str, str] | None = None,
              setup: Callable | None = None) -> list[Outcome]:
    """``fn(rank, n, store_address, arrays, *args)`` in ``n`` processes; ranks still running
    at the deadline are killed and reported so."""
    server = TCPStore("127.0.0.1", 0, is_server=True, timeout=timeout)
    addr = f"tcp://127.0.0.1:{server.port}"
    procs, pipes = [], []
    try:
        for rank in range(n):
            parent, child = _CTX.Pipe(duplex=False)
            p = _CTX.Process(target=_rank, args=(fn, rank, n, addr, args, env or {}, setup,
                                                 child), daemon=True)
            p.start()
            child.close()
            procs.append(p)
            pipes.append(parent)
        return _collect(procs, pipes, time.monotonic() + timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
        server.close()


def _collect(procs: list, pipes: list, deadline: float) -> list[Outcome]:
    outcomes = [Outcome(rank) for rank in range(len(procs))]
    pending = set(range(len(procs)))
    while pending and time.monotonic() < deadline:
        ready = mp.connection.wait([pipes[r] for r in pending] + [procs[r].sentinel
                                                                  for r in pending], 0.1)
        for r in list(pending):
            if pipes[r] in ready:
                try:
                    outcomes[r].value, outcomes[r].error = pipes[r].recv()
                except EOFError:
                    pass
            if pipes[r] in ready or procs[r].sentinel in ready:
                procs[r].join(10)
                outcomes[r].exitcode = procs[r].exitcode
                pending.discard(r)
    for r in pending:
        outcomes[r].error = "still running at the deadline (killed)"
    return outcomes
