"""Hostile uses of the training calls: ranks that disagree on dtypes, trailing shapes, counts or
member lists, a rank that never comes to a monitored barrier or dies before it, an object
receiver that meets a plain send. Every one ends in an error naming the ranks on every rank
(never a hang: each call has a deadline well inside the spawn's, and a hang would show as
CollectiveTimeout), on shared memory and TCP."""

from __future__ import annotations

import os

import numpy as np
import pytest
from multiproc import spawn
from tiers import grid

import gpucoll

pytestmark = pytest.mark.timeout(240)
TRANSPORTS = grid(["shm", "tcp"], "shm")
CALL_TIMEOUT = 30.0


def _comm(rank: int, n: int, addr: str):
    return gpucoll.init("ring", rank=rank, world_size=n, store=addr, timeout=CALL_TIMEOUT)


def _outcome(fn) -> tuple[str, str]:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test reads the kind and the message
        return type(exc).__name__, str(exc)
    return "ok", ""


def _run(transport: str, body, n: int, addr: str, *args) -> list:
    return spawn(body, n, addr, *args, timeout=180, env={"GPUCOLL_TRANSPORT": transport})


# -- dtype and trailing shape: caught in the exchange of sizes, before any data ----------------

DISAGREEING = {
    "all_gather_v": lambda c, x: c.all_gather_v(x),
    "gather_v": lambda c, x: c.gather_v(x, root=2),
    "all_to_all_v": lambda c, x: c.all_to_all_v([x] * c.size),
}


def disagree_on_dtype_then_go_on(rank: int, n: int, addr: str, call: str, what: str) -> tuple:
    with gpucoll.init("ring", rank=rank, world_size=n, store=addr, timeout=CALL_TIMEOUT) as c:
        x = np.ones((rank + 1, 3), np.float32)
        if rank == 1 and what == "dtype":
            x = x.astype(np.float64)
        if rank == 1 and what == "shape":
            x = np.ones((rank + 1, 4), np.float32)
        outcome = _outcome(lambda: DISAGREEING[call](c, x))
        after = c.all_gather_object(rank)  # the communicator is still usable
        return outcome, after


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("call", sorted(DISAGREEING))
@pytest.mark.parametrize("what, detail", [
    ("dtype", "ranks 0, 2 pass float32 (k, 3); rank 1 passes float64 (k, 3)"),
    ("shape", "ranks 0, 2 pass float32 (k, 3); rank 1 passes float32 (k, 4)"),
])
def test_a_dtype_or_trailing_shape_disagreement_fails_every_rank_before_data_moves(
        store_addr, transport, call, what, detail):
    results = _run(transport, disagree_on_dtype_then_go_on, 3, store_addr, call, what)
    for rank, ((kind, message), after) in enumerate(results):
        assert kind == "CollectiveMismatch", (rank, kind, message)
        assert detail in message and "no data moved" in message, message
        assert after == [0, 1, 2]


# -- counts= that differ on one rank: caught by the digest in the frames ----------------------

def _counts_case(c, name: str, counts: list[int], rank: int):
    rows = counts[rank]
    if name == "all_gather_v":
        return c.all_gather_v(np.ones((rows, 2), np.float32), counts=counts)
    if name == "all_gather_v_ring":  # large enough for the ring schedule
        return c.all_gather_v(np.ones((rows * 20_000, 2), np.float32),
                              counts=[k * 20_000 for k in counts])
    if name == "gather_v":
        return c.gather_v(np.ones((rows, 2), np.float32), root=0, counts=counts)
    if name == "scatter_v":
        chunks = [np.ones((k, 2), np.float32) for k in counts]
        return c.scatter_v(chunks if rank == 0 else None, 0, counts=counts,
                           out=np.zeros((rows, 2), np.float32))
    if name == "all_to_all_v":
        return c.all_to_all_v([np.ones((counts[rank], 2), np.float32)] * c.size, counts=counts)
    if name == "reduce_scatter_v":
        return c.reduce_scatter_v(np.ones((sum(counts), 2), np.float32), counts)
    if name == "reduce_scatter_v_ring":
        big = [k * 20_000 for k in counts]
        return c.reduce_scatter_v(np.ones((sum(big), 2), np.float32), big)
    raise AssertionError(name)


def wrong_counts_on_one_rank(rank: int, n: int, addr: str, name: str, auto_elsewhere: bool):
    with _comm(rank, n, addr) as c:
        counts = [1, 2, 3]
        if rank == 2:  # locally consistent, globally wrong
            counts = [1, 1, 3] if name != "all_to_all_v" else [2, 2, 3]
        if auto_elsewhere and rank != 2:
            result = _outcome(lambda: c.all_gather_v(np.ones((counts[rank], 2), np.float32)))
        else:
            result = _outcome(lambda: _counts_case(c, name, counts, rank))
        if result[0] == "ok":  # this rank's part completed: the next call hears of it
            result = ("next call: " + _outcome(lambda: c.barrier())[0],
                      _outcome(lambda: c.barrier())[1])
        try:
            c.close()
        except gpucoll.GpucollError:
            pass
        return result


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("name", ["all_gather_v", "all_gather_v_ring", "gather_v", "scatter_v",
                                  "all_to_all_v", "reduce_scatter_v", "reduce_scatter_v_ring"])
def test_counts_that_differ_on_one_rank_are_a_mismatch_not_a_hang(store_addr, transport, name):
    results = _run(transport, wrong_counts_on_one_rank, 3, store_addr, name, False)
    kinds = [kind for kind, _ in results]
    assert all(k in ("CollectiveMismatch", "next call: CollectiveMismatch") for k in kinds), \
        results
    assert "CollectiveMismatch" in kinds  # at least the ranks that met the odd one, in the call
    messages = " ".join(m for _, m in results)
    assert "counts/shape digest" in messages or "elements" in messages, messages


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_counts_on_one_rank_and_an_exchange_on_the_others_is_a_mismatch(store_addr, transport):
    results = _run(transport, wrong_counts_on_one_rank, 3, store_addr, "all_gather_v", True)
    assert all(kind.endswith("CollectiveMismatch") for kind, _ in results), results


# -- objects, groups, barriers ----------------------------------------------------------------

def recv_object_meets_a_plain_send(rank: int, n: int, addr: str) -> tuple:
    with _comm(rank, n, addr) as c:
        if rank == 0:
            c.send(np.zeros(8, np.int64), 1)
            return ("ok", "")
        return _outcome(lambda: c.recv_object(0))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_recv_object_names_a_send_that_is_not_an_object(store_addr, transport):
    results = _run(transport, recv_object_meets_a_plain_send, 2, store_addr)
    assert results[1][0] == "CollectiveMismatch"
    assert "what rank 0 sent is not an object header" in results[1][1]


def new_group_disagreement(rank: int, n: int, addr: str) -> tuple:
    with _comm(rank, n, addr) as c:
        outcome = _outcome(lambda: c.new_group([0, 1] if rank == 2 else [0, 2]))
        return outcome, c.all_gather_object(rank)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_new_group_with_different_member_lists_fails_everywhere(store_addr, transport):
    results = _run(transport, new_group_disagreement, 3, store_addr)
    for (kind, message), after in results:
        assert kind == "CollectiveMismatch" and "different member lists" in message, message
        assert after == [0, 1, 2]


def absent_from_monitored_barrier(rank: int, n: int, addr: str, dies: bool) -> tuple:
    c = _comm(rank, n, addr)
    store = c._store
    if rank == 2:
        if dies:
            os._exit(3)
        store.wait(["test/failed/0", "test/failed/1"], timeout=60)  # absent until they gave up
        try:
            c.close()
        except gpucoll.GpucollError:
            pass
        return ("absent", "", None)
    store.set(f"test/ready/{rank}", b"1")  # ranks 0 and 1 come together, however loaded the
    store.wait(["test/ready/0", "test/ready/1"], timeout=60)  # machine: only rank 2 is missing
    try:
        c.monitored_barrier(timeout=3.0)
        return ("ok", "", None)
    except gpucoll.GpucollError as exc:
        return (type(exc).__name__, str(exc), exc.peer)
    finally:
        store.set(f"test/failed/{rank}", b"1")
        try:
            c.close()
        except gpucoll.GpucollError:
            pass


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_monitored_barrier_names_the_rank_that_never_arrived(store_addr, transport):
    results = _run(transport, absent_from_monitored_barrier, 3, store_addr, False)
    for kind, message, _ in results[:2]:
        assert kind == "CollectiveTimeout", message
        assert "rank 2 never arrived within" in message and "monitored_barrier" in message


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_monitored_barrier_names_a_rank_that_died(store_addr, transport):
    outcomes = spawn(absent_from_monitored_barrier, 3, store_addr, True, timeout=180,
                     env={"GPUCOLL_TRANSPORT": transport}, check=False)
    assert outcomes[2].exitcode == 3
    for o in outcomes[:2]:
        kind, message, peer = o.value
        assert kind == "PeerFailure" and peer == 2 and "rank 2 died" in message, message


# -- the debug check accepts what differs legitimately -----------------------------------------

def debug_mode_calls(rank: int, n: int, addr: str) -> list:
    with _comm(rank, n, addr) as c:
        got = c.all_gather_v(np.ones((rank + 1, 2), np.float32))
        obj = c.broadcast_object({"r": rank} if rank == 0 else None)
        c.all_reduce_many([np.ones(3), np.ones((2, 2))])
        with c.batch() as b:
            c.isend(np.ones(4), (rank + 1) % n)
            c.irecv(np.zeros(4), (rank - 1) % n)
        b.wait()
        bad = _outcome(lambda: c.all_gather_v(np.ones((1, 2 + (rank == 1)), np.float32)))
        return [len(got), obj, bad[0]]


def test_debug_mode_accepts_uneven_rows_and_catches_other_disagreements(store_addr):
    results = spawn(debug_mode_calls, 3, store_addr, timeout=180, env={"GPUCOLL_DEBUG": "1"})
    assert all(r[:2] == [3, {"r": 0}] for r in results)
    assert all(r[2] == "CollectiveMismatch" for r in results)
