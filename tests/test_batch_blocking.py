"""A blocking send or recv inside ``with comm.batch():`` behaves the same on every backend: it is
refused at once with a UsageError (it would wait on a peer that waits on the batch, a deadlock
once messages outgrow the eager size), while ``send(..., async_op=True)`` and ``recv(...,
async_op=True)`` join the batch as isend and irecv do. The communicator stays usable."""

from __future__ import annotations

import numpy as np
import pytest
from multiproc import spawn
from nccl_ranks import dev, emulated

import gpucoll

BIG = 4_000_000  # float64 elements: 32 MB, far past every eager size


def _exchange(comm, make, host):
    me, peer = comm.rank, 1 - comm.rank
    x, y = make(np.full(BIG, me, np.float64)), make(np.zeros(BIG, np.float64))
    refused = []
    with comm.batch() as b:
        comm.irecv(y, peer)
        try:
            comm.send(x, peer)
        except gpucoll.UsageError as exc:
            refused.append(str(exc))
        try:
            comm.recv(y, peer)
        except gpucoll.UsageError as exc:
            refused.append(str(exc))
        joined = comm.send(x, peer, async_op=True)
    b.wait()
    joined.wait()
    got = host(y)
    after = comm.all_reduce(make(np.ones(3)))  # still usable
    return refused, bool(np.all(got == peer)), host(after).tolist()


def _on_ring(rank: int, n: int, addr: str):
    with gpucoll.init("ring", rank=rank, world_size=n, store=addr, timeout=30) as comm:
        return _exchange(comm, lambda a: a, lambda a: a)


def _on_nccl(rank: int, n: int, addr: str):
    with emulated(addr, rank, n) as (rt, comm):
        def host(a):
            rt.synchronize()
            return np.array(a.get())

        return _exchange(comm, lambda a: dev(rt, a), host)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("body", [_on_ring, _on_nccl], ids=["ring", "nccl"])
def test_a_blocking_send_or_recv_in_a_batch_is_refused_and_async_ones_join_it(store_addr, body):
    for refused, exact, after in spawn(body, 2, store_addr, timeout=50,
                                       env={"GPUCOLL_TRANSPORT": "shm"}):
        assert len(refused) == 2, refused
        assert "blocking send inside `with comm.batch():` is refused" in refused[0]
        assert "use isend" in refused[0] and "use irecv" in refused[1]
        assert "on rank" in refused[0]
        assert exact and after == [2.0, 2.0, 2.0]
