"""``Communicator``: the public face of a group of ranks.

Every method checks its arguments once before the rank takes part, optionally checks under
GPUCOLL_DEBUG=1 that all ranks make the same call (both checks: ``gpucoll.validation``), and
hands the backend flat contiguous buffers. Each collective gets a sequence number, the same
on every rank, which the backend's progress record shows while the call runs (and the ring stamps
on every message, so ranks that disagree are caught). Sync calls run on the caller's thread;
calls with ``async_op=True`` return a ``Work`` and complete in issue order, except non-blocking
sends and receives, which progress side by side.

Every call also gets an entry in the communicator's flight recorder (``gpucoll.progress``), which
``gpucoll.dumps`` writes out when the group fails, on SIGUSR1, or when ``gpucoll doctor`` asks.
After a lost rank, ``shrink()`` makes a communicator of the survivors. A rank that gives up
(``abort()``, an exception out of a ``with`` block, or one nobody catches: a ``sys.excepthook``)
tells its peers why, so that they fail at once with its reason.

A communicator serves one thread at a time, in the process that made it: a call from a second
thread while another is inside a call, or any call in a forked child, raises ``UsageError`` (the
first also aborts the communicator on every rank, since the two threads' calls could pair with
different calls elsewhere).

Strided (non-contiguous) inputs are copied to a contiguous buffer first; for ops that write into
their input (all_reduce, broadcast, reduce, recv) the result is copied back into it afterwards.
``out=`` buffers must be C-contiguous.

``OutOfPlaceCalls`` holds the out-of-place forms of all_reduce, reduce and broadcast (``out=``),
as NCCL has them: ``x`` is only read (on ranks where it is read at all) and the result lands in
``out``, an array of ``x``'s shape and dtype that shares no memory with it. The in-place calls
hand off there when they are given ``out``, so their own path stays as it was. ``GroupCalls``
holds subgroups by member list and a barrier that names the ranks that never arrived: what
torch.distributed users reach for as ``new_group(ranks)`` and ``monitored_barrier``.
"""

from __future__ import annotations

import atexit
import functools
import json
import operator
import os
import struct
import sys
import threading
import time
import types
import weakref
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from gpucoll import cuda
from gpucoll.arrays import (
    SUPPORTED_DTYPES,
    ArrayRef,
    as_ref,
    dtype_from_name,
    new_array,
    write_back,
)
from gpucoll.backends import Backend, tagged
from gpucoll.batch import FusedCalls, PointToPointCalls
from gpucoll.dumps import Flight
from gpucoll.errors import (
    CollectiveMismatch,
    CollectiveTimeout,
    GpucollError,
    PeerFailure,
    StoreError,
    UsageError,
)
from gpucoll.messages import MessageCalls
from gpucoll.objects import ObjectCalls
from gpucoll.progress import KIND, NO_CALL, Recorder, clock, ranks_text, size_from_env, stream_id
from gpucoll.store import (
    CLOSED_AFTER,
    Liveness,
    agree_survivors,
    leave_group,
    share,
    wait_for_ranks,
)
from gpucoll.uneven import UnevenCalls
from gpucoll.validation import VALID_OPS, Call, SignatureCheck, check_timeout
from gpucoll.validation import entry as _entry
from gpucoll.work import CompletedWork, FutureWork, Work

# the communicators of this process, for a fork and for an uncaught exception
_LIVE: weakref.WeakSet = weakref.WeakSet()


def _forked() -> None:
    for comm in list(_LIVE):
        comm._forked = True


os.register_at_fork(after_in_child=_forked)


def _abort_on_uncaught(previous: Callable) -> Callable:
    """An ``sys.excepthook`` that first aborts every open communicator of the process, so that
    its peers fail at once with the exception's text (MPI_Abort's promptness, and the reason),
    then hands over to ``previous``. Not in an interactive session, which lives on after one.
    A gpucoll error's frames inside gpucoll are left out of the traceback (one line says how
    many; GPUCOLL_VERBOSE=1 keeps them): the user's own frames and the message are what tell
    a user where and why, and every surviving rank of a job prints one."""

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if not (hasattr(sys, "ps1") or sys.flags.interactive):
            for comm in list(_LIVE):
                try:
                    culprit = _blamed(value, getattr(comm, "rank", None))
                    if culprit is None:
                        comm.abort(f"uncaught {kind.__name__}: {value}")
                    else:  # a peer's failure, passed on to the peers
                        comm._abort(f"uncaught {kind.__name__}: {value}", culprit)
                except Exception:  # noqa: BLE001 - the traceback below must still be printed
                    pass
        hidden = 0
        if isinstance(value, GpucollError) and not verbose_tracebacks():
            tb, hidden = _without_gpucoll_frames(tb)
            value.__traceback__ = tb  # what the printer reads, whatever its tb argument
        previous(kind, value, tb)
        if hidden:
            print(f"({hidden} frame{'s' if hidden > 1 else ''} inside gpucoll left out; "
                  f"GPUCOLL_VERBOSE=1 or `gpucoll run --verbose` shows them)", file=sys.stderr)

    hook.gpucoll = True
    return hook


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep  # gpucoll/ itself


def verbose_tracebacks() -> bool:
    """GPUCOLL_VERBOSE=1 (any value but empty or 0): tracebacks keep gpucoll's own frames."""
    return os.environ.get("GPUCOLL_VERBOSE", "") not in ("", "0")


def _without_gpucoll_frames(tb: Any) -> tuple[Any, int]:
    """``tb`` without its frames in gpucoll's own files, and how many were left out."""
    kept, hidden = [], 0
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.startswith(_PACKAGE_DIR):
            hidden += 1
        else:
            kept.append(tb)
        tb = tb.tb_next
    chain = None
    for entry in reversed(kept):
        chain = types.TracebackType(chain, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return chain, hidden


def _release_store(store: Any, rank: int, size: int, timeout: float) -> None:
    """Close a store this communicator made. Where this process hosts it (rank 0 under
    mpirun, say), first wait up to ``timeout`` for the other ranks' processes to leave it:
    they may still be starting up or at work in other groups, and need it."""
    if getattr(store, "is_server", False):
        where = f"rank {rank} of {size}"
        left = store.other_clients(timeout, what=f"closing the store hosted by {where}")
        if left:
            print(f"gpucoll: {where} hosts the job's store and stops it now, although "
                  f"{len(left)} other process{'es' if len(left) > 1 else ''} still "
                  f"use{'s' if len(left) == 1 else ''} it after {timeout:g} s "
                  f"({', '.join(left[:4])}{', ...' if len(left) > 4 else ''}): they lose it",
                  file=sys.stderr, flush=True)
    store.close()


@atexit.register
def _close_at_exit() -> None:
    """A process that ends without closing its communicators (a script written the mpi4py way)
    closes them now, as MPI_Finalize would, the one that owns the store last: its peers learn
    that it closed rather than died, and can go on among themselves, and where this process
    hosts the job's store it stays up for the ranks that still need it (``_release_store``).
    A communicator aborted (by an uncaught exception, say) is only released."""
    comms = [c for c in list(_LIVE) if not c.closed and not c._forked]
    for comm in sorted(comms, key=lambda c: c._owned_store is not None):
        try:
            comm.close()
        except GpucollError:
            pass  # its peers see their own side of it


def _gives_up(exc: object) -> bool:
    """Whether ``exc`` leaving a ``with`` block means the rank gives up: not a failure of the
    group (already told), nor a generator closed early or ``sys.exit(0)``, which end normally."""
    if isinstance(exc, SystemExit):
        return exc.code not in (None, 0)
    return not isinstance(exc, (GpucollError, GeneratorExit))


def _blamed(exc: object, rank: int) -> int | None:
    """The rank to blame for ``exc`` as seen from ``rank``: the peer a PeerFailure names,
    unless it is ``rank`` itself; None for any other error."""
    peer = getattr(exc, "peer", None)
    if isinstance(exc, PeerFailure) and isinstance(peer, int) and peer != rank:
        return peer
    return None


def _install_abort_hook() -> None:
    if not getattr(sys.excepthook, "gpucoll", False):
        sys.excepthook = _abort_on_uncaught(sys.excepthook)


def debug_enabled() -> bool:
    """GPUCOLL_DEBUG=1 (any value but empty or 0) turns on the cross-rank signature check."""
    return os.environ.get("GPUCOLL_DEBUG", "") not in ("", "0")


class OutOfPlaceCalls:
    """The ``out=`` forms for ``Communicator`` (a mixin: it uses the communicator's argument
    checks, sequence numbers and backend)."""

    def _all_reduce_out(self, c: Call, x: Any, out: Any, op: Any, async_op: bool,
                        timeout: float | None, stream: Any) -> Any:
        ref = c.array(x, "x")
        rop = c.op(op, ref.dtype)
        t = c.timeout(timeout, self.timeout)
        res = c.output(out, ref, tuple(ref.shape), (ref,))
        seq = self._signature(c, t, ref, op=rop)
        b = self._backend
        return self._issue(c, seq, lambda: b.all_reduce_out(ref, res, rop, timeout=t,
                                                             stream=stream),
                           res.array, async_op, stream)

    def _reduce_out(self, c: Call, x: Any, out: Any, root: Any, op: Any, async_op: bool,
                    timeout: float | None, stream: Any) -> Any:
        root = c.rank_arg(root, "root")
        ref = c.array(x, "x")
        rop = c.op(op, ref.dtype)
        t = c.timeout(timeout, self.timeout)
        res = None if out is None else c.output(out, ref, tuple(ref.shape), (ref,))
        if res is None and self.rank == root:
            raise c.fail(ValueError, "out is None on the root; root receives the result there")
        seq = self._signature(c, t, ref, op=rop, root=root)
        b = self._backend
        return self._issue(c, seq, lambda: b.reduce_out(
            ref, res if self.rank == root else None, root, rop, timeout=t, stream=stream),
            None if res is None else res.array, async_op, stream)

    def _broadcast_out(self, c: Call, x: Any, out: Any, root: Any, async_op: bool,
                       timeout: float | None, stream: Any) -> Any:
        root = c.rank_arg(root, "root")
        t = c.timeout(timeout, self.timeout)
        if self.rank == root:
            if x is None:
                raise c.fail(TypeError, f"x is None on the root; root {root} broadcasts its x")
            ref = c.array(x, "x")
            res = c.output(out, ref, tuple(ref.shape), (ref,))
        else:  # x is not read here: out alone says what arrives
            ref = None
            res = c.array(out, "out", writable=True, copy=False)
        seq = self._signature(c, t, res, root=root)
        b = self._backend
        return self._issue(c, seq, lambda: b.broadcast_out(ref, res, root, timeout=t,
                                                            stream=stream),
                           res.array, async_op, stream)


class GroupCalls:
    """``new_group`` and ``monitored_barrier`` for ``Communicator`` (a mixin: it uses the
    communicator's argument checks, store and ``split``)."""

    _monitored = 0  # monitored barriers so far, the same count on every rank

    @_entry
    def new_group(self, ranks: Sequence[int], *, timeout: float | None = None) -> Any:
        """A communicator of the listed ranks, numbered in sorted order (as
        torch.distributed.new_group); None on the ranks not listed. Collective over this
        communicator: every rank passes the same ranks (else CollectiveMismatch everywhere)."""
        c = self._call("new_group")
        members = _members(c, ranks, self.size)
        t = c.timeout(timeout, self.timeout)
        seq = self._signature(c, t, None, ranks=members)
        digest = zlib.crc32(struct.pack(f"<{len(members)}q", *members))
        lists = self._agree(c, seq, struct.pack("<I", digest), t, "new_group")
        odd = [r for r, v in enumerate(lists) if v != lists[self.rank]]
        if odd:
            same = [r for r, v in enumerate(lists) if v == lists[self.rank]]
            raise CollectiveMismatch(
                f"{c.where}: the ranks pass different member lists: {ranks_text(same)} "
                f"{'passes' if len(same) == 1 else 'pass'} {members}, {ranks_text(odd)} "
                f"{'passes' if len(odd) == 1 else 'pass'} another; no group was made")
        mine = self.rank in members
        return self._split(c, 0 if mine else None, members.index(self.rank) if mine else 0, t)

    @_entry
    def monitored_barrier(self, *, timeout: float | None = None) -> None:
        """A barrier through the store that, when ranks do not arrive within ``timeout``,
        raises CollectiveTimeout naming every one of them on every rank that did (a rank that
        died is a PeerFailure naming it at once). After earlier asynchronous work, like
        ``barrier``; the communicator is unusable after it fails."""
        c = self._call("monitored_barrier")
        if self._store is None:
            raise c.fail(UsageError, "this communicator has no store to meet in")
        t = c.timeout(timeout, self.timeout)
        seq = self._signature(c, t, None)
        n = self._monitored
        self._monitored = n + 1
        store, me = self._store, self.rank

        def meet() -> None:
            keys = [f"monitored/{n}/{r}" for r in range(self.size)]
            store.set(keys[me], b"1")
            # only the ranks not there yet are waited for: one that arrived and then left (it
            # timed out first, say) is no reason to fail
            missing = [r for r, v in enumerate(store.peek(keys)) if v is None]
            if missing:
                wait_for_ranks(store, [keys[r] for r in missing], t, ranks=missing,
                               what=f"monitored_barrier #{seq}", rank=me,
                               absent="never arrived", liveness=self._liveness)
            if n >= 2:  # every rank has read the keys of two barriers ago
                store.delete_key(f"monitored/{n - 2}/{me}")

        self._issue(c, seq, lambda: self._in_store(meet), None, False, None)


def _members(c: Call, ranks: Any, size: int) -> list[int]:
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence):
        raise c.fail(TypeError, f"ranks must be a list of ranks, got {type(ranks).__name__}")
    out = []
    for i, r in enumerate(ranks):
        if isinstance(r, bool) or not hasattr(type(r), "__index__"):
            raise c.fail(TypeError, f"ranks[{i}] must be an int, got {type(r).__name__}")
        r = operator.index(r)
        if not 0 <= r < size:
            raise c.fail(ValueError, f"ranks[{i}] = {r} is not a rank of this communicator "
                                     f"(0..{size - 1})")
        out.append(r)
    if not out:
        raise c.fail(ValueError, "ranks is empty; a group needs at least one rank")
    if len(set(out)) != len(out):
        raise c.fail(ValueError, f"ranks {list(ranks)} lists a rank twice")
    return sorted(out)


class Communicator(OutOfPlaceCalls, UnevenCalls, ObjectCalls, MessageCalls, PointToPointCalls,
                   FusedCalls, GroupCalls):
    """A group of ``size`` ranks; this process is ``rank``; ``backend`` names the engine.

    Every method is collective (all ranks of the group call it, in the same order) except
    ``send``/``recv`` (the two ranks named) and ``close``. ``timeout=`` bounds one call (default:
    the communicator's); ``stream=`` orders device work on a CUDA stream (default: current).
    A strided ``x`` is copied to a contiguous buffer, and for the ops that write into ``x``
    (all_reduce, reduce, broadcast, recv) the result is copied back into it.
    """

    def __init__(self, backend: Backend, store: Any, *, timeout: float,
                 debug: bool | None = None, owned_store: Any = None, liveness: Any = None):
        trace_size = size_from_env()  # first: a bad value must not leave half a communicator
        self._backend = backend
        self.rank: int = backend.rank
        self.size: int = backend.size
        self.backend: str = backend.name
        self._backend_reason: str = getattr(backend, "backend_reason", None) or (
            f"the {backend.name} backend was given to the Communicator directly")
        self.timeout = check_timeout(timeout, "timeout", "Communicator")
        self._store = store
        self._owned_store = owned_store
        self._liveness = liveness if liveness is not None else Liveness.of(
            store, self.rank, self.size)  # a rank that dies while others wait in the store
        self._progress = backend.progress
        self._closed = False
        self._forked = False
        self._pid = os.getpid()
        self._entry = threading.Lock()  # held by the thread inside a call
        self._inside = ""  # the call that thread is in (for the concurrent-use message)
        self._seq = 0  # collective calls that passed validation, the same count on every rank
        self._splits = 0
        self._shrinks = 0
        self._shrunk: list[Communicator] = []  # groups shrunk from this one
        self._parents: list[Communicator] = []  # ... and the groups this one was shrunk from
        self._leave_pending = False  # its place in the store is kept for a shrunk group
        self._agreements = 0  # values agreed through the store so far
        self._children: list[Communicator] = []
        self._calls: dict[str, Call] = {}
        self._check = SignatureCheck(store, self.rank, self.size, self._liveness) if (
            debug_enabled() if debug is None else debug) else None
        # the lean path of the common calls on NumPy arrays (not under the debug check)
        self._lean_backend = backend.lean if self._check is None else None
        self._recorder = Recorder(trace_size)  # the last calls, for dumps and the doctor
        self._keep = self._recorder.keep
        self._flight = Flight(self._recorder, store, self.rank, self.size, backend)
        self._aborted: str | None = None  # why abort() ended it
        self._parent_ranks: list[int] | None = None  # split: each rank's rank in the parent
        _LIVE.add(self)
        _install_abort_hook()

    # -- reductions, in place ---------------------------------------------------------------

    def all_reduce(self, x: Any, op: Any = "sum", *, out: Any = None, async_op: bool = False,
                   timeout: float | None = None, stream: Any = None) -> Any:
        """Combine ``x`` over all ranks with ``op``, in place; returns ``x``.

        Every rank gets a bit-identical result (a fixed reduction order). With ``out`` the
        result lands there instead, ``x`` is only read, and ``out`` is returned.
        """
        if type(x) is np.ndarray and timeout is None and stream is None:
            lean = self._lean_backend
            try:
                rop = VALID_OPS.get((op, x.dtype))
            except TypeError:  # an unhashable op: the general path says what is wrong
                rop = None
            if lean is not None and rop is not None:
                if async_op:
                    if out is None and x.flags.writeable and lean.can_start(x, rop):
                        work = self._lean_async("all_reduce", _ALL_REDUCE, lean.start_all_reduce,
                                                x, rop, {"op": rop})
                        if work is not None:
                            return work
                elif out is None:
                    if x.flags.writeable and self._lean("all_reduce", _ALL_REDUCE,
                                                        lean.host_all_reduce, x, rop):
                        return x
                elif (type(out) is np.ndarray and out.shape == x.shape and out.dtype == x.dtype
                      and out.flags.writeable and not np.may_share_memory(x, out)
                      and self._lean("all_reduce", _ALL_REDUCE,
                                     _into(out, x, lean.host_all_reduce), out, rop)):
                    return out
        return self._all_reduce(x, op, async_op, timeout, stream, out)

    @_entry
    def _all_reduce(self, x: Any, op: Any, async_op: bool, timeout: float | None,
                    stream: Any, out: Any = None) -> Any:
        c = self._call("all_reduce")
        if out is not None:
            return self._all_reduce_out(c, x, out, op, async_op, timeout, stream)
        ref = c.array(x, "x", writable=True)
        rop = c.op(op, ref.dtype)
        t = c.timeout(timeout, self.timeout)
        seq = self._signature(c, t, ref, op=rop)
        b = self._backend
        return self._issue(c, seq, lambda: b.all_reduce(ref, rop, timeout=t, stream=stream),
                           x, async_op, stream, ref, x)

    @_entry
    def reduce(self, x: Any, root: int = 0, op: Any = "sum", *, out: Any = None,
               async_op: bool = False, timeout: float | None = None, stream: Any = None) -> Any:
        """Combine ``x`` over all ranks into root's ``x``; returns ``x`` (unchanged off root).

        With ``out`` the result lands in root's ``out`` instead and ``x`` is only read; returns
        ``out``. Other ranks may pass ``out=None`` (their ``out`` is never written).
        """
        c = self._call("reduce")
        if out is not None:
            return self._reduce_out(c, x, out, root, op, async_op, timeout, stream)
        root = c.rank_arg(root, "root")
        ref = c.array(x, "x", writable=self.rank == root)
        rop = c.op(op, ref.dtype)
        t = c.timeout(timeout, self.timeout)
        seq = self._signature(c, t, ref, op=rop, root=root)
        b = self._backend
        return self._issue(c, seq, lambda: b.reduce(ref, root, rop, timeout=t, stream=stream),
                           x, async_op, stream, ref, x)

    def broadcast(self, x: Any, root: int = 0, *, out: Any = None, async_op: bool = False,
                  timeout: float | None = None, stream: Any = None) -> Any:
        """Copy root's ``x`` into every rank's ``x`` (same shape and dtype); returns ``x``.

        With ``out`` root's ``x`` lands in every rank's ``out`` (root's too) and ``x`` is only
        read on root (other ranks may pass ``x=None``); returns ``out``.
        """
        if (type(x) is np.ndarray and type(root) is int and timeout is None
                and stream is None and out is None and 0 <= root < self.size
                and x.dtype in _LEAN_DTYPES and (x.flags.writeable or root == self.rank)):
            lean = self._lean_backend
            if lean is not None and not async_op:
                if self._lean("broadcast", _BROADCAST, lean.host_broadcast, x, root):
                    return x
            elif lean is not None and lean.can_start(x):
                work = self._lean_async("broadcast", _BROADCAST, lean.start_broadcast, x, root,
                                        {"root": root})
                if work is not None:
                    return work
        return self._broadcast(x, root, async_op, timeout, stream, out)

    @_entry
    def _broadcast(self, x: Any, root: Any, async_op: bool, timeout: float | None,
                   stream: Any, out: Any = None) -> Any:
        c = self._call("broadcast")
        if out is not None:
            return self._broadcast_out(c, x, out, root, async_op, timeout, stream)
        root = c.rank_arg(root, "root")
        ref = c.array(x, "x", writable=self.rank != root)
        t = c.timeout(timeout, self.timeout)
        seq = self._signature(c, t, ref, root=root)
        b = self._backend
        return self._issue(c, seq, lambda: b.broadcast(ref, root, timeout=t, stream=stream),
                           x, async_op, stream, ref, x)

    # -- ops that make a new array (or fill out=) -----------------------------------------

    @_entry
    def all_gather(self, x: Any, *, tiled: bool = False, out: Any = None, async_op: bool = False,
                   timeout: float | None = None, stream: Any = None) -> Any:
        """Every rank's ``x`` on every rank: shape ``(size, *x.shape)``, slot i from rank i.

        ``tiled=True`` concatenates along axis 0 instead: ``(size * x.shape[0], ...)``.
        """
        c = self._call("all_gather")
        ref = c.array(x, "x")
        t = c.timeout(timeout, self.timeout)
        res = c.output(out, ref, c.stacked(tuple(ref.shape), tiled), (ref,))
        seq = self._signature(c, t, ref, tiled=tiled)
        b = self._backend
        return self._issue(c, seq, lambda: b.all_gather(ref, res, timeout=t, stream=stream),
                           res.array, async_op, stream)

    @_entry
    def gather(self, x: Any, root: int = 0, *, tiled: bool = False, out: Any = None,
               async_op: bool = False, timeout: float | None = None, stream: Any = None) -> Any:
        """Every rank's ``x`` on root, as ``all_gather`` lays it out; None on other ranks.

        ``out`` is used on root only.
        """
        c = self._call("gather")
        ref = c.array(x, "x")
        root = c.rank_arg(root, "root")
        t = c.timeout(timeout, self.timeout)
        res = None
        if self.rank == root:
            res = c.output(out, ref, c.stacked(tuple(ref.shape), tiled), (ref,))
        seq = self._signature(c, t, ref, root=root, tiled=tiled)
        b = self._backend
        return self._issue(c, seq, lambda: b.gather(ref, res, root, timeout=t, stream=stream),
                           None if res is None else res.array, async_op, stream)

    @_entry
    def scatter(self, x: Any = None, root: int = 0, *, tiled: bool = False, out: Any = None,
                async_op: bool = False, timeout: float | None = None, stream: Any = None) -> Any:
        """Root's ``x`` of shape ``(size, *s)`` split by slot: rank i gets ``x[i]``, shape ``s``.

        ``tiled=True``: root's ``x`` is ``(size * k, ...)`` and each rank gets ``k`` rows.
        Other ranks pass ``x=None`` (dtype and shape come from root) or an ``out=`` buffer; ``x``
        is ignored off root. The ranks first agree on the slot's layout, so an ``out`` that does
        not match root's slots is a CollectiveMismatch on every rank before any data moves.
        """
        c = self._call("scatter")
        root = c.rank_arg(root, "root")
        t = c.timeout(timeout, self.timeout)
        if self.rank == root:
            if x is None:
                raise c.fail(TypeError, f"x is None on the root; root {root} passes the "
                                        f"({self.size}, ...) array to scatter")
            src = c.array(x, "x")
            res = c.output(out, src, c.slots(src, "x", tiled), (src,))
        else:
            src = None
            res = None if out is None else c.array(out, "out", writable=True, copy=False)
        seq = self._signature(c, t, res, root=root, tiled=tiled)
        res = self._scatter_layout(c, seq, root, src, res, t)
        b = self._backend
        return self._issue(c, seq, lambda: b.scatter(src, res, root, timeout=t, stream=stream),
                           res.array, async_op, stream)

    @_entry
    def reduce_scatter(self, x: Any, op: Any = "sum", *, tiled: bool = False, out: Any = None,
                       async_op: bool = False, timeout: float | None = None,
                       stream: Any = None) -> Any:
        """``x`` of shape ``(size, *s)`` reduced over ranks; rank i gets reduced slot i.

        ``tiled=True``: ``x`` is ``(size * k, ...)`` and each rank gets ``k`` reduced rows.
        """
        c = self._call("reduce_scatter")
        ref = c.array(x, "x")
        rop = c.op(op, ref.dtype)
        t = c.timeout(timeout, self.timeout)
        res = c.output(out, ref, c.slots(ref, "x", tiled), (ref,))
        seq = self._signature(c, t, ref, op=rop, tiled=tiled)
        b = self._backend
        return self._issue(c, seq,
                           lambda: b.reduce_scatter(ref, res, rop, timeout=t, stream=stream),
                           res.array, async_op, stream)

    @_entry
    def all_to_all(self, x: Any, *, tiled: bool = False, out: Any = None, async_op: bool = False,
                   timeout: float | None = None, stream: Any = None) -> Any:
        """Exchange slots: ``x`` and the result have shape ``(size, *s)``, and result slot j is
        slot ``rank`` of rank j's ``x``. ``tiled=True`` splits axis 0 into ``size`` blocks."""
        c = self._call("all_to_all")
        ref = c.array(x, "x")
        t = c.timeout(timeout, self.timeout)
        c.slots(ref, "x", tiled)
        res = c.output(out, ref, tuple(ref.shape), (ref,))
        seq = self._signature(c, t, ref, tiled=tiled)
        b = self._backend
        return self._issue(c, seq, lambda: b.all_to_all(ref, res, timeout=t, stream=stream),
                           res.array, async_op, stream)

    # -- point to point and barrier ---------------------------------------------------------

    @_entry
    def send(self, x: Any, dst: int, *, tag: int = 0, async_op: bool = False,
             timeout: float | None = None, stream: Any = None) -> Work | None:
        """Send ``x`` to rank ``dst``, which calls ``recv`` with the same dtype and size.

        With ``async_op=True`` the send progresses alongside later sends and receives (a
        blocking ``recv`` completes while it is pending). Messages between two ranks arrive in
        the order they were sent, whatever their ``tag`` (an int >= 0): arrays pair in order,
        and the receive names the same tag (checked under GPUCOLL_DEBUG=1).
        """
        c = self._call("send")
        if self._in_batch():
            if async_op:
                return self._p2p("isend", x, dst, True, timeout, stream, tag)
            raise c.fail(UsageError, self._BLOCKING_IN_BATCH.format(call="send", posted="isend"))
        ref = c.array(x, "x")
        dst = c.peer(dst, "dst")
        tag = c.tag(tag)
        t = c.timeout(timeout, self.timeout)
        check = self._pair_signature(c, ref, dst, sending=True, tag=tag)
        b = self._backend
        kw = tagged(tag)
        if async_op and check is None:
            self._recorder.posted()  # its end is the Work's, which the recorder does not see
            return b.isend(ref, dst, timeout=t, stream=stream, **kw).bind(None, c.where)
        return self._issue(c, None, lambda: b.send(ref, dst, timeout=t, stream=stream, **kw),
                           None, async_op, stream, check=check, timeout=t)

    @_entry
    def recv(self, x: Any, src: int, *, tag: int = 0, async_op: bool = False,
             timeout: float | None = None, stream: Any = None) -> Any:
        """Receive into ``x`` what rank ``src`` sends; returns ``x``.

        ``async_op=True`` posts the receive and returns its Work at once (see ``send``)."""
        c = self._call("recv")
        if self._in_batch():
            if async_op:
                return self._p2p("irecv", x, src, False, timeout, stream, tag)
            raise c.fail(UsageError, self._BLOCKING_IN_BATCH.format(call="recv", posted="irecv"))
        ref = c.array(x, "x", writable=True)
        src = c.peer(src, "src")
        tag = c.tag(tag)
        t = c.timeout(timeout, self.timeout)
        check = self._pair_signature(c, ref, src, sending=False, tag=tag)
        b = self._backend
        kw = tagged(tag)
        if async_op and check is None and ref.array is x:
            self._recorder.posted()  # its end is the Work's, which the recorder does not see
            return b.irecv(ref, src, timeout=t, stream=stream, **kw).bind(x, c.where)
        return self._issue(c, None, lambda: b.recv(ref, src, timeout=t, stream=stream, **kw),
                           x, async_op, stream, ref, x, check=check, timeout=t)

    _BLOCKING_IN_BATCH = (
        "a blocking {call} inside `with comm.batch():` is refused: the batch's sends and "
        "receives are posted only when the block ends, so a peer may wait on them while this "
        "call waits on the peer (a deadlock on every backend once messages are large); use "
        "{posted}, or {call}(..., async_op=True), which join the batch")

    def _in_batch(self) -> bool:
        """Whether this thread has a ``with comm.batch():`` block open on this communicator."""
        batch = self._batch
        return batch is not None and batch.thread == threading.get_ident()

    @_entry
    def barrier(self, *, async_op: bool = False, timeout: float | None = None) -> Work | None:
        """Return once every rank has called barrier (and, in issue order, all earlier work)."""
        c = self._call("barrier")
        t = c.timeout(timeout, self.timeout)
        seq = self._signature(c, t, None)
        b = self._backend
        return self._issue(c, seq, lambda: b.barrier(timeout=t), None, async_op, None)

    # -- groups and lifetime ---------------------------------------------------------------

    @_entry
    def split(self, color: int | None, key: int = 0, *,
              timeout: float | None = None) -> Communicator | None:
        """A communicator of the ranks that pass the same ``color`` (MPI_Comm_split).

        Ranks are numbered by ``key``, then by rank here. A rank passing ``color=None`` takes
        part and gets None. Collective over this communicator.
        """
        c = self._call("split")
        if color is not None:
            color = c.integer(color, "color", expected="an int or None")
        key = c.integer(key, "key")
        return self._split(c, color, key, c.timeout(timeout, self.timeout))

    def _split(self, c: Call, color: int | None, key: int, t: float) -> Communicator | None:
        seq = self._signature(c, t, None)
        n = self._splits
        self._splits += 1
        entries = [json.loads(e) for e in self._agree(c, seq, json.dumps([color, key]).encode(),
                                                      t, "split")]
        sub_store, sub_rank, sub_size = None, None, 0
        if color is not None:
            members = sorted((k, r) for r, (col, k) in enumerate(entries) if col == color)
            sub_rank, sub_size = members.index((key, self.rank)), len(members)
            sub_store = _prefix(f"split/{n}/{color}", self._store)
        # backends see a colour's index among the colours in use (any int is a colour on every
        # backend, None is "no group"), and NCCL's 32-bit colour can never overflow
        index = None if color is None else sorted(
            {col for col, _ in entries if col is not None}).index(color)
        made: list[Backend | None] = []
        self._backend.run_sync(lambda: made.append(self._backend.split(
            sub_store, sub_rank, sub_size, index, key, timeout=t)))
        if made[0] is None:
            return None
        sub = Communicator(made[0], sub_store, timeout=self.timeout,
                           debug=self._check is not None)
        sub._backend_reason = f"split from a {self.backend} communicator: {self.backend_reason}"
        sub._flight.family = self._flight.family
        sub._parent_ranks = [r for _, r in members]
        self._children = [child for child in self._children if not child.closed] + [sub]
        return sub

    @_entry
    def shrink(self, *, timeout: float | None = None) -> Communicator:
        """A communicator of the ranks of this group that are still alive, renumbered in order
        (rank i of the new group is the i-th survivor): the way to carry on after a
        PeerFailure. Collective over the survivors; any of them may call it first.

        The survivors agree through the store on who is left (a rank whose will says it died or
        closed is out; one that has not called ``shrink`` by the deadline is out too, and
        raises PeerFailure when it does); if another rank dies while the new group forms, they
        agree again without it. ``timeout`` bounds the wait for the survivors, and then again
        the forming of the new group. Needs the store to outlive the lost ranks (``gpucoll
        run``'s store lives in the launcher). This communicator stays as it was: close it when
        done; its place in the store is kept until the shrunk group closes.
        """
        c = self._call("shrink")
        t = c.timeout(timeout, self.timeout)
        if self._liveness is None:
            raise UsageError(f"{c.where}: shrink needs a store that keeps wills (a TCPStore "
                             f"or PrefixStore of one), to tell the dead ranks from the living")
        epoch = self._shrinks
        self._shrinks += 1
        for attempt in range(self.size):
            name = f"shrink/{epoch}/{attempt}"
            members = self._in_store(functools.partial(
                agree_survivors, self._store, self.rank, self.size, self._liveness, t,
                attempt=name, what=c.where))
            sub = self._shrunk_group(c, name, members, time.monotonic() + t)
            if sub is not None:
                return sub
        raise PeerFailure(f"{c.where}: every attempt to shrink the group lost another rank")

    def _shrunk_group(self, c: Call, name: str, members: list[int],
                      deadline: float) -> Communicator | None:
        """The group of ``members`` in namespace ``name``, or None when a member died while it
        formed (every member sees that alike: the group is complete only once every member
        says it is ready)."""
        rank, size = members.index(self.rank), len(members)
        space = _prefix(f"{name}/group", self._store)
        live = Liveness(space, rank, size, earlier=(self._store, members))
        made = None
        try:
            made = self._backend.shrink(space, members, liveness=live,
                                        timeout=max(deadline - time.monotonic(), 0.0))
            space.set(f"ready/{rank}", b"1")
            wait_for_ranks(space, [f"ready/{r}" for r in range(size)],
                           max(deadline - time.monotonic(), 0.0), what=f"{c.where} (forming "
                           f"the group of ranks {members})", rank=rank, liveness=live)
        except PeerFailure:
            if made is not None:
                made.abort("a member died while the shrunk group formed")
                made.close()
            live.leave()
            return None
        except BaseException:
            if made is not None:
                made.abort("shrink failed")
                made.close()
            live.leave()
            raise
        sub = Communicator(made, space, timeout=self.timeout, debug=self._check is not None,
                           liveness=live)
        sub._backend_reason = f"shrunk from a {self.backend} communicator: {self.backend_reason}"
        sub._flight.family = self._flight.family
        sub._owned_store, self._owned_store = self._owned_store, None
        sub._parents.append(self)
        self._shrunk.append(sub)
        return sub

    @property
    def ring_order(self) -> list[int] | None:
        """The ranks in the order the host ring visits them (None on other backends)."""
        return getattr(self._backend, "ring_order", None)

    @property
    def backend_reason(self) -> str:
        """Why this communicator runs on ``backend``: requested by name, or what
        ``backend="auto"`` found on the ranks (e.g. which rank cannot use NCCL)."""
        return self._backend_reason

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Finish issued work, release the backend (and the store, if this communicator made
        it) and communicators split from this one. Idempotent; not collective.

        Raises PeerFailure if a peer left without receiving data this rank sent it, or
        CollectiveMismatch if a peer sent data that no call here received (everything is
        released first). In a forked child it only marks the communicator closed: the parent's
        connections are the parent's."""
        if self._closed:
            return
        self._closed = True
        if self._forked:
            return
        try:
            culprit = self._cause()
            if culprit is not None:  # the peers of split groups learn whose failure ends them
                self._abort_children(f"{type(self._flight.error).__name__}: "
                                     f"{self._flight.error}", culprit)
            for child in self._children:
                try:
                    child.close()
                except GpucollError:
                    pass  # the child's peers see their own side of it
            try:
                self._backend.run_sync(lambda: None)
            except GpucollError:
                pass  # the failed call already reported it; closing must still succeed
            self._backend.close()
        except GpucollError as exc:
            self._flight.failed(exc)
            raise
        finally:
            self._flight.close()
            self._leave()
            if self._owned_store is not None:
                _release_store(self._owned_store, self.rank, self.size, self.timeout)

    def abort(self, reason: str = "aborted by the program") -> None:
        """End this communicator now on every rank: a call in progress here (in any thread)
        and the peers' calls raise, the peers a ``PeerFailure`` naming this rank and
        ``reason``; later calls here raise; ``close()`` then only releases. Not collective;
        idempotent; communicators split from this one are aborted too. A ``with`` block that
        ends in an exception aborts with its text, and so does an exception nobody catches
        (for every open communicator of the process)."""
        self._abort(str(reason), None)

    def _abort(self, reason: str, culprit: int | None) -> None:
        """``abort(reason)``, blaming rank ``culprit`` (or the peer whose failure this
        communicator already raised): a rank that gives up because of another's failure
        passes that rank on, so that every peer names the first failure, not this rank."""
        if self._closed or self._forked or self._aborted is not None:
            return
        self._aborted = reason
        culprit = culprit if culprit is not None else self._cause()
        self._abort_children(reason, culprit)
        try:
            self._backend.abort(self._aborted if culprit is None else PeerFailure(
                f"rank {self.rank} aborted because of rank {culprit}: {reason}", peer=culprit))
        finally:
            if self._liveness is not None:  # peers waiting in the store learn it there
                self._liveness.leave(aborted=self._aborted, culprit=culprit)

    def _abort_children(self, reason: str, culprit: int | None) -> None:
        """Abort the communicators split from this one, blaming ``culprit`` (a rank here) in
        their numbering, or, where it is no member, saying who it was here."""
        for child in self._children:
            ranks = child._parent_ranks
            if culprit is None or ranks is None:
                child._abort(reason, None)
            elif culprit in ranks:
                child._abort(reason, ranks.index(culprit))
            else:
                child._abort(f"{reason} (because of rank {culprit} of the communicator it was "
                             f"split from)", None)

    def _cause(self) -> int | None:
        """The peer whose failure ended this communicator here (the first error it raised
        names it), or None."""
        return _blamed(self._flight.error, self.rank)

    def _leave(self) -> None:
        """Leave the group's place in the store (never raises; the last rank out deletes its
        keys), unless a group shrunk from this one still lives there: it leaves for both."""
        if any(not sub.closed for sub in self._shrunk):
            self._leave_pending = True
        elif self._store is not None:
            culprit = self._cause()
            why = self._aborted
            if why is None and culprit is not None:  # closed after a peer's failure: say whose
                why = f"{CLOSED_AFTER}{type(self._flight.error).__name__}: {self._flight.error}"
            leave_group(self._store, self.rank, self.size, why, culprit)
        for parent in self._parents:
            if parent._leave_pending and not any(not s.closed for s in parent._shrunk):
                parent._leave_pending = False
                parent._leave()

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, kind: type | None, *exc: object) -> None:
        if kind is None:
            self.close()
            return
        try:  # an error is already on its way out: closing must not replace it
            culprit = _blamed(exc[0], self.rank)
            if _gives_up(exc[0]) or culprit is not None:  # the peers learn why this rank stops
                self._abort(f"{kind.__name__}: {exc[0]}", culprit)
            self.close()
        except GpucollError:
            pass

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<Communicator rank {self.rank} of {self.size}, {self.backend}, {state}>"

    # -- plumbing -----------------------------------------------------------------------------

    def _lean(self, name: str, kind: int, run: Callable, x: np.ndarray, arg: Any) -> bool:
        """Run a call on a C-contiguous NumPy array whose other arguments are known good, with
        nothing of the general path's but what it must do: refuse a forked child and a second
        thread, number the collective, mark it in the progress record and the flight recorder.
        False (nothing done) when the general path must run, to say what is wrong."""
        if not x.flags.c_contiguous or self._forked or self._closed \
                or not self._entry.acquire(False):
            return False
        try:
            self._inside = name
            seq = self._seq
            self._seq = seq + 1
            keep = self._keep  # the flight recorder: the call as it starts, then its end
            if kind == _ALL_REDUCE:  # arg: the op; else broadcast's root
                keep((seq, kind, x.dtype, x.size, -1, arg, clock()))
            else:
                keep((seq, kind, x.dtype, x.size, arg, None, clock()))
            progress = self._progress
            progress.enter(seq, kind)
            try:
                run(x if x.ndim == 1 else x.reshape(-1), arg, seq, self.timeout)
            except BaseException as exc:
                keep(-clock())
                progress.leave(False)
                self._failed(exc)
                raise
            progress.leave(True)
            keep(clock())
        finally:
            self._entry.release()
        return True

    def _lean_async(self, name: str, kind: int, start: Callable, x: np.ndarray, arg: Any,
                    fields: dict[str, Any]) -> Work | None:
        """An async all_reduce or broadcast of a NumPy array whose other arguments are known
        good, started on this thread by ``start(x, arg, seq, timeout)`` (the lean backend's
        ``start_all_reduce``/``start_broadcast``; its ``can_start`` said it may): a small call
        that finds its peers there completes here, at a synchronous call's cost; the rest of
        one that does not is queued. None (nothing done) when the general path must run.
        Marked in the progress record and the flight recorder as queued calls are."""
        if not x.flags.c_contiguous or self._forked or self._closed \
                or not self._entry.acquire(False):
            return None
        try:
            self._inside = name
            seq = self._seq
            self._seq = seq + 1
            rec, keep, progress = self._recorder, self._keep, self._progress
            rec.current = (seq, kind, x.dtype, x.size, fields, -1, 0)
            n = rec.issued()
            rec.current = NO_CALL
            keep(("S", n, clock()))
            progress.enter(seq, kind)
            label = self._call(name).where
            try:
                rest = start(x if x.ndim == 1 else x.reshape(-1), arg, seq, self.timeout)
            except Exception as exc:  # noqa: BLE001 - an async call's error comes from wait()
                keep(("E", n, -clock()))
                progress.leave(False)
                self._failed(exc)
                work = FutureWork()
                work.fail(exc)
                return work.bind(x, label)
            if rest is None:
                progress.leave(True)
                keep(("E", n, clock()))
                return CompletedWork().bind(x, label)
            return self._lean_backend.run_async(
                self._queued(seq, kind, rest, n, started=True)).bind(x, label)
        finally:
            self._entry.release()

    def _call(self, name: str) -> Call:
        if self._closed:
            raise ValueError(f"{name} on rank {self.rank} of {self.size}: the communicator is "
                             f"closed")
        call = self._calls.get(name)
        if call is None:
            call = self._calls[name] = Call(name, self.rank, self.size)
        return call

    def _in_child(self, name: str) -> UsageError:
        return UsageError(
            f"{name} on rank {self.rank} of {self.size}: this communicator belongs to process "
            f"{self._pid} and this is a forked child of it; a child cannot use its "
            f"parent's communicator (make a new one with gpucoll.init in the child, or use "
            f"the 'spawn' or 'forkserver' start method)")

    def _concurrent(self, name: str) -> UsageError:
        """Another thread is inside a call: abort everywhere (the two threads' calls could
        pair with different calls on other ranks) and say so."""
        message = (f"{name} on rank {self.rank} of {self.size}: another thread is inside "
                   f"{self._inside or 'a call'} on this communicator; a communicator serves one "
                   f"thread at a time (give each thread its own, e.g. with split), so it is "
                   f"aborted on every rank")
        try:
            self._backend.abort(message)
        except Exception:  # noqa: BLE001 - the UsageError below is what matters
            pass
        return UsageError(message)

    def _issue(self, c: Call, seq: int | None, call: Callable[[], None], result: Any,
               async_op: bool, stream: Any, staged: ArrayRef | None = None, target: Any = None,
               check: Callable[[float], None] | None = None, timeout: float = 0.0) -> Any:
        """Run ``call`` now (sync) or in issue order (async), marked in the progress record as
        collective ``seq`` (None: a send or receive); copy a contiguous stand-in of a strided
        ``target`` back into it afterwards; run a debug ``check`` first."""
        if check is not None or (staged is not None and staged.array is not target):
            call = _wrapped(call, check, timeout, staged, target, stream)
        rec = self._recorder
        if rec.current is NO_CALL:  # a call that kept no signature (an object's send)
            rec.current = (-1 if seq is None else seq, KIND.get(c.name, 0), None, -1, None,
                           -1, 0)
        if stream is not None:
            rec.on_stream(stream_id(stream))
        if async_op:
            call = self._queued(seq, 0 if seq is None else KIND[c.name], call, rec.issued())
            rec.current = NO_CALL
            return self._backend.run_async(call, stream=stream).bind(result, c.where)
        call = self._timed(call) if seq is None else self._tracked(seq, KIND[c.name], call)
        rec.current = NO_CALL
        self._backend.run_sync(call)
        return result

    def _tracked(self, seq: int, kind: int, call: Callable[[], None]) -> Callable[[], None]:
        """``call``, collective ``seq``, run now: marked in the progress record, its start and
        end kept by the flight recorder; a failure that ends the group dumps the recorder."""
        progress, keep, failed = self._progress, self._keep, self._failed
        head = self._recorder.current

        def run() -> None:
            keep((head, clock()))
            progress.enter(seq, kind)
            try:
                call()
            except BaseException as exc:
                keep(-clock())
                progress.leave(False)
                failed(exc)
                raise
            progress.leave(True)
            keep(clock())

        return run

    def _timed(self, call: Callable[[], None]) -> Callable[[], None]:
        """``call``, a send or receive run now, its start and end kept by the recorder."""
        keep, flight, head = self._keep, self._flight, self._recorder.current

        def run() -> None:
            keep((head, clock()))
            try:
                call()
            except BaseException as exc:
                keep(-clock())
                if isinstance(exc, GpucollError):
                    flight.failed(exc)
                raise
            keep(clock())

        return run

    def _queued(self, seq: int | None, kind: int, call: Callable[[], None],
                n: int, started: bool = False) -> Callable[[], None]:
        """``call``, queued as the recorder's call ``n``: as ``_tracked`` (``_timed`` for a
        send or receive), when it runs later; ``started``: the call's start is marked already
        (``call`` is the rest of it)."""
        progress = None if seq is None else self._progress
        keep, flight, failed = self._keep, self._flight, self._failed

        def run() -> None:
            if not started:
                keep(("S", n, clock()))
                if progress is not None:
                    progress.enter(seq, kind)
            try:
                call()
            except BaseException as exc:
                keep(("E", n, -clock()))
                if progress is None:  # a send or receive
                    if isinstance(exc, GpucollError):
                        flight.failed(exc)
                    raise
                progress.leave(False)
                failed(exc)
                raise
            if progress is not None:
                progress.leave(True)
            keep(("E", n, clock()))

        return run

    def _failed(self, exc: BaseException) -> None:
        """A collective ended in ``exc``. A failure of the group dumps the flight recorder (on
        its first failure only). An interrupt (KeyboardInterrupt, SystemExit) left the call half
        done: wherever it struck, the peers must not wait for the rest, so the backend is
        aborted (a no-op when the backend already failed with it)."""
        if isinstance(exc, GpucollError):
            self._flight.failed(exc)
        elif not isinstance(exc, Exception):
            self._backend.abort(f"{type(exc).__name__} during collective #{self._seq - 1}")

    def _signature(self, c: Call, t: float, ref: ArrayRef | None, **fields: Any) -> int:
        """The sequence number of this collective (after the debug check, when it is on)."""
        seq = self._seq
        self._seq += 1
        self._recorder.signature(seq, KIND.get(c.name, 0), ref, fields)
        if self._check is None:
            return seq
        sig = {"call": c.name, "dtype": None, "shape": None, **fields}
        if ref is not None:
            sig["dtype"], sig["shape"] = ref.dtype.name, list(ref.shape)
        self._in_store(lambda: self._check.collective(seq, sig, t, c.name))
        return seq

    def _pair_signature(self, c: Call, ref: ArrayRef, peer: int, sending: bool,
                        tag: int = 0) -> Callable[[float], None] | None:
        self._recorder.point_to_point(KIND.get(c.name, 0), ref, peer)
        if self._check is None:
            return None
        sig = {"call": c.name, "dtype": ref.dtype.name, "shape": list(ref.shape),
               "count": ref.count, "peer": peer, "tag": tag}
        verify = self._check.point_to_point(peer, sending, sig, c.name)
        return lambda timeout: self._in_store(lambda: verify(timeout))

    def _in_store(self, step: Callable[[], Any]) -> Any:
        """Run ``step``, which meets other ranks in the store. A rank lost or late there ends
        the group as a failed collective does: the backend is aborted with the error, so that
        later calls, close() and the peers know it was reported."""
        try:
            return step()
        except (PeerFailure, CollectiveTimeout, StoreError) as exc:
            self._backend.abort(exc)
            raise

    # -- agreeing on small values before a call ---------------------------------------------

    def _agree(self, c: Call, seq: int, value: bytes, t: float, what: str) -> list[bytes]:
        """Every rank's ``value`` (at most ``_AGREE_BYTES``) in rank order; collective. On a
        backend that runs on host arrays it travels in-band (a dead peer is noticed at once);
        otherwise through the store."""
        if len(value) > _AGREE_BYTES:
            raise c.fail(ValueError, f"{what}'s description is {len(value)} bytes, more than "
                                     f"{_AGREE_BYTES}")
        if getattr(self._backend, "host_control", False):
            mine = np.zeros(_AGREE_BYTES + 2, np.uint8)
            mine[:2] = np.frombuffer(struct.pack("<H", len(value)), np.uint8)
            mine[2:2 + len(value)] = np.frombuffer(value, np.uint8)
            every = np.empty((self.size, mine.size), np.uint8)
            x, out = as_ref(mine, "value"), as_ref(every, "out")
            b = self._backend
            b.run_sync(self._tracked(seq, KIND[c.name],
                                     lambda: b.all_gather(x, out, timeout=t)))
            return [row[2:2 + struct.unpack("<H", row[:2].tobytes())[0]].tobytes()
                    for row in every]
        return self._in_store(lambda: self._share(value, t, c))

    def _share(self, value: bytes, t: float, c: Call) -> list[bytes]:
        """Every rank's ``value`` in rank order, through the store; collective. A rank deletes
        its key of two agreements ago: every rank has read it by the time this one is made."""
        n = self._agreements
        self._agreements += 1
        keys = [f"agree/{n}/{r}" for r in range(self.size)]
        values = share(self._store, keys, value, t, what=c.name, rank=self.rank,
                       absent="did not call it", liveness=self._liveness)
        if n >= 2:
            self._store.delete_key(f"agree/{n - 2}/{self.rank}")
        return values

    def _scatter_layout(self, c: Call, seq: int, root: int, src: ArrayRef | None,
                        res: ArrayRef | None, t: float) -> ArrayRef:
        """The ranks agree on the slot layout: root's slots, and the ``out`` of every other
        rank that passed one. A disagreement is a CollectiveMismatch on every rank, before any
        data moves; a rank without ``out`` gets a new array like root's."""
        if self.size == 1:
            return res
        if self.rank == root:
            mine = _layout(res.dtype, res.shape, src.kind)
        else:
            mine = b"" if res is None else _layout(res.dtype, res.shape, res.kind)
        layouts = [_read_layout(v) for v in self._agree(c, seq, mine, t, "scatter")]
        dtype, shape, kind = layouts[root]
        odd = [r for r, lay in enumerate(layouts)
               if lay is not None and r != root and lay[:2] != (dtype, shape)]
        if odd:
            detail = "; ".join(f"rank {r}'s out is {layouts[r][0].name}{list(layouts[r][1])}"
                               for r in odd)
            raise CollectiveMismatch(
                f"{c.where}: root {root} scatters slots of {dtype.name}{list(shape)}, but "
                f"{detail}; no data moved")
        if res is None:
            return c.array(new_array(kind, shape, dtype), "out")
        return res


_AGREE_BYTES = 1024
_ALL_REDUCE, _BROADCAST = KIND["all_reduce"], KIND["broadcast"]
_LEAN_DTYPES = frozenset(dtype_from_name(n) for n in SUPPORTED_DTYPES if n != "bfloat16")
_LAYOUT = struct.Struct("<BBB")  # dtype code, array kind, ndim; then ndim int64 extents
_KINDS = ("host", "device")


def _into(out: np.ndarray, x: np.ndarray, run: Callable) -> Callable:
    """``run`` (a lean all_reduce) of ``x``'s values into ``out``: out of place."""
    def outside(flat: np.ndarray, arg: Any, seq: int, timeout: float) -> None:
        run(flat, arg, seq, timeout, src=x.reshape(-1))
    return outside


def _layout(dtype: np.dtype, shape: tuple[int, ...], kind: str) -> bytes:
    return _LAYOUT.pack(SUPPORTED_DTYPES.index(dtype.name), _KINDS.index(kind), len(shape)) + \
        struct.pack(f"<{len(shape)}q", *shape)


def _read_layout(data: bytes) -> tuple[np.dtype, tuple[int, ...], str] | None:
    if not data:
        return None
    code, kind, ndim = _LAYOUT.unpack_from(data)
    shape = struct.unpack_from(f"<{ndim}q", data, _LAYOUT.size)
    return dtype_from_name(SUPPORTED_DTYPES[code]), tuple(shape), _KINDS[kind]


def _wrapped(call: Callable[[], None], check: Callable[[float], None] | None, timeout: float,
             staged: ArrayRef | None, target: Any, stream: Any) -> Callable[[], None]:
    """``call`` preceded by a debug check and followed by a write-back into ``target``. A
    device stand-in is written back on the call's stream, after the call: ``stream``, else
    the current stream of this (the issuing) thread, resolved now since an asynchronous call
    may run on another thread."""
    back = staged is not None and staged.array is not target
    if back and stream is None and staged.kind == "device":
        rt = cuda.runtime()
        with rt.using_device(staged.device):
            stream = rt.current_stream()

    def run() -> None:
        if check is not None:
            check(timeout)
        call()
        if back:
            write_back(staged, target, stream)

    return run


def _prefix(prefix: str, store: Any) -> Any:
    from gpucoll.store import PrefixStore

    return PrefixStore(prefix, store)
