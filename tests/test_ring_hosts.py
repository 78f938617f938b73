"""Ranks on several hosts: each host's ranks meet over shared memory, hosts over TCP, and a large
all_reduce runs hierarchically (within hosts, then across, then within again). Hosts are told
apart by GPUCOLL_HOST_ID, so one machine stands in for several."""

from __future__ import annotations

import os

import numpy as np
import pytest
from multiproc import spawn
from tiers import grid

import gpucoll

COUNT = 300_007  # past the direct exchange, a ring message of many pieces


def _on_hosts(rank, n, addr, hosts, op, dtype):
    os.environ["GPUCOLL_HOST_ID"] = f"host-{hosts[rank]}"
    with gpucoll.init("ring", rank=rank, world_size=n, store=addr, timeout=60) as comm:
        x = _values(rank, dtype)
        comm.all_reduce(x, op=op)
        b = comm._backend.inner
        across = sum(link.sent() for link in b._mesh.links
                     if link is not None and link.kind == "tcp")
        return x.tobytes(), b.links, b.ring_order, b._hosts, across


def _values(rank, dtype):
    rng = np.random.default_rng(rank)
    return (rng.random(COUNT) * 4 + rank).astype(dtype)


def _expected(n, op, dtype):
    stack = np.stack([_values(r, dtype) for r in range(n)])
    if op == "sum":
        return stack.sum(axis=0, dtype=np.float64)
    if op == "avg":
        return stack.mean(axis=0, dtype=np.float64)
    return {"max": stack.max, "min": stack.min}[op](axis=0)


@pytest.mark.parametrize("hosts", grid([[0, 0, 1, 1], [0, 1, 0, 1], [0, 0, 1, 1, 2, 2]],
                                       [[0, 0, 1, 1]]), ids=["2x2", "2x2-interleaved", "3x2"])
@pytest.mark.parametrize("op", grid(["sum", "avg", "max"], "sum"))
def test_all_reduce_across_hosts_is_hierarchical_right_and_bit_identical(store_addr, hosts, op):
    n = len(hosts)
    results = spawn(_on_hosts, n, store_addr, hosts, op, "float64",
                    env={"GPUCOLL_TRANSPORT": "auto"})
    first = results[0][0]
    assert all(r[0] == first for r in results), "ranks disagree on the result"
    got = np.frombuffer(first, np.float64)
    np.testing.assert_allclose(got, _expected(n, op, "float64"), rtol=1e-12)
    per_host, hosts_n = n // len(set(hosts)), len(set(hosts))
    # each rank sends the network only its shard's share: 2(M-1)/M of 1/L of the buffer
    shard_share = 2 * (hosts_n - 1) / hosts_n * COUNT * 8 / per_host
    for rank, (_, links, order, grouped, across) in enumerate(results):
        assert across <= shard_share + 4096, (rank, across, shard_share)
        assert grouped == [[r for r in range(n) if hosts[r] == h] for h in sorted(set(hosts))]
        assert all(kind == ("shm" if hosts[j] == hosts[rank] else "tcp")
                   for j, kind in links.items())
        # the flat ring (small and uneven cases) keeps each host's ranks together
        assert order == [r for h in grouped for r in h]


def test_hosts_with_different_rank_counts_use_the_flat_ring(store_addr):
    hosts = [0, 0, 0, 1]
    results = spawn(_on_hosts, 4, store_addr, hosts, "sum", "float32",
                    env={"GPUCOLL_TRANSPORT": "auto"})
    assert all(r[3] is None for r in results)
    got = [np.frombuffer(r[0], np.float32) for r in results]
    assert all(np.array_equal(g, got[0]) for g in got)
    np.testing.assert_allclose(got[0], _expected(4, "sum", "float32"), rtol=1e-5)
