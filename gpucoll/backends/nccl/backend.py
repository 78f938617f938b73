"""The NCCL backend: collectives on device arrays, enqueued on CUDA streams through nccl4py.

Starting it goes through the store (device choice, arrival, the unique id): every rank first
announces itself in the store and waits for the others with the start-up deadline, so a missing
rank becomes a ``CollectiveTimeout`` naming it (and a rank that died a ``PeerFailure`` naming it)
before any rank enters NCCL. Rank 0 then makes the unique id and publishes its 128 bytes; the
others read them. The communicator itself is made by ``driver``.

Every call (each enqueues its work in a ``Call`` block, which does the steps below)
1. makes the communicator's device current while it runs, and restores the caller's, so that
   its events and temporaries belong to that device whichever thread or device context the
   caller is in;
2. orders its stream (``stream=``, default: the current stream) after the producers of its
   data: the caller's current stream, and the stream a CUDA-array-interface v3 object names;
3. enqueues NCCL's work through ``driver`` (no call blocks past its deadline) and records an
   event after it. The watchdog (``Watchdog``, below) polls that event against the call's
   deadline, and every buffer NCCL touches (inputs, outputs, temporaries) stays referenced until
   it completes, so that no memory pool hands that memory out while NCCL still reads or writes
   it.

NCCL calls return once enqueued, so a collective whose peer never shows up hangs the stream, not
the caller: when the oldest event is not done by its call's deadline, NCCL reports an
asynchronous error, or a peer is found dead in the store, the watchdog thread fails the backend
(which aborts the NCCL communicator between calls, freeing the stream) with an error naming the
op and rank, and ``EventWork`` is the ``Work`` that waits on those events. The thread also keeps
this rank's position in the sequence of calls in the store (``progress/{rank}``, at most every
half second), so that a rank whose call times out can say which rank is behind and where.

Results are stream-ordered: later work on the stream sees them. gather, scatter and all-to-all
are grouped send/recv; reductions NCCL lacks run as an all-gather plus a local reduction on the
device (``driver``'s codes). All CUDA access goes through ``gpucoll.cuda`` so that the emulation
in the tests can stand in for it.

The out-of-place, uneven, coalesced and batched calls are NCCL groups too. The uneven all-gather
takes one of three forms, by the size of the gathered buffer, after published measurements of
the three (UCC's TL/NCCL all-gather-v, openucx/ucc#347: one node, 8 GPUs, sizes as that table
gives them): a group of broadcasts, one per rank (what PyTorch and vLLM use), was fastest up to
512 KiB; a group of sends and receives from 1 to 4 MiB; one all-gather padded to the largest
rank's size, then compacted, from 8 MiB on (1.9x the sends and receives at 128 MiB). The padded
form is skipped when padding would move much more than the data (very uneven sizes). The
thresholds are that table's; machines with other links may favour other ones. The uneven
reduce-scatter is a group of reduces, one per rank, each to the rank that owns the slot.

``backend="auto"`` (``agree``) picks NCCL where it works for every rank, else the host ring: each
rank judges itself (CuPy, a CUDA device, nccl4py and its library, which GPU it would drive) and
publishes its verdict in the group's store, and all ranks apply the same rule to the same
verdicts, so they agree without a leader. Ranks that would share a GPU get the ring
(NCCL there has not been measured against it); the reason names the first rank (or GPU) that
rules NCCL out.

``backend="nccl"`` runs several ranks on one GPU (``shared_gpu_settings``): NCCL refuses two ranks
of a communicator on one GPU, before 2.30 only when their host hash and bus id are equal
("Duplicate GPU detected", NCCL's src/init.cc; the host hash is NCCL_HOSTID's when set,
src/misc/utils.cc getHostHash), from 2.30 unless NCCL_MULTI_RANK_GPU_ENABLE=1. So ranks that
share a GPU get distinct NCCL_HOSTID values before 2.30 (NCCL then joins them over its socket
transport) and NCCL_MULTI_RANK_GPU_ENABLE=1 from 2.30, set before the process's first NCCL call
(NCCL reads its parameters once).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from gpucoll import cuda
from gpucoll.backends import Backend
from gpucoll.backends.nccl.driver import (
    DTYPE_CODES,
    IN_PROGRESS,
    SUCCESS,
    Buf,
    Driver,
    failed_peer,
    failure,
    forced_blocking,
    reduce_plan,
    translate,
    wire,
)
from gpucoll.backends.nccl.hostarrays import HostCopies, host_arrays
from gpucoll.errors import (
    BackendUnavailable,
    CollectiveTimeout,
    GpucollError,
    PeerFailure,
    UsageError,
)
from gpucoll.ops import ReduceOp
from gpucoll.progress import Progress, Waiting, diagnose
from gpucoll.rendezvous import local_rank
from gpucoll.store import Liveness, fetch, gather, share, wait_for_ranks
from gpucoll.work import Work, wait_event

_INT32 = DTYPE_CODES["int32"]
# a member's vote on ncclCommShrink: "0" its communicator cannot, "1" it can (healthy), "2" it
# can, revoked after a failure (then every member shrinks with NCCL_SHRINK_ABORT)
SHRINK_VOTE = "nccl/shrink/{}"
BROADCAST_MAX_BYTES = 512 << 10  # uneven all-gather: up to here, a group of broadcasts
PADDED_MIN_BYTES = 8 << 20  # from here: one padded all-gather ...
PADDED_MAX_WASTE = 1.25  # ... unless padding moves more than this times the data


def same_stream(a: int, b: int) -> bool:
    """True when two stream handles name one stream (CAI's 1 is the legacy null stream 0)."""
    return a == b or (a in (0, cuda.STREAM_LEGACY) and b in (0, cuda.STREAM_LEGACY))


def load_nccl(rt: Any, rank: int) -> tuple[Any, Any]:
    """nccl4py's ``nccl.core`` and its raw bindings through the runtime, or BackendUnavailable
    saying why (also where NCCL_COMM_BLOCKING would make its communicators blocking)."""
    forced = forced_blocking()
    if forced:
        raise BackendUnavailable(f"nccl backend on rank {rank}: {forced}")
    try:
        return rt.nccl(), rt.nccl_bindings()
    except Exception as exc:  # noqa: BLE001 - ImportError, or a library that fails to load
        raise BackendUnavailable(
            f"nccl backend on rank {rank}: nccl4py cannot be loaded ({type(exc).__name__}: "
            f"{exc}); install gpucoll[cuda12]") from exc


# ---- start-up through the store: device choice, arrival, the unique id ---------------------------

UID_KEY = "nccl/unique_id"
ARRIVE_KEY = "nccl/arrived/{}"
ENTER_KEY = "nccl/entered/{}"
UID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES


def pick_device(rt: Any, rank: int, device: int | None) -> int:
    """The device ordinal this rank drives: ``device`` if given, else its local rank (modulo
    the devices this process sees)."""
    count = rt.device_count()
    if count < 1:
        raise BackendUnavailable(f"nccl backend on rank {rank}: this process sees no CUDA device")
    if device is None:
        return local_rank(rank) % count
    if isinstance(device, int) and not isinstance(device, bool) and 0 <= device < count:
        return device
    raise ValueError(
        f"device={device!r} on rank {rank}: expected an int in [0, {count}) "
        f"(this process sees {count} CUDA device(s))"
    )


def arrive(store: Any, rank: int, size: int, timeout: float, liveness: Liveness | None,
           what: str = "NCCL start-up") -> None:
    """Store barrier: return once all ``size`` ranks arrived, else CollectiveTimeout naming the
    ranks that never did (PeerFailure for one that died)."""
    store.set(ARRIVE_KEY.format(rank), str(rank))
    wait_for_ranks(store, [ARRIVE_KEY.format(r) for r in range(size)], timeout, what=what,
                   rank=rank, liveness=liveness)


def share_unique_id(store: Any, rank: int, nc: Any, timeout: float, liveness: Liveness | None,
                    root: int = 0) -> bytes:
    """Rank ``root`` makes the unique id (``nc`` is nccl4py's ``nccl.core``) and publishes it;
    every rank returns its bytes."""
    if rank == root:
        raw = bytes(nc.get_unique_id())
        store.set(UID_KEY, raw)
        return raw
    raw = fetch(store, UID_KEY, root, timeout, what="NCCL start-up", rank=rank,
                absent="did not publish the unique id", liveness=liveness)
    if len(raw) != UID_BYTES:
        raise ValueError(f"an NCCL unique id has {UID_BYTES} bytes, got {len(raw)}")
    return raw


GPU_KEY = "nccl/gpu/{}"
_said_shared: list[str] = []  # the shared-GPU line, once per process


def share_gpus(store: Any, rank: int, size: int, nc: Any, gpu: str, timeout: float,
               liveness: Liveness | None) -> None:
    """Collective, before the first NCCL call: every rank publishes the GPU it drives
    (host/bus id); where ranks share one, set what the installed NCCL needs to accept that
    (``shared_gpu_settings``) and say so once on stderr. BackendUnavailable where the
    environment forbids it."""
    keys = [GPU_KEY.format(r) for r in range(size)]
    store.set(keys[rank], json.dumps([gpu, os.environ.get("NCCL_HOSTID", "")]))
    peers = [json.loads(v) for v in gather(
        store, keys, timeout, what="NCCL start-up", rank=rank,
        absent="did not say which GPU it drives", liveness=liveness)]
    gpus = [g for g, _ in peers]
    if len(set(gpus)) == len(gpus):
        return
    settings, line = shared_gpu_settings(library_version(nc), gpus, rank,
                                         hostids=[h for _, h in peers])
    os.environ.update(settings)
    if line and line not in _said_shared:
        _said_shared.append(line)
        print(line, file=sys.stderr, flush=True)


def shared_gpu_settings(version: str, gpus: list[str], rank: int, environ: Any = None,
                        hostids: list[str] | None = None) -> tuple[dict[str, str], str]:
    """What rank ``rank`` sets so that NCCL ``version`` accepts ranks on one GPU (``gpus``: the
    GPU of each rank; ``hostids``: the NCCL_HOSTID each rank's user set, "" for none), and the
    line that says so (rank 0's; empty on the others).

    NCCL < 2.30 refuses two ranks whose host hash and bus id are equal: a rank with no
    NCCL_HOSTID gets ``<host>/gpucoll-<k>``, k its place among the ranks on its GPU, so ranks on
    one GPU differ and ranks on different GPUs of one host still share a host; a user's
    NCCL_HOSTID is kept, and refused where it equals another rank's on the same GPU. NCCL >= 2.30
    needs NCCL_MULTI_RANK_GPU_ENABLE=1; the user's 0, or NCCL_NVLS_ENABLE=1, forbids it."""
    env = os.environ if environ is None else environ
    numbers = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    shared = sorted({g for g in gpus if gpus.count(g) > 1})
    ranks = [r for r, g in enumerate(gpus) if g == shared[0]]
    where = f"ranks {', '.join(map(str, ranks))} share GPU {shared[0]}" + (
        f" (and {len(shared) - 1} other GPU(s) have several ranks)" if len(shared) > 1 else "")
    if numbers >= MULTI_RANK_GPU_VERSION:
        if (env.get("NCCL_MULTI_RANK_GPU_ENABLE") or "1") != "1":
            raise BackendUnavailable(
                f"nccl backend on rank {rank}: {where}, and NCCL {version} accepts that only with "
                f"NCCL_MULTI_RANK_GPU_ENABLE=1, which this environment sets to "
                f"{env['NCCL_MULTI_RANK_GPU_ENABLE']!r}: unset it, or use backend='ring'")
        if env.get("NCCL_NVLS_ENABLE", "") == "1":
            raise BackendUnavailable(
                f"nccl backend on rank {rank}: {where}, and NCCL refuses several ranks on one GPU "
                f"with NCCL_NVLS_ENABLE=1: unset it, or use backend='ring'")
        settings = {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}
        how = "NCCL_MULTI_RANK_GPU_ENABLE=1"
    else:
        hostids = hostids or [env.get("NCCL_HOSTID", "") if r == rank else ""
                              for r in range(len(gpus))]
        ids = [h or f"{g.split('/', 1)[0]}/gpucoll-{gpus[:r].count(g)}"
               for r, (g, h) in enumerate(zip(gpus, hostids, strict=True))]
        pairs = list(zip(ids, gpus, strict=True))
        clash = [r for r, p in enumerate(pairs) if pairs.count(p) > 1]
        if clash:
            raise BackendUnavailable(
                f"nccl backend on rank {rank}: ranks {', '.join(map(str, clash))} share GPU "
                f"{gpus[clash[0]]} with the same NCCL_HOSTID {ids[clash[0]]!r}, and NCCL "
                f"{version} refuses that (\"Duplicate GPU detected\"): give each rank its own "
                f"NCCL_HOSTID, or unset it and gpucoll sets one per rank")
        settings = {} if hostids[rank] else {"NCCL_HOSTID": ids[rank]}
        how = ("a distinct NCCL_HOSTID per rank on one GPU, so NCCL joins them over sockets"
               + (" (the user's where set)" if any(hostids) else ""))
    line = (f"gpucoll: {where}; NCCL {version} runs them with {how}" if rank == 0 else "")
    return settings, line


def enter(store: Any, rank: int) -> None:
    """Mark that this rank is about to enter NCCL's start-up (``ncclCommInitRankConfig``)."""
    store.set(ENTER_KEY.format(rank), str(rank))


def not_entered(store: Any, rank: int, size: int) -> str:
    """Which ranks have not entered NCCL's start-up, for a start-up that timed out."""
    try:
        values = store.peek([ENTER_KEY.format(r) for r in range(size)])
    except Exception as exc:  # noqa: BLE001 - a diagnosis aid: the store may be gone
        return f"which ranks entered it could not be read ({exc})"
    missing = [r for r, v in enumerate(values) if v is None and r != rank]
    if not missing:
        return "every rank entered it"
    names = ", ".join(map(str, missing))
    return f"rank{'s' if len(missing) > 1 else ''} {names} never entered it"


class NcclBackend(Backend):
    """One NCCL communicator over ``size`` ranks, one CUDA device per rank.

    Constructing it is collective: all ranks meet in ``store`` (the communicator's namespace),
    rank 0 publishes the NCCL unique id, and each rank makes its communicator on ``device``
    (default: its local rank), which also becomes this thread's current device.
    """

    name = "nccl"

    def __init__(self, store: Any, rank: int, size: int, *, timeout: float,
                 device: int | None = None, _driver: Driver | None = None):
        self.rank, self.size, self.timeout = rank, size, timeout
        self._rt = rt = cuda.runtime()
        if _driver is None:
            ok, why = rt.available()
            if not ok:
                raise BackendUnavailable(f"nccl backend on rank {rank}: {why}")
            nc, raw = load_nccl(rt, rank)
            self.device = pick_device(rt, rank, device)
            rt.set_device(self.device)
            _driver = self._start(nc, raw, store, rank, size, timeout,
                                  Liveness.of(store, rank, size))
        else:
            self.device = device
        self._nc = _driver
        self._store = store
        self._closed = False
        self._last: Pending | None = None
        self._scratch: Any = None
        # host arrays' write-backs still to do, in issue order (``hostarrays``)
        self._host_queue: list[HostCopies] = []
        self._host_lock = threading.Lock()
        positions = Positions(store, rank, size, self.progress)
        _driver.diagnose = positions.diagnose
        self._watchdog = Watchdog(rank, size, self._check_async, self._fail, _driver.liveness,
                                  positions)

    def _start(self, nc: Any, raw: Any, store: Any, rank: int, size: int, timeout: float,
               liveness: Liveness | None) -> Driver:
        """Arrival, the unique id, then the communicator of ``rank`` of ``size`` meeting in
        ``store``, all within one deadline."""
        deadline = time.monotonic() + timeout
        arrive(store, rank, size, timeout, liveness)
        share_gpus(store, rank, size, nc, f"{socket.gethostname()}/"
                   f"{self._rt.device_identity(self.device)}", _left(deadline), liveness)
        uid = share_unique_id(store, rank, nc, _left(deadline), liveness)
        enter(store, rank)
        with self._rt.using_device(self.device):
            return Driver.create(nc, raw, size, rank, uid, deadline=deadline, timeout=timeout,
                                 liveness=liveness,
                                 diagnose=lambda: not_entered(store, rank, size))

    # ---- plumbing -------------------------------------------------------------------------

    def refuse_capture(self, opname: str, s: int) -> None:
        """UsageError when stream ``s`` is capturing a CUDA graph, before anything is queued."""
        if self._rt.is_capturing(s):
            raise UsageError(
                f"{opname} on rank {self.rank}: stream {s:#x} is capturing a CUDA graph; "
                "the nccl backend cannot run collectives under capture (it tracks each call "
                "with an event the host polls)")

    def _begin(self, opname: str, stream: Any, timeout: float, refs: tuple) -> int:
        """Check the buffers, resolve the stream and order it after the data's producers
        (the communicator's device is current)."""
        if self._closed or self._nc.failure is not None:
            self.raise_failure()
        rt = self._rt
        current = rt.current_stream()
        s = current if stream is None else rt.stream_handle(stream)
        self.refuse_capture(opname, s)
        producers = [] if same_stream(current, s) else [current]
        if producers:  # NCCL would fail on it, and a failed NCCL call ends the communicator
            where = rt.stream_device(s)
            if where is not None and where != self.device:
                raise ValueError(
                    f"{opname}: stream={s:#x} is a stream of device {where}, but rank "
                    f"{self.rank}'s communicator is on device {self.device}; pass a stream of "
                    f"device {self.device}")
        for ref in refs:
            if ref is None:
                continue
            if ref.device is not None and ref.device != self.device:
                raise ValueError(
                    f"{opname}: a buffer is on device {ref.device}, but rank {self.rank}'s "
                    f"communicator is on device {self.device}; buffers must be on the "
                    "communicator's device"
                )
            if ref.stream is not None and not same_stream(ref.stream, s) and all(
                    not same_stream(ref.stream, p) for p in producers):
                producers.append(ref.stream)
        for p in producers:
            rt.wait_event(s, rt.record_event(p))
        return s

    def _end(self, opname: str, s: int, deadline: float, timeout: float, keep: Any) -> None:
        """Record the event that marks the call's completion and hand it to the watchdog;
        ``keep`` (every buffer of the call) stays referenced until then."""
        event = self._rt.record_event(s)
        self._last = Pending(event, deadline, opname, timeout, keep)
        self._watchdog.add(self._last)

    def _call(self, opname: str, stream: Any, timeout: float, refs: tuple) -> Call:
        """The block in which one call is enqueued (``Call``), within ``timeout``."""
        return Call(self, opname, stream, timeout, refs)

    def _copy(self, dst: int, src: int, nbytes: int, s: int) -> None:
        if dst != src and nbytes:
            self._rt.memcpy_async(dst, src, nbytes, s)

    # ---- collectives ------------------------------------------------------------------------

    @host_arrays("x")
    def all_reduce(self, x: Any, op: ReduceOp, *, timeout: float, stream: Any = None) -> None:
        plan = reduce_plan(op, x.dtype, "all_reduce")
        with self._call("all_reduce", stream, timeout, (x,)) as call:
            if x.count:
                self._all_reduce_into(call, x, x, plan, op)

    @host_arrays("x")
    def broadcast(self, x: Any, root: int, *, timeout: float, stream: Any = None) -> None:
        with self._call("broadcast", stream, timeout, (x,)) as call:
            if x.count:
                w = wire(x.dtype)
                buf = Buf(x.ptr, x.count * w.factor, w.code)
                call.run(self._nc.calls.broadcast, buf, buf, root)

    @host_arrays("x")
    def reduce(self, x: Any, root: int, op: ReduceOp, *, timeout: float,
               stream: Any = None) -> None:
        plan = reduce_plan(op, x.dtype, "reduce")
        with self._call("reduce", stream, timeout, (x,)) as call:
            if x.count and plan.native:
                buf = Buf(x.ptr, x.count * plan.factor, plan.code)
                call.run(self._nc.calls.reduce, buf, buf, plan.op, root)
            elif x.count:  # gather every rank's x on root, which reduces the slots locally
                self._gather_reduced(call, x, x, root, op)

    @host_arrays("out")
    def all_gather(self, x: Any, out: Any, *, timeout: float, stream: Any = None) -> None:
        with self._call("all_gather", stream, timeout, (x, out)) as call:
            if x.count:
                w = wire(x.dtype)
                n = x.count * w.factor
                call.run(self._nc.calls.allgather, Buf(x.ptr, n, w.code),
                         Buf(out.ptr, self.size * n, w.code))

    @host_arrays("out")
    def reduce_scatter(self, x: Any, out: Any, op: ReduceOp, *, timeout: float,
                       stream: Any = None) -> None:
        plan = reduce_plan(op, x.dtype, "reduce_scatter")
        with self._call("reduce_scatter", stream, timeout, (x, out)) as call:
            n = out.count * plan.factor
            if out.count and plan.native:
                call.run(self._nc.calls.reduce_scatter, Buf(x.ptr, self.size * n, plan.code),
                         Buf(out.ptr, n, plan.code), plan.op)
            elif out.count:  # all-to-all brings every rank's slot `rank` here; reduce locally
                keep = call.keep = self._rt.alloc_device(x.nbytes, call.s)
                self._exchange(call, x.ptr, keep.ptr, out.count, out.dtype)
                self._rt.reduce_slots(op.value, keep.ptr, out.ptr, self.size, out.count,
                                      out.dtype, call.s)

    @host_arrays("out")
    def gather(self, x: Any, out: Any | None, root: int, *, timeout: float,
               stream: Any = None) -> None:
        with self._call("gather", stream, timeout, (x, out)) as call:
            if x.count:
                self._gather_to(call, x, out.ptr if out is not None else 0, root)

    @host_arrays("out")
    def scatter(self, x: Any | None, out: Any, root: int, *, timeout: float,
                stream: Any = None) -> None:
        with self._call("scatter", stream, timeout, (x, out)) as call:
            if out.count:
                w = wire(out.dtype)
                n, slot, s = out.count * w.factor, out.nbytes, call.s
                comm = self._nc.calls
                if self.rank == root:
                    call.group([(comm.send, (Buf(x.ptr + r * slot, n, w.code), r),
                                 {"stream": s}) for r in range(self.size) if r != root],
                               even_empty=True)
                    self._copy(out.ptr, x.ptr + root * slot, slot, s)
                else:
                    call.run(comm.recv, Buf(out.ptr, n, w.code), root)

    @host_arrays("out")
    def all_to_all(self, x: Any, out: Any, *, timeout: float, stream: Any = None) -> None:
        with self._call("all_to_all", stream, timeout, (x, out)) as call:
            n = out.count // self.size
            if n:
                self._exchange(call, x.ptr, out.ptr, n, out.dtype)

    @host_arrays()
    def send(self, x: Any, dst: int, *, timeout: float, stream: Any = None,
             tag: int = 0) -> None:
        """NCCL has no tags: messages pair in order (the tag is checked under GPUCOLL_DEBUG)."""
        self._p2p("send", self._nc.calls.send, x, dst, timeout, stream)

    @host_arrays("x")
    def recv(self, x: Any, src: int, *, timeout: float, stream: Any = None,
             tag: int = 0) -> None:
        self._p2p("recv", self._nc.calls.recv, x, src, timeout, stream)

    def _p2p(self, opname: str, fn: Callable, x: Any, peer: int, timeout: float,
             stream: Any) -> None:
        with self._call(opname, stream, timeout, (x,)) as call:
            if x.count:
                w = wire(x.dtype)
                call.run(fn, Buf(x.ptr, x.count * w.factor, w.code), peer)

    def barrier(self, *, timeout: float) -> None:
        """All ranks reach this point: a one-element all-reduce on the current stream, then
        the host waits for it (after earlier work on that stream), within ``timeout``."""
        with self._call("barrier", None, timeout, ()) as call:
            if self._scratch is None:
                self._scratch = self._rt.alloc_device(4, call.s)
            buf = Buf(self._scratch.ptr, 1, _INT32)
            call.run(self._nc.calls.allreduce, buf, buf, 0)  # ncclSum
        EventWork(self, self._last).synchronize()

    # ---- helpers ----------------------------------------------------------------------------

    def _all_reduce_into(self, call: Call, x: Any, out: Any, plan: Any, op: ReduceOp) -> None:
        """``x`` reduced over every rank into ``out`` (``x`` itself: in place). A reduction
        NCCL lacks is an all-gather of every rank's x, then the slots reduced locally."""
        n = x.count * plan.factor
        send = Buf(x.ptr, n, plan.code)
        if plan.native:
            recv = send if out is x else Buf(out.ptr, n, plan.code)
            call.run(self._nc.calls.allreduce, send, recv, plan.op)
            return
        keep = call.keep = self._rt.alloc_device(self.size * x.nbytes, call.s)
        call.run(self._nc.calls.allgather, send, Buf(keep.ptr, self.size * n, plan.code))
        self._rt.reduce_slots(op.value, keep.ptr, out.ptr, self.size, x.count, x.dtype, call.s)

    def _gather_to(self, call: Call, x: Any, out_ptr: int, root: int) -> None:
        """Rank r's ``x`` lands in slot r of ``out_ptr`` on ``root`` (grouped recvs there)."""
        w = wire(x.dtype)
        n, comm, s = x.count * w.factor, self._nc.calls, call.s
        if self.rank != root:
            call.run(comm.send, Buf(x.ptr, n, w.code), root)
            return
        call.group([(comm.recv, (Buf(out_ptr + r * x.nbytes, n, w.code), r), {"stream": s})
                    for r in range(self.size) if r != root], even_empty=True)
        self._copy(out_ptr + root * x.nbytes, x.ptr, x.nbytes, s)

    def _gather_reduced(self, call: Call, x: Any, out: Any, root: int, op: ReduceOp) -> None:
        """A reduce NCCL lacks: every rank's ``x`` gathered on ``root`` (into a temporary,
        ``call.keep``), which reduces the slots into ``out``."""
        if self.rank == root:
            call.keep = self._rt.alloc_device(self.size * x.nbytes, call.s)
        self._gather_to(call, x, call.keep.ptr if call.keep is not None else 0, root)
        if call.keep is not None:
            self._rt.reduce_slots(op.value, call.keep.ptr, out.ptr, self.size, x.count,
                                  x.dtype, call.s)

    def _exchange(self, call: Call, src: int, dst: int, n: int, dtype: Any) -> None:
        """All-to-all of ``n``-element slots: dst slot j = rank j's src slot ``rank``."""
        w = wire(dtype)
        slot, count, comm, s = n * dtype.itemsize, n * w.factor, self._nc.calls, call.s
        calls = []
        for r in range(self.size):
            if r != self.rank:
                calls.append((comm.send, (Buf(src + r * slot, count, w.code), r),
                              {"stream": s}))
                calls.append((comm.recv, (Buf(dst + r * slot, count, w.code), r),
                              {"stream": s}))
        call.group(calls, even_empty=True)
        self._copy(dst + self.rank * slot, src + self.rank * slot, slot, s)

    # ---- out of place: NCCL reads x and writes out ------------------------------------------

    @host_arrays("out")
    def all_reduce_out(self, x: Any, out: Any, op: ReduceOp, *, timeout: float,
                       stream: Any = None) -> None:
        plan = reduce_plan(op, x.dtype, "all_reduce")
        with self._call("all_reduce", stream, timeout, (x, out)) as call:
            if x.count:
                self._all_reduce_into(call, x, out, plan, op)

    @host_arrays("out")
    def reduce_out(self, x: Any, out: Any | None, root: int, op: ReduceOp, *, timeout: float,
                   stream: Any = None) -> None:
        plan = reduce_plan(op, x.dtype, "reduce")
        with self._call("reduce", stream, timeout, (x, out)) as call:
            n = x.count * plan.factor
            if x.count and plan.native:  # the receive buffer is read on root only
                recv = out if out is not None else x
                call.run(self._nc.calls.reduce, Buf(x.ptr, n, plan.code),
                         Buf(recv.ptr, n, plan.code), plan.op, root)
            elif x.count:
                self._gather_reduced(call, x, out, root, op)

    @host_arrays("out")
    def broadcast_out(self, x: Any | None, out: Any, root: int, *, timeout: float,
                      stream: Any = None) -> None:
        with self._call("broadcast", stream, timeout, (x, out)) as call:
            if out.count:
                w = wire(out.dtype)
                n = out.count * w.factor
                send = x if self.rank == root else out  # the send buffer is read on root only
                call.run(self._nc.calls.broadcast, Buf(send.ptr, n, w.code),
                         Buf(out.ptr, n, w.code), root)

    # ---- uneven sizes -----------------------------------------------------------------------

    def _group_p2p(self, fn: Any, ref: Any, peer: int, s: int, ptr: int | None = None,
             count: int | None = None) -> tuple:
        """One send or receive of a group: ``count`` elements of ``ref``'s dtype at ``ptr``."""
        w = wire(ref.dtype)
        count = ref.count if count is None else count
        buf = Buf(ref.ptr if ptr is None else ptr, count * w.factor, w.code)
        return fn, (buf, peer), {"stream": s}

    @host_arrays("recvs")
    def exchange(self, sends: Sequence[tuple[int, Any]], recvs: Sequence[tuple[int, Any]],
                 layout: int, *, timeout: float, stream: Any = None) -> None:
        """One NCCL group of sends and receives; what a rank sends itself is a device copy."""
        refs = tuple(r for _, r in (*sends, *recvs))
        with self._call("exchange", stream, timeout, refs) as call:
            comm, me, s = self._nc.calls, self.rank, call.s
            own = [r for p, r in recvs if p == me]
            for i, src in enumerate(r for p, r in sends if p == me):
                self._copy(own[i].ptr, src.ptr, src.nbytes, s)
            calls = [self._group_p2p(comm.send, ref, peer, s) for peer, ref in sends if peer != me]
            calls += [self._group_p2p(comm.recv, ref, peer, s) for peer, ref in recvs if peer != me]
            call.group(calls)

    @host_arrays("out")
    def all_gather_v(self, x: Any, out: Any, counts: Sequence[int], layout: int, *,
                     timeout: float, stream: Any = None) -> None:
        item, n, total = x.dtype.itemsize, self.size, sum(counts)
        biggest = max(counts)
        with self._call("all_gather_v", stream, timeout, (x, out)) as call:
            if not total:
                pass
            elif total * item >= PADDED_MIN_BYTES and n * biggest <= PADDED_MAX_WASTE * total:
                self._padded_all_gather(call, x, out, counts, biggest)
            elif total * item <= BROADCAST_MAX_BYTES:
                call.group(self._broadcasts(x, out, counts, call.s))
            else:  # a group of sends and receives, straight into the slots of out
                call.group(self._sends_and_receives(x, out, counts, call.s))

    def _padded_all_gather(self, call: Call, x: Any, out: Any, counts: Sequence[int],
                           biggest: int) -> None:
        """One all-gather of slots padded to the largest, then each slot copied into place;
        its scratch buffer is ``call.keep`` (alive until the call completes)."""
        w, item, n, s = wire(x.dtype), x.dtype.itemsize, self.size, call.s
        keep = call.keep = self._rt.alloc_device((n + 1) * biggest * item, s)
        padded = keep.ptr + n * biggest * item  # this rank's padded slot, after the others
        self._copy(padded, x.ptr, x.nbytes, s)
        call.run(self._nc.calls.allgather, Buf(padded, biggest * w.factor, w.code),
                 Buf(keep.ptr, n * biggest * w.factor, w.code))
        start = 0
        for r, k in enumerate(counts):
            self._copy(out.ptr + start * item, keep.ptr + r * biggest * item, k * item, s)
            start += k

    def _broadcasts(self, x: Any, out: Any, counts: Sequence[int], s: int) -> list:
        """One broadcast per rank, from its x into its slot of out."""
        w, item, calls, start = wire(x.dtype), x.dtype.itemsize, [], 0
        for r, k in enumerate(counts):
            slot = Buf(out.ptr + start * item, k * w.factor, w.code)
            send = Buf(x.ptr, k * w.factor, w.code) if r == self.rank else slot
            calls.append((self._nc.calls.broadcast, (send, slot, r), {"stream": s}))
            start += k
        return calls

    def _sends_and_receives(self, x: Any, out: Any, counts: Sequence[int], s: int) -> list:
        """x to every other rank, and every other rank's x into its slot of out (this rank's
        own slot: a device copy)."""
        item, me, comm, calls, start = x.dtype.itemsize, self.rank, self._nc.calls, [], 0
        for r, k in enumerate(counts):
            if r == me:
                self._copy(out.ptr + start * item, x.ptr, x.nbytes, s)
            else:
                calls.append(self._group_p2p(comm.send, x, r, s))
                calls.append(self._group_p2p(comm.recv, x, r, s, out.ptr + start * item, k))
            start += k
        return calls

    @host_arrays("out")
    def reduce_scatter_v(self, x: Any, out: Any, counts: Sequence[int], op: ReduceOp,
                         layout: int, *, timeout: float, stream: Any = None) -> None:
        plan = reduce_plan(op, x.dtype, "reduce_scatter_v")
        item, me, comm = x.dtype.itemsize, self.rank, self._nc.calls
        with self._call("reduce_scatter_v", stream, timeout, (x, out)) as call:
            s = call.s
            if not sum(counts):
                pass
            elif plan.native:  # one reduce per slot, to the rank that owns it, as one group
                calls, start = [], 0
                for r, k in enumerate(counts):
                    send = Buf(x.ptr + start * item, k * plan.factor, plan.code)
                    recv = Buf(out.ptr, k * plan.factor, plan.code) if r == me else send
                    calls.append((comm.reduce, (send, recv, plan.op, r), {"stream": s}))
                    start += k
                call.group(calls)
            else:  # every rank's slot `me` comes here (grouped send/recv), then a local reduction
                keep = call.keep = self._rt.alloc_device(self.size * out.nbytes, s)
                calls, start = [], 0
                for r, k in enumerate(counts):
                    if r != me:
                        calls.append(self._group_p2p(comm.send, x, r, s, x.ptr + start * item, k))
                        calls.append(self._group_p2p(comm.recv, out, r, s,
                                                     keep.ptr + r * out.nbytes))
                    else:
                        self._copy(keep.ptr + me * out.nbytes, x.ptr + start * item,
                                   out.nbytes, s)
                    start += k
                call.group(calls)
                if out.count:
                    self._rt.reduce_slots(op.value, keep.ptr, out.ptr, self.size, out.count,
                                          out.dtype, s)

    # ---- many arrays, and point to point in one go ------------------------------------------

    @host_arrays("xs")
    def all_reduce_coalesced(self, xs: Sequence[Any], op: ReduceOp, *, timeout: float,
                             stream: Any = None) -> None:
        """The arrays NCCL reduces natively as one group (one launch); the others one by one."""
        rest = []
        with self._call("all_reduce_many", stream, timeout, tuple(xs)) as call:
            calls = []
            for x in xs:
                plan = reduce_plan(op, x.dtype, "all_reduce_many")
                if not plan.native:
                    rest.append(x)
                elif x.count:
                    buf = Buf(x.ptr, x.count * plan.factor, plan.code)
                    calls.append((self._nc.calls.allreduce, (buf, buf, plan.op),
                                  {"stream": call.s}))
            call.group(calls)
        for x in rest:
            self.all_reduce(x, op, timeout=timeout, stream=stream)

    @host_arrays("ops")
    def batch_p2p(self, ops: Sequence[tuple[bool, Any, int]], *, timeout: float,
                  stream: Any = None, tags: Sequence[int] | None = None) -> list:
        """Every send and receive as one NCCL group; they share its completion event."""
        refs = tuple(ref for _, ref, _ in ops)
        with self._call("batch_isend_irecv", stream, timeout, refs) as call:
            comm = self._nc.calls
            call.group([self._group_p2p(comm.send if sending else comm.recv, ref, peer, call.s)
                        for sending, ref, peer in ops])
        return [EventWork(self, self._last) for _ in ops]

    # ---- async, lifecycle -------------------------------------------------------------------

    def run_async(self, call: Callable[[], None], *, stream: Any = None) -> EventWork:
        """Enqueue ``call`` (every call records its event) and return its Work."""
        self._last = None
        call()
        if self._last is None:
            raise GpucollError(f"rank {self.rank}: the call enqueued nothing on the nccl "
                               "backend")
        return EventWork(self, self._last)

    def _event_work(self, pending: Pending) -> EventWork:
        return EventWork(self, pending)

    def run_sync(self, call: Callable[[], None]) -> None:
        call()  # NCCL calls on one communicator are already ordered by their streams

    def split(self, store: Any, rank: int | None, size: int, color: int | None, key: int,
              *, timeout: float) -> NcclBackend | None:
        """ncclCommSplit, once this rank's earlier work has completed (NCCL requires that no
        work be outstanding). ``color`` is the group's index among the colours (the
        communicator's agreement made it so) and ``rank`` the NCCL key."""
        deadline = time.monotonic() + timeout
        self.raise_failure()
        self._drain("split", deadline, timeout)
        liveness = Liveness.of(store, rank, size) if rank is not None else None
        with self._rt.using_device(self.device):
            made = self._nc.split("split", color, rank, size, deadline=deadline,
                                  timeout=timeout, liveness=liveness)
        if made is None:
            return None
        return NcclBackend(store, rank, size, timeout=timeout, device=self.device, _driver=made)

    def shrink(self, store: Any, members: list[int], *, timeout: float,
               liveness: Any = None) -> NcclBackend:
        """The survivors' backend: ``members`` (this group's ranks that are left, ascending;
        rank i of the new group is ``members[i]``), meeting in ``store``.

        ncclCommShrink when every member's communicator can make it (``Driver.shrinkable``:
        after a failure the communicator was revoked, not aborted, and has gone quiet). The
        members vote in the store first, since all must take the same way; otherwise (a
        binding or NCCL library without revoke or shrink, a communicator aborted) they start
        a new communicator among themselves, as at start-up."""
        deadline = time.monotonic() + timeout
        rank, size, driver = members.index(self.rank), len(members), self._nc
        if driver.failure is None and not self._closed:
            self._drain("shrink", deadline, timeout)  # NCCL_SHRINK_DEFAULT: nothing in flight
        vote = b"0" if not driver.shrinkable(deadline) else \
            b"1" if driver.failure is None else b"2"
        votes = share(store, [SHRINK_VOTE.format(r) for r in range(size)], vote,
                      _left(deadline), what=f"shrink on rank {self.rank} (NCCL)", rank=rank,
                      liveness=liveness)
        with self._rt.using_device(self.device):
            if b"0" not in votes:
                excluded = [r for r in range(self.size) if r not in members]
                made = driver.shrink("shrink", excluded, rank, size, abort=b"2" in votes,
                                     deadline=deadline, timeout=timeout, liveness=liveness)
            else:
                made = self._start(driver.nc, driver.raw, store, rank, size, _left(deadline),
                                   liveness)
        return NcclBackend(store, rank, size, timeout=timeout, device=self.device, _driver=made)

    def _drain(self, opname: str, deadline: float, timeout: float) -> None:
        """Wait for every call still outstanding, by ``deadline``: calls on different streams
        may complete in any order, so the last call's event alone does not say they are done."""
        for pending in self._watchdog.outstanding():
            if not EventWork(self, pending)._wait(_left(deadline)):
                raise self._nc.fail(CollectiveTimeout(
                    f"{opname} on rank {self.rank} of {self.size}: earlier work "
                    f"({pending.opname}) did not complete within {timeout:g} s; the NCCL "
                    f"communicator was aborted"))

    def failure(self) -> GpucollError | None:
        return self._nc.failure

    def raise_failure(self) -> None:
        """Raise why this backend stopped working, if it did."""
        if self._nc.failure is not None:
            raise copy.copy(self._nc.failure)
        if self._closed:
            raise GpucollError(f"nccl backend on rank {self.rank} is closed")

    def _check_async(self, opname: str) -> None:
        """The watchdog's look at NCCL's asynchronous error."""
        status = self._nc.async_error(opname)
        if status not in (SUCCESS, IN_PROGRESS):
            raise failure(status, opname, self.rank, self.size)

    def _fail(self, exc: GpucollError) -> None:
        """Record the first failure and abort the NCCL communicator (between calls). A
        failure found here (a timeout, an NCCL error), not learnt from a peer, is published in
        the store, so that peers waiting for this rank fail at once, naming it and why."""
        pending = self._watchdog.clear()
        first = self._nc.failure is None
        self._nc.fail(exc)
        for p in pending:  # an aborted kernel may still be winding down
            cuda.hold(p.event, p.keep)
        if first and not isinstance(exc, PeerFailure) and self._nc.liveness is not None:
            self._nc.liveness.failed(str(exc))

    def expire(self, pending: Pending) -> None:
        """``pending`` missed its deadline: fail the backend, unless it failed already."""
        if self._nc.failure is None and not cuda.event_done(pending.event):
            self._fail(self._watchdog.expired(pending))

    def abort(self, reason: str | GpucollError) -> None:
        self._fail(reason if isinstance(reason, GpucollError) else GpucollError(
            f"nccl backend on rank {self.rank} aborted: {reason}"))

    def close(self) -> None:
        """Wait (within the deadline) for enqueued work, then finalize and destroy the
        communicator; after an abort or a timeout, return at once."""
        if self._closed:
            return
        try:
            for pending in self._watchdog.outstanding():  # each within its own deadline
                EventWork(self, pending)._wait(None)
        except GpucollError:
            pass
        self._closed = True
        self._watchdog.close()
        with self._rt.using_device(self.device):
            self._nc.close(time.monotonic() + self.timeout)
        self._last = self._scratch = None


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.0)


# ---- deadlines for work on CUDA streams: the watchdog, and event-backed Work ---------------------

POLL_MAX = 0.05  # seconds between polls of a pending event, at most
LINGER = 0.01  # seconds the watchdog keeps polling after its queue empties, before it idles
TICK = 0.5  # seconds between looks at the store (dead peers; this rank's position)
PROGRESS_KEY = "progress/{}"


class Call:
    """One call being enqueued, as a ``with`` block (``NcclBackend._call``). Entering it makes
    the communicator's device current, checks the buffers ``refs`` and resolves the stream
    ``s``, ordered after the data's producers (``_begin``); ``run`` and ``group`` enqueue NCCL's
    work on ``s`` under the call's deadline. Leaving it without an error records the completion
    event for the watchdog (``_end``), with ``refs`` and ``keep`` (a temporary buffer of the
    call) referenced until then; the caller's device is current again either way."""

    __slots__ = ("backend", "opname", "stream", "timeout", "deadline", "refs", "s", "keep",
                 "_guard")

    def __init__(self, backend: NcclBackend, opname: str, stream: Any, timeout: float,
                 refs: tuple):
        self.backend, self.opname, self.stream, self.refs = backend, opname, stream, refs
        self.timeout, self.deadline = timeout, time.monotonic() + timeout
        self.keep: Any = None

    def __enter__(self) -> Call:
        backend = self.backend
        self._guard = guard = backend._rt.using_device(backend.device)
        guard.__enter__()
        try:
            self.s = backend._begin(self.opname, self.stream, self.timeout, self.refs)
        except BaseException as exc:
            guard.__exit__(type(exc), exc, exc.__traceback__)
            raise
        return self

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        try:
            if kind is None:
                self.backend._end(self.opname, self.s, self.deadline, self.timeout,
                                  (self.refs, self.keep))
        finally:
            self._guard.__exit__(kind, exc, tb)

    def run(self, fn: Callable, *args: Any) -> None:
        """``fn(*args, stream=s)``, one of the driver's ``calls``."""
        self.backend._nc.call(self.opname, fn, *args, stream=self.s, deadline=self.deadline,
                              timeout=self.timeout)

    def group(self, calls: list, *, even_empty: bool = False) -> None:
        """``calls`` as one NCCL group; none when it is empty, unless ``even_empty``."""
        if calls or even_empty:
            self.backend._nc.group(self.opname, calls, deadline=self.deadline,
                                   timeout=self.timeout)


@dataclasses.dataclass(slots=True)
class Pending:
    """One enqueued call: the event after it, its deadline, and what must outlive its work."""

    event: Any
    deadline: float
    opname: str
    timeout: float
    keep: Any = None


class Positions:
    """This rank's progress record, published in the group's store, and the diagnosis of
    where every rank is (read back from the store) when a call times out."""

    def __init__(self, store: Any, rank: int, size: int, progress: Progress):
        self.store, self.rank, self.size, self.progress = store, rank, size, progress
        self._sent = b""

    def publish(self) -> None:
        """Put this rank's record in the store if it changed since the last time."""
        data = self.progress.encode()
        if data != self._sent and self.store is not None:
            try:
                self.store.set(PROGRESS_KEY.format(self.rank), data)
                self._sent = data
            except Exception:  # noqa: BLE001 - a diagnosis aid: the store may be gone
                pass

    def diagnose(self) -> str:
        """Which rank is behind and where, from the records in the store."""
        self.publish()
        try:
            values = self.store.peek([PROGRESS_KEY.format(r) for r in range(self.size)])
        except Exception as exc:  # noqa: BLE001
            return f"the ranks' progress could not be read ({exc})"
        found = {r: Progress.decode(r, v) for r, v in enumerate(values) if v is not None}
        return diagnose(found, [r for r in range(self.size) if r not in found])


class Watchdog:
    """Polls the events of enqueued calls in issue order; calls ``on_fail(exc)`` once if one
    misses its deadline, ``check()`` (NCCL's async error query) raises, or ``liveness`` finds a
    peer that died."""

    def __init__(self, rank: int, size: int, check: Callable[[str], None],
                 on_fail: Callable[[GpucollError], None], liveness: Any = None,
                 positions: Positions | None = None):
        self.rank, self.size = rank, size
        self._check, self._on_fail = check, on_fail
        self._liveness, self._positions = liveness, positions
        self._pending: collections.deque[Pending] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._idle = True  # the thread waits for work (not polling): adding must wake it
        self._next_tick = self._next_look = 0.0
        self._notice = Waiting(f"rank {rank}")  # a call long unfinished says where ranks are
        self._noticed: Pending | None = None
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"gpucoll-nccl-watchdog-{rank}")
        self._thread.start()

    def add(self, item: Pending) -> None:
        # deque.append is atomic; the lock is taken only to wake an idle thread (the thread
        # sets _idle before it looks at the deque, so no item is missed)
        self._pending.append(item)
        if self._idle:
            with self._cond:
                self._cond.notify()

    def outstanding(self) -> list[Pending]:
        """The calls not yet seen complete, in issue order."""
        with self._cond:
            return list(self._pending)

    def clear(self) -> list[Pending]:
        """Forget every pending call; returns them."""
        with self._cond:
            pending = list(self._pending)
            self._pending.clear()
        return pending

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._pending.clear()
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        cuda.own_thread()  # its event queries must not disturb other threads' graph captures
        delay = 0.0005
        while True:
            with self._cond:
                if not self._pending and not self._closed:
                    # stay awake a moment first: calls in quick succession then add their
                    # events without waking this thread each time
                    self._cond.wait(LINGER)
                self._idle = True
                if not self._pending and not self._closed:
                    self._cond.wait(TICK)
                self._idle = False
                if self._closed:
                    return
                head = self._pending[0] if self._pending else None
            self._tick()
            if head is None:
                continue
            failure = self._inspect(head)
            if failure is not None:
                self.clear()
                self._on_fail(failure)
                continue
            with self._cond:
                if self._pending and self._pending[0] is head and not cuda.event_done(
                        head.event):
                    self._cond.wait(delay)
                    delay = min(delay * 2, POLL_MAX)
                    continue
                self._retire()
            delay = 0.0005

    def _tick(self) -> None:
        """At most every TICK seconds: publish this rank's position."""
        now = time.monotonic()
        if now >= self._next_tick:
            self._next_tick = now + TICK
            if self._positions is not None:
                self._positions.publish()

    def _retire(self) -> None:
        """Drop every finished call at the head of the queue in one go (under the lock):
        one pass per wake-up, not one per call, keeps this thread off the callers' GIL."""
        pending = self._pending
        try:
            while pending and cuda.event_done(pending[0].event):
                pending.popleft()
        except Exception:  # noqa: BLE001 - _inspect reports it once that call is the head
            pass

    def _inspect(self, head: Pending) -> GpucollError | None:
        try:
            if cuda.event_done(head.event):  # a query refused by a capture: not done yet
                return None
            self._check(head.opname)
        except GpucollError as exc:
            return exc
        except Exception as exc:  # noqa: BLE001 - CUDA errors from the event query
            return translate(exc, head.opname, self.rank, self.size)
        now = time.monotonic()
        if self._liveness is not None and now >= self._next_look:
            self._next_look = now + TICK
            try:  # a peer that closed may simply have finished first: only the dead count
                died = [r for r, how in self._liveness.gone().items()
                        if how != "closed" and r != self.rank]
                if died:
                    self._liveness.check(head.opname, died)
                failed = failed_peer(self._liveness, head.opname, self.rank, self.size)
                if failed is not None:  # a live peer whose communicator failed
                    return failed
            except PeerFailure as exc:
                return exc
            except GpucollError:
                pass  # the store is gone: the deadline still holds
        if now > head.deadline:
            return self.expired(head)
        self._say_waiting(head, now)
        return None

    def _say_waiting(self, head: Pending, now: float) -> None:
        """Every GPUCOLL_WAIT_LOG seconds that ``head`` is unfinished, one line saying where
        the ranks are (``gpucoll.progress``)."""
        notice = self._notice
        if head is not self._noticed:
            self._noticed = head
            begun = head.deadline - head.timeout
            notice.restart(begun if begun == begun and begun < now else now)  # nan: no deadline
            notice.what = f"{head.opname} on rank {self.rank} of {self.size}"
            notice.timeout = head.timeout
        if now >= notice.due:
            notice.tick(lambda: f"({whom})" if (whom := self._whom()) else "for its peers",
                        now)

    def _whom(self) -> str | None:
        """What an unfinished call waits for: on one rank only the device's earlier work on
        its stream; else where the progress records show the ranks (None without them)."""
        if self.size == 1:
            return ("one rank: it waits for the device, for work queued before it on its "
                    "stream")
        if self._positions is None:
            return None
        return f"where the ranks are: {self._positions.diagnose()}"

    def expired(self, item: Pending) -> CollectiveTimeout:
        """The error for a call that missed its deadline, saying where every rank is (on one
        rank: that it waited for the device)."""
        why = f"; {whom}" if (whom := self._whom()) else ""
        return CollectiveTimeout(
            f"{item.opname} on rank {self.rank} of {self.size} did not complete within "
            f"{item.timeout:g} s{why}; the NCCL communicator was aborted")


class EventWork(Work):
    """An NCCL call in flight on a stream, marked by the CUDA event recorded after it.

    ``wait()`` makes the caller's current stream wait for the call (the host does not block)
    and returns its result; ``synchronize()`` (or ``wait(timeout)``) blocks the host until it
    is done, bounded by the call's deadline; ``is_completed()`` queries the event.
    """

    def __init__(self, backend: Any, pending: Pending):
        self._backend = backend
        self._pending = pending

    def is_completed(self) -> bool:
        return self._backend.failure() is not None or cuda.event_done(self._pending.event)

    def _order(self) -> None:
        self._backend.raise_failure()
        rt = cuda.runtime()
        rt.wait_event(rt.current_stream(), self._pending.event)

    def _wait(self, timeout: float | None) -> bool:
        p = self._pending
        limit = p.deadline if timeout is None else time.monotonic() + timeout
        if wait_event(p.event, limit, self._backend.raise_failure):
            return True
        if timeout is not None:
            return False
        self._backend.expire(p)  # as the watchdog would now (the first failure counts)
        self._backend.raise_failure()
        return True  # not reached: the backend has failed


# ---- what backend="auto" picks: NCCL where it works for every rank, else the host ring -----------

KEY = "auto/{}"
MULTI_RANK_GPU_VERSION = (2, 30)


def nccl_version(code: int) -> str:
    """NCCL's integer version as text: 23203 -> "2.32.3" (codes before 2.9 were 2804 style)."""
    if code <= 0:
        return "unknown"
    if code < 20900:
        return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"
    return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"


def library_version(nc: Any) -> str:
    """The version of the NCCL library nccl4py (``nc``) loaded, e.g. "2.32.3"."""
    lib = nc.get_version().libnccl
    if lib is None:
        raise RuntimeError("nccl4py found no NCCL library (install nvidia-nccl-cu12)")
    return str(lib.version)


def local_verdict(rt: Any = None, *, rank: int = 0, device: Any = None) -> dict[str, Any]:
    """Whether this process can run the NCCL backend and why (never raises): ``ok``, ``why``,
    and when ok, ``gpu`` (host and PCI bus id of the device it would drive)."""
    rt = cuda.runtime() if rt is None else rt
    ok, why = rt.available()
    if not ok:
        return {"ok": False, "why": why}
    forced = forced_blocking()
    if forced:
        return {"ok": False, "why": forced}
    try:
        version = library_version(rt.nccl())
    except Exception as exc:  # noqa: BLE001 - any failure to load NCCL means "not usable"
        return {"ok": False, "why": f"nccl4py cannot be loaded ({type(exc).__name__}: {exc}); "
                                    f"install gpucoll[cuda12]"}
    try:
        chosen = pick_device(rt, rank, device)
        gpu = f"{socket.gethostname()}/{rt.device_identity(chosen)}"
    except Exception as exc:  # noqa: BLE001
        return {"ok": False, "why": f"no device to drive ({type(exc).__name__}: {exc})"}
    return {"ok": True, "why": f"{why}, NCCL {version}, device {chosen}", "gpu": gpu}


def decide(verdicts: list[dict[str, Any]], rank: int) -> tuple[str, str]:
    """The rule every rank applies to every rank's verdict: ``("nccl"|"ring", reason)``."""
    unable = [(r, v["why"]) for r, v in enumerate(verdicts) if not v["ok"]]
    if unable:
        r, reason = unable[0]
        more = f" (and {len(unable) - 1} other rank(s))" if len(unable) > 1 else ""
        return "ring", f"auto: the host ring, because rank {r}{more} cannot use NCCL: {reason}"
    by_gpu: dict[str, list[int]] = {}
    for r, v in enumerate(verdicts):
        by_gpu.setdefault(v["gpu"], []).append(r)
    shared = [(gpu, ranks) for gpu, ranks in by_gpu.items() if len(ranks) > 1]
    if shared:
        gpu, ranks = shared[0]
        return "ring", (
            f"auto: the host ring, because ranks {', '.join(map(str, ranks))} would share GPU "
            f"{gpu}, where NCCL is not known to be faster than the ring; backend='nccl' runs "
            f"NCCL there")
    return "nccl", f"auto: every rank can use NCCL (rank {rank}: {verdicts[rank]['why']})"


def agree(store: Any, rank: int, size: int, timeout: float,
          device: Any = None) -> tuple[str, str]:
    """Collective: ``("nccl"|"ring", reason)``, the same on every rank."""
    mine = local_verdict(rank=rank, device=device)
    keys = [KEY.format(r) for r in range(size)]
    store.set(keys[rank], json.dumps(mine))
    values = gather(store, keys, timeout, what="backend='auto'", rank=rank,
                    absent="did not report whether it can use NCCL",
                    liveness=Liveness.of(store, rank, size))
    return decide([json.loads(v) for v in values], rank)
