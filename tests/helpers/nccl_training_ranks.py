"""Rank bodies for the training calls through the NCCL backend, against the emulation.

Each installs an ``EmulatedRuntime`` (device memory = host memory exposing
``__cuda_array_interface__``), checks results against NumPy, returns the NCCL calls the
emulation saw (so tests can say which form ran), and finally asserts no misuse was seen.
"""

from __future__ import annotations

import numpy as np
from nccl_ranks import check_reduced, data, dev, emulated, reduce_all

import gpucoll
from gpucoll.backends.nccl import backend as nccl_backend


def _host(a) -> np.ndarray:
    return a.get()


def _calls(comm) -> list[str]:
    return [name for name, _ in comm._backend._nc.comm.calls]


def out_of_place(rank: int, n: int, addr: str) -> list[str]:
    with emulated(addr, rank, n) as (rt, comm):
        for op, dtype in (("sum", np.float32), ("max", np.int32), ("avg", np.float64),
                          ("band", np.int32), ("sum", np.complex64)):
            x, y = dev(rt, data(rank, (3, 5), dtype)), dev(rt, np.zeros((3, 5), dtype))
            assert comm.all_reduce(x, op=op, out=y) is y
            check_reduced(_host(y), op, [data(r, (3, 5), dtype) for r in range(n)], op)
            assert np.array_equal(_host(x), data(rank, (3, 5), dtype))
        for root in range(n):
            x = dev(rt, data(rank, (7,), np.float32))
            out = dev(rt, np.zeros(7, np.float32)) if rank == root or rank % 2 else None
            got = comm.reduce(x, root=root, op="sum", out=out) if out is not None else \
                comm.reduce(x, root=root, op="sum")
            if rank == root:
                want = reduce_all("sum", [data(r, (7,), np.float32) for r in range(n)])
                assert np.array_equal(_host(got), want)
            assert np.array_equal(_host(x), data(rank, (7,), np.float32))
            src = dev(rt, data(root, (4,), np.int64)) if rank == root else None
            out = dev(rt, np.zeros(4, np.int64))
            assert comm.broadcast(src, root=root, out=out) is out
            assert np.array_equal(_host(out), data(root, (4,), np.int64))
        return _calls(comm)


def uneven(rank: int, n: int, addr: str, form: str) -> list[str]:
    """Every uneven call; ``form`` picks the all-gather's form for these small sizes."""
    if form == "padded":
        nccl_backend.PADDED_MIN_BYTES, nccl_backend.PADDED_MAX_WASTE = 0, 100.0
    elif form == "sends":
        nccl_backend.BROADCAST_MAX_BYTES = -1
    with emulated(addr, rank, n) as (rt, comm):
        mine = data(rank, (rank + 1, 3), np.float32)
        rows = [data(r, (r + 1, 3), np.float32) for r in range(n)]
        got = comm.all_gather_v(dev(rt, mine))
        assert [_host(g).tolist() for g in got] == [r.tolist() for r in rows]
        tiled = comm.all_gather_v(dev(rt, mine), counts=[r + 1 for r in range(n)], tiled=True)
        assert np.array_equal(_host(tiled), np.concatenate(rows))
        root = n - 1
        g = comm.gather_v(dev(rt, mine), root=root)
        assert (g is None) == (rank != root)
        if g is not None:
            assert [_host(a).tolist() for a in g] == [r.tolist() for r in rows]
        chunks = [dev(rt, np.full((j + 1, 2), rank * 10 + j, np.int64)) for j in range(n)]
        back = comm.all_to_all_v(chunks)
        for j, part in enumerate(back):
            assert np.array_equal(_host(part), np.full((rank + 1, 2), j * 10 + rank))
        s = comm.scatter_v(chunks if rank == 0 else None, root=0)
        assert np.array_equal(_host(s), np.full((rank + 1, 2), rank))
        counts = [k + 1 for k in range(n)]
        for op, dtype in (("sum", np.float32), ("bxor", np.int16), ("avg", np.float64)):
            x = data(rank, (sum(counts), 2), dtype)
            red = comm.reduce_scatter_v(dev(rt, x), counts, op)
            start = sum(counts[:rank])
            slots = [data(r, (sum(counts), 2), dtype)[start:start + counts[rank]]
                     for r in range(n)]
            check_reduced(_host(red), op, slots, op)
        return _calls(comm)


def objects(rank: int, n: int, addr: str) -> None:
    with emulated(addr, rank, n) as (rt, comm):
        meta = {"step": 7, "weights": np.arange(100_000, dtype=np.float32)}
        got = comm.broadcast_object(meta if rank == 0 else None)
        assert got["step"] == 7 and np.array_equal(got["weights"], meta["weights"])
        every = comm.all_gather_object({"rank": rank, "a": np.full(70_000, rank)})
        assert [e["rank"] for e in every] == list(range(n))
        assert all(np.array_equal(e["a"], np.full(70_000, r)) for r, e in enumerate(every))
        assert comm.gather_object(rank * 3, root=1) == ([r * 3 for r in range(n)]
                                                        if rank == 1 else None)
        assert comm.scatter_object([f"to {r}" for r in range(n)] if rank == 0 else None) == \
            f"to {rank}"
        if rank == 0:
            comm.send_object([np.ones(80_000)] * 8, 1)
        elif rank == 1:
            got = comm.recv_object(0)
            assert len(got) == 8 and all(np.array_equal(a, np.ones(80_000)) for a in got)


def batched(rank: int, n: int, addr: str) -> list[str]:
    with emulated(addr, rank, n) as (rt, comm):
        nxt, prv = (rank + 1) % n, (rank - 1) % n
        x = dev(rt, np.full(1 << 10, rank, np.float32))
        y = dev(rt, np.zeros(1 << 10, np.float32))
        with comm.batch() as b:
            comm.isend(x, nxt)
            comm.irecv(y, prv)
        b.wait()
        rt.synchronize()
        assert np.array_equal(_host(y), np.full(1 << 10, prv))
        ops = [gpucoll.P2POp(comm.irecv, x, prv), gpucoll.P2POp("isend", y, nxt)]
        works = comm.batch_isend_irecv(ops)
        assert works[0].wait() is x
        rt.synchronize()
        assert np.array_equal(_host(x), np.full(1 << 10, (rank - 2) % n))
        return _calls(comm)


def fused(rank: int, n: int, addr: str) -> list[str]:
    with emulated(addr, rank, n) as (rt, comm):
        arrays = [dev(rt, data(rank, (i + 1, 3), np.float32)) for i in range(5)]
        arrays.append(dev(rt, data(rank, (4,), np.int32)))
        comm.all_reduce_many(arrays, "max")
        for i, a in enumerate(arrays[:5]):
            want = reduce_all("max", [data(r, (i + 1, 3), np.float32) for r in range(n)])
            assert np.array_equal(_host(a), want)
        bucket = gpucoll.Bucket([(3,), (2, 2)], np.float64, kind="device")
        bucket[0][...] = rank
        bucket[1][...] = 1.0
        comm.all_reduce_many(bucket)
        assert np.array_equal(_host(bucket.flat), [sum(range(n))] * 3 + [n] * 4)
        return _calls(comm)


def groups(rank: int, n: int, addr: str) -> None:
    with emulated(addr, rank, n) as (rt, comm):
        comm.monitored_barrier(timeout=20)
        sub = comm.new_group([0, n - 1])
        assert (sub is None) == (rank not in (0, n - 1))
        if sub is not None:
            assert sub.size == 2 and sub.rank == (0 if rank == 0 else 1)
            x = dev(rt, np.full(3, rank, np.float32))
            sub.all_reduce(x)
            assert np.array_equal(_host(x), np.full(3, n - 1))
            sub.close()
