"""A rank killed (SIGKILL) at each stage of start-up: joining the group in the store, the address
exchange, the connections and shared-memory rings of the host ring, the ring order, and the
arrival and unique id of the NCCL backend (on the emulation). Every survivor must raise a
PeerFailure naming the killed rank within ``BOUND_S`` of its death, never a timeout, and never
blame a rank that merely gave up because of it.

The victim arms a stage by replacing, in its own process, the function that starts it with one
that records the time in the test's store and kills the process (``_die``).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from multiproc import spawn
from tiers import grid

import gpucoll
from gpucoll.errors import GpucollError, PeerFailure

LONG = 60.0  # a deadline no passing case gets near: the death must be noticed without it
BOUND_S = 5.0  # how soon every survivor must raise after the death
TRANSPORTS = grid(["shm", "tcp"], "shm")
WORLDS = grid([2, 3], 2)
JOB = "gpucoll/jobs/anonymous/0/"  # the slot the first group of the test's store forms in

pytestmark = pytest.mark.timeout(120)


def _side(addr: str):
    """A client of the test's store, for the ranks' own coordination."""
    from gpucoll.store import TCPStore, parse_address

    return TCPStore(*parse_address(addr), timeout=LONG)


def _die(side) -> None:
    """Record the time, then die at once (SIGKILL: no clean-up, as a crash)."""
    side.set("died", repr(time.time()))
    side.close()
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(stage: str, rank: int, n: int, side) -> None:
    """Make this process kill itself when start-up reaches ``stage``."""
    from gpucoll import backends
    from gpucoll.store import PrefixStore
    from gpucoll.transport import mesh

    if stage == "join, before its claim":  # its will is made; the others already wait
        claim = PrefixStore.compare_set

        def compare_set(self, key, expected, desired):
            if key.startswith("member/"):
                side.wait([JOB + f"member/{r}" for r in range(n) if r != rank], timeout=LONG)
                _die(side)
            return claim(self, key, expected, desired)

        PrefixStore.compare_set = compare_set
    elif stage == "join, before the others arrive":  # claimed; the others start after it died
        claim = PrefixStore.compare_set

        def compare_set(self, key, expected, desired):
            got = claim(self, key, expected, desired)
            if key.startswith("member/"):
                _die(side)
            return got

        PrefixStore.compare_set = compare_set
    elif stage == "address exchange":  # published its address, then died
        gather = mesh.Mesh._gather_addresses

        def gather_then_die(self, store, deadline):
            gather(self, store, deadline)
            _die(side)

        mesh.Mesh._gather_addresses = gather_then_die
    elif stage == "connections":  # connected to the lower ranks, died before accepting
        mesh.Mesh._accept = lambda self, *a: _die(side)
    elif stage == "memory rings":  # connected, died before passing its rings
        mesh.Mesh._share_rings = lambda self, *a: _die(side)
    elif stage == "ring order":  # rank 0 died before publishing the ring order
        backends.topology_order = lambda size: _die(side)
    else:
        raise AssertionError(stage)


def _start(rank, n, addr, stage, victim):
    side = _side(addr)
    if rank == victim:
        _arm(stage, rank, n, side)
    elif stage == "join, before the others arrive":
        side.wait(["died"], timeout=LONG)
    try:
        with gpucoll.init("ring", rank=rank, world_size=n, store=addr, timeout=LONG) as comm:
            comm.barrier()  # a death after this rank's own set-up was done shows here
    except GpucollError as exc:
        since = time.time() - float(side.get("died", timeout=LONG))
        return type(exc).__name__, getattr(exc, "peer", None), str(exc), since
    return None


def _check_named(outcomes, victim: int) -> None:
    """The victim died of SIGKILL; every other rank raised PeerFailure naming it in time."""
    assert outcomes[victim].exitcode == -signal.SIGKILL, outcomes[victim]
    for o in outcomes:
        if o.rank == victim:
            continue
        assert o.error is None and o.value is not None, \
            f"rank {o.rank} raised no GpucollError: {o.error!r}\n{o.trace}"
        name, named, text, since = o.value
        assert (name, named) == (PeerFailure.__name__, victim), text
        assert f"rank {victim} died" in text, text
        assert since < BOUND_S, f"{since:.1f} s: {text}"


STAGES = ["join, before its claim", "join, before the others arrive", "address exchange",
          "connections"]


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("n", WORLDS)
def test_a_rank_killed_at_a_stage_of_start_up_is_named_by_every_survivor(store_addr, stage,
                                                                          transport, n):
    victim = n - 1 if stage == "connections" else 1  # the last rank connects to every other
    outcomes = spawn(_start, n, store_addr, stage, victim, check=False,
                     env={"GPUCOLL_TRANSPORT": transport})
    _check_named(outcomes, victim)


@pytest.mark.parametrize("victim", [0, 1])
def test_a_rank_killed_before_passing_its_memory_rings_is_named_by_every_survivor(store_addr,
                                                                                   victim):
    outcomes = spawn(_start, 2, store_addr, "memory rings", victim, check=False,
                     env={"GPUCOLL_TRANSPORT": "shm"})
    _check_named(outcomes, victim)


@pytest.mark.slow
def test_rank_0_killed_before_publishing_the_ring_order_is_named_by_every_survivor(store_addr):
    outcomes = spawn(_start, 3, store_addr, "ring order", 0, check=False)
    _check_named(outcomes, 0)


# -- the NCCL backend, on the emulation ------------------------------------------------------

NCCL_STAGES = {"arrival": "arrive", "unique id": "share_unique_id", "communicator": "enter"}


def _start_nccl(rank, n, addr, stage, victim):
    from nccl_emulation import EmulatedRuntime

    from gpucoll import cuda
    from gpucoll.backends.nccl import backend

    side = _side(addr)
    rt = EmulatedRuntime(addr, devices=n, hang_timeout=LONG)
    cuda.set_runtime(rt)
    if rank == victim:
        setattr(backend, NCCL_STAGES[stage], lambda *a, **k: _die(side))
    try:
        with gpucoll.init("nccl", rank=rank, world_size=n, store=addr, timeout=LONG) as comm:
            comm.barrier()
    except GpucollError as exc:
        since = time.time() - float(side.get("died", timeout=LONG))
        return type(exc).__name__, getattr(exc, "peer", None), str(exc), since
    finally:
        rt.close()
    return None


@pytest.mark.parametrize("stage", list(NCCL_STAGES))
@pytest.mark.parametrize("victim", [0, 1])
@pytest.mark.parametrize("n", WORLDS)
def test_a_rank_killed_during_nccl_start_up_is_named_by_every_survivor(store_addr, stage,
                                                                       victim, n):
    outcomes = spawn(_start_nccl, n, store_addr, stage, victim, check=False)
    _check_named(outcomes, victim)
