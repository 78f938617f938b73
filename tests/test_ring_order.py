"""The host ring under a rank order other than 0..n-1: every collective keeps its meaning,
all_reduce stays bit-identical on every rank, and the order chosen from the topology reaches
every rank."""

from __future__ import annotations

import numpy as np
import pytest
from multiproc import spawn
from test_ring import CHECKS, data
from tiers import grid

import gpucoll.topology
from gpucoll import backends
from gpucoll.arrays import as_ref
from gpucoll.ops import ReduceOp

# small (direct exchange) and > 64 KiB per rank in float64 (the ring and chain schedules)
COUNTS = [1, 4099, 70001]
ORDERS = [(3, [0, 2, 1]), (3, [2, 0, 1]), (4, [0, 2, 1, 3]), (4, [3, 1, 0, 2])]


def open_backend(rank: int, n: int, addr: str, transport: str, order):
    """This rank's RingBackend, visiting ranks in ``order``, in the namespace ``ring`` of the
    test's store."""
    from gpucoll.backends.ring import RingBackend
    from gpucoll.store import PrefixStore, TCPStore

    host, port = addr.removeprefix("tcp://").rsplit(":", 1)
    store = TCPStore(host, int(port), timeout=30)
    return store, RingBackend(PrefixStore("ring", store), rank, n, timeout=30,
                              transport=transport, order=order)


def _run_collectives(rank, n, addr, transport, order):
    store, b = open_backend(rank, n, addr, transport, order)
    try:
        for coll, check in CHECKS.items():
            for count in COUNTS:
                try:
                    check(b, rank, n, count, np.dtype("float64"))
                except AssertionError as exc:
                    raise AssertionError(f"{coll} of {count} elements: {exc}") from None
        return b.ring_order
    finally:
        b.close()
        store.close()


@pytest.mark.parametrize("transport", grid(["shm", "tcp"], "shm"))
@pytest.mark.parametrize(("n", "order"), ORDERS)
def test_every_collective_matches_numpy_under_a_ring_order(store_addr, n, order, transport):
    assert spawn(_run_collectives, n, store_addr, transport, order, timeout=100) == [order] * n


def _random_all_reduce(rank, n, addr, transport, order):
    store, b = open_backend(rank, n, addr, transport, order)
    try:
        out = []
        for count in COUNTS:
            x = np.random.default_rng(rank * 31 + count).standard_normal(count)
            b.all_reduce(as_ref(x, "x"), ReduceOp.SUM, timeout=30)
            out.append(x.tobytes())
        return out
    finally:
        b.close()
        store.close()


@pytest.mark.parametrize("transport", grid(["shm", "tcp"], "shm"))
def test_all_reduce_is_bit_identical_on_every_rank_under_a_ring_order(store_addr, transport):
    results = spawn(_random_all_reduce, 4, store_addr, transport, [3, 1, 0, 2], timeout=60)
    assert all(r == results[0] for r in results[1:])


@pytest.mark.parametrize("order", [[0, 1, 1], [0, 1], [1, 2, 3], [0, 1, 2, 3], ["0", 1, 2],
                                   [True, 0, 2], (i for i in range(3))])
def test_an_order_that_is_not_a_permutation_of_the_ranks_is_a_value_error(order):
    from gpucoll.backends.ring import RingBackend

    with pytest.raises(ValueError, match="permutation of the ranks 0..2"):
        RingBackend(None, 0, 3, timeout=1, order=order)  # rejected before the store is used


def test_this_gpu_less_machine_keeps_rank_order():
    assert backends.topology_order(4) is None


class _Devices:
    def __init__(self, count: int):
        self.count = count

    def device_count(self) -> int:
        return self.count


def test_each_rank_uses_the_gpu_of_its_local_rank(monkeypatch):
    monkeypatch.setattr(backends.cuda, "runtime", lambda: _Devices(4))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert backends.rank_devices(4) == [0, 1, 2, 3]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,4,5,7")
    assert backends.rank_devices(4) == [6, 4, 5, 7]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1a,GPU-2b,GPU-3c,GPU-4d")
    assert backends.rank_devices(4) is None


def test_ranks_sharing_gpus_keep_rank_order(monkeypatch):
    monkeypatch.setattr(backends.cuda, "runtime", lambda: _Devices(2))
    assert backends.rank_devices(4) is None


def test_the_gpu_ring_becomes_a_rank_order(monkeypatch):
    monkeypatch.setattr(backends, "rank_devices", lambda size: [4, 5, 6, 7])
    monkeypatch.setattr(gpucoll.topology, "probe_ring_order", lambda gpus: [4, 6, 7, 5])
    assert backends.topology_order(4) == [0, 2, 3, 1]


@pytest.mark.parametrize("answer", [[4, 6, 9, 5], None, RuntimeError("NVML went away")])
def test_a_topology_answer_that_does_not_fit_keeps_rank_order(monkeypatch, answer):
    def probe(gpus):
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(backends, "rank_devices", lambda size: [4, 5, 6, 7])
    monkeypatch.setattr(gpucoll.topology, "probe_ring_order", probe)
    assert backends.topology_order(4) is None


def _build_ring(rank, n, addr, fake):
    """Build the ring as ``backend="ring"`` does; with ``fake``, rank 0's topology suggests GPUs
    0, 2, 3, 1 and any other rank's a different ring (which must not be used)."""
    from gpucoll.backends import create_backend
    from gpucoll.communicator import Communicator
    from gpucoll.store import PrefixStore, TCPStore

    if fake:
        backends.rank_devices = lambda size: list(range(size))
        suggestion = [0, 2, 3, 1] if rank == 0 else [0, 3, 2, 1]
        gpucoll.topology.probe_ring_order = lambda gpus: suggestion
    host, port = addr.removeprefix("tcp://").rsplit(":", 1)
    store = TCPStore(host, int(port), timeout=30)
    ns = PrefixStore("g", store)
    comm = Communicator(create_backend("ring", ns, rank, n, timeout=30), ns, timeout=30)
    try:
        x = data(rank, 70001, np.float64)
        comm.all_reduce(x)
        np.testing.assert_array_equal(x, sum(data(r, 70001, np.float64) for r in range(n)))
        return comm.ring_order
    finally:
        comm.close()
        store.close()


def test_the_ring_keeps_rank_order_when_the_topology_cannot_be_seen(store_addr):
    assert spawn(_build_ring, 4, store_addr, False, timeout=60) == [[0, 1, 2, 3]] * 4


def test_rank_0s_topology_order_is_published_and_used_by_every_rank(store_addr):
    assert spawn(_build_ring, 4, store_addr, True, timeout=60) == [[0, 2, 3, 1]] * 4
