"""Rank bodies for the GPU-hazard tests (``test_gpu_hazards.py``), each in a spawned process on
the emulation: ranks that never come or die at NCCL's start-up, at a first connection, at a
split or during a call; the watchdog against a call inside NCCL; strided write-backs; colours;
ranks that share a GPU; zero-size arrays; avg."""

from __future__ import annotations

import contextlib

import numpy as np
from nccl_emulation import EmulatedRuntime, FakeDeviceArray
from nccl_ranks import check_reduced, emulated

from gpucoll import cuda
from gpucoll.backends.nccl import NcclBackend
from gpucoll.backends.nccl import backend as nccl_backend
from gpucoll.default import create
from gpucoll.errors import CollectiveTimeout, GpucollError, PeerFailure
from gpucoll.selftest import RankOneAway, fails_without_rank_1
from gpucoll.store import Liveness, PrefixStore, TCPStore, parse_address


def _store(addr: str) -> TCPStore:
    return TCPStore(*parse_address(addr), timeout=30)


def _only_the_store_steps(store: TCPStore, rank: int, n: int) -> None:
    """What a rank does of NCCL's start-up before it enters NCCL: arrive, say which GPU it
    drives (its own), read the id."""
    ns = PrefixStore("g/", store)
    liveness = Liveness.of(ns, rank, n)
    nccl_backend.arrive(ns, rank, n, 30, liveness)
    nccl_backend.share_gpus(ns, rank, n, None, f"rank{rank}/gpu", 30, liveness)
    nccl_backend.share_unique_id(ns, rank, None, 30, liveness)


def start_up_without_a_peer(rank: int, n: int, addr: str, dies: bool) -> str:
    """Rank 1 passes the store steps of start-up, then never enters NCCL (or dies): rank 0's
    start-up fails within its deadline and names it."""
    rt = EmulatedRuntime(addr)
    cuda.set_runtime(rt)
    store = _store(addr)
    try:
        with RankOneAway(rank, store, wait=30) as away:
            if rank == 1:
                _only_the_store_steps(store, rank, n)
            if away.stays_away(dies=dies):
                return ""
            # the deadline is for NCCL's part: rank 1's store steps, however late on a loaded
            # machine, must not run it out (rank 1 would then miss the unique id)
            PrefixStore("g/", store).wait([nccl_backend.ARRIVE_KEY.format(1)], timeout=30)
            exc = fails_without_rank_1("start-up", (CollectiveTimeout, PeerFailure),
                                       lambda: NcclBackend(PrefixStore("g/", store), 0, n,
                                                           timeout=1.5))
            return f"{type(exc).__name__}: {exc}"
    finally:
        store.close()
        rt.close()


@contextlib.contextmanager
def _rank_1_away(addr: str, rank: int, n: int):
    """(runtime, store, communicator, ``RankOneAway`` waiting in that store) on the emulation;
    everything is closed on the way out."""
    rt = EmulatedRuntime(addr)
    cuda.set_runtime(rt)
    store = _store(addr)
    comm = create("nccl", rank=rank, world_size=n, store=addr, timeout=30)
    try:
        with RankOneAway(rank, store, wait=30) as away:
            yield rt, store, comm, away
    finally:
        comm.close()
        store.close()
        rt.close()


def first_call_without_a_peer(rank: int, n: int, addr: str, dies: bool) -> str:
    """The communicator is made; rank 1 never makes the first collective (or dies): rank 0's
    first call, which must connect to its peers, fails within its deadline naming rank 1."""
    with _rank_1_away(addr, rank, n) as (rt, _, comm, away):
        if away.stays_away(dies=dies):
            return ""
        x = FakeDeviceArray(np.ones(4, np.float32), rt)
        exc = fails_without_rank_1("a first collective", (CollectiveTimeout, PeerFailure),
                                   lambda: comm.all_reduce(x, timeout=1.5))
        return f"{type(exc).__name__}: {exc}"


def split_without_a_peer(rank: int, n: int, addr: str) -> str:
    """Rank 1 never enters the NCCL split: rank 0's split fails within its deadline."""
    with _rank_1_away(addr, rank, n) as (_, store, comm, away):
        if away.stays_away():
            return ""
        sub_store = PrefixStore("sub/", store)
        exc = fails_without_rank_1("a split", (CollectiveTimeout, PeerFailure),
                                   lambda: comm._backend.split(sub_store, 0, 1, 0, 0,
                                                               timeout=1.5))
        return f"{type(exc).__name__}: {exc}"


def peer_dies_during_a_call(rank: int, n: int, addr: str) -> str:
    """Connected ranks; rank 1 dies instead of joining an all_reduce: rank 0 learns it from the
    store (a PeerFailure naming rank 1), long before the call's 30 s deadline."""
    with emulated(addr, rank, n) as (rt, comm):
        x = FakeDeviceArray(np.ones(4, np.float32), rt)
        comm.barrier()
        RankOneAway(rank).stays_away(dies=True)
        exc = fails_without_rank_1("an all_reduce", PeerFailure, lambda: (
            comm.all_reduce(x, async_op=True, timeout=30).synchronize()))
        return str(exc)


def watchdog_against_a_call_inside_nccl(rank: int, n: int, addr: str) -> str:
    """An async all_reduce misses its 0.5 s deadline while the caller is in its next call (a
    first send, which must connect to rank 1, who never receives). The watchdog must not free
    the communicator under that call: the emulation reports an abort under a call as misuse."""
    with emulated(addr, rank, n) as (rt, comm):
        store = _store(addr)
        try:
            with RankOneAway(rank, store, wait=30) as away:
                x = FakeDeviceArray(np.ones(4, np.float32), rt)
                comm.barrier()
                if away.stays_away():
                    return ""
                comm.all_reduce(x, async_op=True, timeout=0.5)
                exc = fails_without_rank_1("a send", GpucollError,
                                           lambda: comm.send(x, 1, timeout=20))
                return f"{type(exc).__name__}: {exc}"
        finally:
            store.close()


def strided_write_back(rank: int, n: int, addr: str) -> list:
    """A strided x is reduced through a contiguous stand-in on stream s; the stand-in is copied
    back on s after the call, and outlives that copy, though the caller keeps no reference to
    it and the pool hands a freed block out at once."""
    with emulated(addr, rank, n) as (rt, comm):
        s = rt.new_stream()
        big = FakeDeviceArray(np.arange(8, dtype=np.float64) + 10 * rank, rt)
        x = big[::2]  # elements 0, 2, 4, 6: strided
        with rt.paused():
            work = comm.all_reduce(x, async_op=True, stream=s)
            decoy = FakeDeviceArray(np.full(4, -1.0), rt)  # a freed stand-in's block, if any
        work.synchronize()
        got = big.get(stream=s)
        del decoy
        base = np.arange(8, dtype=np.float64)
        want = base + 10 * rank
        want[::2] = sum(base[::2] + 10 * r for r in range(n))
        np.testing.assert_array_equal(got, want)
        return got.tolist()


def colours(rank: int, n: int, addr: str, backend: str, colour: int) -> tuple:
    """Every rank passes ``colour``: one group of all ranks, whatever int it is."""
    rt = EmulatedRuntime(addr)
    cuda.set_runtime(rt)
    comm = create(backend, rank=rank, world_size=n, store=addr, timeout=30)
    try:
        sub = comm.split(colour, key=-rank)
        if sub is None:
            return (None, None)
        x = np.array([rank], np.int64) if backend == "ring" else \
            FakeDeviceArray(np.array([rank], np.int64), rt)
        sub.all_reduce(x)
        total = int(x[0]) if backend == "ring" else int(x.get()[0])
        result = (sub.rank, sub.size, total)
        sub.close()
        return result
    finally:
        comm.close()
        rt.close()
        cuda.set_runtime(None)


def auto_on_one_gpu(rank: int, n: int, addr: str) -> tuple:
    """``backend="auto"`` with every rank on the one GPU of its machine."""
    rt = EmulatedRuntime(addr, devices=1)
    cuda.set_runtime(rt)
    comm = create("auto", rank=rank, world_size=n, store=addr, timeout=30)
    try:
        if comm.backend == "nccl":
            x = FakeDeviceArray(np.array([rank + 1.0]), rt)
            comm.all_reduce(x)
            total = float(x.get()[0])
        else:
            x = np.array([rank + 1.0])
            comm.all_reduce(x)
            total = float(x[0])
        return comm.backend, comm.backend_reason, total
    finally:
        comm.close()
        rt.close()
        cuda.set_runtime(None)


ZERO_SIZE_OPS = ("sum", "bxor", "max")


def zero_size(rank: int, n: int, addr: str) -> list:
    """Every collective on zero-size device arrays (NULL pointers, as CuPy's), including the
    reductions NCCL lacks (an all-gather and a local reduction)."""
    with emulated(addr, rank, n) as (rt, comm):
        shapes = []
        for op, dtype in (("sum", np.float32), ("bxor", np.int32), ("sum", np.int16)):
            x = FakeDeviceArray(np.zeros(0, dtype), rt)
            assert x.ptr == 0
            comm.all_reduce(x, op=op)
            comm.reduce(x, root=0, op=op)
            comm.broadcast(x, root=0)
            shapes.append(comm.all_gather(x).shape)
            shapes.append(comm.reduce_scatter(FakeDeviceArray(np.zeros((n, 0), dtype), rt),
                                              op=op).shape)
            shapes.append(comm.all_to_all(FakeDeviceArray(np.zeros((n, 0), dtype), rt)).shape)
            got = comm.gather(x, root=0)
            shapes.append(None if got is None else got.shape)
            src = FakeDeviceArray(np.zeros((n, 0), dtype), rt) if rank == 0 else None
            shapes.append(comm.scatter(src, root=0).shape)
        if rank == 0:
            comm.send(FakeDeviceArray(np.zeros(0, np.float32), rt), 1)
        elif rank == 1:
            comm.recv(FakeDeviceArray(np.zeros(0, np.float32), rt), 0)
        comm.barrier()
        return shapes


def avg_values(rank: int, n: int, addr: str, backend: str, dtype_name: str) -> list:
    """avg of values where a premultiply by fl(1/n) and a sum divided by n round differently,
    within ``avg_rtol`` of the exact mean on every backend; returns what came out."""
    from gpucoll.arrays import dtype_from_name

    dtype = dtype_from_name(dtype_name)
    parts = [np.array([1.0, 2.0, 7.0, 11.0, 100.0, 0.1], np.float64).astype(dtype) * (r + 1)
             for r in range(n)]
    if backend == "ring":
        comm = create("ring", rank=rank, world_size=n, store=addr, timeout=30)
        with comm:
            x = parts[rank].copy()
            comm.all_reduce(x, op="avg")
            check_reduced(x, "avg", parts, f"ring avg {dtype_name}")
            return x.astype(np.float64).tolist()
    with emulated(addr, rank, n) as (rt, comm):
        x = FakeDeviceArray(parts[rank], rt)
        comm.all_reduce(x, op="avg")
        got = x.get()
        check_reduced(got, "avg", parts, f"nccl avg {dtype_name}")
        return got.astype(np.float64).tolist()


def receive_then_collective(rank: int, n: int, addr: str, matched: bool) -> str:
    """Rank 0 posts an irecv on a stream of its own, then an all_reduce on the default stream.
    Rank 1 sends before its all_reduce (``matched``) or after it. NCCL runs one communicator's
    calls in issue order whatever their streams, so rank 0's all_reduce waits for its receive:
    matched, both calls complete; unmatched, every rank's all_reduce misses its 2 s deadline
    (and nothing hangs). Returns how each rank's all_reduce ended."""
    with emulated(addr, rank, n) as (rt, comm):
        x, box = FakeDeviceArray(np.ones(4, np.float32), rt), FakeDeviceArray(np.zeros(4), rt)
        comm.barrier()  # connected: the calls below wait on the device, not on the host
        if rank == 0:
            comm.send(box, 1)
        else:
            comm.recv(box, 0)
        if rank == 0:
            side = rt.new_stream()
            received = comm.irecv(box, 1, stream=side, timeout=2)
            reduced = comm.all_reduce(x, async_op=True, timeout=2)
        elif matched:
            sent = comm.isend(box, 0, timeout=2)
            reduced = comm.all_reduce(x, async_op=True, timeout=2)
        else:
            reduced = comm.all_reduce(x, async_op=True, timeout=2)
            sent = comm.isend(box, 0, timeout=2)
        try:
            reduced.synchronize()
            (received if rank == 0 else sent).synchronize()
        except CollectiveTimeout as exc:
            return f"CollectiveTimeout: {exc}"
        return "done"


def stuck_peer_of_a_timed_out_rank(rank: int, n: int, addr: str) -> str:
    """Rank 0's all_reduce misses its 1 s deadline while rank 1, alive, is busy elsewhere; then
    rank 1 sends to rank 0 with a 15 s deadline. Rank 0 published its failure in the store, so
    rank 1 learns it at once: a PeerFailure naming rank 0 and why, long before 15 s. Returns,
    on rank 1, the seconds it took and the error's text."""
    import time

    with emulated(addr, rank, n) as (rt, comm):
        store = _store(addr)
        try:
            x = FakeDeviceArray(np.ones(4, np.float32), rt)
            comm.barrier()
            if rank == 0:  # connect the pair, so that the send below waits on the device
                comm.send(x, 1)
            else:
                comm.recv(x, 0)
            if rank == 0:
                try:
                    comm.all_reduce(x, async_op=True, timeout=1.0).synchronize()
                except CollectiveTimeout:
                    store.set("test/zero-failed", b"1")
                store.wait(["test/one-done"], timeout=30)
                return ""
            store.wait(["test/zero-failed"], timeout=30)
            started = time.monotonic()
            try:
                comm.isend(x, 0, timeout=15).synchronize()
            except PeerFailure as exc:
                return f"{time.monotonic() - started:.1f} s: {exc}"
            finally:
                store.set("test/one-done", b"1")
            return "the send completed"
        finally:
            store.close()


def a_later_call_that_connects(rank: int, n: int, addr: str) -> list:
    """After a barrier (a small all_reduce: one algorithm connected), a large all_reduce needs
    another algorithm's connections: NCCL leaves the communicator in progress meanwhile, and
    the call must wait for that (within its deadline) before anything else touches it.
    Returns the channels connected, and whether the result is right."""
    with emulated(addr, rank, n) as (rt, comm):
        comm.barrier()
        nccl = comm._backend._nc.comm
        before = list(nccl.connections)
        x = FakeDeviceArray(np.full(1 << 15, rank + 1, np.float32), rt)  # 128 KiB
        comm.all_reduce(x)
        comm.all_gather(x)  # the same algorithm: nothing new to connect
        return [before, nccl.connections[len(before):], bool((x.get() == 3).all())]
