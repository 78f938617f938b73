"""``Communicator.shrink()``: the survivors of a lost rank make a group of their own, renumbered
in order, and agree on who is left even when another rank dies during the shrink.

Every case runs real ranks (the spawn helper) on the host ring, on both transports where the
transport matters, and on the NCCL backend over the emulation of nccl4py, and checks the new
group by using it.
"""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
from multiproc import spawn
from tiers import grid

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


@pytest.mark.parametrize("transport", grid(["shm", "tcp"], "shm"))
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
    from gpucoll.store import agree_survivors

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


# -- the NCCL backend (on the emulation of nccl4py the NCCL tests use) --------------------------

def _nccl_rank(rank, n, addr, victims, how, kill_after_vote):
    """Ranks ``victims`` die (SIGKILL) after a first all_reduce; the others' next call fails,
    they shrink, and the new group computes on device arrays. Returns what the survivor saw:
    its new place, the sum, how each communicator of its shrunk group was made (nccl4py's
    ``Communicator.init`` or ``shrink``), whether the old one was revoked, and its aborts.

    ``how``: "native" (nccl4py with revoke and shrink), "no-shrink" (a binding without them),
    "one-aborted" (rank 0's old communicator aborted, the others' revoked).
    ``kill_after_vote``: a rank that dies in the shrink itself, once it has voted on how."""
    from nccl_emulation import EmulatedRuntime, FakeDeviceArray, without_shrink

    from gpucoll import cuda
    from gpucoll.backends.nccl import backend as nccl_backend
    from gpucoll.default import create

    rt = EmulatedRuntime(addr)
    if how == "no-shrink":
        without_shrink(rt)
    cuda.set_runtime(rt)
    comm = create("nccl", rank=rank, world_size=n, store=addr, timeout=LONG)
    new = None
    try:
        x = FakeDeviceArray(np.ones(4, np.float32), rt)
        comm.all_reduce(x)
        rt.synchronize()
        side = _side(addr)
        side.set(f"test/done/{rank}", "1")
        if rank in victims:
            side.wait([f"test/done/{r}" for r in range(n)], timeout=LONG)
            os.kill(os.getpid(), signal.SIGKILL)
        with pytest.raises(PeerFailure):
            comm.all_reduce(x, async_op=True).synchronize()
        old = comm._backend._nc
        if how == "one-aborted" and rank == 0:
            old.fail(old.failure, free=True)
        if rank == kill_after_vote:
            share = nccl_backend.share

            def vote_then_die(*args, **kwargs):
                votes = share(*args, **kwargs)
                os.kill(os.getpid(), signal.SIGKILL)
                return votes

            nccl_backend.share = vote_then_die
        new = comm.shrink()
        y = FakeDeviceArray(np.full(4, float(rank + 1), np.float32), rt)
        new.all_reduce(y)
        rt.synchronize()
        made = [new._backend._nc.comm.made_by]
        assert rt.misuse == [], rt.misuse
        return {"rank": new.rank, "size": new.size, "sum": y.get().tolist(), "made": made,
                "revoked": old.comm.revoked}
    finally:
        if new is not None:
            new.close()
        comm.close()
        rt.close()
        cuda.set_runtime(None)


def _sum(olds):
    return [float(sum(r + 1 for r in olds))] * 4


def test_nccl_survivors_shrink_their_revoked_communicator_with_ncclcommshrink(store_addr):
    """Rank 1 of 3 dies: each survivor's failed communicator was revoked (not aborted), and
    the survivors exclude rank 1 from it with ncclCommShrink."""
    outcomes = spawn(_nccl_rank, 3, store_addr, (1,), "native", None, check=False)
    assert outcomes[1].exitcode == -signal.SIGKILL
    assert [o.value for o in (outcomes[0], outcomes[2])] == [
        {"rank": i, "size": 2, "sum": _sum([0, 2]), "made": ["shrink"], "revoked": True}
        for i in range(2)], outcomes


def test_nccl_survivors_without_revoke_or_shrink_start_a_new_communicator(store_addr):
    outcomes = spawn(_nccl_rank, 3, store_addr, (2,), "no-shrink", None, check=False)
    assert [o.value for o in outcomes[:2]] == [
        {"rank": i, "size": 2, "sum": _sum([0, 1]), "made": ["init"], "revoked": False}
        for i in range(2)], outcomes


def test_nccl_survivors_all_start_a_new_communicator_when_one_of_them_cannot_shrink(
        store_addr):
    """Rank 0's old communicator is aborted (it cannot shrink), the others' are revoked (they
    could): they vote, and every survivor takes the same way, a new communicator."""
    outcomes = spawn(_nccl_rank, 4, store_addr, (3,), "one-aborted", None, check=False)
    assert [o.value["made"] for o in outcomes[:3]] == [["init"]] * 3, outcomes
    assert [o.value["sum"] for o in outcomes[:3]] == [_sum([0, 1, 2])] * 3


def test_nccl_survivors_agree_again_when_a_member_dies_inside_ncclcommshrink(store_addr):
    """Rank 3 dies; rank 2 votes for ncclCommShrink with the others, then dies before it
    shrinks: the others' shrink fails alike, they agree again without rank 2, and (their old
    communicators now aborted) start a new one."""
    outcomes = spawn(_nccl_rank, 4, store_addr, (3,), "native", 2, check=False)
    assert [o.exitcode for o in outcomes[2:]] == [-signal.SIGKILL] * 2, outcomes
    assert [o.value for o in outcomes[:2]] == [
        {"rank": i, "size": 2, "sum": _sum([0, 1]), "made": ["init"], "revoked": True}
        for i in range(2)], outcomes


def _nccl_nobody_lost(rank, n, addr):
    from nccl_emulation import FakeDeviceArray
    from nccl_ranks import emulated

    with emulated(addr, rank, n, timeout=LONG) as (rt, comm):
        comm.all_reduce(FakeDeviceArray(np.ones(2, np.float32), rt))
        with comm.shrink() as new:
            y = FakeDeviceArray(np.full(2, float(rank + 1), np.float32), rt)
            new.all_reduce(y)
            rt.synchronize()
            return new.rank, new.size, y.get().tolist(), new._backend._nc.comm.made_by


def test_nccl_shrinking_a_healthy_group_keeps_every_rank_through_ncclcommshrink(store_addr):
    """No failure: the earlier work is drained first (NCCL_SHRINK_DEFAULT needs nothing in
    flight), the emulation sees no misuse."""
    assert spawn(_nccl_nobody_lost, 2, store_addr) == [
        (r, 2, [3.0, 3.0], "shrink") for r in range(2)]


def _library(version):
    from types import SimpleNamespace

    lib = None if version is None else SimpleNamespace(version=version)
    return SimpleNamespace(get_version=lambda: SimpleNamespace(libnccl=lib))


@pytest.mark.parametrize("version, call, able", [
    ("2.26.5", "shrink", False), ("2.27.3", "shrink", True), ("2.27.3", "revoke", False),
    ("2.28.3", "revoke", True), ("2.32.3", "shrink", True), (None, "shrink", False)])
def test_nccl_shrink_and_revoke_are_used_only_where_the_library_has_them(version, call, able):
    """nccl4py has every method whatever NCCL library it loaded; an older library refuses the
    call only when it is made, so the library's version decides (no library: neither)."""
    from types import SimpleNamespace

    from gpucoll.backends.nccl.driver import supports

    comm = SimpleNamespace(shrink=None, revoke=None)
    assert supports(_library(version), comm, call) is able
    assert supports(_library("2.32.3"), SimpleNamespace(), call) is False
