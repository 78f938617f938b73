"""``Communicator.shrink()``: the survivors of a lost rank make a group of their own, renumbered
in order, and agree on who is left even when another rank dies during the shrink.

Every case runs real ranks (the spawn helper) on the host ring, on both transports where the
transport matters, and checks the new group by using it.
"""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
from multiproc import spawn

import gpucoll
from gpucoll.errors import PeerFailure

pytestmark = pytest.mark.timeout(180)

LONG = 60.0
SLOT = "gpucoll/jobs/anonymous/0"  # the first group's namespace in a test's fresh store


def _side(addr: str):
    from gpucoll.store import TCPStore, parse_address

    host, port = parse_address(addr)
    return TCPStore(host, port, timeout=LONG)


def _open(rank: int, n: int, addr: str):
    return gpucoll.init("ring", rank=rank, world_size=n, store=addr, timeout=LONG)


def _lose(comm, victim: int, addr: str) -> None:
    """One all_reduce everyone finishes; then ``victim`` dies and the others' next call fails.
    The victim dies only once every rank has said its all_reduce is done: a rank that dies
    right after its own call can make a slower peer's same call fail."""
    x = np.ones(4)
    comm.all_reduce(x)
    side = _side(addr)
    key = f"test/lost/{comm.size}-{victim}"
    if comm.rank == victim:
        side.wait([f"{key}/{r}" for r in range(comm.size) if r != victim], timeout=LONG)
        os.kill(os.getpid(), signal.SIGKILL)
    side.set(f"{key}/{comm.rank}", "1")
    with pytest.raises(PeerFailure):
        comm.all_reduce(x)


def _check_group(comm, old_rank: int) -> dict:
    """What the new group says of itself: its members' old ranks (all_gather) and a sum."""
    olds = comm.all_gather(np.array([old_rank]))
    total = np.array([float(comm.rank)])
    comm.all_reduce(total)
    return {"rank": comm.rank, "size": comm.size, "olds": olds.ravel().tolist(),
            "sum": float(total[0])}


# -- one lost rank -----------------------------------------------------------------------------

def _middle_rank_dies(rank, n, addr):
    comm = _open(rank, n, addr)
    _lose(comm, 1, addr)
    new = comm.shrink()
    try:
        return _check_group(new, rank)
    finally:
        new.close()
        comm.close()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_the_survivors_form_a_group_renumbered_in_order(store_addr, transport):
    outcomes = spawn(_middle_rank_dies, 4, store_addr, check=False,
                     env={"GPUCOLL_TRANSPORT": transport})
    assert outcomes[1].exitcode == -signal.SIGKILL
    survivors = [outcomes[r].value for r in (0, 2, 3)]
    assert survivors == [{"rank": i, "size": 3, "olds": [0, 2, 3], "sum": 3.0}
                         for i in range(3)], outcomes


# -- a second death during the shrink ----------------------------------------------------------

def _second_death(rank, n, addr, when):
    """Rank 3 dies; then rank 2 dies too: ``before`` the survivors agree (it never calls
    shrink), or ``after`` (it took part in their agreement, and dies before the group forms)."""
    from gpucoll.store.gather import agree_survivors

    comm = _open(rank, n, addr)
    _lose(comm, 3, addr)
    if rank == 2 and when == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 2 and when == "after":  # shrink's first step, as comm.shrink() takes it
        agree_survivors(comm._store, rank, n, comm._liveness, LONG, attempt="shrink/0/0")
        os.kill(os.getpid(), signal.SIGKILL)
    new = comm.shrink()
    try:
        return _check_group(new, rank)
    finally:
        new.close()
        comm.close()


@pytest.mark.parametrize("when", ["before", "after"])
def test_survivors_agree_on_who_is_left_when_a_second_rank_dies_during_the_shrink(
        store_addr, store_server, when):
    outcomes = spawn(_second_death, 4, store_addr, when, check=False)
    assert [o.exitcode for o in outcomes[2:]] == [-signal.SIGKILL] * 2
    assert [o.value for o in outcomes[:2]] == [
        {"rank": r, "size": 2, "olds": [0, 1], "sum": 1.0} for r in range(2)], outcomes
    agreed = [store_server.get(f"{SLOT}/shrink/0/{a}/members", timeout=1).decode()
              for a in ((0,) if when == "before" else (0, 1))]
    assert agreed == (["[0, 1]"] if when == "before" else ["[0, 1, 2]", "[0, 1]"])


# -- a rank too late -----------------------------------------------------------------------------

def _comes_late(rank, n, addr):
    """Rank 2 is alive but waits until the others have shrunk without it (their shrink has a
    short deadline); then it calls shrink and learns it was left out."""
    side = _side(addr)
    comm = _open(rank, n, addr)
    _lose(comm, 3, addr)
    if rank == 2:
        side.wait(["shrunk/0", "shrunk/1"], timeout=LONG)
        try:
            comm.shrink()
        except PeerFailure as exc:
            return str(exc)
        finally:
            comm.close()
    new = comm.shrink(timeout=2.0)
    side.set(f"shrunk/{rank}", "1")
    try:
        return _check_group(new, rank)
    finally:
        new.close()
        comm.close()


def test_a_survivor_that_comes_after_the_deadline_is_told_it_was_left_out(store_addr):
    outcomes = spawn(_comes_late, 4, store_addr, check=False)
    assert [o.value for o in outcomes[:2]] == [
        {"rank": r, "size": 2, "olds": [0, 1], "sum": 1.0} for r in range(2)], outcomes
    assert outcomes[2].value is not None, (outcomes[2].trace, outcomes[2].exitcode)
    assert "the surviving ranks [0, 1] agreed on their group before this rank arrived" \
        in outcomes[2].value, outcomes[2].trace


# -- shrinking again, and what is left in the store ----------------------------------------------

def _twice(rank, n, addr):
    first = _open(rank, n, addr)
    _lose(first, 3, addr)
    second = first.shrink()
    _lose(second, 2, addr)  # old rank 2
    third = second.shrink()
    try:
        return _check_group(third, rank)
    finally:
        for comm in (third, second, first):
            comm.close()


def test_a_shrunk_group_can_lose_a_rank_and_shrink_again(store_addr):
    outcomes = spawn(_twice, 4, store_addr, check=False)
    assert [o.value for o in outcomes[:2]] == [
        {"rank": r, "size": 2, "olds": [0, 1], "sum": 1.0} for r in range(2)], outcomes


def _one_closes_early(rank, n, addr):
    """Rank 2 closes its communicator (no death); the others shrink past it, close the old
    group first and the shrunk one last."""
    side = _side(addr)
    comm = _open(rank, n, addr)
    comm.all_reduce(np.ones(2))
    if rank == 2:
        comm.close()
        side.set("closed", "1")
        return None
    side.wait(["closed"], timeout=LONG)
    with pytest.raises(PeerFailure, match="rank 2"):
        comm.all_reduce(np.ones(2))
    new = comm.shrink()
    comm.close()  # its place in the store stays while the shrunk group lives in it
    result = _check_group(new, rank)
    new.close()
    return result


def test_groups_shrunk_past_a_rank_that_closed_leave_no_keys(store_addr, store_server):
    outcomes = spawn(_one_closes_early, 3, store_addr)
    assert outcomes[:2] == [{"rank": r, "size": 2, "olds": [0, 1], "sum": 1.0}
                            for r in range(2)]
    store_server.delete_key("closed")  # the test's own
    assert store_server.num_keys() == 0


def _nobody_lost(rank, n, addr):
    with _open(rank, n, addr) as comm:
        comm.all_reduce(np.ones(2))
        with comm.shrink() as new:
            return _check_group(new, rank)


def test_shrinking_a_whole_group_keeps_every_rank(store_addr):
    assert spawn(_nobody_lost, 3, store_addr) == [
        {"rank": r, "size": 3, "olds": [0, 1, 2], "sum": 3.0} for r in range(3)]


# -- the NCCL backend (on the emulation of NCCL the NCCL tests use) ------------------------------

def _nccl_rank_dies(rank, n, addr):
    """Rank 2 dies; once its will says so, the others shrink, and the new group, a new NCCL
    communicator (CuPy's binding has no ncclCommShrink), computes on device arrays."""
    from nccl_emulation import EmulatedRuntime, FakeDeviceArray

    from gpucoll import cuda
    from gpucoll.default import create

    rt = EmulatedRuntime(addr)
    cuda.set_runtime(rt)
    comm = create("nccl", rank=rank, world_size=n, store=addr, timeout=LONG)
    try:
        x = FakeDeviceArray(np.ones(4, np.float32), rt)
        comm.all_reduce(x)
        rt.synchronize()
        if rank == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        _side(addr).wait([f"{SLOT}/gone/2"], timeout=LONG)
        new = comm.shrink()
        y = FakeDeviceArray(np.full(4, rank + 1, np.float32), rt)
        new.all_reduce(y)
        rt.synchronize()
        result = (new.backend, new.rank, new.size, y.get().tolist())
        new.close()
        return result
    finally:
        comm.close()
        rt.close()
        cuda.set_runtime(None)


def test_nccl_survivors_without_ncclcommshrink_start_a_new_communicator(store_addr):
    outcomes = spawn(_nccl_rank_dies, 3, store_addr, check=False)
    assert outcomes[2].exitcode == -signal.SIGKILL
    assert [o.value for o in outcomes[:2]] == [("nccl", r, 2, [3.0] * 4) for r in range(2)], \
        outcomes


class _ShrinkableComm:
    """An NCCL communicator whose binding has ncclCommShrink (as nccl4py's does): it records
    the call and returns the new communicator."""

    def __init__(self, calls: list):
        self.calls = calls

    def shrink(self, excluded, *rest):
        self.calls.append(("shrink", list(excluded), rest))
        return _ShrinkableComm(self.calls)

    def check_async_error(self):
        pass

    def abort(self):
        self.calls.append(("abort",))

    def destroy(self):
        self.calls.append(("destroy",))


def _nccl_native_shrink(rank, n, addr, dead):
    from nccl_emulation import EmulatedRuntime

    from gpucoll import cuda
    from gpucoll.backends.nccl import NcclBackend
    from gpucoll.store import PrefixStore

    rt = EmulatedRuntime(addr)
    cuda.set_runtime(rt)
    calls: list = []
    try:
        store = _side(addr)
        old = NcclBackend(PrefixStore("old", store), rank, n, timeout=LONG,
                          _comm=_ShrinkableComm(calls))
        members = [r for r in range(n) if r != dead]
        new = old.shrink(PrefixStore("new", store), members, timeout=LONG)
        shape = (new.rank, new.size)
        new.close()
        old.close()
        return shape, calls
    finally:
        rt.close()
        cuda.set_runtime(None)


def test_nccl_survivors_whose_binding_can_shrink_call_ncclcommshrink(store_addr):
    """Ranks 0 and 2 of 3 survive rank 1 with communicators still usable: they exclude it with
    ncclCommShrink rather than start a new communicator."""
    outcomes = spawn(_nccl_native_shrink, 3, store_addr, 1, check=False)
    for r, new_rank in ((0, 0), (2, 1)):
        shape, calls = outcomes[r].value
        assert shape == (new_rank, 2)
        assert calls[0] == ("shrink", [1], ())
