"""The host ring backend: every collective on NumPy buffers, over shared memory or TCP.

Construction is collective: ranks meet through the store and build a mesh of connections
(``gpucoll.transport.mesh``). Calls run inline on the caller's thread (small calls are latency
bound); ``run_async`` hands calls to one worker thread, which keeps issue order. The first error
(a timeout, a dead or aborting peer, an interrupt) poisons the backend: peers are told, later
calls fail at once, and ``close()`` still releases everything.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from gpucoll.backends import ring_algos as algos
from gpucoll.backends.base import Backend
from gpucoll.errors import CollectiveTimeout, GpucollError, PeerFailure
from gpucoll.ops import ReduceOp, finish_avg, host_ufunc
from gpucoll.transport.engine import CORES, Engine, State
from gpucoll.transport.mesh import Mesh
from gpucoll.transport.monitor import CLOSE, Monitor, encode_abort
from gpucoll.work import FutureWork

if TYPE_CHECKING:
    from gpucoll.arrays import ArrayRef

_CLOSE_GRACE_S = 2.0  # how long close() lets calls in flight finish before aborting them


class RingBackend(Backend):
    """Host collectives for ``size`` ranks; ``store`` is this group's store namespace.

    Buffers are host NumPy views (``ArrayRef.host``); device arrays reach this backend through
    ``gpucoll.backends.staged``, which copies them to and from host memory around each call.
    ``order`` is the sequence of ranks around the ring (None: 0, 1, ..., size-1); every rank must
    pass the same one.
    """

    name = "ring"

    def __init__(self, store: Any, rank: int, size: int, *, timeout: float,
                 transport: str = "auto", order: list[int] | None = None):
        if not 0 <= rank < size:
            raise ValueError(f"rank={rank} is outside a group of size {size}")
        self.rank, self.size = rank, size
        self.use_order(order)
        self.timeout = timeout
        self._transport_arg = transport
        self._state = State()
        self._error: BaseException | None = None
        self._closed = False
        self._released = False  # connections closed (after close() or a failure)
        self._lock = threading.Lock()  # one call at a time on the links
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._inflight = 0
        self._idle = threading.Condition()
        self._worker: threading.Thread | None = None
        self._mesh = Mesh(store, rank, size, timeout=timeout, transport=transport)
        self.transport = self._mesh.transport
        busy = self._mesh.local_ranks > CORES
        self._engine = Engine(rank, self._mesh.links, self._mesh.bell, self._state, busy)
        self._monitor = Monitor(rank, self._mesh.control, self._mesh.bell, self._state)

    @property
    def local_ranks(self) -> int:
        """How many ranks of the group (this one included) run on this rank's host."""
        return self._mesh.local_ranks

    @property
    def ring_order(self) -> list[int]:
        """The ranks in the order the ring visits them."""
        return list(self._order)

    def use_order(self, order: list[int] | None) -> None:
        """Make the ring visit ranks in ``order`` (None: rank order). Every rank must switch to
        the same order before its next collective."""
        if order is None:
            order = range(self.size)
        elif not (isinstance(order, (list, tuple))
                  and all(isinstance(r, int) and not isinstance(r, bool) for r in order)
                  and sorted(order) == list(range(self.size))):
            raise ValueError(f"order={order!r} on rank {self.rank}: expected a permutation of the "
                             f"ranks 0..{self.size - 1}")
        self._order = tuple(order)
        self._pos = self._order.index(self.rank)

    @property
    def links(self) -> dict[int, str]:
        """Which transport carries data to each peer: ``{peer: "shm" | "tcp"}``."""
        return {j: link.kind for j, link in enumerate(self._mesh.links) if link is not None}

    # -- running a call --------------------------------------------------------------------
    def _call(self, opname: str, timeout: float, fn: Callable, *args) -> None:
        self._check_usable(opname)
        step = algos.Step(self._engine, self.rank, self.size, time.monotonic() + timeout, opname,
                          self._order, self._pos)
        with self._lock:
            try:
                fn(step, *args)
            except BaseException as exc:
                self._poison(exc)
                self._release()
                raise

    def _reducing(self, opname: str, timeout: float, fn: Callable, *args) -> None:
        # overflow to inf (or NaN from inf - inf) is the IEEE answer, as on the GPU; NumPy's
        # warning would point into this package's internals
        with np.errstate(over="ignore", invalid="ignore"):
            self._call(opname, timeout, fn, *args)

    def _check_usable(self, opname: str) -> None:
        if self._closed:
            raise GpucollError(f"{opname} on rank {self.rank}: the ring backend is closed")
        if self._error is None and self._state.failure is not None:
            self._fail(self._state.failure)  # a peer failed while this rank was idle
        if self._error is not None:
            raise self._unusable(opname)

    def _unusable(self, opname: str) -> GpucollError:
        err = self._error
        msg = f"{opname} on rank {self.rank}: unusable after an earlier failure: {err}"
        if isinstance(err, PeerFailure):
            return PeerFailure(msg, peer=err.peer)
        if isinstance(err, CollectiveTimeout):
            return CollectiveTimeout(msg)
        return GpucollError(msg)

    def _poison(self, exc: BaseException) -> None:
        """Remember the first failure and tell every peer, so nobody waits for this rank."""
        if self._error is not None:
            return
        self._error = exc
        culprit = exc.peer if isinstance(exc, PeerFailure) and exc.peer is not None else self.rank
        reason = f"{type(exc).__name__}: {exc}"
        self._monitor.broadcast(encode_abort(reason, culprit))

    def _fail(self, exc: BaseException) -> None:
        """Poison, and release the connections now unless a call in flight still uses them
        (that call releases them as it fails)."""
        self._poison(exc)
        if self._lock.acquire(blocking=False):
            try:
                self._release()
            finally:
                self._lock.release()

    def _release(self) -> None:
        """Stop the monitor and close every link; the caller holds ``_lock``. Idempotent."""
        if not self._released:
            self._released = True
            self._monitor.stop()
            self._mesh.close()

    @staticmethod
    def _finish(op: ReduceOp, size: int) -> Callable | None:
        if op is ReduceOp.AVG:
            return lambda view: finish_avg(view, size)
        return None

    # -- collectives -----------------------------------------------------------------------
    def all_reduce(self, x: ArrayRef, op: ReduceOp, *, timeout: float, stream: Any = None) -> None:
        self._reducing("all_reduce", timeout, algos.all_reduce, x.host, host_ufunc(op),
                   self._finish(op, self.size))

    def broadcast(self, x: ArrayRef, root: int, *, timeout: float, stream: Any = None) -> None:
        self._call("broadcast", timeout, algos.broadcast, x.host, root)

    def reduce(self, x: ArrayRef, root: int, op: ReduceOp, *, timeout: float,
               stream: Any = None) -> None:
        self._reducing("reduce", timeout, algos.reduce, x.host, root, host_ufunc(op),
                   self._finish(op, self.size))

    def all_gather(self, x: ArrayRef, out: ArrayRef, *, timeout: float,
                   stream: Any = None) -> None:
        self._call("all_gather", timeout, algos.all_gather, x.host, out.host)

    def gather(self, x: ArrayRef, out: ArrayRef | None, root: int, *, timeout: float,
               stream: Any = None) -> None:
        self._call("gather", timeout, algos.gather, x.host, _host(out), root)

    def scatter(self, x: ArrayRef | None, out: ArrayRef, root: int, *, timeout: float,
                stream: Any = None) -> None:
        self._call("scatter", timeout, algos.scatter, _host(x), out.host, root)

    def reduce_scatter(self, x: ArrayRef, out: ArrayRef, op: ReduceOp, *, timeout: float,
                       stream: Any = None) -> None:
        self._reducing("reduce_scatter", timeout, algos.reduce_scatter, x.host, out.host,
                   host_ufunc(op), self._finish(op, self.size))

    def all_to_all(self, x: ArrayRef, out: ArrayRef, *, timeout: float,
                   stream: Any = None) -> None:
        self._call("all_to_all", timeout, algos.all_to_all, x.host, out.host)

    def send(self, x: ArrayRef, dst: int, *, timeout: float, stream: Any = None) -> None:
        self._check_peer(dst, "dst")
        self._call(f"send to rank {dst}", timeout, _p2p, dst, x.host, True)

    def recv(self, x: ArrayRef, src: int, *, timeout: float, stream: Any = None) -> None:
        self._check_peer(src, "src")
        self._call(f"recv from rank {src}", timeout, _p2p, src, x.host, False)

    def _check_peer(self, peer: int, name: str) -> None:
        if not 0 <= peer < self.size or peer == self.rank:
            raise ValueError(f"{name}={peer} on rank {self.rank}: expected another rank of this "
                             f"group, 0..{self.size - 1}")

    def barrier(self, *, timeout: float) -> None:
        self._call("barrier", timeout, algos.barrier)

    # -- ordering --------------------------------------------------------------------------
    def run_async(self, call: Callable[[], None], *, stream: Any = None) -> FutureWork:
        work = FutureWork()
        with self._idle:  # the worker decides to stop under this lock, so nothing is lost
            if self._closed or self._error is not None:
                work.fail(self._unusable("async call") if self._error is not None else
                          GpucollError(f"rank {self.rank}: the ring backend is closed"))
                return work
            self._inflight += 1
            if self._worker is None:
                self._worker = threading.Thread(target=self._work_loop, daemon=True,
                                                name=f"gpucoll-ring-{self.rank}")
                self._worker.start()
            self._queue.put((work, call))
        return work

    def _work_loop(self) -> None:
        """Run queued calls in order; after a failure, fail what is queued and stop."""
        while True:
            item = self._queue.get()
            if item is None:
                return
            work, call = item
            work.run(call)
            with self._idle:
                self._inflight -= 1
                if self._error is not None:
                    self._fail_queued()
                    self._idle.notify_all()
                    return
                self._idle.notify_all()

    def _fail_queued(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                item[0].fail(self._unusable("async call"))
                self._inflight -= 1

    def run_sync(self, call: Callable[[], None]) -> None:
        if self._inflight and threading.current_thread() is not self._worker:
            with self._idle:
                self._idle.wait_for(lambda: self._inflight == 0)
        call()

    # -- groups and lifetime ---------------------------------------------------------------
    def split(self, store: Any, rank: int | None, size: int, color: int | None, key: int,
              *, timeout: float) -> RingBackend | None:
        if color is None or rank is None:
            return None
        return RingBackend(store, rank, size, timeout=timeout, transport=self._transport_arg)

    def abort(self, reason: str) -> None:
        err = GpucollError(f"rank {self.rank} aborted: {reason}")
        if self._state.failure is None:
            self._state.failure = err
        try:  # wake a call blocked in the engine; -1 once released
            os.eventfd_write(self._mesh.bell, 1)
        except OSError:
            pass
        self._fail(err)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join(_CLOSE_GRACE_S)
            if self._worker.is_alive():
                self.abort("closed while asynchronous work was still running")
                self._worker.join()
        if not self._lock.acquire(timeout=_CLOSE_GRACE_S):
            # another thread is inside a call: end it rather than wait for its deadline
            self.abort("closed while a call was in progress")
            self._lock.acquire()
        try:
            if not self._released:
                self._monitor.broadcast(CLOSE)
            self._release()
        finally:
            self._lock.release()


def _host(ref) -> np.ndarray | None:
    return None if ref is None else ref.host


def _p2p(s: algos.Step, peer: int, arr: np.ndarray, sending: bool) -> None:
    s.run(s.send(peer, arr) if sending else s.recv(peer, arr))
