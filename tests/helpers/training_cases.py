"""The training calls checked against NumPy on one communicator: each case is a function of
the communicator that raises on a wrong result. Every rank runs the same cases in the same
order; ``run`` returns ``{case name: (topic, error text or "")}``.

A rank's inputs are pure functions of its rank, so each rank computes what it must get. Values
are small integers (floats too), so sums are exact in any order and compared for equality.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable

import numpy as np

import gpucoll
from gpucoll import objects

CASES: list[tuple[str, str, Callable]] = []  # (topic, name, body)


def case(topic: str):
    def register(fn: Callable) -> Callable:
        CASES.append((topic, fn.__name__, fn))
        return fn
    return register


def val(rank: int, shape, dtype=np.float32, salt: int = 0) -> np.ndarray:
    n = int(np.prod(shape))
    return ((np.arange(n) % 11 + rank * 3 + salt) % 50).reshape(shape).astype(dtype)


def reduced(op: str, parts: list, dtype) -> np.ndarray:
    """What reducing ``parts`` (one per rank) with ``op`` gives, in ``dtype``."""
    if op == "avg":
        return (sum(parts) / len(parts)).astype(dtype)
    ufunc = {"sum": np.add, "max": np.maximum, "min": np.minimum, "bxor": np.bitwise_xor}[op]
    return np.asarray(ufunc.reduce(parts), dtype)


def check(got, want, what: str = "") -> None:
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape or got.dtype != want.dtype or not np.array_equal(got, want):
        raise AssertionError(f"{what}: got {got.dtype}{got.shape} {got.ravel()[:6]}, want "
                             f"{want.dtype}{want.shape} {want.ravel()[:6]}")


# -- out of place ------------------------------------------------------------------------------

@case("out_of_place")
def all_reduce_out_leaves_x_and_fills_out(comm):
    for count, dtype, op in ((5, np.float32, "sum"), (70_001, np.float64, "sum"),
                             (7, np.int32, "max"), (40_000, np.int64, "bxor"),
                             (9, np.float32, "avg")):
        x = val(comm.rank, (count,), dtype)
        out = np.full(count, -1, dtype)
        assert comm.all_reduce(x, op, out=out) is out
        want = reduced(op, [val(r, (count,), dtype) for r in range(comm.size)], dtype)
        check(out, want, f"all_reduce {op} {count}")
        check(x, val(comm.rank, (count,), dtype), "x unchanged")


@case("out_of_place")
def reduce_out_fills_roots_out_only(comm):
    for root in range(comm.size):
        for count in (3, 70_001):
            x = val(comm.rank, (count,))
            out = np.full(count, -1, np.float32)
            got = comm.reduce(x, root, out=out if comm.rank == root or comm.rank % 2 else None)
            if comm.rank == root:
                assert got is out
                check(out, sum(val(r, (count,)) for r in range(comm.size)), "reduce out")
            else:
                check(out, np.full(count, -1, np.float32), "out untouched off root")
            check(x, val(comm.rank, (count,)), "x unchanged")


@case("out_of_place")
def broadcast_out_fills_every_out(comm):
    for root in range(comm.size):
        for count in (4, 70_001):
            x = val(comm.rank, (count,), np.int16) if comm.rank == root else None
            out = np.zeros(count, np.int16)
            assert comm.broadcast(x, root, out=out) is out
            check(out, val(root, (count,), np.int16), "broadcast out")


@case("out_of_place")
def out_of_place_async_returns_out(comm):
    x, out = val(comm.rank, (6, 2)), np.zeros((6, 2), np.float32)
    assert comm.all_reduce(x, out=out, async_op=True).wait() is out
    check(out, sum(val(r, (6, 2)) for r in range(comm.size)), "async out")


# -- uneven sizes ------------------------------------------------------------------------------

def rows_of(rank: int) -> int:
    return (rank * 2 + 1) % 4  # 1, 3, 1, 3: and 0 rows nowhere; see zero_rows


@case("uneven")
def all_gather_v_returns_every_ranks_rows(comm):
    for trailing, dtype, scale in (((3,), np.float32, 1), ((), np.int64, 1),
                                   ((2, 2), np.float64, 1), ((5,), np.float32, 4000)):
        k = rows_of(comm.rank) * scale
        x = val(comm.rank, (k, *trailing), dtype)
        got = comm.all_gather_v(x)
        assert isinstance(got, list) and len(got) == comm.size
        for r, part in enumerate(got):
            check(part, val(r, (rows_of(r) * scale, *trailing), dtype), f"slot {r}")


@case("uneven")
def all_gather_v_with_counts_tiled_and_out(comm):
    counts = [rows_of(r) for r in range(comm.size)]
    x = val(comm.rank, (counts[comm.rank], 3))
    want = np.concatenate([val(r, (counts[r], 3)) for r in range(comm.size)])
    check(comm.all_gather_v(x, counts=counts, tiled=True), want, "tiled")
    out = np.zeros_like(want)
    parts = comm.all_gather_v(x, counts=counts, out=out)
    check(out, want, "out")
    assert all(np.shares_memory(p, out) for p in parts if p.size)
    assert comm.all_gather_v(x, counts=counts, out=out, tiled=True) is out


@case("uneven")
def zero_rows_on_some_ranks(comm):
    counts = [0 if r % 2 else 2 for r in range(comm.size)]
    x = val(comm.rank, (counts[comm.rank], 4))
    got = comm.all_gather_v(x)
    for r in range(comm.size):
        check(got[r], val(r, (counts[r], 4)), f"slot {r}")
    g = comm.gather_v(x, root=comm.size - 1)
    if comm.rank == comm.size - 1:
        check(np.concatenate(g), np.concatenate([val(r, (counts[r], 4)) for r in
                                                range(comm.size)]), "gather")


@case("uneven")
def gather_v_on_each_root(comm):
    for root in range(comm.size):
        x = val(comm.rank, (rows_of(comm.rank) + root, 2), np.int32)
        got = comm.gather_v(x, root)
        if comm.rank != root:
            assert got is None
            continue
        for r, part in enumerate(got):
            check(part, val(r, (rows_of(r) + root, 2), np.int32), f"root {root} slot {r}")
    counts = [rows_of(r) for r in range(comm.size)]
    tiled = comm.gather_v(val(comm.rank, (counts[comm.rank],)), 0, counts=counts, tiled=True)
    if comm.rank == 0:
        check(tiled, np.concatenate([val(r, (counts[r],)) for r in range(comm.size)]), "tiled")


@case("uneven")
def scatter_v_from_each_root(comm):
    for root in range(comm.size):
        chunks = [val(j, (j + 1, 3), np.float64, salt=root) for j in range(comm.size)]
        got = comm.scatter_v(chunks if comm.rank == root else None, root)
        check(got, val(comm.rank, (comm.rank + 1, 3), np.float64, salt=root), f"root {root}")
    counts = [j + 2 for j in range(comm.size)]
    out = np.zeros((counts[comm.rank],), np.uint8)
    chunks = [val(j, (counts[j],), np.uint8) for j in range(comm.size)]
    got = comm.scatter_v(chunks if comm.rank == 0 else None, 0, counts=counts, out=out)
    assert got is out
    check(out, val(comm.rank, (counts[comm.rank],), np.uint8), "counts= and out=")


@case("uneven")
def all_to_all_v_sends_each_rank_its_chunk(comm):
    for scale in (1, 3000):
        chunks = [val(comm.rank * 10 + j, ((j + comm.rank) % 3 * scale, 2)) for j in
                  range(comm.size)]
        got = comm.all_to_all_v(chunks)
        for j, part in enumerate(got):
            check(part, val(j * 10 + comm.rank, ((comm.rank + j) % 3 * scale, 2)),
                  f"from {j}")
    counts = [(comm.rank + j) % 3 for j in range(comm.size)]
    chunks = [val(comm.rank * 10 + j, ((j + comm.rank) % 3, 2)) for j in range(comm.size)]
    tiled = comm.all_to_all_v(chunks, counts=counts, tiled=True)
    check(tiled, np.concatenate([val(j * 10 + comm.rank, (counts[j], 2)) for j in
                                 range(comm.size)]), "counts= tiled")


@case("uneven")
def reduce_scatter_v_gives_each_rank_its_rows(comm):
    for scale, op, dtype in ((1, "sum", np.float32), (5000, "sum", np.float64),
                             (1, "min", np.int32), (3000, "avg", np.float32)):
        counts = [rows_of(r) * scale for r in range(comm.size)]
        x = val(comm.rank, (sum(counts), 2), dtype)
        got = comm.reduce_scatter_v(x, counts, op)
        whole = reduced(op, [val(r, (sum(counts), 2), dtype) for r in range(comm.size)], dtype)
        start = sum(counts[:comm.rank])
        check(got, whole[start:start + counts[comm.rank]], f"{op} x{scale}")


@case("uneven")
def uneven_calls_run_asynchronously(comm):
    x = val(comm.rank, (rows_of(comm.rank), 2))
    w1 = comm.all_gather_v(x, async_op=True)
    w2 = comm.all_to_all_v([x] * comm.size, async_op=True)
    got = w1.wait()
    assert len(got) == comm.size and len(w2.wait()) == comm.size
    check(got[0], val(0, (rows_of(0), 2)), "async")


# -- objects -----------------------------------------------------------------------------------

def big(rank: int, n: int = 100_000) -> np.ndarray:
    return np.arange(n, dtype=np.float64) + rank


@case("objects")
def broadcast_object_from_each_root(comm):
    for root in range(comm.size):
        obj = {"root": root, "w": big(root), "note": "x" * 100}
        got = comm.broadcast_object(obj if comm.rank == root else None, root)
        if comm.rank == root:
            assert got is obj
        else:
            assert got["root"] == root and got["note"] == "x" * 100
            check(got["w"], big(root), "array")
            # the array was received out of band: it is a view of the received buffer
            assert not got["w"].flags.owndata and got["w"].flags.writeable


@case("objects")
def all_gather_object_returns_copies_in_rank_order(comm):
    mine = {"rank": comm.rank, "a": big(comm.rank, 40_000 * (comm.rank + 1))}
    got = comm.all_gather_object(mine)
    assert [g["rank"] for g in got] == list(range(comm.size))
    for r, g in enumerate(got):
        check(g["a"], big(r, 40_000 * (r + 1)), f"rank {r}")
    assert got[comm.rank] is not mine and not np.shares_memory(got[comm.rank]["a"], mine["a"])


@case("objects")
def gather_and_scatter_object(comm):
    for root in range(comm.size):
        got = comm.gather_object((comm.rank, "s" * comm.rank), root)
        assert got == ([(r, "s" * r) for r in range(comm.size)] if comm.rank == root else None)
        objs = [{"for": r, "a": big(r, 50_000)} for r in range(comm.size)]
        mine = comm.scatter_object(objs if comm.rank == root else None, root)
        assert mine["for"] == comm.rank
        check(mine["a"], big(comm.rank, 50_000), "scatter")


@case("objects")
def objects_with_many_buffers(comm):
    many = [np.full(40_000, k, np.int64) for k in range(9)]  # more lengths than the head holds
    got = comm.broadcast_object(many if comm.rank == 0 else None)
    assert all(np.array_equal(a, m) for a, m in zip(got, many, strict=True))
    every = comm.all_gather_object(many if comm.rank % 2 == 0 else comm.rank)
    for r, e in enumerate(every):
        assert e == r if r % 2 else all(np.array_equal(a, m) for a, m in zip(e, many,
                                                                          strict=True))
    s = comm.scatter_object([many if r % 2 else r for r in range(comm.size)]
                            if comm.rank == 0 else None)
    assert s == comm.rank if comm.rank % 2 == 0 else len(s) == 9


@case("objects")
def objects_in_pieces_under_a_small_message_limit(comm):
    limit = objects.MESSAGE_BYTES
    objects.MESSAGE_BYTES = 4096
    try:
        obj = {"a": big(0, 300_000), "b": b"y" * 50_000}
        got = comm.broadcast_object(obj if comm.rank == 0 else None)
        check(got["a"], obj["a"], "pieces")
        assert got["b"] == obj["b"]
        every = comm.all_gather_object(big(comm.rank, 20_000 + comm.rank))
        for r, e in enumerate(every):
            check(e, big(r, 20_000 + r), f"rank {r}")
        if comm.size > 1:
            if comm.rank == 0:
                comm.send_object(obj, 1)
            elif comm.rank == 1:
                got = comm.recv_object(0)
                check(got["a"], obj["a"], "p2p pieces")
    finally:
        objects.MESSAGE_BYTES = limit


@case("objects")
def send_and_recv_object_around_a_ring(comm):
    if comm.size == 1:
        return
    nxt, prv = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    for _ in range(2):  # even ranks send first, odd ones receive first: no cycle
        if comm.rank % 2 == 0:
            comm.send_object({"from": comm.rank, "a": big(comm.rank, 60_000)}, nxt)
            got = comm.recv_object(prv)
        else:
            got = comm.recv_object(prv)
            comm.send_object({"from": comm.rank, "a": big(comm.rank, 60_000)}, nxt)
        assert got["from"] == prv
        check(got["a"], big(prv, 60_000), "ring")


@case("objects")
def an_unpicklable_object_fails_everywhere_and_the_group_goes_on(comm):
    odd = comm.size - 1
    try:
        comm.all_gather_object(threading.Lock() if comm.rank == odd else comm.rank)
    except TypeError as exc:  # the rank that had it: its own error
        assert comm.rank == odd, exc
    except Exception as exc:  # the others: PicklingError naming the rank
        assert type(exc).__name__ == "PicklingError" and f"rank {odd}" in str(exc), exc
    else:
        raise AssertionError("no error")
    assert comm.all_gather_object(comm.rank) == list(range(comm.size))


# -- fused -------------------------------------------------------------------------------------

@case("fused")
def all_reduce_many_of_mixed_shapes_and_dtypes(comm):
    arrays = [val(comm.rank, (i % 4 + 1, 3)) for i in range(50)]
    arrays += [val(comm.rank, (5,), np.int64), val(comm.rank, (), np.float64)]
    assert comm.all_reduce_many(arrays) is arrays
    for i, a in enumerate(arrays[:50]):
        check(a, sum(val(r, (i % 4 + 1, 3)) for r in range(comm.size)), f"array {i}")
    check(arrays[50], sum(val(r, (5,), np.int64) for r in range(comm.size)), "int64")
    check(arrays[51], sum(val(r, (), np.float64) for r in range(comm.size)), "0-d")


@case("fused")
def all_reduce_many_of_equal_shapes_and_strided_views(comm):
    arrays = [val(comm.rank, (10, 10), salt=i) for i in range(200)]
    base = np.stack([val(comm.rank, (6,), salt=i) for i in range(4)])
    views = [base[:, ::2], base[:, 1::2]]
    comm.all_reduce_many(arrays + views, "max")
    for i, a in enumerate(arrays):
        check(a, np.maximum.reduce([val(r, (10, 10), salt=i) for r in range(comm.size)]), "eq")
    check(base, np.maximum.reduce([np.stack([val(r, (6,), salt=i) for i in range(4)])
                                   for r in range(comm.size)]), "strided")


@case("fused")
def all_reduce_many_over_the_fusion_limit(comm):
    fused = importlib.import_module("gpucoll.batch")  # the module; gpucoll.batch is a function

    limit, fused.FUSE_BYTES = fused.FUSE_BYTES, 1000
    try:
        arrays = [val(comm.rank, (100 + i,)) for i in range(30)]
        comm.all_reduce_many(arrays, "avg")
        for i, a in enumerate(arrays):
            check(a, (sum(val(r, (100 + i,)) for r in range(comm.size)) / comm.size
                      ).astype(np.float32), f"array {i}")
    finally:
        fused.FUSE_BYTES = limit


@case("fused")
def a_bucket_is_reduced_in_place(comm):
    bucket = gpucoll.Bucket([(3,), (2, 2), 5], np.float32)
    for i, a in enumerate(bucket):
        a[...] = comm.rank + i
    assert comm.all_reduce_many(bucket) is bucket
    for i, a in enumerate(bucket):
        check(a, np.full(a.shape, sum(range(comm.size)) + comm.size * i, np.float32), "bucket")
    assert comm.all_reduce_many(bucket, async_op=True).wait() is bucket


# -- batched point to point --------------------------------------------------------------------

@case("batch")
def a_ring_exchange_of_4_mib_per_step_in_batches(comm):
    if comm.size == 1:
        return
    nxt, prv = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    send = np.full(1 << 20, comm.rank, np.float32)  # 4 MiB
    recv = np.empty_like(send)
    for step in range(2 * comm.size):
        with comm.batch() as b:
            comm.isend(send, nxt)
            comm.irecv(recv, prv)
        b.wait()
        check(recv[:: 1 << 16], np.full(16, (comm.rank - 1 - step) % comm.size, np.float32),
              f"step {step}")
        send, recv = recv, send


@case("batch")
def batch_isend_irecv_with_p2pops(comm):
    if comm.size == 1:
        return
    nxt, prv = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    out = [np.zeros(3, np.int32) for _ in range(3)]
    ops = [gpucoll.P2POp(gpucoll.irecv, out[0], prv), gpucoll.P2POp("isend", val(comm.rank, (3,),
                                                                               np.int32), nxt),
           gpucoll.P2POp(comm.irecv, out[1], prv), gpucoll.P2POp(comm.isend,
                                                                 val(comm.rank, (3,), np.int32,
                                                                     salt=1), nxt)]
    works = comm.batch_isend_irecv(ops)
    assert works[0].wait() is out[0] and works[1].wait() is None
    for w in works:
        w.wait()
    check(out[0], val(prv, (3,), np.int32), "first")
    check(out[1], val(prv, (3,), np.int32, salt=1), "second, in order")


@case("batch")
def isend_and_irecv_outside_a_batch(comm):
    if comm.size == 1:
        return
    nxt, prv = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    got = np.zeros(70_000, np.float64)
    r = comm.irecv(got, prv)
    s = comm.isend(val(comm.rank, (70_000,), np.float64), nxt)
    assert r.wait() is got and s.wait() is None
    check(got, val(prv, (70_000,), np.float64), "irecv")


# -- groups ------------------------------------------------------------------------------------

@case("groups")
def new_group_of_some_ranks(comm):
    members = sorted({0, comm.size - 1})
    sub = comm.new_group(list(reversed(members)))
    if comm.rank not in members:
        assert sub is None
        return
    try:
        assert sub.size == len(members) and sub.rank == members.index(comm.rank)
        assert sub.all_gather_object(comm.rank) == members
    finally:
        sub.close()


@case("groups")
def monitored_barrier_passes_when_all_arrive(comm):
    for _ in range(3):
        comm.monitored_barrier(timeout=30)


def run(comm) -> dict:
    """Every case on this rank: ``{name: (topic, "" or the error)}``; stops at the first
    failure (the ranks may be out of step after it)."""
    report = {}
    for topic, name, body in CASES:
        try:
            body(comm)
            report[name] = (topic, "")
        except Exception as exc:  # noqa: BLE001 - reported to the test
            report[name] = (topic, f"{type(exc).__name__}: {exc}")
            report["stopped"] = ("stopped", f"stopped at {name}")
            break
    return report
