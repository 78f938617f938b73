"""The host ring backend on its own: every collective against a NumPy reference, on world sizes
1-4, over shared memory and over TCP, from 0 elements past the ring's large-message threshold."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from multiproc import spawn

from gpucoll.ops import ReduceOp

TRANSPORTS = ["shm", "tcp"]
WORLDS = [1, 2, 3, 4]
# 0, odd, just under/over the direct-exchange threshold, and a many-piece ring message
COUNTS = [0, 1, 7, 4099, 16385, 300_007]


@dataclasses.dataclass(frozen=True)
class Ref:
    """The four ArrayRef fields a backend reads."""

    host: np.ndarray

    @property
    def count(self) -> int:
        return self.host.size

    @property
    def dtype(self) -> np.dtype:
        return self.host.dtype

    @property
    def nbytes(self) -> int:
        return self.host.nbytes


def open_backend(rank: int, n: int, addr: str, transport: str, timeout: float = 30.0):
    """This rank's RingBackend in the namespace ``ring`` of the test's store."""
    from gpucoll.backends.ring import RingBackend
    from gpucoll.store import PrefixStore, TCPStore

    host, port = addr.removeprefix("tcp://").rsplit(":", 1)
    store = TCPStore(host, int(port), timeout=timeout)
    return store, RingBackend(PrefixStore("ring", store), rank, n, timeout=timeout,
                              transport=transport)


def data(rank: int, count: int, dtype, salt: int = 0) -> np.ndarray:
    """Rank-specific values that stay exact in every dtype used here."""
    rng = np.random.default_rng(1000 * rank + 7 * count + salt)
    return rng.integers(-8, 9, size=count).astype(dtype)


def _run_collective(rank, n, addr, transport, coll, dtype):
    store, b = open_backend(rank, n, addr, transport)
    try:
        for count in COUNTS:
            CHECKS[coll](b, rank, n, count, np.dtype(dtype))
        b.barrier(timeout=30)
        return b.links
    finally:
        b.close()
        store.close()


def _check_all_reduce(b, rank, n, count, dtype):
    for op, fold in ((ReduceOp.SUM, np.add), (ReduceOp.MAX, np.maximum)):
        x = data(rank, count, dtype)
        b.all_reduce(Ref(x), op, timeout=30)
        expected = data(0, count, dtype)
        for r in range(1, n):
            expected = fold(expected, data(r, count, dtype))
        np.testing.assert_array_equal(x, expected, err_msg=f"{op} count={count}")


def _check_broadcast(b, rank, n, count, dtype):
    root = n - 1
    x = data(rank, count, dtype)
    b.broadcast(Ref(x), root, timeout=30)
    np.testing.assert_array_equal(x, data(root, count, dtype))


def _check_reduce(b, rank, n, count, dtype):
    root = n // 2
    x = data(rank, count, dtype)
    b.reduce(Ref(x), root, ReduceOp.SUM, timeout=30)
    expected = sum(data(r, count, dtype) for r in range(n)) if rank == root else data(
        rank, count, dtype)
    np.testing.assert_array_equal(x, np.asarray(expected, dtype))


def _check_all_gather(b, rank, n, count, dtype):
    out = np.full(n * count, -1, dtype)
    b.all_gather(Ref(data(rank, count, dtype)), Ref(out), timeout=30)
    np.testing.assert_array_equal(out, np.concatenate([data(r, count, dtype) for r in range(n)]))


def _check_gather(b, rank, n, count, dtype):
    root = (1 % n)
    out = np.full(n * count, -1, dtype) if rank == root else None
    b.gather(Ref(data(rank, count, dtype)), Ref(out) if out is not None else None, root,
             timeout=30)
    if rank == root:
        np.testing.assert_array_equal(out, np.concatenate([data(r, count, dtype)
                                                           for r in range(n)]))


def _check_scatter(b, rank, n, count, dtype):
    root = 0
    x = Ref(data(0, n * count, dtype)) if rank == root else None
    out = np.full(count, -1, dtype)
    b.scatter(x, Ref(out), root, timeout=30)
    np.testing.assert_array_equal(out, data(0, n * count, dtype)[rank * count:(rank + 1) * count])


def _check_reduce_scatter(b, rank, n, count, dtype):
    x = data(rank, n * count, dtype)
    before = x.copy()
    out = np.full(count, -1, dtype)
    b.reduce_scatter(Ref(x), Ref(out), ReduceOp.SUM, timeout=30)
    total = sum(data(r, n * count, dtype) for r in range(n))
    np.testing.assert_array_equal(out, np.asarray(total, dtype)[rank * count:(rank + 1) * count])
    np.testing.assert_array_equal(x, before)


def _check_all_to_all(b, rank, n, count, dtype):
    out = np.full(n * count, -1, dtype)
    b.all_to_all(Ref(data(rank, n * count, dtype)), Ref(out), timeout=30)
    expected = np.concatenate([data(j, n * count, dtype)[rank * count:(rank + 1) * count]
                               for j in range(n)])
    np.testing.assert_array_equal(out, expected)


def _check_send_recv(b, rank, n, count, dtype):
    # a ring of messages: rank r sends to r+1; even ranks send first, odd ranks receive first
    if n == 1:
        return
    x = data(rank, count, dtype)
    got = np.full(count, -1, dtype)
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    if rank % 2 == 0:
        b.send(Ref(x), nxt, timeout=30)
        b.recv(Ref(got), prv, timeout=30)
    else:
        b.recv(Ref(got), prv, timeout=30)
        b.send(Ref(x), nxt, timeout=30)
    np.testing.assert_array_equal(got, data(prv, count, dtype))


CHECKS = {
    "all_reduce": _check_all_reduce,
    "broadcast": _check_broadcast,
    "reduce": _check_reduce,
    "all_gather": _check_all_gather,
    "gather": _check_gather,
    "scatter": _check_scatter,
    "reduce_scatter": _check_reduce_scatter,
    "all_to_all": _check_all_to_all,
    "send_recv": _check_send_recv,
}


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("n", WORLDS)
@pytest.mark.parametrize("coll", sorted(CHECKS))
def test_collective_matches_numpy(store_addr, coll, n, transport):
    links = spawn(_run_collective, n, store_addr, transport, coll, "float32", timeout=90)
    assert all(kind == transport for rank_links in links for kind in rank_links.values())
