"""The self-check's rank bodies: each runs in a process of its own, ``fn(rank, n, addr, arrays,
device, *args)`` (``device`` None: the rank's local rank), and returns a short text for the
report or raises.

``arrays`` makes and reads device arrays (``CupyArrays``: CuPy on the real devices; the tests
pass an emulated one). Everything else goes through gpucoll's public API and ``gpucoll.cuda``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from gpucoll import cuda
from gpucoll.arrays import SUPPORTED_DTYPES, dtype_from_name
from gpucoll.default import create
from gpucoll.errors import CollectiveTimeout, GpucollError, PeerFailure
from gpucoll.ops import ReduceOp, check_op_dtype

SIZES = (0, 1, 1031, 1 << 20)  # elements: empty, one, odd, 4-8 MiB
QUICK_SIZES = (0, 1, 1031)


class CupyArrays:
    """Device arrays on the real devices, through CuPy."""

    def __init__(self) -> None:
        self._streams: dict[int, Any] = {}  # streams made here live as long as the check

    def put(self, host: np.ndarray) -> Any:
        import cupy

        return cupy.asarray(host)

    def get(self, x: Any, stream: int | None = None) -> np.ndarray:
        """A host copy, made on ``stream`` (default: the current stream)."""
        return x.get(stream=None if stream is None else self._streams[stream])

    def new_stream(self) -> int:
        import cupy

        s = cupy.cuda.Stream(non_blocking=True)
        self._streams[int(s.ptr)] = s
        return int(s.ptr)

    def current(self, stream: int) -> Any:
        """A context in which ``stream`` (made by ``new_stream``) is the current stream."""
        return self._streams[stream]


def _values(dtype: np.dtype, shape: tuple, rank: int) -> np.ndarray:
    """Exactly representable values, different on each rank, small enough for any sum."""
    base = (np.arange(int(np.prod(shape))) % 5 + rank + 1).reshape(shape)
    if dtype.kind == "b":
        return (base % 2).astype(bool)
    if dtype.kind == "c":
        return (base + 1j * base).astype(dtype)
    return base.astype(dtype)


def _expected(op: ReduceOp, parts: list[np.ndarray]) -> np.ndarray:
    if op is ReduceOp.AVG:
        return np.mean([p.astype(np.complex128) for p in parts], axis=0)
    fn = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum,
          "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}[op.value]
    out = parts[0]
    for p in parts[1:]:
        out = fn(out, p)
    return out.astype(parts[0].dtype)


def _close(got: np.ndarray, want: np.ndarray, op: ReduceOp, n: int) -> bool:
    if op is not ReduceOp.AVG:
        return np.array_equal(got, want)
    import ml_dtypes

    eps = float(ml_dtypes.finfo(got.real.dtype if got.dtype.kind == "c" else got.dtype).eps)
    return np.allclose(got.astype(np.complex128), want, rtol=(n + 1) * eps, atol=0)


def _cases(quick: bool) -> Iterator[tuple[np.dtype, ReduceOp, int]]:
    for name in SUPPORTED_DTYPES:
        dtype = dtype_from_name(name)
        for op in ReduceOp:
            try:
                check_op_dtype(op, dtype, "all_reduce")
            except TypeError:
                continue
            for size in QUICK_SIZES if quick else SIZES:
                yield dtype, op, size


def matrix(rank: int, n: int, addr: str, arrays: Any, device: int | None, quick: bool) -> str:
    """Every dtype x op x size of all_reduce on NCCL, then every other collective once, against
    NumPy; the cases NCCL refuses (e.g. complex prod) are counted, not failed."""
    comm = create("nccl", rank=rank, world_size=n, store=addr, timeout=60, device=device)
    wrong, refused, done = [], 0, 0
    with comm:
        for dtype, op, size in _cases(quick):
            try:
                x = arrays.put(_values(dtype, (size,), rank))
                comm.all_reduce(x, op=op)
            except TypeError:
                refused += 1
                continue
            want = _expected(op, [_values(dtype, (size,), r) for r in range(n)])
            if not _close(arrays.get(x), want, op, n):
                wrong.append(f"all_reduce {op.value} {dtype.name} x{size}")
            done += 1
        wrong += _others(comm, arrays, rank, n)
    if wrong:
        raise AssertionError(f"{len(wrong)} wrong: {', '.join(wrong[:8])}")
    return f"{done} all_reduce cases and 7 other collectives right ({refused} refused by NCCL)"


def _others(comm: Any, arrays: Any, rank: int, n: int) -> list[str]:
    """broadcast, reduce, all_gather, gather, scatter, reduce_scatter, all_to_all: the wrong."""
    wrong = []
    mine = _values(np.dtype(np.float32), (n, 3), rank)
    every = [_values(np.dtype(np.float32), (n, 3), r) for r in range(n)]

    def check(name: str, got: Any, want: np.ndarray) -> None:
        if got is not None and not np.array_equal(arrays.get(got), want):
            wrong.append(name)

    x = arrays.put(mine)
    comm.broadcast(x, root=n - 1)
    check("broadcast", x, every[n - 1])
    x = arrays.put(mine)
    comm.reduce(x, root=0)
    check("reduce", x if rank == 0 else None, sum(every))
    check("all_gather", comm.all_gather(arrays.put(mine)), np.stack(every))
    check("gather", comm.gather(arrays.put(mine), root=0), np.stack(every))
    check("scatter", comm.scatter(arrays.put(every[0]) if rank == 0 else None, root=0),
          every[0][rank])
    check("reduce_scatter", comm.reduce_scatter(arrays.put(mine)), sum(every)[rank])
    check("all_to_all", comm.all_to_all(arrays.put(mine)), np.stack([e[rank] for e in every]))
    return wrong


def missing_at_start_up(rank: int, n: int, addr: str, arrays: Any, device: int | None) -> str:
    """Rank 1 never starts: rank 0's start-up must end within its 3 s deadline naming it."""
    if rank == 1:
        return ""
    start = time.monotonic()
    try:
        create("nccl", rank=0, world_size=n, store=addr, timeout=3, device=device)
    except CollectiveTimeout as exc:
        if "rank 1" not in str(exc):
            raise AssertionError(f"the timeout does not name rank 1: {exc}") from exc
        return f"CollectiveTimeout after {time.monotonic() - start:.1f} s (deadline 3 s): {exc}"
    raise AssertionError("start-up without rank 1 succeeded")


def skipped_call(rank: int, n: int, addr: str, arrays: Any, device: int | None) -> str:
    """Rank 1 skips an all_reduce: rank 0's must fail by its 2 s deadline, then every later
    call fails at once; both close without hanging."""
    from gpucoll.store import TCPStore, parse_address

    store = TCPStore(*parse_address(addr), timeout=60)
    comm = create("nccl", rank=rank, world_size=n, store=addr, timeout=60, device=device)
    try:
        x = arrays.put(np.ones(1024, np.float32))
        comm.barrier()
        if rank == 1:
            store.get("selftest/skipped", timeout=60)
            return ""
        start = time.monotonic()
        try:
            comm.all_reduce(x, async_op=True, timeout=2).synchronize()
        except CollectiveTimeout as exc:
            took = time.monotonic() - start
            try:
                comm.all_reduce(x)
            except GpucollError:
                pass
            else:
                raise AssertionError("the aborted communicator took another call") from exc
            return f"CollectiveTimeout after {took:.1f} s (deadline 2 s): {exc}"
        raise AssertionError("an all_reduce without rank 1 completed")
    finally:
        if rank == 0:
            store.set("selftest/skipped", "1")
        comm.close()
        store.close()


def dead_peer(rank: int, n: int, addr: str, arrays: Any, device: int | None) -> str:
    """Rank 1 dies before an all_reduce: rank 0 must name it long before the 60 s deadline."""
    comm = create("nccl", rank=rank, world_size=n, store=addr, timeout=60, device=device)
    with comm:
        x = arrays.put(np.ones(1024, np.float32))
        comm.barrier()
        if rank == 1:
            os._exit(0)
        start = time.monotonic()
        try:
            comm.all_reduce(x, async_op=True).synchronize()
        except PeerFailure as exc:
            return f"PeerFailure after {time.monotonic() - start:.1f} s: {exc}"
        raise AssertionError("an all_reduce without rank 1 completed")


def stream_race(rank: int, n: int, addr: str, arrays: Any, device: int | None) -> str:
    """x is written on a busy current stream and the collective runs on another: it must read
    what was written, not what was there before."""
    rt = cuda.runtime()
    comm = create("nccl", rank=rank, world_size=n, store=addr, timeout=60, device=device)
    with comm:
        x = arrays.put(np.zeros(1 << 16, np.float32))
        src = arrays.put(np.full(1 << 16, rank + 1.0, np.float32))
        producer, other = arrays.new_stream(), arrays.new_stream()
        ptr = lambda a: int(a.__cuda_array_interface__["data"][0])  # noqa: E731
        with arrays.current(producer):
            release = rt.stall(producer)
            rt.memcpy_async(ptr(x), ptr(src), 4 << 16, producer)
            out = comm.all_gather(x, stream=other)
            release()
        got = arrays.get(out, other)
    want = np.repeat(np.arange(1.0, n + 1.0, dtype=np.float32), 1 << 16).reshape(n, -1)
    if not np.array_equal(got, want):
        raise AssertionError("the collective read x before the busy stream had written it")
    return "the collective waited for the stream that wrote its input"


def honest_completion(rank: int, n: int, addr: str, arrays: Any, device: int | None) -> str:
    """is_completed() is False while the device is busy before the call, True after."""
    rt = cuda.runtime()
    comm = create("nccl", rank=rank, world_size=n, store=addr, timeout=60, device=device)
    with comm:
        x = arrays.put(np.ones(1024, np.float32))
        comm.barrier()
        s = arrays.new_stream()
        with arrays.current(s):
            release = rt.stall(s)
            work = comm.all_reduce(x, async_op=True)
            busy = work.is_completed()
            release()
            work.synchronize()
        if busy or not work.is_completed():
            raise AssertionError(f"is_completed() said {busy} while the device was busy and "
                                 f"{work.is_completed()} after synchronize()")
    return "False while the stream was busy, True after synchronize()"


def split_after_async(rank: int, n: int, addr: str, arrays: Any, device: int | None) -> str:
    """split() right after asynchronous work, then a collective on the new communicator."""
    comm = create("nccl", rank=rank, world_size=n, store=addr, timeout=60, device=device)
    with comm:
        x = arrays.put(np.ones(1 << 20, np.float32))
        comm.all_reduce(x, async_op=True)
        sub = comm.split(0, key=-rank)
        y = arrays.put(np.array([rank + 1.0], np.float32))
        sub.all_reduce(y)
        total = float(arrays.get(y)[0])
        sub.close()
    if total != n * (n + 1) / 2:
        raise AssertionError(f"the split communicator's sum is {total}")
    return f"split of {n} rank(s) after async work; its all_reduce is right"


def bandwidth(rank: int, n: int, addr: str, arrays: Any, device: int | None,
              sizes: tuple[int, ...], iters: int) -> list[tuple[int, float, float]]:
    """(bytes, microseconds per all_reduce, bus GB/s) of float32 all_reduce, nccl-tests' way:
    bus bandwidth = bytes / time * 2 (n - 1) / n."""
    comm = create("nccl", rank=rank, world_size=n, store=addr, timeout=120, device=device)
    rows = []
    with comm:
        for nbytes in sizes:
            x = arrays.put(np.ones(nbytes // 4, np.float32))
            comm.all_reduce(x)
            comm.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                comm.all_reduce(x)
            comm.barrier()
            seconds = (time.perf_counter() - start) / iters
            factor = 2 * (n - 1) / n if n > 1 else 0.0
            rows.append((nbytes, seconds * 1e6, nbytes / seconds * factor / 1e9))
    return rows
