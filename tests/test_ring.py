"""The host ring backend on its own: every collective against a NumPy reference, on world sizes
1-4, over shared memory and over TCP, from 0 elements past the ring's large-message threshold."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from multiproc import spawn
from tiers import SLOW, grid

from gpucoll.arrays import as_ref
from gpucoll.errors import CollectiveTimeout
from gpucoll.ops import ReduceOp

TRANSPORTS = grid(["shm", "tcp"], "shm")
WORLDS = grid([1, 2, 3, 4], [1, 2])
# 0, odd, just under/over the direct-exchange threshold, and a many-piece ring message
COUNTS = [0, 1, 7, 4099, 16385, 300_007]


def ref(arr: np.ndarray):
    """The ArrayRef the communicator would hand the backend for ``arr``."""
    return as_ref(arr, "x")


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


def _run_collectives(rank, n, addr, transport, dtype):
    store, b = open_backend(rank, n, addr, transport)
    try:
        for coll, check in CHECKS.items():
            for count in COUNTS:
                try:
                    check(b, rank, n, count, np.dtype(dtype))
                except AssertionError as exc:
                    raise AssertionError(f"{coll} of {count} elements: {exc}") from None
        b.barrier(timeout=30)
        return b.links
    finally:
        b.close()
        store.close()


def _check_all_reduce(b, rank, n, count, dtype):
    for op, fold in ((ReduceOp.SUM, np.add), (ReduceOp.MAX, np.maximum)):
        x = data(rank, count, dtype)
        b.all_reduce(ref(x), op, timeout=30)
        expected = data(0, count, dtype)
        for r in range(1, n):
            expected = fold(expected, data(r, count, dtype))
        np.testing.assert_array_equal(x, expected, err_msg=f"{op} count={count}")


def _check_broadcast(b, rank, n, count, dtype):
    root = n - 1
    x = data(rank, count, dtype)
    b.broadcast(ref(x), root, timeout=30)
    np.testing.assert_array_equal(x, data(root, count, dtype))


def _check_reduce(b, rank, n, count, dtype):
    root = n // 2
    x = data(rank, count, dtype)
    b.reduce(ref(x), root, ReduceOp.SUM, timeout=30)
    expected = sum(data(r, count, dtype) for r in range(n)) if rank == root else data(
        rank, count, dtype)
    np.testing.assert_array_equal(x, np.asarray(expected, dtype))


def _check_all_gather(b, rank, n, count, dtype):
    out = np.full(n * count, -1, dtype)
    b.all_gather(ref(data(rank, count, dtype)), ref(out), timeout=30)
    np.testing.assert_array_equal(out, np.concatenate([data(r, count, dtype) for r in range(n)]))


def _check_gather(b, rank, n, count, dtype):
    root = (1 % n)
    out = np.full(n * count, -1, dtype) if rank == root else None
    b.gather(ref(data(rank, count, dtype)), ref(out) if out is not None else None, root,
             timeout=30)
    if rank == root:
        np.testing.assert_array_equal(out, np.concatenate([data(r, count, dtype)
                                                           for r in range(n)]))


def _check_scatter(b, rank, n, count, dtype):
    root = 0
    x = ref(data(0, n * count, dtype)) if rank == root else None
    out = np.full(count, -1, dtype)
    b.scatter(x, ref(out), root, timeout=30)
    np.testing.assert_array_equal(out, data(0, n * count, dtype)[rank * count:(rank + 1) * count])


def _check_reduce_scatter(b, rank, n, count, dtype):
    x = data(rank, n * count, dtype)
    before = x.copy()
    out = np.full(count, -1, dtype)
    b.reduce_scatter(ref(x), ref(out), ReduceOp.SUM, timeout=30)
    total = sum(data(r, n * count, dtype) for r in range(n))
    np.testing.assert_array_equal(out, np.asarray(total, dtype)[rank * count:(rank + 1) * count])
    np.testing.assert_array_equal(x, before)


def _check_all_to_all(b, rank, n, count, dtype):
    out = np.full(n * count, -1, dtype)
    b.all_to_all(ref(data(rank, n * count, dtype)), ref(out), timeout=30)
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
        b.send(ref(x), nxt, timeout=30)
        b.recv(ref(got), prv, timeout=30)
    else:
        b.recv(ref(got), prv, timeout=30)
        b.send(ref(x), nxt, timeout=30)
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
def test_every_collective_matches_numpy(store_addr, n, transport):
    links = spawn(_run_collectives, n, store_addr, transport, "float32", timeout=100)
    assert all(kind == transport for rank_links in links for kind in rank_links.values())


DTYPES = ["bool", "int8", "uint16", "int64", "float16", "bfloat16", "float32", "float64",
          "complex64", "complex128"]


def _dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _all_reduce_dtypes(rank, n, addr, transport):
    store, b = open_backend(rank, n, addr, transport)
    try:
        for name in DTYPES:
            dtype = _dtype(name)
            for count in (5, 40_001):  # direct exchange, then the ring
                for op, fold in ((ReduceOp.SUM, np.add), (ReduceOp.MAX, np.maximum)):
                    if op is ReduceOp.MAX and dtype.kind == "c":
                        continue
                    x = data(rank, count, dtype)
                    b.all_reduce(ref(x), op, timeout=30)
                    expected = data(0, count, dtype)
                    for r in range(1, n):
                        expected = fold(expected, data(r, count, dtype))
                    np.testing.assert_array_equal(x, expected, err_msg=f"{name} {op} {count}")
    finally:
        b.close()
        store.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_all_reduce_handles_every_dtype(store_addr, transport):
    spawn(_all_reduce_dtypes, 3, store_addr, transport, timeout=90)


def _random_all_reduce(rank, n, addr, transport, op):
    store, b = open_backend(rank, n, addr, transport)
    try:
        results = []
        for count in (1001, 250_001):
            x = np.random.default_rng(rank + 10 * count).standard_normal(count).astype(np.float32)
            b.all_reduce(ref(x), op, timeout=30)
            results.append(x)
        return results
    finally:
        b.close()
        store.close()


@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PROD])
@pytest.mark.parametrize("n", grid([3, 4], 3))
def test_all_reduce_is_bit_identical_on_every_rank(store_addr, n, op):
    per_rank = spawn(_random_all_reduce, n, store_addr, "shm", op, timeout=60)
    for results in per_rank[1:]:
        for mine, first in zip(results, per_rank[0], strict=True):
            assert mine.tobytes() == first.tobytes()


def test_avg_is_the_mean(store_addr):
    per_rank = spawn(_random_all_reduce, 3, store_addr, "tcp", ReduceOp.AVG, timeout=60)
    for i, count in enumerate((1001, 250_001)):
        inputs = [np.random.default_rng(r + 10 * count).standard_normal(count).astype(np.float32)
                  for r in range(3)]
        np.testing.assert_allclose(per_rank[0][i], np.mean(inputs, axis=0), rtol=1e-5,
                                   atol=1e-6)


def _async_in_order(rank, n, addr):
    store, b = open_backend(rank, n, addr, "shm")
    try:
        xs = [np.full(10_000 * (i % 3 + 1), i + rank, np.int64) for i in range(8)]
        works = [b.run_async(lambda x=x: b.all_reduce(ref(x), ReduceOp.SUM, timeout=30))
                 for x in xs]
        last = np.zeros(1, np.int64)
        b.run_sync(lambda: b.all_reduce(ref(last), ReduceOp.MAX, timeout=30))
        done_before_sync = all(w.is_completed() for w in works)
        for w in works:
            w.wait(30)
        return done_before_sync, [int(x[0]) for x in xs]
    finally:
        b.close()
        store.close()


def test_async_work_completes_in_issue_order_before_a_sync_call(store_addr):
    for done_before_sync, sums in spawn(_async_in_order, 2, store_addr, timeout=60):
        assert done_before_sync
        assert sums == [2 * i + 1 for i in range(8)]


def _waiters_run_queued_calls(rank, n, addr):
    """With the worker thread kept from starting, only waiting callers can run async calls."""
    store, b = open_backend(rank, n, addr, "shm")
    b._start_worker = lambda: None  # noqa: SLF001 - the behaviour under test needs no worker
    ran = []
    try:
        def call(i, x):
            return lambda: (ran.append(i), b.all_reduce(ref(x), ReduceOp.SUM, timeout=30))

        xs = [np.full(1000 * (i + 1), i + rank, np.int64) for i in range(6)]
        works = [b.run_async(call(i, x)) for i, x in enumerate(xs)]
        timed_out = False
        try:
            works[1].wait(timeout=0.2)  # a wait with a timeout only waits
        except CollectiveTimeout:
            timed_out = ran == []
        works[2].wait()  # runs calls 0, 1 and 2, in issue order
        after_wait = (list(ran), [w.is_completed() for w in works])
        last = np.zeros(1, np.int64)
        b.run_sync(lambda: b.all_reduce(ref(last), ReduceOp.MAX, timeout=30))  # runs 3 to 5
        return timed_out, after_wait, ran, [int(x[0]) for x in xs]
    finally:
        b.close()
        store.close()


def test_a_caller_waiting_for_async_calls_runs_them_itself_in_issue_order(store_addr):
    for timed_out, after_wait, ran, sums in spawn(_waiters_run_queued_calls, 2, store_addr,
                                                   timeout=60):
        assert timed_out
        assert after_wait == ([0, 1, 2], [True] * 3 + [False] * 3)
        assert ran == list(range(6))
        assert sums == [2 * i + 1 for i in range(6)]


def _waiters_on_three_threads(rank, n, addr):
    store, b = open_backend(rank, n, addr, "shm")
    ran = []
    try:
        def call(i, x):
            return lambda: (ran.append(i), b.all_reduce(ref(x), ReduceOp.SUM, timeout=30))

        xs = [np.full(500 * (i % 4 + 1), i + rank, np.int64) for i in range(12)]
        works = [b.run_async(call(i, x)) for i, x in enumerate(xs)]
        threads = [threading.Thread(target=works[i].wait) for i in (11, 5)]
        for t in threads:
            t.start()
        works[2].wait()
        for t in threads:
            t.join(30)
        return ran, [w.is_completed() for w in works], [int(x[0]) for x in xs]
    finally:
        b.close()
        store.close()


def test_threads_waiting_for_different_async_calls_run_them_once_each_in_issue_order(
        store_addr):
    for ran, completed, sums in spawn(_waiters_on_three_threads, 2, store_addr, timeout=60):
        assert ran == list(range(12))
        assert all(completed)
        assert sums == [2 * i + 1 for i in range(12)]


def _split_in_two(rank, n, addr):
    from gpucoll.store import PrefixStore

    store, b = open_backend(rank, n, addr, "auto")
    try:
        color = rank % 2
        members = [r for r in range(n) if r % 2 == color]
        sub = b.split(PrefixStore(f"sub{color}", store), members.index(rank), len(members),
                      color, 0, timeout=30)
        x = np.array([rank], np.int64)
        sub.all_reduce(ref(x), ReduceOp.SUM, timeout=30)
        sub.close()
        none = b.split(PrefixStore("none", store), None, 0, None, 0, timeout=30)
        return int(x[0]), none
    finally:
        b.close()
        store.close()


def test_split_builds_a_working_backend_per_color(store_addr):
    results = spawn(_split_in_two, 4, store_addr, timeout=60)
    assert results == [(2, None), (4, None), (2, None), (4, None)]


def _two_hosts(rank, n, addr):
    import os

    os.environ["GPUCOLL_HOST_ID"] = f"host{rank // 2}"  # ranks 0,1 and 2,3 pose as two hosts
    store, b = open_backend(rank, n, addr, "auto")
    try:
        for coll in ("all_reduce", "broadcast", "all_to_all", "reduce_scatter"):
            for count in COUNTS:
                CHECKS[coll](b, rank, n, count, np.dtype("float32"))
        return b.links
    finally:
        b.close()
        store.close()


def test_ranks_on_two_hosts_use_shm_inside_a_host_and_tcp_across(store_addr):
    links = spawn(_two_hosts, 4, store_addr, timeout=90)
    assert links[0] == {1: "shm", 2: "tcp", 3: "tcp"}
    assert links[3] == {0: "tcp", 1: "tcp", 2: "shm"}


@pytest.mark.slow
def test_tiny_shared_memory_rings_still_carry_every_collective(store_addr):
    spawn(_run_collectives, 3, store_addr, "shm", "float64", timeout=100,
          env={"GPUCOLL_SHM_RING_BYTES": "4096"})


def _reduce_in_many_chunks(rank, n, addr, transport):
    from gpucoll.backends import ring_algos

    ring_algos.CHAIN_CHUNK = 1000  # not a multiple of 16: messages need padding in the rings
    store, b = open_backend(rank, n, addr, transport)
    try:
        for root in range(n):
            _check_reduce(b, rank, n, 70_001, np.dtype("int32"))
            b.barrier(timeout=30)
            x = data(rank, 70_001, np.dtype("float64"))
            b.reduce(ref(x), root, ReduceOp.MAX, timeout=30)
            if rank == root:
                np.testing.assert_array_equal(x, np.max([data(r, 70_001, np.dtype("float64"))
                                                         for r in range(n)], axis=0))
    finally:
        b.close()
        store.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_reduce_chain_forwards_many_chunks_without_a_full_copy(store_addr, transport):
    spawn(_reduce_in_many_chunks, 4, store_addr, transport, timeout=90)


def _beyond_64_mib(rank, n, addr, transport):
    store, b = open_backend(rank, n, addr, transport)
    try:
        count = (64 << 20) // 4 + 3
        x = np.full(count, rank + 1, np.float32)
        x[::7] = -rank
        b.all_reduce(ref(x), ReduceOp.SUM, timeout=60)
        expected = np.full(count, n * (n + 1) / 2, np.float32)
        expected[::7] = -n * (n - 1) / 2
        np.testing.assert_array_equal(x, expected)
        b.broadcast(ref(x), n - 1, timeout=60)
        np.testing.assert_array_equal(x, expected)
    finally:
        b.close()
        store.close()


@pytest.mark.slow
@SLOW
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_arrays_beyond_64_mib_reduce_and_broadcast_exactly(store_addr, transport):
    spawn(_beyond_64_mib, 3, store_addr, transport, timeout=100)


def _half_ring_calls(rank, n, addr, ring_bytes):
    import gpucoll

    wrong = []
    with gpucoll.init("ring", rank=rank, world_size=n, store=addr, timeout=30) as comm:
        for i in range(14):  # enough calls of these sizes to go round a 2 MiB ring many times
            count = (16_385, 131_071, 262_000, 70_001)[i % 4]
            x = data(rank, count, np.dtype("int32"), salt=i)
            comm.all_reduce(x)
            if not np.array_equal(x, sum(data(r, count, np.dtype("int32"), salt=i)
                                         for r in range(n))):
                wrong.append(f"all_reduce {i}")
            y = data(i % n, count, np.dtype("float32"), salt=i) if rank == i % n \
                else np.zeros(count, np.float32)
            comm.broadcast(y, root=i % n)
            if not np.array_equal(y, data(i % n, count, np.dtype("float32"), salt=i)):
                wrong.append(f"broadcast {i}")
    return wrong


@pytest.mark.parametrize("native", grid(["1", "0"], "1"), ids=["compiled", "python"])
@pytest.mark.parametrize("n,ring_bytes", grid([(2, None), (3, None), (2, "65536")], [(2, None)],
                                            rows=True))
def test_calls_up_to_half_a_ring_are_exact_as_they_wrap_around_it(store_addr, n, ring_bytes,
                                                                  native):
    env = {"GPUCOLL_TRANSPORT": "shm", "GPUCOLL_NATIVE": native}
    if ring_bytes:
        env["GPUCOLL_SHM_RING_BYTES"] = ring_bytes
    assert spawn(_half_ring_calls, n, store_addr, ring_bytes, timeout=90, env=env) == [[]] * n


def _paths_meet(rank, n, addr, coll):
    """Rank 1 takes the general path (as when its engine is busy), the others the small path:
    blocks of 200,000 bytes go in one round either way, in the same messages."""
    import gpucoll

    k = 50_000  # float32 elements per block
    with gpucoll.init("ring", rank=rank, world_size=n, store=addr, timeout=30) as comm:
        if rank == 1:
            comm._lean_backend._small_bytes = 0
        mine = [data(rank, k, np.dtype("float32"), salt=j) for j in range(n)]
        if coll == "all_gather":
            got = comm.all_gather(mine[0], tiled=True)
            want = np.concatenate([data(r, k, np.dtype("float32"), salt=0) for r in range(n)])
        elif coll == "reduce_scatter":
            got = comm.reduce_scatter(np.concatenate(mine), tiled=True)
            want = sum(data(r, k, np.dtype("float32"), salt=rank) for r in range(n))
        elif coll == "all_to_all":
            got = comm.all_to_all(np.concatenate(mine), tiled=True)
            want = np.concatenate([data(r, k, np.dtype("float32"), salt=rank) for r in range(n)])
        else:
            got = mine[0].copy()
            comm.all_reduce(got)
            want = sum(data(r, k, np.dtype("float32"), salt=0) for r in range(n))
        return np.array_equal(got.reshape(-1), want)


@pytest.mark.parametrize("coll", ["all_gather", "reduce_scatter", "all_to_all", "all_reduce"])
def test_ranks_on_the_small_and_the_general_path_meet_in_one_call(store_addr, coll):
    assert spawn(_paths_meet, 3, store_addr, coll, timeout=60,
                 env={"GPUCOLL_TRANSPORT": "shm"}) == [True] * 3


# -- the outboxes: large all_reduces among ranks that all share a host --------------------------

def test_only_an_all_reduce_too_large_for_one_round_among_all_of_a_hosts_ranks_takes_the_outboxes():
    from types import SimpleNamespace

    from gpucoll.backends.ring_algos import use_outboxes

    boxes = SimpleNamespace(ranks=[0, 1, 2, 3])
    assert use_outboxes(boxes, 1001, 4, 1000)
    assert not use_outboxes(boxes, 1000, 4, 1000)  # one round of messages carries it
    assert not use_outboxes(None, 1001, 4, 1000)  # a peer on another host: no outboxes
    assert use_outboxes(SimpleNamespace(ranks=[0, 1]), 1001, 2, 1000)  # two as well
    assert not use_outboxes(boxes, 1001, 3, 1000)  # a part of the host's ranks
    assert not use_outboxes(boxes, 1001, 4, -1)  # a link that is not shared memory


SLOT = 262_144  # float32 elements in one slot of an outbox (1 MiB)
# (dtype, op, count): two whole slots; a last slot of 5 elements, where some ranks' shares are
# empty; sizes that are no multiple of anything; more than a slot of one-byte elements
OUTBOX_CASES = [("float32", "sum", 2 * SLOT), ("float32", "avg", 3 * SLOT + 5),
                ("int64", "max", 300_007), ("float64", "prod", 200_001),
                ("int8", "min", 1_500_001), ("bfloat16", "sum", 700_001),
                ("complex64", "sum", 200_003), ("uint16", "bxor", 600_009)]


def _fold_reference(n: int, count: int, dtype: np.dtype, op: str, salt: int) -> np.ndarray:
    """Every rank's ``data`` folded left to right in rank order, as the outboxes fold."""
    from gpucoll.ops import finish_avg, host_ufunc

    ufunc = host_ufunc(ReduceOp(op))
    want = data(0, count, dtype, salt)
    for r in range(1, n):
        want = ufunc(want, data(r, count, dtype, salt))
    if op == "avg":
        finish_avg(want, n)
    return want


def _through_the_outboxes(rank, n, addr):
    """Every case in place, out of place and asynchronously, between collectives of other
    paths; returns the cases whose result differs from the reference and how many calls went
    through the outboxes."""
    import gpucoll
    from gpucoll.backends import ring_algos

    real, calls = ring_algos.all_reduce_outboxes, []
    ring_algos.all_reduce_outboxes = lambda *a: calls.append(1) or real(*a)
    wrong = []
    with gpucoll.init("ring", rank=rank, world_size=n, store=addr, timeout=60) as comm:
        for i, (name, op, count) in enumerate(OUTBOX_CASES):
            dtype = _dtype(name)
            want = _fold_reference(n, count, dtype, op, i)
            x = data(rank, count, dtype, i)
            out = comm.all_reduce(x, op=op, out=np.empty_like(x))
            comm.all_reduce(x, op=op)
            y = data(rank, count, dtype, i)
            comm.all_reduce(y, op=op, async_op=True).wait()
            for how, got in (("out of place", out), ("in place", x), ("async", y)):
                if got.tobytes() != want.tobytes():
                    wrong.append(f"{name} {op} {count} {how}")
            small = np.full(3, rank, np.float32)
            comm.broadcast(small, root=i % n)  # other paths between: the counters go on
            if not (small == i % n).all():
                wrong.append(f"broadcast after {name}")
    return wrong, len(calls)


@pytest.mark.parametrize("n", grid([2, 3, 4], 2))
def test_large_all_reduces_through_the_outboxes_are_exact_in_every_form(store_addr, n):
    results = spawn(_through_the_outboxes, n, store_addr, timeout=240,
                    env={"GPUCOLL_TRANSPORT": "shm"})
    assert results == [([], 3 * len(OUTBOX_CASES))] * n


def _outbox_input_kept(rank, n, addr):
    """Out of place, the input is only read."""
    import gpucoll

    with gpucoll.init("ring", rank=rank, world_size=n, store=addr, timeout=60) as comm:
        x = data(rank, 3 * SLOT + 11, np.dtype("float32"))
        before = x.copy()
        x.flags.writeable = False
        out = comm.all_reduce(x, out=np.zeros_like(x))
        return x.tobytes() == before.tobytes(), float(out[0]), float(sum(
            data(r, 3 * SLOT + 11, np.dtype("float32"))[0] for r in range(n)))


def test_an_out_of_place_all_reduce_through_the_outboxes_leaves_its_input_alone(store_addr):
    for kept, got, want in spawn(_outbox_input_kept, 3, store_addr, timeout=90,
                                 env={"GPUCOLL_TRANSPORT": "shm"}):
        assert kept and got == want


def _out_of_place_beside_in_place(rank, n, addr, hosts):
    """Large all_reduces with even ranks out of place (read-only input, synchronous and
    asynchronous) and odd ranks in place, in one call: (input kept, sum exact, each case's
    result bytes, the same call all in place's)."""
    import os

    import gpucoll

    os.environ["GPUCOLL_HOST_ID"] = f"host{rank * hosts // n}"
    count = 1_500_007  # 6 MB of float32: past the one-round paths, several pieces a segment
    with gpucoll.init("ring", rank=rank, world_size=n, store=addr, timeout=60) as comm:
        kept, results = True, []
        for op, async_op in (("sum", False), ("avg", True), ("max", False)):
            x = data(rank, count, np.dtype("float32"))
            before = x.copy()
            x.flags.writeable = False
            if rank % 2 == 0:
                out = np.full_like(x, np.nan)
                work = comm.all_reduce(x, op=op, out=out, async_op=async_op)
                if async_op:
                    work.wait()
            else:
                out = x.copy()
                comm.all_reduce(out, op=op)
            kept &= x.tobytes() == before.tobytes()
            again = before.copy()
            comm.all_reduce(again, op=op)
            results.append((out.tobytes() == again.tobytes(), hash(out.tobytes())))
        want = sum(data(r, count, np.dtype("float32")) for r in range(n))
        return kept, results[0][1] == hash(want.tobytes()), results


@pytest.mark.parametrize(("n", "transport", "hosts"), grid(
    [(2, "shm", 1), (3, "tcp", 1), (4, "auto", 2)], [(2, "shm", 1)], rows=True),
    ids=["outboxes-shm", "ring-tcp", "two-hosts"])
def test_a_large_out_of_place_all_reduce_reads_its_input_where_in_place_reads_out(
        store_addr, n, transport, hosts):
    said = spawn(_out_of_place_beside_in_place, n, store_addr, hosts, timeout=120,
                 env={"GPUCOLL_TRANSPORT": transport})
    for kept, exact, results in said:
        assert kept and exact
        assert all(same for same, _ in results), results
    assert len({tuple(results) for _, _, results in said}) == 1  # bit-identical on every rank


def _outboxes_with_messages_in_flight(rank, n, addr):
    """Rank 0 sends rank 1 a message four times their ring without waiting, then makes a large
    all_reduce; rank 1 posts its receive only once rank 0 is in that call, then joins it. Rank
    0's engine is busy with the message when it meets the others in the outboxes (its frame
    header queues behind it on the link); the message must arrive whole and the sums be exact."""
    import gpucoll
    from gpucoll.backends import ring_algos
    from gpucoll.store import TCPStore, parse_address

    side = TCPStore(*parse_address(addr), timeout=60)
    real, busy = ring_algos.all_reduce_outboxes, []

    def spy(s, *args):
        busy.append(bool(s.engine.active or s.engine.inbox))
        if rank == 0:
            side.set("in the call", b"")
        return real(s, *args)

    ring_algos.all_reduce_outboxes = spy
    count, big = 3 * SLOT + 7, np.arange(2_000_000, dtype=np.float32)
    x = data(rank, count, np.dtype("float32"))
    with gpucoll.init("ring", rank=rank, world_size=n, store=addr, timeout=60) as comm:
        inbox = np.zeros_like(big)
        work = comm.send(big, dst=1, async_op=True) if rank == 0 else None
        if rank == 1:
            side.wait(["in the call"], timeout=60)
            work = comm.recv(inbox, src=0, async_op=True)
        comm.all_reduce(x)
        if work is not None:
            work.wait()
        exact = x.tobytes() == _fold_reference(n, count, np.dtype("float32"), "sum", 0).tobytes()
        side.close()
        return exact, rank != 1 or np.array_equal(inbox, big), rank != 0 or busy == [True]


def test_a_rank_with_messages_in_flight_meets_the_others_in_the_outboxes(store_addr):
    assert spawn(_outboxes_with_messages_in_flight, 3, store_addr, timeout=90,
                 env={"GPUCOLL_TRANSPORT": "shm"}) == [(True, True, True)] * 3


