"""Rank bodies for the NCCL-backend tests: each runs in a spawned process against the emulation.

Every body installs an ``EmulatedRuntime`` (device memory = host memory exposing
``__cuda_array_interface__``), builds a Communicator with ``backend="nccl"``, checks its results
against NumPy, and finally asserts that the emulated NCCL saw no misuse.
"""

from __future__ import annotations

import contextlib
import io
import os
import time

import ml_dtypes
import numpy as np
from nccl_emulation import EmulatedRuntime, FakeDeviceArray

from gpucoll import cuda
from gpucoll.batch import P2POp
from gpucoll.default import create
from gpucoll.selftest import RankOneAway, fails_without_rank_1

BF16 = np.dtype(ml_dtypes.bfloat16)


def data(rank: int, shape: tuple, dtype) -> np.ndarray:
    """Rank-specific, exactly representable test values of ``dtype``."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape))
    base = (np.arange(n) % 7 + rank + 1).reshape(shape)
    if dtype.kind == "b":
        return ((base + rank) % 2).astype(bool)
    if dtype.kind == "c":
        return (base + 1j * (base - rank)).astype(dtype)
    return base.astype(dtype)


@contextlib.contextmanager
def emulated(addr: str, rank: int, n: int, *, timeout: float = 30.0, **kw):
    """(runtime, communicator) on the emulation; checks for misuse on the way out."""
    rt = EmulatedRuntime(addr, **kw)
    cuda.set_runtime(rt)
    comm = None
    try:
        comm = create("nccl", rank=rank, world_size=n, store=addr, timeout=timeout)
        yield rt, comm
        rt.synchronize()
        assert rt.misuse == [], rt.misuse
    finally:
        if comm is not None:
            comm.close()
        rt.close()
        cuda.set_runtime(None)


def dev(rt, arr) -> FakeDeviceArray:
    return FakeDeviceArray(arr, rt)


def reduce_all(op: str, parts: list[np.ndarray]) -> np.ndarray:
    """The exact result (``avg``: the mean in float64/complex128, before any rounding)."""
    if op == "avg":
        wide = np.complex128 if parts[0].dtype.kind == "c" else np.float64
        return np.mean([p.astype(wide) for p in parts], axis=0)
    fn = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum,
          "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}[op]
    out = parts[0].copy()
    for p in parts[1:]:
        out = fn(out, p)
    return out.astype(parts[0].dtype)


def avg_rtol(dtype, n: int) -> float:
    """How far ``avg`` of same-signed values of ``dtype`` over ``n`` ranks may be from the
    exact mean, relatively. NCCL premultiplies each value by fl(1/n) and sums: n products and
    n - 1 sums, each rounding by at most eps/2, plus the rounding of fl(1/n) itself; the ring
    sums and divides once (n roundings). (n + 1) * eps covers both."""
    return (n + 1) * float(ml_dtypes.finfo(np.dtype(dtype)).eps)


def check_reduced(got: np.ndarray, op: str, parts: list[np.ndarray], what: str = "") -> None:
    """``got`` equals the reduction of ``parts`` exactly, or for ``avg`` within ``avg_rtol``."""
    want = reduce_all(op, parts)
    assert got.dtype == parts[0].dtype, what
    if op != "avg":
        np.testing.assert_array_equal(got, want, err_msg=what)
        return
    wide = np.complex128 if got.dtype.kind == "c" else np.float64
    np.testing.assert_allclose(got.astype(wide), want, atol=0, err_msg=what,
                               rtol=avg_rtol(got.real.dtype if got.dtype.kind == "c"
                                             else got.dtype, len(parts)))


ALL_REDUCE_CASES = [
    ("sum", np.float32), ("sum", np.float64), ("sum", np.float16), ("sum", BF16),
    ("sum", np.int8), ("sum", np.uint8), ("sum", np.int32), ("sum", np.uint32),
    ("sum", np.int64), ("sum", np.uint64), ("prod", np.int64), ("min", np.float32),
    ("max", np.int32), ("avg", np.float32), ("avg", np.float64), ("avg", BF16),
    ("sum", np.complex64), ("avg", np.complex128), ("band", np.int32), ("bor", np.bool_),
    ("bxor", np.uint16), ("sum", np.int16), ("max", np.uint16),
]


def all_reduce_cases(rank: int, n: int, addr: str) -> list:
    with emulated(addr, rank, n) as (rt, comm):
        for op, dtype in ALL_REDUCE_CASES:
            x = dev(rt, data(rank, (3, 5), dtype))
            assert comm.all_reduce(x, op=op) is x
            check_reduced(x.get(), op, [data(r, (3, 5), dtype) for r in range(n)],
                          f"{op} {np.dtype(dtype).name}")
        return [name for name, _ in comm._backend._nc.comm.calls]


def rooted_cases(rank: int, n: int, addr: str) -> None:
    with emulated(addr, rank, n) as (rt, comm):
        for root in range(n):
            x = dev(rt, data(rank, (4,), np.float32))
            comm.broadcast(x, root=root)
            np.testing.assert_array_equal(x.get(), data(root, (4,), np.float32))
            for op, dtype in (("sum", np.int32), ("bor", np.uint8), ("sum", np.complex64)):
                y = dev(rt, data(rank, (2, 3), dtype))
                comm.reduce(y, root=root, op=op)
                if rank == root:
                    want = reduce_all(op, [data(r, (2, 3), dtype) for r in range(n)])
                    np.testing.assert_array_equal(y.get(), want)


def gather_cases(rank: int, n: int, addr: str) -> None:
    with emulated(addr, rank, n) as (rt, comm):
        parts = [data(r, (2, 3), np.int64) for r in range(n)]
        out = comm.all_gather(dev(rt, parts[rank]))
        assert isinstance(out, FakeDeviceArray) and out.shape == (n, 2, 3)
        np.testing.assert_array_equal(out.get(), np.stack(parts))
        tiled = comm.all_gather(dev(rt, parts[rank]), tiled=True)
        np.testing.assert_array_equal(tiled.get(), np.concatenate(parts))
        for root in range(n):
            got = comm.gather(dev(rt, parts[rank]), root=root)
            if rank == root:
                np.testing.assert_array_equal(got.get(), np.stack(parts))
            else:
                assert got is None


def scatter_cases(rank: int, n: int, addr: str) -> None:
    with emulated(addr, rank, n) as (rt, comm):
        full = np.arange(n * 6, dtype=np.float64).reshape(n, 2, 3)
        for root in range(n):
            src = dev(rt, full) if rank == root else None
            got = comm.scatter(src, root=root)
            assert isinstance(got, FakeDeviceArray)
            np.testing.assert_array_equal(got.get(), full[rank])
        out = dev(rt, np.zeros(3, np.float64))
        src = dev(rt, full.reshape(-1)[: n * 3]) if rank == 0 else None
        comm.scatter(src, root=0, tiled=True, out=out)
        np.testing.assert_array_equal(out.get(), full.reshape(-1)[rank * 3:rank * 3 + 3])


def exchange_cases(rank: int, n: int, addr: str) -> None:
    with emulated(addr, rank, n) as (rt, comm):
        for op, dtype in (("sum", np.float32), ("max", np.int64), ("bxor", np.int32),
                          ("sum", np.int16), ("avg", np.complex64)):
            x = data(rank, (n, 4), dtype)
            got = comm.reduce_scatter(dev(rt, x), op=op)
            check_reduced(got.get(), op, [data(r, (n, 4), dtype)[rank] for r in range(n)], op)
        x = np.array([[rank * 10 + j] * 3 for j in range(n)], dtype=np.uint16)
        got = comm.all_to_all(dev(rt, x))
        np.testing.assert_array_equal(got.get(), [[j * 10 + rank] * 3 for j in range(n)])


def send_recv_ring(rank: int, n: int, addr: str) -> None:
    with emulated(addr, rank, n) as (rt, comm):
        right, left = (rank + 1) % n, (rank - 1) % n
        box = dev(rt, np.zeros(5, np.complex128))
        if rank % 2 == 0:  # even ranks send first: ungrouped send/recv must not cross
            comm.send(dev(rt, data(rank, (5,), np.complex128)), right)
            comm.recv(box, left)
        else:
            comm.recv(box, left)
            comm.send(dev(rt, data(rank, (5,), np.complex128)), right)
        np.testing.assert_array_equal(box.get(), data(left, (5,), np.complex128))
        comm.barrier()


def stream_cases(rank: int, n: int, addr: str) -> list:
    """NCCL gets stream=, else the current stream; the streams NCCL saw are returned."""
    with emulated(addr, rank, n) as (rt, comm):
        s1, s2 = rt.new_stream(), rt.new_stream()
        x = dev(rt, data(rank, (4,), np.float32))
        comm.all_reduce(x, stream=s1)
        with rt.use_stream(s2):
            comm.all_reduce(x)
            comm.all_gather(x)
        comm.broadcast(x, root=0)
        return [args["stream"] for _, args in comm._backend._nc.comm.calls]


def producer_stream_is_waited_on(rank: int, n: int, addr: str) -> bool:
    """A CAI v3 array names the stream that produced it; NCCL's work must come after it."""
    with emulated(addr, rank, n) as (rt, comm):
        producer = rt.new_stream()
        x = FakeDeviceArray(np.zeros(4, np.float32), rt, stream=producer)
        release = rt.stall(producer)  # the producer has not finished writing x
        source = dev(rt, data(rank, (4,), np.float32))
        rt.memcpy_async(x.ptr, source.ptr, 16, producer)
        comm.all_reduce(x)  # enqueued on the current stream, after the producer's event
        release()
        want = reduce_all("sum", [data(r, (4,), np.float32) for r in range(n)])
        np.testing.assert_array_equal(x.get(), want)
        return True


def async_cases(rank: int, n: int, addr: str) -> None:
    with emulated(addr, rank, n) as (rt, comm):
        x = dev(rt, data(rank, (4,), np.float32))
        work = comm.all_reduce(x, async_op=True)
        assert type(work).__name__ == "EventWork"
        assert work.wait() is x  # orders the current stream; the host does not block
        assert work.synchronize(timeout=30) is x
        assert work.is_completed()
        np.testing.assert_array_equal(x.get(), reduce_all(
            "sum", [data(r, (4,), np.float32) for r in range(n)]))
        works = [comm.all_gather(dev(rt, data(rank, (2,), np.int32)), async_op=True)
                 for _ in range(3)]
        results = [w.synchronize(timeout=30).get() for w in works]
        assert all(r.shape == (n, 2) for r in results)


def split_cases(rank: int, n: int, addr: str) -> tuple:
    with emulated(addr, rank, n) as (rt, comm):
        color = None if rank == n - 1 else rank % 2
        sub = comm.split(color, key=-rank)
        if sub is None:
            return (None, None, None)
        x = dev(rt, np.array([rank], np.int64))
        sub.all_reduce(x)
        result = (sub.rank, sub.size, int(x.get()[0]))
        sub.close()
        return result


def missing_rank_at_start(rank: int, n: int, addr: str) -> str:
    """Rank 1 never joins; rank 0 must get a CollectiveTimeout naming it."""
    if RankOneAway(rank).stays_away():
        return ""
    from gpucoll.backends.nccl import NcclBackend
    from gpucoll.errors import CollectiveTimeout
    from gpucoll.store import PrefixStore, TCPStore, parse_address

    rt = EmulatedRuntime(addr)
    cuda.set_runtime(rt)
    store = TCPStore(*parse_address(addr), timeout=10)
    try:
        return str(fails_without_rank_1("start-up", CollectiveTimeout, lambda: NcclBackend(
            PrefixStore("g/", store), 0, n, timeout=1.0)))
    finally:
        store.close()
        rt.close()


def peer_never_calls(rank: int, n: int, addr: str) -> str:
    """Rank 1 skips an all_reduce: rank 0's watchdog aborts and reports a CollectiveTimeout."""
    from gpucoll.errors import CollectiveTimeout
    from gpucoll.store import TCPStore, parse_address

    rt = EmulatedRuntime(addr)
    cuda.set_runtime(rt)
    comm = create("nccl", rank=rank, world_size=n, store=addr, timeout=30)
    store = TCPStore(*parse_address(addr), timeout=30)
    try:
        with RankOneAway(rank, store, wait=30) as away:
            x = dev(rt, np.ones(4, np.float32))
            comm.barrier()  # connected: what follows waits on the stream, not in the call
            if away.stays_away():
                return ""
            work = comm.all_reduce(x, async_op=True, timeout=1.0)
            message = str(fails_without_rank_1("a collective", CollectiveTimeout,
                                               work.synchronize))
            try:
                comm.all_reduce(x)
            except CollectiveTimeout:
                pass
            else:
                raise AssertionError("the aborted communicator accepted more work")
            return message
    finally:
        comm.close()
        store.close()
        rt.close()


def peer_aborts(rank: int, n: int, addr: str) -> tuple[str, str] | None:
    """Rank 1 aborts while rank 0 waits for it in an all_reduce: rank 0 learns it from the
    store, with the reason, long before its deadline. Returns (error type, text) on rank 0."""
    from gpucoll.errors import GpucollError
    from gpucoll.store import TCPStore, parse_address

    side = TCPStore(*parse_address(addr), timeout=60)  # the test's own coordination
    with emulated(addr, rank, n) as (rt, comm):
        x = dev(rt, np.ones(4, np.float32))
        comm.barrier()
        if rank == 1:  # once rank 0 is past the barrier: an abort during it would end it too
            side.wait(["test/past-barrier"], timeout=60)
            comm.abort("the loss is NaN at step 7")
            return None
        side.set("test/past-barrier", b"1")
        start = time.monotonic()
        try:
            comm.all_reduce(x, async_op=True).synchronize()
        except GpucollError as exc:
            return type(exc).__name__, f"{time.monotonic() - start:.1f} s: {exc}"
        raise AssertionError("an all_reduce completed without its aborted peer")


def staged_ring_cases(rank: int, n: int, addr: str) -> list:
    """The ring on device arrays: staged through pinned buffers in 64-byte chunks."""
    from gpucoll.backends import staged

    staged.CHUNK_BYTES = 64
    rt = EmulatedRuntime(addr)
    cuda.set_runtime(rt)
    comm = create("ring", rank=rank, world_size=n, store=addr, timeout=30)
    try:
        s = rt.new_stream()
        x = dev(rt, data(rank, (50,), np.float64))  # 400 bytes: 7 chunks
        comm.all_reduce(x, stream=s)
        np.testing.assert_array_equal(x.get(), reduce_all(
            "sum", [data(r, (50,), np.float64) for r in range(n)]))
        y = dev(rt, data(rank, (33,), np.int32))
        comm.broadcast(y, root=1)
        np.testing.assert_array_equal(y.get(), data(1, (33,), np.int32))
        z = dev(rt, data(rank, (20,), np.uint16))
        comm.reduce(z, root=0, op="bxor")
        if rank == 0:
            np.testing.assert_array_equal(z.get(), reduce_all(
                "bxor", [data(r, (20,), np.uint16) for r in range(n)]))
        g = comm.all_gather(dev(rt, data(rank, (3,), np.float32)))
        assert isinstance(g, FakeDeviceArray)
        np.testing.assert_array_equal(g.get(), np.stack([data(r, (3,), np.float32)
                                                         for r in range(n)]))
        rs = comm.reduce_scatter(dev(rt, data(rank, (n, 5), np.int64)), op="max")
        np.testing.assert_array_equal(rs.get(), reduce_all(
            "max", [data(r, (n, 5), np.int64) for r in range(n)])[rank])
        box = dev(rt, np.zeros(30, np.complex64))
        if rank == 0:
            comm.send(dev(rt, data(0, (30,), np.complex64)), 1)
        elif rank == 1:
            comm.recv(box, 0)
            np.testing.assert_array_equal(box.get(), data(0, (30,), np.complex64))
        w = comm.all_reduce(dev(rt, data(rank, (40,), np.float32)), async_op=True)
        got = w.wait(timeout=30).get()
        np.testing.assert_array_equal(got, reduce_all(
            "sum", [data(r, (40,), np.float32) for r in range(n)]))
        rt.synchronize()
        assert rt.misuse == [], rt.misuse
        return [c for c in rt.misuse]
    finally:
        comm.close()
        rt.close()
        cuda.set_runtime(None)


class DeviceComm:
    """A Communicator fed emulated device copies of NumPy inputs, answering in NumPy, so the
    shared correctness matrix (collective_cases) runs through the NCCL backend unchanged."""

    def __init__(self, comm, rt):
        self.comm, self.rt = comm, rt
        self.rank, self.size = comm.rank, comm.size

    def _d(self, a):
        return None if a is None else FakeDeviceArray(a, self.rt)

    def _h(self, d):
        return None if d is None else d.get()

    def _in_place(self, name, x, *args, **kw):
        d = self._d(x)
        getattr(self.comm, name)(d, *args, **kw)
        x[...] = d.get()
        return x

    def all_reduce(self, x, op="sum"):
        return self._in_place("all_reduce", x, op=op)

    def reduce(self, x, root, op):
        return self._in_place("reduce", x, root, op)

    def broadcast(self, x, root):
        return self._in_place("broadcast", x, root)

    def reduce_scatter(self, x, op, tiled=False):
        return self._h(self.comm.reduce_scatter(self._d(x), op, tiled=tiled))

    def all_gather(self, x, tiled=False):
        return self._h(self.comm.all_gather(self._d(x), tiled=tiled))

    def gather(self, x, root, tiled=False):
        return self._h(self.comm.gather(self._d(x), root, tiled=tiled))

    def all_to_all(self, x, tiled=False):
        return self._h(self.comm.all_to_all(self._d(x), tiled=tiled))

    def scatter(self, x, root, tiled=False, out=None):
        if out is None:
            return self._h(self.comm.scatter(self._d(x), root, tiled=tiled))
        d = self._d(out)
        self.comm.scatter(self._d(x), root, tiled=tiled, out=d)
        out[...] = d.get()
        return out


def collective_matrix(rank: int, n: int, addr: str, host: bool = False) -> dict:
    """Every case of collective_cases through the NCCL backend; case id -> error or None.
    ``host``: the NumPy arrays go to the communicator as they are (staged through the device).

    send/recv cases are left out: their pattern (an unmatched ungrouped send before the recv on
    every rank) blocks the stream on NCCL, as nccl.h warns; send_recv_ring covers the pairing.
    """
    from collective_cases import cases, check

    report = {}
    with emulated(addr, rank, n) as (rt, comm):
        proxy = comm if host else DeviceComm(comm, rt)
        for case in cases(n):
            if case.coll == "send_recv":
                continue
            try:
                report[case.id] = check(proxy, case)
            except TypeError as exc:
                refused = case.op == "prod" and "complex" in case.dtype
                report[case.id] = None if refused and "cannot apply" in str(exc) else repr(exc)
            except Exception as exc:  # noqa: BLE001 - reported per case
                report[case.id] = f"{type(exc).__name__}: {exc}"
    return report


# ---- host (NumPy) arrays on the NCCL backend -----------------------------------------------------

def host_array_results(rank: int, n: int, addr: str) -> None:
    """NumPy arrays in, NumPy arrays out, written before the call returns; read-only and
    out-of-place inputs are left as they were."""
    with emulated(addr, rank, n) as (rt, comm):
        x = data(rank, (3, 5), np.int64)
        assert comm.all_reduce(x, op="max") is x
        np.testing.assert_array_equal(x, reduce_all("max", [data(r, (3, 5), np.int64)
                                                           for r in range(n)]))
        frozen = data(rank, (4,), BF16)
        frozen.setflags(write=False)  # a write-back into it would raise
        got = comm.all_gather(frozen)
        assert type(got) is np.ndarray and got.dtype == BF16
        np.testing.assert_array_equal(got, [data(r, (4,), BF16) for r in range(n)])
        y, out = data(rank, (6,), np.float32), np.zeros(6, np.float32)
        comm.all_reduce(y, out=out)
        np.testing.assert_array_equal(y, data(rank, (6,), np.float32))
        np.testing.assert_array_equal(out, reduce_all("sum", [data(r, (6,), np.float32)
                                                              for r in range(n)]))
        mixed = dev(rt, np.zeros((n, 2), np.int32))  # a host input, a device output
        comm.all_gather(data(rank, (2,), np.int32), out=mixed)
        np.testing.assert_array_equal(mixed.get(), [data(r, (2,), np.int32) for r in range(n)])
        assert comm._backend._host_queue == []


def host_array_async(rank: int, n: int, addr: str) -> list[str]:
    """An irecv and an isend of NumPy arrays both posted before either is waited for complete
    (neither blocks the host); asynchronous collectives return complete, fused and strided
    arrays included; a batch's Works write their arrays when found complete. Returns the
    backend's Work types seen."""
    with emulated(addr, rank, n) as (rt, comm):
        peer = 1 - rank
        box = np.zeros(5, np.complex128)
        mine = data(rank, (5,), np.complex128)
        if rank == 0:  # NCCL pairs one communicator's sends and receives in the order posted
            sending, receiving = comm.isend(mine, peer), comm.irecv(box, peer)
        else:
            receiving, sending = comm.irecv(box, peer), comm.isend(mine, peer)
        sending.wait()
        receiving.wait()
        np.testing.assert_array_equal(box, data(peer, (5,), np.complex128))
        first = data(rank, (3,), np.float64)
        w1 = comm.all_reduce(first, async_op=True)
        assert w1.is_completed()  # written on return: nothing left for wait() to do
        np.testing.assert_array_equal(first, reduce_all(
            "sum", [data(r, (3,), np.float64) for r in range(n)]))
        assert w1.wait() is first
        many = [data(rank, (3,), np.float32), data(rank, (2, 2), np.float32)]
        comm.all_reduce_many(many, async_op=True).wait()  # fused, then unpacked on the host
        np.testing.assert_array_equal(many[1], reduce_all(
            "sum", [data(r, (2, 2), np.float32) for r in range(n)]))
        grid = np.stack([data(rank, (4,), np.float64)] * 2, axis=1)
        column = grid[:, 0]  # strided: reduced through a contiguous stand-in
        assert comm.all_reduce(column, async_op=True).wait() is column
        np.testing.assert_array_equal(grid[:, 0], reduce_all(
            "sum", [data(r, (4,), np.float64) for r in range(n)]))
        np.testing.assert_array_equal(grid[:, 1], data(rank, (4,), np.float64))
        got = np.zeros(4, np.uint8)
        works = comm.batch_isend_irecv([P2POp("isend", data(rank, (4,), np.uint8), peer),
                                        P2POp("irecv", got, peer)])
        deadline = time.monotonic() + 20
        while not works[1].is_completed():  # finding it complete writes the array
            assert time.monotonic() < deadline, "the receive never completed"
            time.sleep(0.001)
        np.testing.assert_array_equal(got, data(peer, (4,), np.uint8))
        for w in works:
            w.wait()
        return [type(w).__name__ for w in (receiving._posted, w1, *(w._posted for w in works))]


def host_array_without_its_peer(rank: int, n: int, addr: str, dies: bool) -> str:
    """Rank 1 skips an all_reduce of NumPy arrays (or dies instead): rank 0 times out at its
    1 s deadline (or learns of the death at once), and its array keeps the values it had.
    Returns, on rank 0, the seconds it took and the error's text."""
    from gpucoll.errors import CollectiveTimeout, PeerFailure
    from gpucoll.store import TCPStore, parse_address

    with emulated(addr, rank, n) as (rt, comm):
        store = TCPStore(*parse_address(addr), timeout=30)
        try:
            with RankOneAway(rank, store, wait=30) as away:
                comm.barrier()
                if away.stays_away(dies=dies):
                    return ""
                x = np.arange(4, dtype=np.float32)
                expected = PeerFailure if dies else CollectiveTimeout
                started = time.monotonic()
                exc = fails_without_rank_1("an all_reduce", expected, lambda: comm.all_reduce(
                    x, timeout=30 if dies else 1.0))
                np.testing.assert_array_equal(x, np.arange(4, dtype=np.float32))
                return f"{time.monotonic() - started:.1f} s: {exc}"
        finally:
            store.close()


SHARED_GPU_VARIABLES = ("NCCL_HOSTID", "NCCL_MULTI_RANK_GPU_ENABLE")


def on_one_gpu(rank: int, n: int, addr: str, version: str) -> tuple[dict, str]:
    """``backend="nccl"`` with every rank on the one GPU of an emulated NCCL ``version``:
    checks all-reduce, broadcast, all-gather and reduce-scatter against NumPy; returns the
    variables NCCL saw and what the rank wrote on stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), \
            emulated(addr, rank, n, devices=1, nccl_version=version) as (rt, comm):
        assert comm.backend == "nccl"
        for op, dtype in (("sum", np.float32), ("max", np.int64), ("avg", np.float64)):
            x = dev(rt, data(rank, (3, 5), dtype))
            comm.all_reduce(x, op=op)
            check_reduced(x.get(), op, [data(r, (3, 5), dtype) for r in range(n)], op)
        for root in range(n):
            x = dev(rt, data(rank, (4,), np.float32))
            comm.broadcast(x, root=root)
            np.testing.assert_array_equal(x.get(), data(root, (4,), np.float32))
        parts = [data(r, (2, 3), np.int32) for r in range(n)]
        np.testing.assert_array_equal(comm.all_gather(dev(rt, parts[rank])).get(),
                                      np.stack(parts))
        full = [data(r, (n, 2), np.float32) for r in range(n)]
        got = comm.reduce_scatter(dev(rt, full[rank]))
        np.testing.assert_allclose(got.get(), sum(f[rank] for f in full), rtol=1e-6)
    return {k: os.environ[k] for k in SHARED_GPU_VARIABLES if os.environ.get(k)}, err.getvalue()


def refused_on_one_gpu(rank: int, n: int, addr: str, version: str) -> str:
    """``backend="nccl"`` on one emulated GPU where the environment forbids sharing it: the
    error each rank gets."""
    rt = EmulatedRuntime(addr, devices=1, nccl_version=version)
    cuda.set_runtime(rt)
    try:
        create("nccl", rank=rank, world_size=n, store=addr, timeout=20)
    except Exception as exc:  # noqa: BLE001 - the test reads which error it was
        return f"{type(exc).__name__}: {exc}"
    finally:
        rt.close()
        cuda.set_runtime(None)
    return "no error"


def raw_init_on_one_gpu(rank: int, n: int, addr: str, version: str, hostids: list) -> str:
    """nccl4py's ``Communicator.init`` straight on the emulation (no gpucoll start-up), every
    rank on device 0 with NCCL_HOSTID ``hostids[rank]`` ("" for none): "ok" or NCCL's error."""
    from gpucoll.store import TCPStore, parse_address

    if hostids[rank]:
        os.environ["NCCL_HOSTID"] = hostids[rank]
    rt = EmulatedRuntime(addr, devices=1, nccl_version=version)
    store = TCPStore(*parse_address(addr), timeout=30)
    nc = rt.nccl()
    try:
        if rank == 0:
            store.set("raw/uid", bytes(nc.get_unique_id()))
        uid = nc.UniqueId.from_bytes(store.get("raw/uid", timeout=30))
        try:
            comm = nc.Communicator.init(n, rank, uid)
        except Exception as exc:  # noqa: BLE001 - the test reads NCCL's refusal
            return f"{type(exc).__name__}: {exc}"
        comm.destroy()
        return "ok"
    finally:
        store.close()
        rt.close()
