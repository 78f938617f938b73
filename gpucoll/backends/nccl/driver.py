"""One nccl4py communicator, driven so that no NCCL call blocks past its deadline; and NCCL's
datatype and op codes for gpucoll's dtypes and ops.

The communicator is non-blocking (``NCCLConfig(blocking=False)``, NCCL >= 2.14): init, split,
finalize and any call that must first connect to its peers return at once with the communicator
"in progress", and NCCL finishes them in the background. ``settle`` polls ``get_async_error``
until the communicator is ready again; when NCCL reports an error, the deadline passes or a peer
is found gone in the store, it aborts the communicator and raises an error naming the op and the
rank (``NcclFailure``, ``CollectiveTimeout``, ``PeerFailure``). This is NCCL's documented
recipe for fault tolerance; a blocking communicator would instead hang the host inside the call.

NCCL allows no other call on a communicator while it is in progress, and ``abort`` frees it. So
every call, and the one abort, take one lock: an abort from another thread (the watchdog, or a
second thread found inside a call) waits until no call is inside NCCL, happens once, and every
later call raises the failure that caused it.

Where NCCL can (``ncclCommRevoke``, NCCL >= 2.28), a failure revokes the communicator
instead of aborting it: its work in flight stops just the same, and every later call raises the
failure, but the handle stays valid, so that the survivors of a lost rank can make a
communicator of themselves with ``ncclCommShrink`` (``shrink``). A revoked communicator is
aborted when it closes (NCCL forbids finalizing it).

The codes (``DTYPE_CODES``, ``OP_CODES``: how gpucoll's dtypes and reduce ops map onto NCCL's
``ncclDataType_t`` and ``ncclRedOp_t``) are nccl.h's (NCCL >= 2.10 for bfloat16) and equal
nccl4py's ``NcclDataType`` and ``NcclRedOp``; a test checks both against the installed packages.
Only dtypes gpucoll accepts are listed (NCCL's fp8 types are not among them). Each plan
(``wire``, ``reduce_plan``) names the NCCL datatype a buffer travels as. What NCCL cannot reduce
natively is either carried exactly another way (complex sum/avg as float pairs; bitwise ops and
dtypes NCCL lacks through an all-gather and a local reduction) or refused with a TypeError
naming the op and dtype.

The collectives themselves go through nccl4py's raw bindings (``nccl.bindings.nccl``, the
functions its ``Communicator`` methods end in) with the addresses, counts and datatypes gpucoll
has already worked out (``Calls``): the ``Communicator`` methods would first resolve every buffer
again through nccl4py's torch and CuPy interop, about a third of a small call's cost.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from gpucoll.errors import CollectiveTimeout, GpucollError, NcclFailure, PeerFailure
from gpucoll.ops import BITWISE, ReduceOp

# ncclResult_t (nccl.h)
RESULT_NAMES = {
    0: "ncclSuccess", 1: "ncclUnhandledCudaError", 2: "ncclSystemError",
    3: "ncclInternalError", 4: "ncclInvalidArgument", 5: "ncclInvalidUsage",
    6: "ncclRemoteError", 7: "ncclInProgress", 8: "ncclTimeout",
}
SUCCESS, REMOTE_ERROR, IN_PROGRESS, TIMEOUT = 0, 6, 7, 8
LOOK_EVERY = 0.5  # seconds between looks at the store for peers that are gone, while settling
DESTROY_MIN_S = 0.5  # what close waits for ncclCommDestroy at least, past its deadline too
QUIESCE_S = 5.0  # how long a revoked communicator may take to stop its work before a shrink
SINCE = {"shrink": (2, 27), "revoke": (2, 28)}  # the NCCL release that added each call


def supports(nc: Any, comm: Any, call: str) -> bool:
    """Whether ``comm`` (of nccl4py ``nc``) can make ``call``: the binding has the method and
    the NCCL library it loaded is recent enough (nccl4py has every method, whatever the
    library, and an older library refuses the call only when it is made)."""
    if not hasattr(comm, call):
        return False
    try:
        version = str(nc.get_version().libnccl.version)
        have = tuple(int(part) for part in version.split(".")[:2])
    except Exception:  # noqa: BLE001 - no library, or a version this cannot read: do not try
        return False
    return have >= SINCE[call]


def failure(status: int | None, opname: str, rank: int, size: int,
            detail: str = "") -> GpucollError:
    """The gpucoll error for NCCL result ``status`` of ``opname`` on ``rank``."""
    what = RESULT_NAMES.get(status, f"status {status}") if status is not None else "refused"
    message = f"{opname} on rank {rank} of {size}: NCCL failed ({what})"
    if detail:
        message += f": {detail}"
    if status == REMOTE_ERROR:
        return PeerFailure(message)
    if status == TIMEOUT:
        return CollectiveTimeout(message)
    return NcclFailure(message, status)


def failed_peer(liveness: Any, opname: str, rank: int, size: int) -> PeerFailure | None:
    """A PeerFailure for the first peer that said in the store that its communicator
    failed (``Liveness.failed``: alive, but it will not take part any more), or None."""
    failed = liveness.failures()
    if not failed:
        return None
    r = min(failed)
    return PeerFailure(f"{opname} on rank {rank} of {size}: rank {r}'s NCCL communicator "
                       f"failed: {failed[r]}", peer=r)


def translate(exc: BaseException, opname: str, rank: int, size: int) -> GpucollError:
    """The gpucoll error for an exception of nccl4py (``NCCLError`` carries ``status``;
    ``NcclInvalid``, its own argument check, has none)."""
    return failure(getattr(exc, "status", None), opname, rank, size, str(exc))


class Buf(NamedTuple):
    """A device buffer as NCCL takes it: its address, its element count and its
    ``ncclDataType_t``."""

    ptr: int
    count: int
    code: int


class Calls:
    """NCCL's collectives on one communicator through nccl4py's raw bindings (``raw``, the
    ``nccl.bindings.nccl`` module), with nccl4py's ``Communicator`` method names and argument
    order; each passes NCCL what that method would: no receive buffer on a reduce's other
    ranks and no send buffer on a broadcast's, counts per rank. Streams are handles (ints)."""

    def __init__(self, raw: Any, comm: Any, rank: int):
        self._raw, self._rank = raw, rank
        self._comm = raw.Comm(comm.ptr)  # the same handle, as the bindings take it

    def allreduce(self, send: Buf, recv: Buf, op: int, *, stream: int) -> None:
        self._raw.all_reduce(send.ptr, recv.ptr, send.count, send.code, op, self._comm, stream)

    def reduce(self, send: Buf, recv: Buf, op: int, root: int, *, stream: int) -> None:
        self._raw.reduce(send.ptr, recv.ptr if root == self._rank else 0, send.count,
                         send.code, op, root, self._comm, stream)

    def broadcast(self, send: Buf, recv: Buf, root: int, *, stream: int) -> None:
        self._raw.broadcast(send.ptr if root == self._rank else 0, recv.ptr, recv.count,
                            recv.code, root, self._comm, stream)

    def allgather(self, send: Buf, recv: Buf, *, stream: int) -> None:
        self._raw.all_gather(send.ptr, recv.ptr, send.count, send.code, self._comm, stream)

    def reduce_scatter(self, send: Buf, recv: Buf, op: int, *, stream: int) -> None:
        self._raw.reduce_scatter(send.ptr, recv.ptr, recv.count, send.code, op, self._comm,
                                 stream)

    def send(self, buf: Buf, peer: int, *, stream: int) -> None:
        self._raw.send(buf.ptr, buf.count, buf.code, peer, self._comm, stream)

    def recv(self, buf: Buf, peer: int, *, stream: int) -> None:
        self._raw.recv(buf.ptr, buf.count, buf.code, peer, self._comm, stream)


def forced_blocking(environ: Any = None) -> str | None:
    """Why NCCL would make gpucoll's communicators blocking in this process, or None.
    NCCL_COMM_BLOCKING=1 (common in job scripts) overrides ``NCCLConfig(blocking=False)`` inside
    NCCL; start-up, first connections and grouped calls would then block in the driver, where
    no deadline, watchdog or abort reaches them."""
    env = os.environ if environ is None else environ
    raw = env.get("NCCL_COMM_BLOCKING", "").strip()
    if raw != "1":
        return None
    return ("NCCL_COMM_BLOCKING=1 is set, and NCCL lets it override gpucoll's non-blocking "
            "communicators: their start-up and first calls would block inside NCCL, past every "
            "deadline and abort. Unset it (or set 0) for this process; gpucoll needs no blocking "
            "communicator")


class Driver:
    """A non-blocking nccl4py ``Communicator`` (``comm``) of ``size`` ranks; ``nc`` is the
    ``nccl.core`` module it came from and ``raw`` nccl4py's raw bindings, through which
    ``calls`` runs the collectives. ``liveness`` (may be None) tells which peers are gone."""

    def __init__(self, nc: Any, raw: Any, comm: Any, rank: int, size: int, liveness: Any):
        self.nc, self.raw, self.comm = nc, raw, comm
        self.calls = Calls(raw, comm, rank)
        self.rank, self.size = rank, size
        self.liveness = liveness
        self.diagnose: Callable[[], str] | None = None  # where the ranks are, for a timeout
        self._lock = threading.Lock()
        self.failure: GpucollError | None = None
        self._freed = False  # aborted or destroyed: the handle must not be used again
        self._revoked = False  # stopped after a failure, the handle kept for a shrink

    @classmethod
    def create(cls, nc: Any, raw: Any, size: int, rank: int, uid: bytes, *, deadline: float,
               timeout: float, liveness: Any, diagnose: Callable[[], str] | None = None
               ) -> Driver:
        """``ncclCommInitRankConfig`` on the current device, settled by ``deadline``."""
        config = nc.NCCLConfig(blocking=False)
        try:
            comm = nc.Communicator.init(size, rank, nc.UniqueId.from_bytes(uid), config=config)
        except Exception as exc:  # noqa: BLE001 - nccl4py's and NCCL's errors alike
            raise translate(exc, "NCCL start-up", rank, size) from exc
        driver = cls(nc, raw, comm, rank, size, liveness)
        driver.settle("NCCL start-up", deadline, timeout, diagnose, managing=True)
        return driver

    # ---- calls --------------------------------------------------------------------------

    def call(self, opname: str, fn: Callable, *args: Any, deadline: float, timeout: float,
             **kwargs: Any) -> None:
        """``fn(*args, **kwargs)``, one of ``calls``' methods, then ``settle``."""
        with self._lock:
            self._usable(opname)
            try:
                fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001
                raise self._refused(exc, opname) from exc
            if int(self.comm.get_async_error()) == SUCCESS:  # the usual case: enqueued
                return
        self.settle(opname, deadline, timeout)

    def group(self, opname: str, calls: list[tuple[Callable, tuple, dict]], *, deadline: float,
              timeout: float) -> None:
        """Several calls as one NCCL group (send/recv that must progress together)."""
        with self._lock:
            self._usable(opname)
            try:
                self.nc.group_start()
                try:
                    for fn, args, kwargs in calls:
                        fn(*args, **kwargs)
                finally:
                    self.nc.group_end()
            except Exception as exc:  # noqa: BLE001
                raise self._refused(exc, opname) from exc
        self.settle(opname, deadline, timeout)

    def settle(self, opname: str, deadline: float, timeout: float,
               diagnose: Callable[[], str] | None = None, *, managing: bool = False) -> None:
        """Wait until the communicator is no longer in progress (NCCL forbids any other call
        until then); abort and raise when it fails, the deadline passes or a peer is gone.
        ``managing``: the making of a communicator (start-up, split, shrink) or its close,
        which a revoked communicator still serves; a failure then aborts (frees) it, since a
        communicator that never formed, or is closing, has nothing left to shrink."""
        delay, look = 0.00005, time.monotonic() + LOOK_EVERY

        def end(exc: GpucollError) -> GpucollError:
            first = self.failure is None
            err = self.fail(exc, free=managing)
            if first and not managing and not isinstance(exc, PeerFailure) and \
                    self.liveness is not None:  # peers waiting for this rank learn it at once
                self.liveness.failed(str(exc))
            return err

        while True:
            status = self.async_error(opname, managing=managing)
            if status == SUCCESS:
                return
            if status != IN_PROGRESS:
                raise end(failure(status, opname, self.rank, self.size))
            now = time.monotonic()
            if now >= look and self.liveness is not None:
                look = now + LOOK_EVERY
                try:
                    self.liveness.check(opname)
                    # a live peer whose communicator failed (not while this one is made or
                    # closed: a shrink's survivors include ranks whose old one failed)
                    failed = None if managing else failed_peer(self.liveness, opname,
                                                                self.rank, self.size)
                    if failed is not None:
                        raise failed
                except PeerFailure as exc:
                    raise end(exc) from None
            if now > deadline:
                diagnose = diagnose or self.diagnose
                why = f"; {diagnose()}" if diagnose is not None else ""
                raise end(CollectiveTimeout(
                    f"{opname} on rank {self.rank} of {self.size} did not complete within "
                    f"{timeout:g} s (NCCL was still connecting to its peers){why}; the NCCL "
                    f"communicator was aborted"))
            time.sleep(delay)
            delay = min(delay * 2, 0.005)

    def async_error(self, opname: str, *, managing: bool = False) -> int:
        """``ncclCommGetAsyncError``: SUCCESS, IN_PROGRESS or an error code; raises the
        failure once the communicator was aborted (or revoked, unless ``managing``)."""
        with self._lock:
            self._usable(opname, managing)
            return int(self.comm.get_async_error())

    def split(self, opname: str, color: int | None, rank: int | None, size: int, *,
              deadline: float, timeout: float, liveness: Any) -> Driver | None:
        """``ncclCommSplit`` (collective over this communicator, which must have no work
        outstanding): the new communicator, where this rank is ``rank`` of ``size`` (its
        key), or None for ``color`` None."""
        with self._lock:
            self._usable(opname)
            try:
                child = self.comm.split(color, 0 if rank is None else rank)
            except Exception as exc:  # noqa: BLE001
                raise self._refused(exc, opname) from exc
        self.settle(opname, deadline, timeout)
        if color is None or rank is None or not child.is_valid:
            return None
        made = Driver(self.nc, self.raw, child, rank, size, liveness)
        made.settle(opname, deadline, timeout, managing=True)
        return made

    def shrinkable(self, deadline: float) -> bool:
        """Whether ``ncclCommShrink`` can make the survivors' communicator from this one: the
        binding and the library have it (``supports``), and the communicator is healthy, or
        revoked and quiet again (its work stopped) by ``deadline`` (at most ``QUIESCE_S`` from
        now). A revoked one that does not quiet down is aborted."""
        with self._lock:  # a failure is revoked under the lock: wait until it is
            if self._freed or not supports(self.nc, self.comm, "shrink"):
                return False
            if not self._revoked:
                return self.failure is None
        deadline = min(deadline, time.monotonic() + QUIESCE_S)
        delay = 0.0005
        while True:
            with self._lock:
                if self._freed:
                    return False
                status = int(self.comm.get_async_error())
            if status == SUCCESS:
                return True
            if status != IN_PROGRESS or time.monotonic() > deadline:
                self.fail(self.failure, free=True)
                return False
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    def shrink(self, opname: str, excluded: list[int], rank: int, size: int, *, abort: bool,
               deadline: float, timeout: float, liveness: Any) -> Driver:
        """``ncclCommShrink`` without the ``excluded`` ranks (collective over the others; see
        ``shrinkable``): the new communicator, where this rank is ``rank`` of ``size``. With
        ``abort`` (after a failure; the same on every member) NCCL_SHRINK_ABORT: what was left
        of the old work is dropped. When it fails, both communicators are aborted (NCCL allows
        nothing else while a shrink is in progress), so that a second try starts a new
        communicator instead."""
        flags = self.nc.CommShrinkFlag
        flag = flags.ABORT if abort else flags.DEFAULT
        with self._lock:
            self._usable(opname, managing=True)
            try:
                child = self.comm.shrink(excluded, None, flag)
            except Exception as exc:  # noqa: BLE001
                err = translate(exc, opname, self.rank, self.size)
                self._end(err, free=True)
                raise err from exc
        made = Driver(self.nc, self.raw, child, rank, size, liveness)
        try:
            made.settle(opname, deadline, timeout, managing=True)
            self.settle(opname, deadline, timeout, managing=True)
        except GpucollError as exc:
            made.fail(exc, free=True)
            self.fail(exc, free=True)
            raise
        return made

    # ---- failure and the end ------------------------------------------------------------

    def fail(self, exc: GpucollError, *, free: bool = False) -> GpucollError:
        """Record the first failure and stop the communicator (once, between calls): revoke
        it where the binding can and ``free`` is not asked, else abort it. Returns the
        failure to raise (the first one, when this is a later one)."""
        with self._lock:
            self._end(exc, free)
            return self.failure

    def _end(self, exc: GpucollError, free: bool) -> None:
        """``fail``'s work, the lock held."""
        if self.failure is None:
            self.failure = exc
        if self._freed:
            return
        if not free and not self._revoked and supports(self.nc, self.comm, "revoke"):
            try:
                self.comm.revoke()
                self._revoked = True
                return
            except Exception:  # noqa: BLE001 - NCCL refused: abort instead
                pass
        if free or not self._revoked:
            self._freed = True
            try:
                self.comm.abort()
            except Exception:  # noqa: BLE001 - the failure recorded above is what matters
                pass

    def close(self, deadline: float) -> None:
        """Finalize (collective: waits, within ``deadline``, for the peers' own close) and
        destroy (waited for until ``deadline``, at least ``DESTROY_MIN_S``); abort instead
        after a failure, or when finalize is refused or does not settle. Never raises."""
        with self._lock:
            if self._freed:
                return
            if self._revoked:  # NCCL forbids finalizing a revoked communicator
                self._end(self.failure, free=True)
                return
            try:
                self.comm.finalize()
            except Exception:  # noqa: BLE001 - destroy would finalize again, blocking: abort
                refused = True
            else:
                refused = False
        if refused:
            self.fail(GpucollError(f"close on rank {self.rank}: NCCL refused to finalize"),
                      free=True)
            return
        try:  # managing: a failure here aborts (frees) the communicator
            self.settle("close", deadline, max(deadline - time.monotonic(), 0.0), managing=True)
        except GpucollError:
            return
        with self._lock:  # from here on nothing else touches the handle
            if self._freed:
                return
            self._freed = True
        # ncclCommDestroy is a blocking call with no deadline of its own: it runs on a thread
        # of its own, outside the lock, and close stops waiting for it at the deadline
        done = threading.Event()

        def destroy() -> None:
            try:
                self.comm.destroy()
            except Exception:  # noqa: BLE001 - closing never raises
                pass
            finally:
                done.set()

        threading.Thread(target=destroy, daemon=True,
                         name=f"gpucoll-nccl-destroy-{self.rank}").start()
        if not done.wait(max(deadline - time.monotonic(), DESTROY_MIN_S)):
            logging.getLogger("gpucoll").warning(
                "rank %d of %d: NCCL's destroy of a finalized communicator did not return "
                "by the close deadline; close returns, leaving it to finish in the background",
                self.rank, self.size)

    def _usable(self, opname: str, managing: bool = False) -> None:
        """Raise (a copy of) the failure that ended this communicator, if any (lock held); a
        revoked one still serves a shrink (``managing``)."""
        if self._freed or (self._revoked and not managing):
            raise copy.copy(self.failure) if self.failure is not None else GpucollError(
                f"{opname} on rank {self.rank} of {self.size}: the NCCL communicator is closed")

    def _refused(self, exc: BaseException, opname: str) -> GpucollError:
        """An NCCL call raised at once (lock held): nothing was enqueued. An error of NCCL's
        own ends the communicator, ncclInvalidArgument included: on a non-blocking
        communicator NCCL keeps a refused call's error as the communicator's asynchronous
        error and refuses every later call (src/enqueue.cc, ncclEnqueueCheck), which is why
        the backend checks the caller's arguments (buffers' and streams' devices, counts,
        datatypes) before NCCL sees them. nccl4py's own argument check (no status) leaves
        the communicator as it was."""
        err = translate(exc, opname, self.rank, self.size)
        if getattr(exc, "status", None) is None:
            return err
        self._end(err, free=False)
        return self.failure


# ---- NCCL's datatype and op codes ----------------------------------------------------------------

# ncclDataType_t (nccl.h): NumPy / ml_dtypes name -> code
DTYPE_CODES: dict[str, int] = {
    "int8": 0,
    "uint8": 1,
    "int32": 2,
    "uint32": 3,
    "int64": 4,
    "uint64": 5,
    "float16": 6,
    "float32": 7,
    "float64": 8,
    "bfloat16": 9,
}

# ncclRedOp_t (nccl.h): note max is 2 and min is 3
OP_CODES: dict[ReduceOp, int] = {
    ReduceOp.SUM: 0,
    ReduceOp.PROD: 1,
    ReduceOp.MAX: 2,
    ReduceOp.MIN: 3,
    ReduceOp.AVG: 4,
}

# a complex number travels as two floats of this NCCL datatype
_COMPLEX_PARTS = {"complex64": DTYPE_CODES["float32"], "complex128": DTYPE_CODES["float64"]}


@dataclasses.dataclass(frozen=True, slots=True)
class Wire:
    """How a dtype travels: as ``factor`` elements of NCCL datatype ``code`` per element."""

    code: int
    factor: int


@dataclasses.dataclass(frozen=True, slots=True)
class ReducePlan:
    """How a reduction runs: ``native`` with NCCL's ``op`` on ``factor``x the elements as NCCL
    datatype ``code``, or (``native`` False) through an all-gather of ``code`` and a local
    reduction."""

    native: bool
    code: int
    op: int
    factor: int


@functools.lru_cache(maxsize=256)
def wire(dtype: np.dtype) -> Wire:
    """The NCCL type that moves ``dtype`` unchanged (movement only: any dtype can travel)."""
    name = dtype.name
    if name in DTYPE_CODES:
        return Wire(DTYPE_CODES[name], 1)
    if name in _COMPLEX_PARTS:
        return Wire(_COMPLEX_PARTS[name], 2)
    return Wire(DTYPE_CODES["uint8"], dtype.itemsize)


@functools.lru_cache(maxsize=256)
def reduce_plan(op: ReduceOp, dtype: np.dtype, opname: str) -> ReducePlan:
    """How NCCL carries out ``op`` on ``dtype``; TypeError when it cannot do so honestly."""
    name = dtype.name
    if name in DTYPE_CODES and op in OP_CODES:
        return ReducePlan(True, DTYPE_CODES[name], OP_CODES[op], 1)
    if name in _COMPLEX_PARTS and op in (ReduceOp.SUM, ReduceOp.AVG):
        # (a+bi)+(c+di) is a componentwise sum, and so is the mean: exact as float pairs
        return ReducePlan(True, _COMPLEX_PARTS[name], OP_CODES[op], 2)
    if dtype.kind in "biu" and (op in BITWISE or op in OP_CODES):
        w = wire(dtype)
        return ReducePlan(False, w.code, -1, w.factor)
    raise TypeError(
        f"{opname}: the NCCL backend cannot apply op={op.value!r} to dtype {name} "
        "(NCCL has no such reduction and no exact substitute)"
    )
