"""The host ring backend: every collective on NumPy buffers, over shared memory or TCP.

Construction is collective: ranks meet through the store and build a mesh of connections
(``gpucoll.transport.mesh``). Calls run inline on the caller's thread (small calls are latency
bound); ``run_async`` hands calls to one worker thread, which keeps issue order. Non-blocking
sends and receives (``isend``/``irecv``) are posted to the engine at once and move alongside
whatever call drives it next, or, when no call runs, on the worker thread: an ``isend`` never
waits for an earlier one, and a blocking ``recv`` completes while an ``isend`` is pending.

Every message starts with a frame header naming its call (sequence number, kind, dtype, count,
root, op), which the receiver checks against its own call: ranks that disagree get
``CollectiveMismatch`` naming both sides instead of wrong data or a hang. The first error (a
timeout, a mismatch, a dead or aborting peer, an interrupt) poisons the backend: peers are told
what happened and whom to blame, later calls fail at once, and ``close()`` still releases
everything. A timeout first asks every peer where it is, so the error names the rank that is
behind. ``close()`` tells the peers how much of their data this rank consumed, and raises if a
peer left without receiving what this rank sent it.
"""

from __future__ import annotations

import collections
import functools
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from gpucoll import cuda
from gpucoll.backends import Backend
from gpucoll.backends import ring_algos as algos
from gpucoll.backends.ring_algos import GroupedRing
from gpucoll.errors import (
    CollectiveMismatch,
    CollectiveTimeout,
    GpucollError,
    PeerFailure,
    UsageError,
)
from gpucoll.ops import ReduceOp, finish_avg, fp_quiet, fp_restore, host_ufunc
from gpucoll.progress import IN_CALL, KIND, SLOTS, Progress, diagnose, kind_name
from gpucoll.transport.engine import CORES, Engine, Recv, Send, State
from gpucoll.transport.mesh import Mesh, Monitor, encode_abort, encode_close
from gpucoll.work import FutureWork

if TYPE_CHECKING:
    from gpucoll.arrays import ArrayRef

_CLOSE_GRACE_S = 2.0  # how long close() lets calls in flight finish before aborting them
_ASK_S = 1.0  # how long a rank that timed out waits for its peers to say where they are
_DRIVE = object()  # worker queue item: move the non-blocking messages
_CALL = object()  # worker queue item: run the earliest queued call


class _CallName:
    """A call's name for error messages, formatted only when one is raised (it is made on
    every call)."""

    __slots__ = ("kind", "code", "seq")

    def __init__(self, kind: str, code: int, seq: int):
        self.kind, self.code, self.seq = kind, code, seq

    def __str__(self) -> str:
        return f"{kind_name(self.code)} #{self.seq}" if self.code else self.kind


class RingBackend(GroupedRing, Backend):
    """Host collectives for ``size`` ranks; ``store`` is this group's store namespace.

    Buffers are host NumPy views (``ArrayRef.host``); device arrays reach this backend through
    ``gpucoll.backends.staged``, which copies them to and from host memory around each call.
    ``order`` is the sequence of ranks around the ring (None: 0, 1, ..., size-1); every rank must
    pass the same one. ``liveness`` (the store's) lets set-up notice a peer that died.
    """

    name = "ring"
    host_control = True  # runs collectives on host arrays: the communicator agrees in-band

    def __init__(self, store: Any, rank: int, size: int, *, timeout: float,
                 transport: str = "auto", order: list[int] | None = None, liveness: Any = None):
        if not 0 <= rank < size:
            raise ValueError(f"rank={rank} is outside a group of size {size}")
        self.rank, self.size = rank, size
        self._check_order(order)  # before the store is used
        self.timeout = timeout
        self._transport_arg = transport
        self._state = State()
        self._error: BaseException | None = None
        self._closed = False
        self._released = False  # connections closed (after close() or a failure)
        # held while the first failure is recorded and told to the peers: the connections are
        # not closed under a thread that is telling them (the peers would see only a death)
        self._telling = threading.RLock()
        self._lock = threading.Lock()  # held by the thread that drives the engine
        self._waiting = 0  # threads that want the lock (the worker yields it to them)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        # queued calls in issue order, as (ticket, work, call); whoever holds _runner takes the
        # earliest: the worker, or a thread waiting for one of them (FutureWork's helper)
        self._pending: collections.deque = collections.deque()
        self._runner = threading.Lock()
        self._issued = self._taken = 0  # tickets of the last call queued, and taken
        self._pid = os.getpid()
        self._inflight = 0
        self._idle = threading.Condition()
        self._worker: threading.Thread | None = None
        self._p2p_counts: dict[tuple[int, bool], int] = {}  # (peer, sending) -> messages
        # the progress record lives in a memfd that ranks on this host can open and read
        self._progress_fd = os.memfd_create("gpucoll-progress", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._progress_fd, 8 * SLOTS)
            self._progress_map = mmap.mmap(self._progress_fd, 8 * SLOTS)
            self._progress_record = Progress(self._progress_map)
            self._mesh = Mesh(store, rank, size, timeout=timeout, transport=transport,
                              progress_fd=self._progress_fd, liveness=liveness)
        except BaseException:
            self._drop_progress_map()
            raise
        self.transport = self._mesh.transport
        self._by_host = _group_by_host(self._mesh.peers)
        # several hosts with the same number of ranks on each: all_reduce goes hierarchical
        self._hosts = self._by_host if len(self._by_host) > 1 and len(
            {len(h) for h in self._by_host}) == 1 and len(self._by_host[0]) > 1 else None
        self.use_order(order)
        busy = self._mesh.local_ranks > CORES
        self._engine = Engine(rank, self._mesh.links, self._mesh.bell, self._state, busy,
                              describe=algos.describe_frame, outboxes=self._mesh.outboxes)
        self._monitor = Monitor(rank, self._mesh.control, self._mesh.bell, self._state,
                                self.progress, self._unconsumed)
        peers = [link for link in self._mesh.links if link is not None]
        # calls of at most this many bytes take the small path (the general path's rule)
        self._small_bytes = algos.in_place_bytes(peers, size)
        self._peer_links = tuple(peers)

    @property
    def lean(self) -> RingBackend:
        return self

    @property
    def local_ranks(self) -> int:
        """How many ranks of the group (this one included) run on this rank's host."""
        return self._mesh.local_ranks

    @property
    def ring_order(self) -> list[int]:
        """The ranks in the order the ring visits them."""
        return list(self._order)

    def use_order(self, order: list[int] | None) -> None:
        """Make the ring visit ranks in ``order`` (None: rank order, each host's ranks together).
        Every rank must switch to the same order before its next collective."""
        self._check_order(order)
        if order is None:
            order = [r for host in self._by_host for r in host]
        self._order = tuple(order)
        self._pos = self._order.index(self.rank)

    def _check_order(self, order: Any) -> None:
        if order is not None and not (
                isinstance(order, (list, tuple))
                and all(isinstance(r, int) and not isinstance(r, bool) for r in order)
                and sorted(order) == list(range(self.size))):
            raise ValueError(f"order={order!r} on rank {self.rank}: expected a permutation of the "
                             f"ranks 0..{self.size - 1}")

    @property
    def links(self) -> dict[int, str]:
        """Which transport carries data to each peer: ``{peer: "shm" | "unix" | "tcp"}``."""
        return {j: link.kind for j, link in enumerate(self._mesh.links) if link is not None}

    # -- running a call --------------------------------------------------------------------
    def _call(self, kind: str, timeout: float, hdr: bytes, fn: Callable, *args) -> None:
        opname = self._name(kind)
        self._check_usable(opname)
        step = algos.Step(self._engine, self.rank, self.size, time.monotonic() + timeout, opname,
                          self._order, self._pos, hdr)
        step.hosts = self._hosts
        self._drive_locked(step.deadline, opname, lambda: fn(step, *args))

    def _drive_locked(self, deadline: float, opname: str, body: Callable[[], None]) -> None:
        """Run ``body`` (which drives the engine) holding the driver lock."""
        if not self._lock.acquire(blocking=False):
            self._take_lock(deadline, opname)
        try:
            body()
        except BaseException as exc:
            err = self._fail_call(self._finished_without(exc, opname))
            if err is exc:
                raise
            raise err from None
        finally:
            self._lock.release()

    def _take_lock(self, deadline: float, opname: str) -> None:
        """Wait for the thread driving the engine (the worker moving non-blocking messages
        yields at once; a call in another thread finishes first)."""
        self._waiting += 1
        try:
            try:
                os.eventfd_write(self._mesh.bell, 1)
            except OSError:
                pass
            if not self._lock.acquire(timeout=max(deadline - time.monotonic(), 0)):
                raise CollectiveTimeout(f"{opname} on rank {self.rank} timed out waiting for "
                                        f"another call of this backend to finish")
        finally:
            self._waiting -= 1

    def _reducing(self, opname: str, timeout: float, hdr: bytes, fn: Callable, *args) -> None:
        # overflow to inf (or NaN from inf - inf) is the IEEE answer, as on the GPU; NumPy's
        # warning would point into this package's internals
        with np.errstate(over="ignore", invalid="ignore"):
            self._call(opname, timeout, hdr, fn, *args)

    def _frame(self, kind: str, arr: np.ndarray, root: int = -1,
               op: ReduceOp | None = None) -> bytes:
        """The header of this call's messages: the communicator's sequence number and call kind
        (from ``progress``), and this backend call's own arguments."""
        p = self.progress
        code = p.kind if p.state == IN_CALL and p.kind else KIND[kind]
        return algos.frame(code, max(p.seq, 0), arr.dtype, arr.size, root, op)

    def _name(self, kind: str) -> _CallName:
        """How errors name the running call: the communicator's call and its sequence number
        (``scatter #3``) while it marks one in ``progress``, else the backend's method."""
        p = self.progress
        return _CallName(kind, p.kind if p.state == IN_CALL else 0, p.seq)

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
        cls = type(err) if isinstance(err, (PeerFailure, CollectiveTimeout,
                                            CollectiveMismatch)) else GpucollError
        new = PeerFailure(msg, peer=err.peer) if cls is PeerFailure else cls(msg)
        new.peer = getattr(err, "peer", None)
        return new

    def _fail_call(self, exc: BaseException) -> BaseException:
        """A call failed: poison the backend (a timeout first learns where every rank is, so
        that it can name the rank that is behind) and release the connections; the error the
        call raises."""
        if self._error is None and isinstance(exc, CollectiveTimeout) \
                and self._state.failure is None:
            exc = self._diagnosed(exc)
        self._poison(exc)
        self._release()
        return exc

    def _finished_without(self, exc: BaseException, name: Any) -> BaseException:
        """A peer that closed cleanly after this very collective (``name``) finished it without
        the message this rank sent it, or without sending the one this rank waits for: the ranks
        disagree on the call, which is what to report rather than the peer's leaving."""
        state, peer = self._state, getattr(exc, "peer", None)
        if type(exc) is not PeerFailure or self._error is not None \
                or not isinstance(name, _CallName) or not name.code \
                or state.closed_after.get(peer, -1) < name.seq:
            return exc
        err = CollectiveMismatch(
            f"{exc}; rank {peer} had finished {name} when it closed, so the two ranks disagree "
            f"on that call (its root, its size, or who sends to whom)")
        err.peer = peer
        return err

    def _poison(self, exc: BaseException) -> None:
        """Remember the first failure and tell every peer, so nobody waits for this rank."""
        with self._telling:
            if self._error is not None:
                return
            self._error = exc
            peer = getattr(exc, "peer", None)
            self._tell_peers(exc, peer if isinstance(peer, int) else self.rank)

    def _tell_peers(self, exc: BaseException, culprit: int) -> None:
        """Send every peer an abort: ``exc``'s kind, the rank to blame, the bytes consumed."""
        for j, link in enumerate(self._mesh.links):
            if link is not None:
                self._monitor.send(j, encode_abort(exc, culprit, link.received()))

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
        """Fail pending non-blocking messages, stop the monitor and close every link; the caller
        holds ``_lock``. Idempotent."""
        if self._error is not None:
            self._engine.fail_background(self._unusable("non-blocking send/recv"))
        if not self._released:
            with self._telling:
                self._released = True
                self._monitor.stop()
                self._mesh.close()

    def _diagnosed(self, exc: CollectiveTimeout) -> CollectiveTimeout:
        """``exc`` with a line saying where every rank is: peers answer over their control
        connections; one that does not is read from its memory when it shares this host."""
        peers = [j for j in range(self.size) if j != self.rank]
        asked = self._monitor.ask(peers)
        limit = time.monotonic() + _ASK_S
        answers = self._monitor.answers
        while any(j not in answers for j in asked) and time.monotonic() < limit:
            self._engine.poller.poll(10)
            self._engine._drain_bell()
        positions = {self.rank: self.progress.position(self.rank)}
        silent = []
        for j in peers:
            data, responsive = answers.get(j), True
            if data is None:
                data, responsive = self._mesh.progress_of(j), False
            if data is None:
                silent.append(j)
            else:
                positions[j] = Progress.decode(j, data, responsive)
        err = CollectiveTimeout(f"{exc}. Where the ranks are: {diagnose(positions, silent)}")
        lowest = min(p.order for p in positions.values())
        behind = [r for r, p in positions.items() if p.order == lowest]
        stopped = [r for r in behind if not positions[r].responsive]
        stuck = silent or stopped or ([] if len(behind) == len(positions) else behind)
        err.peer = stuck[0] if stuck else exc.peer
        return err

    def peer_progress(self) -> dict[int, bytes]:
        """The progress records of this rank's peers on its host, read from their memory
        (as a timeout's diagnosis does; it works while a peer is stopped)."""
        found = {}
        for j in range(self.size):
            if j != self.rank:
                data = self._mesh.progress_of(j)
                if data is not None:
                    found[j] = data
        return found

    def _unconsumed(self, peer: int, consumed: int) -> int:
        """Bytes this rank sent to ``peer`` beyond the ``consumed`` it reported at its close."""
        link = self._mesh.links[peer]
        return 0 if link is None else link.sent() - consumed

    @staticmethod
    def _finish(op: ReduceOp, size: int) -> Callable | None:
        if op is _AVG:
            return lambda view: finish_avg(view, size)
        return None

    # -- collectives -----------------------------------------------------------------------
    def all_reduce(self, x: ArrayRef, op: ReduceOp, *, timeout: float, stream: Any = None) -> None:
        self._all_reduce(x.host, op, self._frame("all_reduce", x.host, op=op), timeout,
                         self._name("all_reduce"))

    def broadcast(self, x: ArrayRef, root: int, *, timeout: float, stream: Any = None) -> None:
        self._broadcast(x.host, root, self._frame("broadcast", x.host, root), timeout,
                        self._name("broadcast"))

    def reduce(self, x: ArrayRef, root: int, op: ReduceOp, *, timeout: float,
               stream: Any = None) -> None:
        self._reducing("reduce", timeout, self._frame("reduce", x.host, root, op), algos.reduce,
                       x.host, root, host_ufunc(op), self._finish(op, self.size))

    def all_gather(self, x: ArrayRef, out: ArrayRef, *, timeout: float,
                   stream: Any = None) -> None:
        x, out = x.host, out.host
        hdr = self._frame("all_gather", x)
        if not self._small(x.nbytes, "all_gather", timeout,
                           lambda d, n: self._small_all_gather(x, out, hdr, d, n)):
            self._call("all_gather", timeout, hdr, algos.all_gather, x, out)

    def gather(self, x: ArrayRef, out: ArrayRef | None, root: int, *, timeout: float,
               stream: Any = None) -> None:
        self._call("gather", timeout, self._frame("gather", x.host, root), algos.gather, x.host,
                   _host(out), root)

    def scatter(self, x: ArrayRef | None, out: ArrayRef, root: int, *, timeout: float,
                stream: Any = None) -> None:
        self._call("scatter", timeout, self._frame("scatter", out.host, root), algos.scatter,
                   _host(x), out.host, root)

    def reduce_scatter(self, x: ArrayRef, out: ArrayRef, op: ReduceOp, *, timeout: float,
                       stream: Any = None) -> None:
        x, out = x.host, out.host
        hdr = self._frame("reduce_scatter", x, op=op)
        if not self._small(out.nbytes, "reduce_scatter", timeout,
                           lambda d, n: self._small_reduce_scatter(x, out, op, hdr, d, n)):
            self._reducing("reduce_scatter", timeout, hdr, algos.reduce_scatter, x, out,
                           host_ufunc(op), self._finish(op, self.size))

    def all_to_all(self, x: ArrayRef, out: ArrayRef, *, timeout: float,
                   stream: Any = None) -> None:
        x, out = x.host, out.host
        hdr = self._frame("all_to_all", x)
        if not self._small(out.nbytes // self.size, "all_to_all", timeout,
                           lambda d, n: self._small_all_to_all(x, out, hdr, d, n)):
            self._call("all_to_all", timeout, hdr, algos.all_to_all, x, out)

    def barrier(self, *, timeout: float) -> None:
        self._call("barrier", timeout, self._frame("barrier", _TOKEN), algos.barrier)

    # -- the lean path: flat host arrays, called between the communicator's progress marks --
    def host_all_reduce(self, x: np.ndarray, op: ReduceOp, seq: int, timeout: float,
                        src: np.ndarray | None = None) -> None:
        """all_reduce of the flat host array ``x`` as collective ``seq``; with ``src`` (flat,
        the same size) out of place: ``src``'s values reduced into ``x``."""
        if self._inflight:
            self.run_sync(_nothing)  # after the asynchronous calls issued before it
        hdr = algos.frame(_ALL_REDUCE, seq, x.dtype, x.size, -1, op)
        if src is not None:
            if self._all_reduce_from(src, x, op, hdr, timeout):
                return
            np.copyto(x, src)
        if self.size == 1 and self._error is None:  # nothing to exchange (x / 1 is x)
            return
        done = self._native_all_reduce(x, op, hdr)
        if done is True:
            return
        self._all_reduce(x, op, hdr, timeout, _CallName("all_reduce", _ALL_REDUCE, seq),
                         done is None)

    def can_start(self, x: np.ndarray, op: ReduceOp | None = None) -> bool:
        """Whether an async all_reduce (with its ``op``) or broadcast (``op`` None) of the host
        array ``x`` may start on the issuing thread (``start_all_reduce``, ``start_broadcast``):
        nothing queued before it, and no peers, or one small message per peer through the
        compiled exchange (which folds ``op``) and nothing else on the engine."""
        if self._inflight or os.getpid() != self._pid:
            return False
        if self.size == 1:
            return self._error is None and not self._closed  # nothing to exchange
        return (0 < x.nbytes <= self._small_bytes and self._engine.native is not None
                and (op is None or self._native_fold(op, x.dtype) is not None)
                and self._idle_engine())

    def start_all_reduce(self, x: np.ndarray, op: ReduceOp, seq: int,
                         timeout: float) -> Callable[[], None] | None:
        """Start an async all_reduce of the flat host array ``x`` as collective ``seq`` on this
        thread, where ``can_start`` said it may: this rank's messages go out and the peers'
        are awaited briefly (as a synchronous call first does). None when the call finished
        here; else the rest of it, to queue at once with ``run_async``. Handing a small call
        to the worker thread costs more than the call (a thread wake-up or two)."""
        if self.size == 1:
            return None  # x / 1 is x for avg
        hdr = algos.frame(_ALL_REDUCE, seq, x.dtype, x.size, -1, op)
        done = self._native_all_reduce(x, op, hdr)
        if done is True:
            return None
        return functools.partial(self._all_reduce, x, op, hdr, timeout,
                                 _CallName("all_reduce", _ALL_REDUCE, seq), done is None)

    def start_broadcast(self, x: np.ndarray, root: int, seq: int,
                        timeout: float) -> Callable[[], None] | None:
        """``start_all_reduce`` for a broadcast of the flat host array ``x`` from ``root``:
        root puts its messages out (done, unless a ring is full); another rank takes root's
        message if it comes within the short wait. None when the call finished here; else the
        whole of it, to queue at once with ``run_async``."""
        if self.size == 1:
            return None
        hdr = algos.frame(_BROADCAST, seq, x.dtype, x.size, root)
        if self._native_broadcast(x, root, hdr):
            return None
        return functools.partial(self._broadcast, x, root, hdr, timeout,
                                 _CallName("broadcast", _BROADCAST, seq))

    def _native_broadcast(self, x: np.ndarray, root: int, hdr: bytes) -> bool:
        """The small broadcast in one compiled call where it can finish there: True when done;
        False when nothing was done (a ring full, root's message not come, a peer that left,
        the engine held), which the small path then does whole."""
        state, engine = self._state, self._engine
        if state.closed_peers or state.ended or not self._lock.acquire(False):
            return False  # the small path says which peer left
        try:
            if self.rank == root:
                return engine.native.swap(self._peer_links, (), _bytes(x), hdr, None,
                                          0, 0) is not False
            link = self._mesh.links[root]
            found = engine.native.swap((), (link,), _bytes(x), hdr, None, *engine.native_wait)
            if type(found) is not list:
                return False
            np.copyto(x, link.rx.typed(found[0], x.dtype, x.size))
            link.release(x.nbytes + algos.FRAME.size)
            return True
        finally:
            self._lock.release()

    def host_broadcast(self, x: np.ndarray, root: int, seq: int, timeout: float) -> None:
        """broadcast of the flat host array ``x`` as collective ``seq``."""
        if self._inflight:
            self.run_sync(_nothing)
        if self.size == 1 and self._error is None:
            return
        hdr = algos.frame(_BROADCAST, seq, x.dtype, x.size, root)
        if self._engine.native is not None and 0 < x.nbytes <= self._small_bytes \
                and self._idle_engine() and self._native_broadcast(x, root, hdr):
            return
        self._broadcast(x, root, hdr, timeout, _CallName("broadcast", _BROADCAST, seq))

    def _native_all_reduce(self, x: np.ndarray, op: ReduceOp, hdr: bytes) -> bool | None:
        """The small path in one compiled call (put, a short wait, the fold in rank order,
        release) when nothing else is in flight: True when the call is done; None when this
        rank's messages went out but not all the peers' have come (the small path waits for
        them); False when nothing was sent."""
        fold = self._native_fold(op, x.dtype)
        if fold is None or not 0 < x.nbytes <= self._small_bytes or not self._idle_engine() \
                or not self._lock.acquire(False):
            return False
        try:
            engine, links = self._engine, self._peer_links
            done = engine.native.swap(links, links, x, hdr, fold, *engine.native_wait)
        finally:
            self._lock.release()
        if done and op is _AVG:
            finish_avg(x, self.size)
        return done

    def _all_reduce(self, x: np.ndarray, op: ReduceOp, hdr: bytes, timeout: float,
                    name: _CallName, sent: bool = False) -> None:
        """Small messages between ranks on shared memory take a tight path of their own (which
        ``sent`` says has already put this rank's messages out)."""
        if sent or 0 < x.nbytes <= self._small_bytes and self._idle_engine():
            deadline = time.monotonic() + timeout
            self._drive_locked(deadline, name,
                               lambda: self._small_all_reduce(x, op, hdr, deadline, name, sent))
            return
        self._reducing("all_reduce", timeout, hdr, algos.all_reduce, x, host_ufunc(op),
                       self._finish(op, self.size))

    def _all_reduce_from(self, x: np.ndarray, out: np.ndarray, op: ReduceOp, hdr: bytes,
                         timeout: float) -> bool:
        """An all_reduce out of place where it costs no copy: messages too large for the
        small paths, whose algorithms read ``x`` where in place they read ``out``; False for
        the others (the caller copies, then reduces in place)."""
        if self.size == 1 or x.nbytes <= self._small_bytes:
            return False
        self._reducing("all_reduce", timeout, hdr, algos.all_reduce, out, host_ufunc(op),
                       self._finish(op, self.size), x)
        return True

    def _broadcast(self, x: np.ndarray, root: int, hdr: bytes, timeout: float,
                   name: _CallName) -> None:
        if 0 < x.nbytes <= self._small_bytes and self._idle_engine():
            deadline = time.monotonic() + timeout
            self._drive_locked(deadline, name,
                               lambda: self._small_broadcast(x, root, hdr, deadline, name))
            return
        self._call("broadcast", timeout, hdr, algos.broadcast, x, root)

    def _native_fold(self, op: ReduceOp, dtype: np.dtype) -> tuple[int, int] | None:
        """(rank, code) for the compiled exchange to fold ``op`` on ``dtype``; None where it
        is not built or has no fold for them (NumPy folds)."""
        code = algos.NATIVE_FOLD.get((op, dtype)) if self._engine.native is not None else None
        return None if code is None else (self.rank, code)

    def _idle_engine(self) -> bool:
        """Nothing else is posted, and the backend has not failed or closed (the general
        path reports those)."""
        engine = self._engine
        return not (engine.active or engine.inbox or self._error is not None
                    or self._state.failure is not None or self._closed)

    def _small_all_reduce(self, x: np.ndarray, op: ReduceOp, hdr: bytes, deadline: float,
                          name: _CallName, sent: bool = False) -> None:
        """Every rank puts ``x`` in every peer's ring and folds what it finds in its own, in
        rank order, reading the peers' values where they lie."""
        links = self._peer_links
        found = self._engine.swap_small(links, links, _bytes(x), hdr, deadline, name,
                                        self._native_fold(op, x.dtype), sent)
        if found is True:  # folded and released by the compiled exchange
            if op is _AVG:
                finish_avg(x, self.size)
            return
        self._fold_found(links, found, x, op)

    def _fold_found(self, links, found: list[int], acc: np.ndarray, op: ReduceOp) -> None:
        """``acc`` (this rank's value) := the fold in rank order of it and each link's message
        (at ``found``, from ``swap_small``), averaged for avg; then release the messages."""
        token = fp_quiet()
        try:
            algos.fold_in_rank_order(self.rank, acc, {
                link.peer: link.rx.typed(at, acc.dtype, acc.size)
                for link, at in zip(links, found, strict=True)}, host_ufunc(op))
            if op is _AVG:
                finish_avg(acc, self.size)
        finally:
            fp_restore(token)
        for link in links:
            link.release(acc.nbytes + algos.FRAME.size)

    def _small(self, nbytes: int, kind: str, timeout: float, body: Callable) -> bool:
        """Run ``body(deadline, name)``, a call whose messages of ``nbytes`` each go in one
        round on shared memory, on the small path when it applies (the general path's direct
        round sends the same messages); False when it does not."""
        if not (0 < nbytes <= self._small_bytes and self._idle_engine()):
            return False
        name = self._name(kind)
        deadline = time.monotonic() + timeout
        self._drive_locked(deadline, name, lambda: body(deadline, name))
        return True

    def _small_all_gather(self, x: np.ndarray, out: np.ndarray, hdr: bytes, deadline: float,
                          name: _CallName) -> None:
        """Every rank puts ``x`` in every peer's ring, then copies each peer's block from its
        own rings into ``out``."""
        links = self._peer_links
        found = self._engine.swap_small(links, links, _bytes(x), hdr, deadline, name)
        outs = algos.blocks(out, x.size, self.size)
        outs[self.rank][:] = x
        _copy_out(links, found, outs)

    def _small_all_to_all(self, x: np.ndarray, out: np.ndarray, hdr: bytes, deadline: float,
                          name: _CallName) -> None:
        """Block j of ``x`` goes to rank j's ring; block j of ``out`` is copied from rank j's."""
        links, k = self._peer_links, x.size // self.size
        xs, outs = algos.blocks(x, k, self.size), algos.blocks(out, k, self.size)
        found = self._engine.swap_small(links, links, [_bytes(xs[link.peer]) for link in links],
                                        hdr, deadline, name)
        outs[self.rank][:] = xs[self.rank]
        _copy_out(links, found, outs)

    def _small_reduce_scatter(self, x: np.ndarray, out: np.ndarray, op: ReduceOp, hdr: bytes,
                              deadline: float, name: _CallName) -> None:
        """Block j of ``x`` goes to rank j's ring; ``out`` := this rank's blocks of every rank,
        folded in rank order where they lie."""
        links = self._peer_links
        xs = algos.blocks(x, out.size, self.size)
        found = self._engine.swap_small(links, links, [_bytes(xs[link.peer]) for link in links],
                                        hdr, deadline, name)
        np.copyto(out, xs[self.rank])
        self._fold_found(links, found, out, op)

    def _small_broadcast(self, x: np.ndarray, root: int, hdr: bytes, deadline: float,
                         name: _CallName) -> None:
        engine = self._engine
        if self.rank == root:
            engine.swap_small(self._peer_links, (), _bytes(x), hdr, deadline, name)
            return
        link = self._mesh.links[root]
        at, = engine.swap_small((), (link,), _bytes(x), hdr, deadline, name)
        np.copyto(x, link.rx.typed(at, x.dtype, x.size))
        link.release(x.nbytes + algos.FRAME.size)

    # -- point to point --------------------------------------------------------------------
    def _message(self, x: ArrayRef, peer: int, sending: bool, tag: int):
        """The op carrying this send or receive, with the next message number of its
        direction (both ends count the messages between them in the same order) and its tag
        (where a collective's frame has its root: a receive whose tag is not its message's
        is a mismatch)."""
        key = (peer, sending)
        n = self._p2p_counts.get(key, 0)
        self._p2p_counts[key] = n + 1
        hdr = algos.frame(KIND["send"], n, x.dtype, x.count, tag or -1)
        link = self._mesh.links[peer]
        return Send(link, x.host, hdr) if sending else Recv(link, x.host, hdr)

    def send(self, x: ArrayRef, dst: int, *, timeout: float, stream: Any = None,
             tag: int = 0) -> None:
        self._p2p(x, dst, True, timeout, tag)

    def recv(self, x: ArrayRef, src: int, *, timeout: float, stream: Any = None,
             tag: int = 0) -> None:
        self._p2p(x, src, False, timeout, tag)

    def _p2p(self, x: ArrayRef, peer: int, sending: bool, timeout: float, tag: int) -> None:
        opname = f"{'send to' if sending else 'recv from'} rank {peer}"
        self._check_peer(peer, "dst" if sending else "src")
        self._check_usable(opname)
        op = self._message(x, peer, sending, tag)
        deadline = time.monotonic() + timeout
        progress = self.progress
        progress.p2p(KIND["send" if sending else "recv"], peer)
        try:
            self._drive_locked(deadline, opname,
                               lambda: self._engine.run((op,), deadline, opname))
        finally:
            progress.p2p(0, -1)

    def isend(self, x: ArrayRef, dst: int, *, timeout: float, stream: Any = None,
              tag: int = 0) -> FutureWork:
        return self._post(x, dst, True, timeout, tag)

    def irecv(self, x: ArrayRef, src: int, *, timeout: float, stream: Any = None,
              tag: int = 0) -> FutureWork:
        return self._post(x, src, False, timeout, tag)

    def _post(self, x: ArrayRef, peer: int, sending: bool, timeout: float,
              tag: int) -> FutureWork:
        """Post a non-blocking send or receive: in issue order behind earlier messages on its
        link, alongside everything else. Its handle completes when the message has moved."""
        opname = f"{'isend to' if sending else 'irecv from'} rank {peer}"
        self._check_peer(peer, "dst" if sending else "src")
        work = FutureWork()
        self._check_usable(opname)
        op = self._message(x, peer, sending, tag)
        deadline = time.monotonic() + timeout

        def done(error: BaseException | None) -> None:
            if error is None:
                work.run(_nothing)
            else:
                work.fail(error)

        submit = lambda: self._engine.submit(op, deadline, opname, done)  # noqa: E731
        with self._idle:
            if self._inflight:  # behind asynchronous calls not yet started: post in turn
                self._enqueue(lambda: submit())
                return work
        submit()
        self._wake_worker()
        return work

    def _check_peer(self, peer: int, name: str) -> None:
        if not 0 <= peer < self.size or peer == self.rank:
            raise ValueError(f"{name}={peer} on rank {self.rank}: expected another rank of this "
                             f"group, 0..{self.size - 1}")

    # -- ordering --------------------------------------------------------------------------
    def run_async(self, call: Callable[[], None], *, stream: Any = None) -> FutureWork:
        work = FutureWork()
        with self._idle:  # the worker decides to stop under this lock, so nothing is lost
            if self._closed or self._error is not None:
                work.fail(self._unusable("async call") if self._error is not None else
                          GpucollError(f"rank {self.rank}: the ring backend is closed"))
                return work
            work.helper = functools.partial(self._run_through, self._enqueue(call, work))
        return work

    def _enqueue(self, call: Callable[[], None], work: FutureWork | None = None) -> int:
        """Queue ``call`` for the worker (the caller holds ``_idle``); its ticket."""
        self._inflight += 1
        self._issued += 1
        self._start_worker()
        self._pending.append((self._issued, work or FutureWork(), call))
        self._queue.put(_CALL)
        return self._issued

    def _run_next(self) -> bool:
        """Run the earliest queued call on this thread (the caller holds ``_runner``); False
        when none is left. After a failure, fail what is queued."""
        with self._idle:
            if not self._pending:
                return False
            self._taken, work, call = self._pending.popleft()
        try:
            work.run(call)
        finally:
            if not work.finished():  # an interrupt on a waiting thread, outside the call
                self.abort("interrupted before an async call ran")
                work.fail(self._unusable("async call"))
            with self._idle:
                self._inflight -= 1
                if self._error is not None:
                    self._fail_queued()
                self._idle.notify_all()
        return True

    def _run_through(self, ticket: int) -> None:
        """Run the queued calls up to ticket ``ticket`` on this thread, a caller waiting for
        that call: cheaper than waking the worker and sleeping until it is done (two thread
        wake-ups a call, each of which can cost tens of microseconds where cores sit idle)."""
        if threading.current_thread() is self._worker:
            return
        if os.getpid() != self._pid:  # the rings are the parent's: running a call would tangle them
            raise UsageError(f"rank {self.rank}: waiting for an asynchronous call of process "
                             f"{self._pid} in a forked child of it; a child cannot use its "
                             f"parent's communicator")
        with self._runner:
            while self._taken < ticket and self._run_next():
                pass

    def _start_worker(self) -> None:
        if self._worker is None:
            self._worker = threading.Thread(target=self._work_loop, daemon=True,
                                            name=f"gpucoll-ring-{self.rank}")
            self._worker.start()

    def _wake_worker(self) -> None:
        """Make sure the worker moves posted messages when no call drives the engine."""
        with self._idle:
            if self._closed:
                return
            self._start_worker()
        self._queue.put(_DRIVE)

    def _work_loop(self) -> None:
        """Run queued calls in order; between them move non-blocking messages; after a
        failure, fail what is queued and stop."""
        cuda.own_thread()  # the staged ring's calls poll CUDA events here
        while True:
            if self._engine.has_background and self._queue.empty() and self._error is None:
                self._drive_background()
                continue
            item = self._queue.get()
            if item is None:
                return
            if item is _DRIVE:
                continue
            if not self._pending:  # a waiting caller ran it: do not queue up behind them
                continue
            with self._runner:
                self._run_next()
            if self._error is not None:
                return

    def _drive_background(self) -> None:
        """Move non-blocking messages until they are done or someone else needs the engine."""
        if not self._lock.acquire(timeout=0.05):
            return  # a call drives the engine (and the background messages with it)
        try:
            if self._error is not None:
                return
            self._engine.drive(lambda: self._waiting or not self._queue.empty())
        except BaseException as exc:  # noqa: BLE001 - reported through the messages' handles
            self._fail_call(exc)
        finally:
            self._lock.release()

    def _fail_queued(self) -> None:
        """Fail every queued call (the caller holds ``_idle``)."""
        while self._pending:
            self._taken, work, _ = self._pending.popleft()
            work.fail(self._unusable("async call"))
            self._inflight -= 1

    def run_sync(self, call: Callable[[], None]) -> None:
        if self._inflight and threading.current_thread() is not self._worker:
            self._run_through(self._issued)
            with self._idle:
                self._idle.wait_for(lambda: self._inflight == 0)
        call()

    # -- groups and lifetime ---------------------------------------------------------------
    def split(self, store: Any, rank: int | None, size: int, color: int | None, key: int,
              *, timeout: float) -> RingBackend | None:
        if color is None or rank is None:
            return None
        return RingBackend(store, rank, size, timeout=timeout, transport=self._transport_arg)

    def shrink(self, store: Any, members: list[int], *, timeout: float,
               liveness: Any = None) -> RingBackend:
        """A ring of the surviving ``members``, built afresh (the old one's connections to the
        lost rank cannot be trusted), in rank order."""
        return RingBackend(store, members.index(self.rank), len(members), timeout=timeout,
                           transport=self._transport_arg, liveness=liveness)

    def abort(self, reason: str | GpucollError) -> None:
        err = reason if isinstance(reason, GpucollError) else GpucollError(
            f"rank {self.rank} aborted: {reason}")
        if self._state.failure is None:
            self._state.failure = err
        try:  # wake a call blocked in the engine; -1 once released
            os.eventfd_write(self._mesh.bell, 1)
        except (OSError, ValueError):  # ValueError: -1, the connections are released
            pass
        self._fail(err)

    def close(self) -> None:
        """Finish, tell the peers, and release everything. Raises PeerFailure when a peer left
        without receiving what this rank sent it, and CollectiveMismatch when a peer sent this
        rank data that no call received (after releasing everything)."""
        if self._closed:
            return
        self._closed = True
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join(_CLOSE_GRACE_S)
            if self._worker.is_alive():
                self.abort("closed while asynchronous work was still running")
                self._worker.join()
        held = self._lock.acquire(timeout=_CLOSE_GRACE_S)
        if not held:
            # another thread is inside a call: end it rather than wait for its deadline; if the
            # lock still does not come back, nobody holds it any more (an interrupt that struck
            # between taking it and the call that gives it back), and waiting would hang
            self.abort("closed while a call was in progress")
            held = self._lock.acquire(timeout=_CLOSE_GRACE_S)
        problem = None
        try:
            self._finish_background()
            if not self._released:
                problem = self._say_goodbye()
            self._release()
        finally:
            if held:
                self._lock.release()
            self._drop_progress_map()
        if problem is not None:
            raise problem

    def _in_close(self, failure: BaseException) -> GpucollError:
        message = f"close on rank {self.rank}: {failure}"
        err = PeerFailure(message, failure.peer) if isinstance(failure, PeerFailure) \
            else type(failure)(message)
        err.peer = getattr(failure, "peer", None)
        return err

    def _drop_progress_map(self) -> None:
        record = self.__dict__.get("_progress_record")
        if record is not None:
            record.detach()
        if hasattr(self, "_progress_map"):
            self._progress_map.close()
        os.close(self._progress_fd)

    def _finish_background(self) -> None:
        """Give pending non-blocking messages the close grace to complete, then fail them."""
        if not self._engine.has_background or self._error is not None or self._released:
            return
        limit = time.monotonic() + _CLOSE_GRACE_S
        try:
            self._engine.drive(lambda: time.monotonic() > limit)
        except BaseException as exc:  # noqa: BLE001 - reported through the messages' handles
            self._fail_call(exc)
            return
        if self._engine.has_background:
            self._poison(GpucollError(f"rank {self.rank} closed its communicator with "
                                      f"non-blocking sends or receives still pending"))
            self._release()

    def _say_goodbye(self) -> GpucollError | None:
        """Give what this rank sent a moment to be consumed, tell each peer how much of its data
        this rank consumed, and say what went wrong (None if nothing): data a peer sent that no
        call here received (ranks disagreed: the peers are told so), or data this rank sent to
        a peer that left without it."""
        links, state = self._mesh.links, self._state
        if self._error is None and state.failure is None:
            self._await_delivery()
        # data a peer sent that no call here received proves the ranks disagreed: that is the
        # cause to report, even when a peer has already left without data of ours (because of it)
        problem = self._unreceived() if self._error is None and state.failure in (
            None, state.close_failure) else None
        if problem is not None:
            self._tell_peers(problem, self.rank)
        elif state.failure is not None:  # report it if data this rank sent is in question
            if self._error is None and (self._undelivered() is not None or not all(
                    self._settled(j, link) for j, link in enumerate(links))):
                problem = self._in_close(state.failure)
                # a peer left holding data of ours learns the cause before it sees our close
                # (which, alone, says only that the data was not received)
                peer = getattr(state.failure, "peer", None)
                self._tell_peers(state.failure, peer if isinstance(peer, int) else self.rank)
        # the peers may learn that this rank finished a call they are still in (_finished_without)
        last = self.progress.seq if problem is None and self._error is None \
            and state.failure is None else -1
        for j, link in enumerate(links):
            if link is not None:
                self._monitor.send(j, encode_close(link.received(), last))
        if problem is None and self._error is None:
            problem = self._undelivered()
        return problem

    def _await_delivery(self) -> None:
        """Wait up to the close grace until every peer has consumed what this rank sent it
        (shared memory shows that directly; over a socket only the peer's own close says it),
        has gone, or has failed."""
        links, state = self._mesh.links, self._state
        deadline = time.monotonic() + _CLOSE_GRACE_S
        while state.failure is None and time.monotonic() < deadline and not all(
                self._settled(j, link) for j, link in enumerate(links)):
            time.sleep(0.001)

    def _settled(self, j: int, link: Any) -> bool:
        """Nothing this rank sent to peer ``j`` is still in question: it sent nothing, the peer
        consumed it (visible on shared memory), or the peer closed or is gone (its close says
        what it consumed)."""
        state = self._state
        return (link is None or not link.sent() or (link.kind == "shm" and link.delivered())
                or j in state.closed_peers or j in state.ended)

    def _unreceived(self) -> CollectiveMismatch | None:
        """A mismatch naming the first message a peer sent that no call here received. A
        message of a collective later than any this rank entered is not one: the peer went on
        to a call this rank never made (it was interrupted, say), and this rank's close tells
        the peer so."""
        latest = self.progress.seq
        for j, link in enumerate(self._mesh.links):
            if link is not None and link.unread():
                head = link.next_frame(algos.FRAME.size)
                if head is not None and algos.later_call(head, latest):
                    continue
                what = f"a message of {algos.describe_frame(head)}" if head else \
                    f"{link.unread()} or more bytes"
                err = CollectiveMismatch(
                    f"close on rank {self.rank}: rank {j} sent this rank {what} that no call "
                    f"here received (ranks disagree on a collective, or a send has no recv)")
                err.peer = j
                return err
        return None

    def _undelivered(self) -> PeerFailure | None:
        """A failure naming a peer that left without consuming what this rank sent it: it said
        how much it consumed (closing or aborting), or it died and shared memory shows what it
        left; a socket cannot tell, so anything sent to a peer that died is in question."""
        state = self._state
        for j, link in enumerate(self._mesh.links):
            if link is None:
                continue
            consumed = state.consumed.get(j)
            if consumed is not None:
                lost = link.sent() - consumed
            elif j not in state.ended:
                lost = 0
            else:
                lost = link.undelivered() if link.kind == "shm" else link.sent()
            if lost > 0:
                return PeerFailure(f"close on rank {self.rank}: rank {j} left without "
                                   f"receiving {lost} bytes this rank sent it", peer=j)
        return None


_TOKEN = np.zeros(1, np.uint8)
_ALL_REDUCE, _BROADCAST = KIND["all_reduce"], KIND["broadcast"]
_AVG = ReduceOp.AVG  # (an enum member read from its class costs 0.2 us)


def _group_by_host(peers: list[dict]) -> list[list[int]]:
    """The ranks of each host (by the mesh's host identity), hosts in order of their lowest
    rank: the same lists on every rank."""
    hosts: dict[str, list[int]] = {}
    for rank, facts in enumerate(peers):
        hosts.setdefault(facts["id"], []).append(rank)
    return list(hosts.values())


def _bytes(x: np.ndarray) -> memoryview:
    """The bytes of a flat array (a memoryview cast is cheaper than ``x.view(np.uint8)``, but
    not every dtype exports a buffer format that casts)."""
    try:
        return memoryview(x).cast("B")
    except (TypeError, ValueError):
        return memoryview(x.view(np.uint8))


def _copy_out(links, found: list[int], outs: list[np.ndarray]) -> None:
    """Copy each link's message (at ``found``, from ``swap_small``) into its peer's block of
    ``outs`` and release it."""
    for link, at in zip(links, found, strict=True):
        out = outs[link.peer]
        np.copyto(out, link.rx.typed(at, out.dtype, out.size))
        link.release(out.nbytes + algos.FRAME.size)


def _nothing() -> None:
    pass


def _host(ref) -> np.ndarray | None:
    return None if ref is None else ref.host
