"""Blame that cascades: a rank that fails because another rank failed passes that rank on, so
that every survivor names the first failure, never a rank that merely gave up because of it.

Four ranks; rank 1 is killed (SIGKILL) in a call of the whole group (a split, an all_reduce).
Rank 3 meanwhile waits in a group split off earlier with rank 0 alone, so it can only learn of
the death from rank 0, which gives up on both groups as its ``with`` block ends in the error.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
from multiproc import spawn
from tiers import grid

import gpucoll
from gpucoll.errors import GpucollError, PeerFailure

LONG = 60.0  # a deadline no passing case gets near: the death must be noticed without it
BOUND_S = 5.0  # how soon every survivor must raise after the death
BACKENDS = grid(["ring-shm", "ring-tcp", "nccl"], ["ring-shm", "nccl"])

pytestmark = pytest.mark.timeout(120)


def _side(addr: str):
    from gpucoll.store import TCPStore, parse_address

    return TCPStore(*parse_address(addr), timeout=LONG)


def _open(rank: int, n: int, addr: str, backend: str):
    if backend == "nccl":
        from nccl_emulation import EmulatedRuntime

        from gpucoll import cuda

        cuda.set_runtime(EmulatedRuntime(addr, devices=n, hang_timeout=LONG))
        return gpucoll.init("nccl", rank=rank, world_size=n, store=addr, timeout=LONG)
    os.environ["GPUCOLL_TRANSPORT"] = backend.split("-")[1]
    return gpucoll.init("ring", rank=rank, world_size=n, store=addr, timeout=LONG)


def _cascade(rank, n, addr, backend, call):
    side = _side(addr)
    try:
        with _open(rank, n, addr, backend) as comm:
            pair = comm.split(0 if rank in (0, 3) else 1)  # ranks 0 and 3; ranks 1 and 2
            comm.barrier()
            if rank == 3:  # waits for rank 0, which gives up when rank 1 dies
                pair.all_reduce(np.ones(4))
                return None
            if rank == 1:
                side.wait(["past/0", "past/2"], timeout=LONG)
                side.set("died", repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            side.set(f"past/{rank}", b"")
            if call == "split":
                comm.split(rank % 2)
            else:
                comm.all_reduce(np.ones(1 << 16))
    except GpucollError as exc:
        since = time.time() - float(side.get("died", timeout=LONG))
        return type(exc).__name__, getattr(exc, "peer", None), str(exc), since
    return None


@pytest.mark.parametrize("call", ["split", "all_reduce"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_survivor_names_the_killed_rank_not_the_one_that_gave_up_for_it(store_addr,
                                                                              backend, call):
    outcomes = spawn(_cascade, 4, store_addr, backend, call, check=False)
    assert outcomes[1].exitcode == -signal.SIGKILL
    for o in (outcomes[0], outcomes[2], outcomes[3]):
        assert o.error is None and o.value is not None, \
            f"rank {o.rank} raised no GpucollError: {o.error!r}\n{o.trace}"
        name, peer, text, since = o.value
        assert name == PeerFailure.__name__, text
        assert "rank 1 died" in text, f"rank {o.rank}: {text}"
        assert since < BOUND_S, f"{since:.1f} s: {text}"
        if o.rank != 3:
            assert peer == 1, text
    # rank 3 is rank 1 of its pair: rank 0 of the pair relayed the failure, and says so
    text = outcomes[3].value[2]
    assert "rank 0" in text and "split from" in text, text
