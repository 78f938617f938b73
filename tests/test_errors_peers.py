"""Errors that involve other ranks: GPUCOLL_DEBUG=1 catches ranks making different calls, a
killed rank is named by every survivor, a rank that never arrives times the call out."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import numpy as np
import pytest
from multiproc import spawn

import gpucoll
from gpucoll.backends import topology_order
from gpucoll.errors import CollectiveMismatch, CollectiveTimeout, PeerFailure

DEBUG = {"GPUCOLL_DEBUG": "1"}


def _mismatch(rank: int, n: int, addr: str, case: str) -> list:
    """Rank 1 makes a different call than the others; then everyone makes the same one."""
    with gpucoll.init("ring", rank=rank, world_size=n, store=addr, timeout=30) as comm:
        x = np.ones(4, dtype=np.float32)
        odd = rank == 1
        calls = {
            "op": lambda: comm.broadcast(x) if odd else comm.all_reduce(x),
            "dtype": lambda: comm.all_reduce(x.astype(np.float64) if odd else x),
            "shape": lambda: comm.all_gather(np.ones(5 if odd else 4)),
            "root": lambda: comm.broadcast(x, root=1 if odd else 0),
            "reduce_op": lambda: comm.all_reduce(x, op="max" if odd else "sum"),
        }
        try:
            calls[case]()
            message = None
        except CollectiveMismatch as exc:
            message = str(exc)
        after = comm.all_reduce(np.ones(1))  # the group is still in step
    return [message, float(after[0])]


@pytest.mark.parametrize("case, detail", [
    ("op", r"ranks 0, 2 called all_reduce\(float32\[4\], op=sum\); rank 1 called "
           r"broadcast\(float32\[4\], root=0\)"),
    ("dtype", r"rank 1 called all_reduce\(float64\[4\], op=sum\)"),
    ("shape", r"rank 1 called all_gather\(float64\[5\], tiled=False\)"),
    ("root", r"rank 1 called broadcast\(float32\[4\], root=1\)"),
    ("reduce_op", r"rank 1 called all_reduce\(float32\[4\], op=max\)"),
])
def test_debug_mode_names_the_ranks_that_disagree_and_their_calls(case, detail, store_addr):
    results = spawn(_mismatch, 3, store_addr, case, timeout=60, env=DEBUG)
    for rank, (message, after) in enumerate(results):
        assert message is not None, f"rank {rank} did not raise"
        assert f"on rank {rank} of 3" in message and "collective #0" in message
        assert "(rank 1 disagrees with rank 0)" in message
        assert re.search(detail, message), message
        assert after == 3.0


def _matching_calls_in_debug_mode(rank: int, n: int, addr: str) -> list:
    with gpucoll.init("ring", rank=rank, world_size=n, store=addr, timeout=30) as comm:
        out = [float(comm.all_reduce(np.array([1.0]))[0]) for _ in range(5)]
        if rank == 0:
            comm.scatter(np.arange(n, dtype=np.int16).reshape(n, 1), root=0)
        else:
            comm.scatter(None, root=0)
        comm.send(np.ones(3), (rank + 1) % n, async_op=True)
        comm.recv(np.empty(3), (rank - 1) % n)
        sub = comm.split(rank % 2)
        out.append(float(sub.all_reduce(np.array([1.0]))[0]))
        comm.barrier()
    return out


def test_debug_mode_passes_matching_calls(store_addr):
    assert spawn(_matching_calls_in_debug_mode, 3, store_addr, timeout=60, env=DEBUG) == \
        [[3.0] * 5 + [2.0], [3.0] * 5 + [1.0], [3.0] * 5 + [2.0]]


def _p2p_mismatch(rank: int, n: int, addr: str) -> str | None:
    with gpucoll.init("ring", rank=rank, world_size=n, store=addr, timeout=30) as comm:
        try:
            if rank == 0:
                comm.send(np.ones(4, np.float32), 1)
            else:
                comm.recv(np.ones(5, np.float32), 0)
        except CollectiveMismatch as exc:
            return str(exc)
    return None


def test_debug_mode_catches_send_and_recv_of_different_sizes(store_addr):
    messages = spawn(_p2p_mismatch, 2, store_addr, timeout=60, env=DEBUG)
    for message in messages:
        assert message and "message #0 from rank 0 to rank 1 does not match" in message
        assert "rank 0 called send(float32[4], peer=1) with 4 elements" in message
        assert "rank 1 called recv(float32[5], peer=0) with 5 elements" in message


def _debug_missing_rank(rank: int, n: int, addr: str) -> str | None:
    with gpucoll.init("ring", rank=rank, world_size=n, store=addr, timeout=30) as comm:
        if rank == 1:
            time.sleep(2.0)  # never makes the call (while it stays, else its leaving is named)
            return None
        try:
            comm.all_reduce(np.ones(2), timeout=1.0)
        except CollectiveTimeout as exc:
            return str(exc)
    return "no error"


def test_debug_mode_names_a_rank_that_never_calls(store_addr):
    message = spawn(_debug_missing_rank, 2, store_addr, timeout=60, env=DEBUG)[0]
    assert message and "rank 1 did not make call all_reduce" in message


def _sockets() -> int:
    fds = os.listdir("/proc/self/fd")
    return sum(os.readlink(f"/proc/self/fd/{fd}").startswith("socket:") for fd in fds
               if os.path.exists(f"/proc/self/fd/{fd}"))


def _lose_a_rank(rank: int, n: int, addr: str) -> list:
    # what the ring's set-up may load for the first time (CUDA, for the topology) keeps its own
    # sockets for the life of the process on a GPU machine: load it before counting
    topology_order(n)
    sockets = _sockets()
    comm = gpucoll.init("ring", rank=rank, world_size=n, store=addr, timeout=30)
    x = np.ones(1 << 20, dtype=np.float32)
    try:
        for i in range(100000):
            if rank == n - 1 and i == 3:
                # die from another thread while this one is inside a collective
                threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGKILL)).start()
            comm.all_reduce(x)
            x[:] = 1
        return ["finished"]
    except PeerFailure as exc:
        return [type(exc).__name__, exc.peer, str(exc)]
    finally:
        comm.close()
        leftover = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
        assert leftover == [], leftover
        assert _sockets() == sockets, "sockets left open after close()"


def test_a_killed_rank_is_named_by_every_survivor(store_addr):
    outcomes = spawn(_lose_a_rank, 3, store_addr, timeout=60, check=False)
    assert outcomes[2].exitcode == -signal.SIGKILL
    for survivor in outcomes[:2]:
        assert survivor.ok, survivor.trace
        kind, peer, message = survivor.value
        assert kind == "PeerFailure" and peer == 2 and "2" in message


def _skip_a_call(rank: int, n: int, addr: str) -> str | None:
    from gpucoll.store import TCPStore, parse_address

    with TCPStore(*parse_address(addr), timeout=30) as store, \
            gpucoll.init("ring", rank=rank, world_size=n, store=addr, timeout=30) as comm:
        if rank == 1:  # makes no call until rank 0 is done
            store.get("rank 0 is done", timeout=30)
            return None
        try:
            comm.all_reduce(np.ones(2), timeout=0.5)
            return "no error"
        except CollectiveTimeout as exc:
            return type(exc).__name__
        finally:
            store.set("rank 0 is done", b"1")


def test_a_call_nobody_joins_times_out(store_addr):
    outcomes = spawn(_skip_a_call, 2, store_addr, timeout=60, check=False)
    assert outcomes[0].value == "CollectiveTimeout", outcomes[0].trace
