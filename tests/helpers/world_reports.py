"""Tables of cases run once per world: one spawn per (world size, transport) runs a whole table
on every rank, each rank returns a report ``{case: (kind, error)}`` (an empty error: the case
passed), and the tests read the reports, one kind of case per test (``test_collectives``,
``test_training_calls``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from multiproc import spawn
from tiers import grid

from gpucoll.store import TCPStore

# (world size, transport); the fast tier keeps one rank and two ranks over shared memory
WORLDS = grid([(1, "auto"), (2, "tcp"), (2, "shm"), (3, "tcp"), (3, "shm"), (4, "tcp"),
               (4, "shm")], [(1, "auto"), (2, "shm")])


def world_id(world: tuple[int, str]) -> str:
    return f"{world[0]}ranks-{world[1]}"


@functools.cache
def table_reports(fn: Callable, size: int, transport: str, timeout: float) -> list[dict]:
    """Every rank's report from ``fn(rank, size, store_address)`` on ``size`` ranks over
    ``transport``; run once per test process, then read by every test of that world."""
    server = TCPStore("127.0.0.1", 0, is_server=True, timeout=60)
    try:
        return spawn(fn, size, f"tcp://127.0.0.1:{server.port}", timeout=timeout,
                     env={"GPUCOLL_TRANSPORT": transport})
    finally:
        server.close()


def assert_passed(reports: list[dict], kind: str, most: int = 40) -> None:
    """Every case of ``kind`` passed on every rank; else an AssertionError listing the first
    ``most`` failures as ``rank R: case: error``."""
    failures = [f"rank {rank}: {case}: {error}" for rank, report in enumerate(reports)
                for case, (k, error) in report.items() if k == kind and error]
    assert not failures, "\n".join(failures[:most])
