"""The NCCL backend: collectives on device arrays, enqueued on CUDA streams through
``cupy.cuda.nccl``.

Every call returns once its work is enqueued on ``stream`` (default: the current stream), so
results are stream-ordered. An event recorded after each call lets the watchdog
(``nccl_watch``) enforce the call's deadline by aborting the communicator. CuPy's binding has
no gather, scatter or all-to-all: those are grouped send/recv (``groupStart``/``groupEnd``).
All CUDA access goes through ``gpucoll.cuda`` so the emulation in the tests can stand in for it.
"""

from __future__ import annotations

import copy
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from gpucoll import cuda
from gpucoll.backends import nccl_boot
from gpucoll.backends.base import Backend
from gpucoll.backends.nccl_grouped import GroupedNccl
from gpucoll.backends.nccl_types import reduce_plan, wire
from gpucoll.backends.nccl_watch import EventWork, Pending, Watchdog, translate
from gpucoll.errors import BackendUnavailable, GpucollError
from gpucoll.ops import ReduceOp
from gpucoll.store.gather import gather

COMM_SPLIT_VERSION = 21801  # ncclCommSplit needs NCCL >= 2.18.1


def same_stream(a: int, b: int) -> bool:
    """True when two stream handles name one stream (CAI's 1 is the legacy null stream 0)."""
    return a == b or (a in (0, cuda.STREAM_LEGACY) and b in (0, cuda.STREAM_LEGACY))


class NcclBackend(GroupedNccl, Backend):
    """One NCCL communicator over ``size`` ranks, one CUDA device per rank.

    Constructing it is collective: all ranks meet in ``store`` (the communicator's namespace),
    rank 0 publishes the NCCL unique id, and each rank builds its ``NcclCommunicator`` on
    ``device`` (default: its local rank).
    """

    name = "nccl"

    def __init__(self, store: Any, rank: int, size: int, *, timeout: float,
                 device: int | None = None, _comm: Any = None):
        self.rank, self.size, self.timeout = rank, size, timeout
        self._rt = cuda.runtime()
        ok, why = self._rt.available()
        if not ok:
            raise BackendUnavailable(f"nccl backend on rank {rank}: {why}")
        self._nccl = self._rt.nccl()
        self._NcclError = self._nccl.NcclError
        self.device = nccl_boot.select_device(self._rt, rank, device)
        if _comm is None:
            nccl_boot.arrive(store, rank, size, timeout)
            raw = nccl_boot.share_unique_id(store, rank, size, self._nccl, timeout)
            _comm = self._call("NCCL start-up", nccl_boot.create_comm, self._nccl, size, raw, rank)
        self._comm = _comm
        self._lock = threading.Lock()
        self._failure: GpucollError | None = None
        self._closed = self._closing = False
        self._last: Pending | None = None
        self._scratch: Any = None
        self._watchdog = Watchdog(rank, size, self._check_async, self._fail)

    # ---- plumbing -------------------------------------------------------------------------

    def _call(self, opname: str, fn: Callable, *args: Any) -> Any:
        try:
            return fn(*args)
        except self._NcclError as exc:
            raise self._error(opname, exc) from exc

    def _error(self, opname: str, exc: BaseException) -> GpucollError:
        """The error to raise for ``exc``, an NcclError from ``opname``."""
        if self._failure is not None:  # aborted under us: report why
            return copy.copy(self._failure)
        return translate(exc, opname, self.rank, self.size)

    def _begin(self, opname: str, stream: Any, refs: tuple) -> int:
        """Check the buffers, resolve the stream, and order it after the buffers' producers."""
        if self._failure is not None or self._closed:
            self.raise_failure()
        s = self._rt.stream_handle(stream)
        for ref in refs:
            if ref is None:
                continue
            if ref.kind != "device":
                raise TypeError(
                    f"{opname}: the nccl backend needs device arrays, got a host array "
                    f"({type(ref.array).__name__}) on rank {self.rank}"
                )
            if ref.device is not None and ref.device != self.device:
                raise ValueError(
                    f"{opname}: a buffer is on device {ref.device}, but rank {self.rank}'s "
                    f"communicator is on device {self.device}; buffers must be on the "
                    "communicator's device"
                )
            if ref.stream is not None and not same_stream(ref.stream, s):
                self._rt.wait_event(s, self._rt.record_event(ref.stream))
        return s

    def _end(self, opname: str, s: int, timeout: float, keep: Any = None) -> None:
        """Record the event that marks the call's completion and hand it to the watchdog;
        ``keep`` (temporaries) stays referenced until then."""
        event = self._rt.record_event(s)
        self._last = Pending(event, time.monotonic() + timeout, opname, timeout, keep)
        self._watchdog.add(self._last)

    def _group(self, opname: str, calls: list[tuple[Callable, tuple]]) -> None:
        """Run send/recv calls as one NCCL group so they progress together."""
        nccl = self._nccl
        try:
            nccl.groupStart()
            try:
                for fn, args in calls:
                    fn(*args)
            finally:
                nccl.groupEnd()
        except self._NcclError as exc:
            raise self._error(opname, exc) from exc

    def _copy(self, dst: int, src: int, nbytes: int, s: int) -> None:
        if dst != src and nbytes:
            self._rt.memcpy_async(dst, src, nbytes, s)

    # ---- collectives ------------------------------------------------------------------------

    def all_reduce(self, x: Any, op: ReduceOp, *, timeout: float, stream: Any = None) -> None:
        s = self._begin("all_reduce", stream, (x,))
        plan = reduce_plan(op, x.dtype, "all_reduce")
        keep = None
        if plan.native:
            self._call("all_reduce", self._comm.allReduce, x.ptr, x.ptr, x.count * plan.factor,
                       plan.code, plan.op, s)
        else:  # all-gather every rank's x, then reduce the slots locally
            keep = self._rt.alloc_device(self.size * x.nbytes, s)
            self._call("all_reduce", self._comm.allGather, x.ptr, keep.ptr,
                       x.count * plan.factor, plan.code, s)
            self._rt.reduce_slots(op.value, keep.ptr, x.ptr, self.size, x.count, x.dtype, s)
        self._end("all_reduce", s, timeout, keep)

    def broadcast(self, x: Any, root: int, *, timeout: float, stream: Any = None) -> None:
        s = self._begin("broadcast", stream, (x,))
        w = wire(x.dtype)
        self._call("broadcast", self._comm.broadcast, x.ptr, x.ptr, x.count * w.factor, w.code,
                   root, s)
        self._end("broadcast", s, timeout)

    def reduce(self, x: Any, root: int, op: ReduceOp, *, timeout: float,
               stream: Any = None) -> None:
        s = self._begin("reduce", stream, (x,))
        plan = reduce_plan(op, x.dtype, "reduce")
        keep = None
        if plan.native:
            self._call("reduce", self._comm.reduce, x.ptr, x.ptr, x.count * plan.factor,
                       plan.code, plan.op, root, s)
        else:  # gather every rank's x on root, which reduces the slots locally
            keep = self._rt.alloc_device(self.size * x.nbytes, s) if self.rank == root else None
            self._gather_to(x, keep.ptr if keep is not None else 0, root, s, "reduce")
            if keep is not None:
                self._rt.reduce_slots(op.value, keep.ptr, x.ptr, self.size, x.count, x.dtype, s)
        self._end("reduce", s, timeout, keep)

    def all_gather(self, x: Any, out: Any, *, timeout: float, stream: Any = None) -> None:
        s = self._begin("all_gather", stream, (x, out))
        w = wire(x.dtype)
        self._call("all_gather", self._comm.allGather, x.ptr, out.ptr, x.count * w.factor,
                   w.code, s)
        self._end("all_gather", s, timeout)

    def reduce_scatter(self, x: Any, out: Any, op: ReduceOp, *, timeout: float,
                       stream: Any = None) -> None:
        s = self._begin("reduce_scatter", stream, (x, out))
        plan = reduce_plan(op, x.dtype, "reduce_scatter")
        keep = None
        if plan.native:
            self._call("reduce_scatter", self._comm.reduceScatter, x.ptr, out.ptr,
                       out.count * plan.factor, plan.code, plan.op, s)
        else:  # all-to-all brings every rank's slot `rank` here; reduce them locally
            keep = self._rt.alloc_device(x.nbytes, s)
            self._exchange(x.ptr, keep.ptr, out.count, out.dtype, s, "reduce_scatter")
            self._rt.reduce_slots(op.value, keep.ptr, out.ptr, self.size, out.count, out.dtype, s)
        self._end("reduce_scatter", s, timeout, keep)

    def gather(self, x: Any, out: Any | None, root: int, *, timeout: float,
               stream: Any = None) -> None:
        s = self._begin("gather", stream, (x, out))
        self._gather_to(x, out.ptr if out is not None else 0, root, s, "gather")
        self._end("gather", s, timeout)

    def scatter(self, x: Any | None, out: Any, root: int, *, timeout: float,
                stream: Any = None) -> None:
        s = self._begin("scatter", stream, (x, out))
        w, n = wire(out.dtype), out.count
        slot = out.nbytes
        if self.rank == root:
            calls = [(self._comm.send, (x.ptr + r * slot, n * w.factor, w.code, r, s))
                     for r in range(self.size) if r != root]
            self._group("scatter", calls)
            self._copy(out.ptr, x.ptr + root * slot, slot, s)
        else:
            self._call("scatter", self._comm.recv, out.ptr, n * w.factor, w.code, root, s)
        self._end("scatter", s, timeout)

    def all_to_all(self, x: Any, out: Any, *, timeout: float, stream: Any = None) -> None:
        s = self._begin("all_to_all", stream, (x, out))
        n = out.count // self.size
        self._exchange(x.ptr, out.ptr, n, out.dtype, s, "all_to_all")
        self._end("all_to_all", s, timeout)

    def send(self, x: Any, dst: int, *, timeout: float, stream: Any = None) -> None:
        s = self._begin("send", stream, (x,))
        w = wire(x.dtype)
        self._call("send", self._comm.send, x.ptr, x.count * w.factor, w.code, dst, s)
        self._end("send", s, timeout)

    def recv(self, x: Any, src: int, *, timeout: float, stream: Any = None) -> None:
        s = self._begin("recv", stream, (x,))
        w = wire(x.dtype)
        self._call("recv", self._comm.recv, x.ptr, x.count * w.factor, w.code, src, s)
        self._end("recv", s, timeout)

    def barrier(self, *, timeout: float) -> None:
        """All ranks reach this point: a one-element all-reduce on the current stream, then
        the host waits for it (after earlier work on that stream), within ``timeout``."""
        s = self._begin("barrier", None, ())
        if self._scratch is None:
            self._scratch = self._rt.alloc_device(4, s)
        self._call("barrier", self._comm.allReduce, self._scratch.ptr, self._scratch.ptr, 1,
                   2, 0, s)  # ncclInt32, ncclSum
        self._end("barrier", s, timeout)
        EventWork(self, self._last).synchronize()

    # ---- grouped helpers ----------------------------------------------------------------

    def _gather_to(self, x: Any, out_ptr: int, root: int, s: int, opname: str) -> None:
        """Rank r's ``x`` lands in slot r of ``out_ptr`` on ``root`` (grouped recvs there)."""
        w, n = wire(x.dtype), x.count
        if self.rank != root:
            self._call(opname, self._comm.send, x.ptr, n * w.factor, w.code, root, s)
            return
        calls = [(self._comm.recv, (out_ptr + r * x.nbytes, n * w.factor, w.code, r, s))
                 for r in range(self.size) if r != root]
        self._group(opname, calls)
        self._copy(out_ptr + root * x.nbytes, x.ptr, x.nbytes, s)

    def _exchange(self, src: int, dst: int, n: int, dtype: Any, s: int, opname: str) -> None:
        """All-to-all of ``n``-element slots: dst slot j = rank j's src slot ``rank``."""
        w = wire(dtype)
        slot = n * dtype.itemsize
        calls = []
        for r in range(self.size):
            if r != self.rank:
                calls.append((self._comm.send, (src + r * slot, n * w.factor, w.code, r, s)))
                calls.append((self._comm.recv, (dst + r * slot, n * w.factor, w.code, r, s)))
        self._group(opname, calls)
        self._copy(dst + self.rank * slot, src + self.rank * slot, slot, s)

    # ---- async, lifecycle -------------------------------------------------------------------

    def run_async(self, call: Callable[[], None], *, stream: Any = None) -> EventWork:
        """Enqueue ``call`` and return a Work tied to the event recorded after it."""
        self._last = None
        call()
        if self._last is None:  # the call enqueued nothing of its own (e.g. barrier-free no-op)
            self._end("collective", self._rt.stream_handle(stream), self.timeout)
        return EventWork(self, self._last)

    def run_sync(self, call: Callable[[], None]) -> None:
        call()  # NCCL calls on one communicator are already ordered by their streams

    def split(self, store: Any, rank: int | None, size: int, color: int | None, key: int,
              *, timeout: float) -> NcclBackend | None:
        """ncclCommSplit when the binding and library have it, else a new communicator per
        color bootstrapped through ``store`` (a fresh unique id)."""
        self.raise_failure()
        if hasattr(self._comm, "commSplit") and self._nccl.get_version() >= COMM_SPLIT_VERSION:
            new = self._call("split", self._comm.commSplit, -1 if color is None else color, key)
            if new is None or rank is None:
                return None
            return NcclBackend(store, rank, size, timeout=timeout, device=self.device, _comm=new)
        if color is None or rank is None:
            return None
        return NcclBackend(store, rank, size, timeout=timeout, device=self.device)

    def shrink(self, store: Any, members: list[int], *, timeout: float,
               liveness: Any = None) -> NcclBackend:
        """The survivors' communicator (``shrink_comm``), on this rank's device."""
        comm = shrink_comm(self, store, members, timeout, liveness)
        return NcclBackend(store, members.index(self.rank), len(members), timeout=timeout,
                           device=self.device, _comm=comm)

    def stream_wait(self, event: Any) -> None:
        """Make the current stream wait for ``event``."""
        self._rt.wait_event(self._rt.current_stream(), event)

    def failure(self) -> GpucollError | None:
        return self._failure

    def raise_failure(self) -> None:
        """Raise why this backend stopped working, if it did."""
        if self._failure is not None:
            raise copy.copy(self._failure)
        if self._closed:
            raise GpucollError(f"nccl backend on rank {self.rank} is closed")

    def _check_async(self, opname: str) -> None:
        comm = self._comm
        if self._failure is None and not self._closed:
            self._call(opname, comm.check_async_error)

    def _fail(self, exc: GpucollError) -> None:
        """Record the first failure and abort the NCCL communicator (frees hung streams)."""
        with self._lock:
            if self._failure is not None:
                return
            self._failure = exc
        self._watchdog.clear()
        try:
            self._comm.abort()
        except Exception:  # noqa: BLE001 - the failure recorded above is what callers see
            pass

    def abort(self, reason: str | GpucollError) -> None:
        self._fail(reason if isinstance(reason, GpucollError) else GpucollError(
            f"nccl backend on rank {self.rank} aborted: {reason}"))

    def close(self) -> None:
        """Wait (within the deadline) for enqueued work, then destroy the communicator; after
        an abort or a timeout, return at once."""
        with self._lock:
            if self._closed or self._closing:
                return
            self._closing = True
        last, finished = self._last, True
        if self._failure is None and last is not None:
            try:
                EventWork(self, last)._wait(None)
            except GpucollError:
                finished = False
        self._closed = True
        self._watchdog.close()
        try:
            if self._failure is None and finished:
                self._comm.destroy()
            else:
                self._comm.abort()
        except Exception:  # noqa: BLE001 - closing never raises
            pass


# -- shrinking -------------------------------------------------------------------------------
# Written against the current binding (CuPy's NcclCommunicator, which has no shrink); the
# backend's move to nccl4py brings Communicator.shrink (ncclCommShrink), used below when every
# member has it.

def shrink_comm(backend: NcclBackend, store: Any, members: list[int], timeout: float,
                liveness: Any = None) -> Any:
    """An NCCL communicator of ``members`` (ranks of ``backend``'s group, this one among them),
    rank i being ``members[i]``; collective over the members, meeting in ``store``.

    ncclCommShrink when every member can call it: its binding has it and its communicator was
    not aborted. This backend aborts a communicator at its first failure (that frees streams
    hung on a dead peer), so after a PeerFailure none can: the members then start a new
    communicator among themselves, as at start-up, with a fresh unique id. They vote in the
    store first, since all must take the same way.
    """
    rank, size = members.index(backend.rank), len(members)
    able = hasattr(backend._comm, "shrink") and backend._failure is None and not backend._closed
    store.set(f"nccl/shrink/{rank}", b"1" if able else b"0")
    votes = gather(store, [f"nccl/shrink/{r}" for r in range(size)], timeout,
                   what=f"NCCL shrink on rank {backend.rank}", rank=rank, liveness=liveness)
    if all(v == b"1" for v in votes):
        excluded = [r for r in range(backend.size) if r not in members]
        return backend._call("shrink", _native_shrink, backend._comm, excluded)
    nccl_boot.arrive(store, rank, size, timeout, what="NCCL shrink")
    raw = nccl_boot.share_unique_id(store, rank, size, backend._nccl, timeout)
    return backend._call("NCCL shrink", nccl_boot.create_comm, backend._nccl, size, raw, rank)


def _native_shrink(comm: Any, excluded: list[int]) -> Any:
    """``comm.shrink(excluded)`` with NCCL_SHRINK_ABORT where the binding names it (nccl4py's
    ``CommShrinkFlag.ABORT``): work still enqueued on the old communicator is abandoned."""
    flags = getattr(sys.modules.get("nccl.core"), "CommShrinkFlag", None)
    if flags is None:
        return comm.shrink(excluded)
    return comm.shrink(excluded, None, flags.ABORT)
