"""An emulated CUDA runtime and NCCL, so the NCCL backend runs in tests without a GPU.

``EmulatedRuntime`` stands in for ``gpucoll.cuda.CupyRuntime``: "device memory" is host memory
registered here, streams are worker threads that run queued work in order, events are markers
in those queues. Its ``nccl()`` is a stand-in for ``cupy.cuda.nccl`` whose
``NcclCommunicator`` has CuPy's method signatures, reads and writes memory at the integer
pointers it is given, and exchanges data between processes through a TCPStore. Unique ids,
``NcclError`` and the version queries are the real library's.

It is written from nccl.h, independently of gpucoll's backend: it checks datatype and op codes,
roots, peers, counts against the allocations the pointers fall in, the device of every buffer
and stream, the in-place rules, that all ranks call the same collective with the same
arguments, and that every send meets a recv of the same count and datatype. Argument errors
raise ``NcclError`` at the call, as NCCL does; what would hang or corrupt memory on a GPU is
recorded in ``runtime.misuse`` and reported through ``check_async_error``.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import hashlib
import pickle
import threading
import time
from typing import Any

import ml_dtypes
import numpy as np
from cupy.cuda import nccl as _real_nccl

from gpucoll.errors import StoreTimeout
from gpucoll.store import TCPStore, parse_address

# nccl.h: ncclDataType_t and ncclRedOp_t, written out again here on purpose
NCCL_TYPES = {
    0: np.dtype(np.int8), 1: np.dtype(np.uint8), 2: np.dtype(np.int32), 3: np.dtype(np.uint32),
    4: np.dtype(np.int64), 5: np.dtype(np.uint64), 6: np.dtype(np.float16),
    7: np.dtype(np.float32), 8: np.dtype(np.float64), 9: np.dtype(ml_dtypes.bfloat16),
    10: np.dtype(ml_dtypes.float8_e4m3fn), 11: np.dtype(ml_dtypes.float8_e5m2),
}
NCCL_OPS = {0: np.add, 1: np.multiply, 2: np.maximum, 3: np.minimum, 4: np.add}
NCCL_AVG = 4
UNHANDLED_CUDA_ERROR, INVALID_ARGUMENT, INVALID_USAGE = 1, 4, 5
DEFAULT_STREAMS = (0, 1, 2)  # null stream, cudaStreamLegacy, cudaStreamPerThread
NcclError = _real_nccl.NcclError


class Misuse(AssertionError):
    """Something a real GPU would hang on or silently corrupt."""


def host_view(ptr: int, nbytes: int, dtype: Any = np.uint8) -> np.ndarray:
    """A writable NumPy view of ``nbytes`` at address ``ptr``."""
    if nbytes == 0:
        return np.empty(0, dtype)
    return np.frombuffer((ctypes.c_char * nbytes).from_address(ptr), dtype=dtype)


# ---- memory --------------------------------------------------------------------------------

class Alloc:
    __slots__ = ("base", "nbytes", "device", "kind", "owner")

    def __init__(self, owner: np.ndarray, device: int | None, kind: str):
        self.owner = owner
        self.base = owner.__array_interface__["data"][0]
        self.nbytes, self.device, self.kind = owner.nbytes, device, kind


class DeviceBuffer:
    """Emulated device memory from ``alloc_device`` (``.ptr``; freed with the object)."""

    def __init__(self, rt: EmulatedRuntime, nbytes: int, device: int):
        self._mem = np.zeros(max(nbytes, 1), np.uint8)
        self.ptr = rt.register(self._mem, device, "device")
        self._rt = rt

    def __del__(self):
        self._rt.release(self._mem)


class FakeDeviceArray:
    """Host memory posing as a device array: ``__cuda_array_interface__`` v3 with a stream."""

    def __init__(self, data: Any, rt: EmulatedRuntime, device: int | None = None,
                 stream: int | None = None, dtype: Any = None):
        self._host = np.array(data, dtype=dtype, copy=True, order="C")
        self._rt = rt
        self.device = rt.current_device() if device is None else device
        self.stream = stream
        self.ptr = rt.register(self._host, self.device, "device")

    shape = property(lambda self: self._host.shape)
    dtype = property(lambda self: self._host.dtype)
    size = property(lambda self: self._host.size)

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": self._host.shape, "typestr": self._host.dtype.str,
                "data": (self.ptr, False), "version": 3, "strides": None, "stream": self.stream}

    def get(self) -> np.ndarray:
        """A host copy, after all queued work (like ``cupy.ndarray.get``)."""
        self._rt.synchronize()
        return self._host.copy()

    def __getitem__(self, key: Any) -> FakeDeviceView:
        """A view sharing this memory (CuPy's basic slicing), e.g. rows of a result."""
        return FakeDeviceView(self, self._host[key])

    def reshape(self, *shape: Any) -> FakeDeviceView:
        return FakeDeviceView(self, self._host.reshape(*shape))

    def __setitem__(self, key: Any, value: Any) -> None:
        """Write from the host, after all queued work (a kernel on the current stream in
        CuPy; here the streams are drained first)."""
        self._rt.synchronize()
        self._host[key] = value

    def __del__(self):
        self._rt.release(self._host)


class FakeDeviceView:
    """Part of a ``FakeDeviceArray`` (C-contiguous), with the same interface."""

    def __init__(self, owner: FakeDeviceArray, host: np.ndarray):
        if not host.flags.c_contiguous:
            raise ValueError("FakeDeviceView: only C-contiguous views are emulated")
        self._owner, self._host = owner, host
        self._rt, self.device, self.stream = owner._rt, owner.device, owner.stream

    shape = property(lambda self: self._host.shape)
    dtype = property(lambda self: self._host.dtype)
    size = property(lambda self: self._host.size)

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": self._host.shape, "typestr": self._host.dtype.str,
                "data": (self._host.__array_interface__["data"][0], False), "version": 3,
                "strides": None, "stream": self.stream}

    def get(self) -> np.ndarray:
        self._rt.synchronize()
        return self._host.copy()

    def __getitem__(self, key: Any) -> FakeDeviceView:
        return FakeDeviceView(self._owner, self._host[key])

    def reshape(self, *shape: Any) -> FakeDeviceView:
        return FakeDeviceView(self._owner, self._host.reshape(*shape))

    def __setitem__(self, key: Any, value: Any) -> None:
        self._rt.synchronize()
        self._host[key] = value


# ---- streams and events --------------------------------------------------------------------

class EmuEvent:
    def __init__(self):
        self._flag = threading.Event()
        self.ptr = id(self)

    def done(self) -> bool:
        return self._flag.is_set()

    def synchronize(self) -> None:
        if not self._flag.wait(60):
            raise Misuse("event never completed (a GPU would block here forever)")


class EmuStream:
    """A CUDA stream: a worker thread running queued callables in order."""

    def __init__(self, rt: EmulatedRuntime, handle: int, device: int | None):
        self.rt, self.handle, self.device = rt, handle, device
        self._queue: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._busy = False
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"emu-stream-{handle}")
        self._thread.start()

    def submit(self, fn) -> None:
        with self._cond:
            self._queue.append(fn)
            self._cond.notify_all()

    def idle(self) -> bool:
        with self._cond:
            return not self._queue and not self._busy

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                fn = self._queue.popleft()
                self._busy = True
            try:
                if fn is None:
                    return
                fn()
            except Exception as exc:  # noqa: BLE001 - reported to the test via misuse
                self.rt.report(f"stream {self.handle}: {type(exc).__name__}: {exc}")
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()


# ---- the runtime ---------------------------------------------------------------------------

class EmulatedRuntime:
    """``gpucoll.cuda.Runtime`` on host memory; ``store_addr`` carries NCCL's traffic."""

    name = "emulated"

    def __init__(self, store_addr: str, devices: int = 8, hang_timeout: float = 30.0,
                 comm_split: bool = True):
        host, port = parse_address(store_addr)
        self.store = TCPStore(host, port, timeout=60.0)
        self.devices, self.hang_timeout = devices, hang_timeout
        self.misuse: list[str] = []
        self._allocs: dict[int, Alloc] = {}
        self._graveyard: list[np.ndarray] = []
        self._streams: dict[int, EmuStream] = {}
        self._next_stream = 0x1000
        self._lock = threading.RLock()
        self._local = threading.local()
        self.held = threading.Event()  # set: NCCL work waits (a peer "never arrives")
        self.module = EmulatedNccl(self, comm_split)

    # memory
    def register(self, arr: np.ndarray, device: int | None, kind: str) -> int:
        a = Alloc(arr, device, kind)
        with self._lock:
            self._allocs[a.base] = a
        return a.base

    def unregister(self, ptr: int) -> None:
        with self._lock:
            self._allocs.pop(ptr, None)

    def find(self, ptr: int, nbytes: int) -> Alloc | None:
        with self._lock:
            for a in self._allocs.values():
                if a.base <= ptr and ptr + nbytes <= a.base + a.nbytes:
                    return a
        return None

    def release(self, mem: np.ndarray) -> None:
        """Free emulated device memory the way CUDA's stream-ordered allocators do: not
        before the work already queued has run (here: at the next ``synchronize``)."""
        self._graveyard.append(mem)

    def report(self, message: str) -> None:
        self.misuse.append(message)

    # the Runtime interface
    def available(self) -> tuple[bool, str]:
        return True, f"emulated CUDA runtime with {self.devices} device(s)"

    def device_count(self) -> int:
        return self.devices

    def set_device(self, device: int) -> None:
        if not 0 <= device < self.devices:
            raise RuntimeError(f"cudaErrorInvalidDevice: device {device} of {self.devices}")
        self._local.device = device

    def current_device(self) -> int:
        return getattr(self._local, "device", 0)

    def current_stream(self) -> int:
        return getattr(self._local, "stream", 0)

    @contextlib.contextmanager
    def use_stream(self, handle: int):
        """Make ``handle`` this thread's current stream inside the block (like ``with s:``)."""
        previous = self.current_stream()
        self._local.stream = handle
        try:
            yield handle
        finally:
            self._local.stream = previous

    def stream_handle(self, stream: Any) -> int:
        from gpucoll.cuda import stream_handle

        return stream_handle(stream, self.current_stream())

    def new_stream(self) -> int:
        with self._lock:
            handle = self._next_stream
            self._next_stream += 0x10
            self._streams[handle] = EmuStream(self, handle, self.current_device())
        return handle

    def stream(self, handle: int) -> EmuStream:
        """The stream behind ``handle``; an unknown handle is a CUDA error."""
        with self._lock:
            s = self._streams.get(handle)
            if s is None and handle in DEFAULT_STREAMS:
                s = self._streams[handle] = EmuStream(self, handle, None)
        if s is None:
            raise RuntimeError(f"cudaErrorInvalidResourceHandle: unknown stream {handle:#x}")
        return s

    def record_event(self, stream: int) -> EmuEvent:
        ev = EmuEvent()
        self.stream(stream).submit(ev._flag.set)
        return ev

    def wait_event(self, stream: int, event: EmuEvent) -> None:
        self.stream(stream).submit(lambda: self._await(event._flag, "a stream waits for an event"))

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        for ptr, what in ((dst, "destination"), (src, "source")):
            if self.find(ptr, nbytes) is None:
                raise RuntimeError(f"cudaErrorInvalidValue: memcpy {what} {ptr:#x}+{nbytes} "
                                   "is not inside any allocation")
        self.stream(stream).submit(lambda: ctypes.memmove(dst, src, nbytes))

    def alloc_device(self, nbytes: int, stream: int) -> DeviceBuffer:
        return DeviceBuffer(self, nbytes, self.current_device())

    def alloc_pinned(self, nbytes: int) -> np.ndarray:
        mem = np.zeros(max(nbytes, 1), np.uint8)
        self.register(mem, None, "pinned")
        return mem[:nbytes]

    def pointer_device(self, ptr: int) -> int | None:
        a = self.find(ptr, 1)
        return a.device if a is not None and a.kind == "device" else None

    def reduce_slots(self, op: str, src: int, dst: int, slots: int, count: int,
                     dtype: np.dtype, stream: int) -> None:
        dtype = np.dtype(dtype)
        for ptr, n in ((src, slots * count), (dst, count)):
            a = self.find(ptr, n * dtype.itemsize)
            if a is None or a.kind != "device":
                raise RuntimeError(f"reduce_slots: {ptr:#x}+{n} elements is not device memory")
        ufunc = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum,
                 "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}[op]

        def run():
            a = host_view(src, slots * count * dtype.itemsize, dtype).reshape(slots, count)
            out = host_view(dst, count * dtype.itemsize, dtype)
            out[...] = ufunc.reduce(a, axis=0)

        self.stream(stream).submit(run)

    def empty(self, shape: tuple, dtype: np.dtype, device: int) -> FakeDeviceArray:
        return FakeDeviceArray(np.zeros(shape, dtype), self, device)

    def nccl(self) -> EmulatedNccl:
        return self.module

    # helpers for tests
    def synchronize(self, timeout: float = 60.0) -> None:
        """Block until every stream ran everything queued so far."""
        deadline = time.monotonic() + timeout
        with self._lock:
            streams = list(self._streams.values())
        for s in streams:
            ev = threading.Event()
            s.submit(ev.set)
            if not ev.wait(max(0.0, deadline - time.monotonic())):
                raise Misuse(f"stream {s.handle:#x} did not drain within {timeout} s")
        with self._lock:
            dead, self._graveyard = self._graveyard, []
            for mem in dead:
                self._allocs.pop(mem.__array_interface__["data"][0], None)

    def close(self) -> None:
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        for s in streams:
            s.submit(None)
        self.store.close()

    def _await(self, flag: threading.Event, what: str) -> None:
        if not flag.wait(self.hang_timeout):
            raise Misuse(f"{what} that never completes (a GPU would hang)")


# ---- NCCL ----------------------------------------------------------------------------------

class EmulatedNccl:
    """Stands in for the module ``cupy.cuda.nccl``."""

    NcclError = NcclError
    get_unique_id = staticmethod(_real_nccl.get_unique_id)
    get_version = staticmethod(_real_nccl.get_version)
    get_build_version = staticmethod(_real_nccl.get_build_version)

    def __init__(self, rt: EmulatedRuntime, comm_split: bool = True):
        self.rt = rt
        self._local = threading.local()
        bases = (EmulatedComm, SplitMixin) if comm_split else (EmulatedComm,)
        self.NcclCommunicator = type("NcclCommunicator", bases, {"_rt": rt})

    def _group(self) -> list | None:
        return getattr(self._local, "ops", None)

    def groupStart(self) -> None:
        self._local.depth = getattr(self._local, "depth", 0) + 1
        if self._local.depth == 1:
            self._local.ops = []

    def groupEnd(self) -> None:
        depth = getattr(self._local, "depth", 0)
        if depth == 0:
            raise NcclError(INVALID_USAGE)  # groupEnd without groupStart
        self._local.depth = depth - 1
        if depth == 1:
            ops, self._local.ops = self._local.ops, None
            if ops:
                ops[0].comm._submit(ops)


class Op:
    __slots__ = ("comm", "name", "send", "recv", "count", "dtype", "op", "root", "peer",
                 "stream", "seq")

    def __init__(self, comm, name, send=0, recv=0, count=0, dtype=0, op=-1, root=-1, peer=-1,
                 stream=0):
        self.comm, self.name, self.send, self.recv, self.count = comm, name, send, recv, count
        self.dtype, self.op, self.root, self.peer, self.stream = dtype, op, root, peer, stream
        self.seq = -1

    def meta(self) -> tuple:
        return (self.name, self.count, self.dtype, self.op, self.root)


class EmulatedComm:
    """``cupy.cuda.nccl.NcclCommunicator`` with the same methods, over host memory."""

    _rt: EmulatedRuntime

    def __init__(self, ndev: int, commId: bytes, rank: int, config: Any = None):
        if not isinstance(commId, bytes):  # CuPy 14 declares `bytes commId`
            raise TypeError(f"Argument 'commId' has incorrect type (expected bytes, got "
                            f"{type(commId).__name__})")
        if len(commId) != 128 or not 0 <= rank < ndev:
            raise NcclError(INVALID_ARGUMENT)
        self._size, self._rank = ndev, rank
        self._device = self._rt.current_device()
        self._uid = commId
        self._prefix = "emu/" + hashlib.sha1(commId).hexdigest()[:20]
        self._alive = True
        self._aborted = threading.Event()
        self.async_error = 0
        self.calls: list[tuple[str, dict]] = []
        self._coll_seq = 0
        self._split_seq = 0
        self._p2p: dict[tuple[str, int], int] = collections.defaultdict(int)
        self._join()

    def _join(self) -> None:
        store = self._rt.store
        store.set(f"{self._prefix}/dev/{self._rank}", str(self._device))
        keys = [f"{self._prefix}/dev/{r}" for r in range(self._size)]
        try:
            store.wait(keys, timeout=self._rt.hang_timeout)
        except StoreTimeout:
            raise Misuse("ncclCommInitRank would hang: not every rank joined") from None
        devices = [int(v) for v in store.multi_get(keys)]
        if len(set(devices)) != len(devices):  # one host here: one rank per GPU
            self._rt.report(f"Duplicate GPU detected: ranks' devices {devices}")
            raise NcclError(INVALID_USAGE)

    # -- queries
    @property
    def comm(self) -> int:
        return id(self) if self._alive else 0

    def device_id(self) -> int:
        return self._device

    def rank_id(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def check_async_error(self) -> None:
        if not self._alive:
            raise NcclError(INVALID_ARGUMENT)
        if self.async_error:
            raise NcclError(self.async_error)

    def abort(self) -> None:
        self._alive = False
        self._aborted.set()

    def destroy(self) -> None:
        self._alive = False

    # -- the calls, with CuPy's signatures
    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
        self._enqueue(Op(self, "allReduce", sendbuf, recvbuf, count, datatype, op, stream=stream))

    def reduce(self, sendbuf, recvbuf, count, datatype, op, root, stream):
        self._enqueue(Op(self, "reduce", sendbuf, recvbuf, count, datatype, op, root,
                         stream=stream))

    def broadcast(self, sendbuff, recvbuff, count, datatype, root, stream):
        self._enqueue(Op(self, "broadcast", sendbuff, recvbuff, count, datatype, root=root,
                         stream=stream))

    def bcast(self, buff, count, datatype, root, stream):
        self.broadcast(buff, buff, count, datatype, root, stream)

    def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream):
        self._enqueue(Op(self, "reduceScatter", sendbuf, recvbuf, recvcount, datatype, op,
                         stream=stream))

    def allGather(self, sendbuf, recvbuf, count, datatype, stream):
        self._enqueue(Op(self, "allGather", sendbuf, recvbuf, count, datatype, stream=stream))

    def send(self, sendbuf, count, datatype, peer, stream):
        self._enqueue(Op(self, "send", send=sendbuf, count=count, dtype=datatype, peer=peer,
                         stream=stream))

    def recv(self, recvbuf, count, datatype, peer, stream):
        self._enqueue(Op(self, "recv", recv=recvbuf, count=count, dtype=datatype, peer=peer,
                         stream=stream))

    # -- checks at the call (what NCCL's ArgsCheck and CUDA would refuse)
    def _check_alive(self) -> None:
        if not self._alive:
            raise NcclError(INVALID_ARGUMENT)  # NULL communicator

    def _enqueue(self, op: Op) -> None:
        self._check_alive()
        self.calls.append((op.name, {k: getattr(op, k) for k in Op.__slots__[1:-1]}))
        self._check(op)
        if op.name in ("send", "recv"):
            key = (op.name, op.peer)
            op.seq = self._p2p[key]
            self._p2p[key] += 1
        else:
            op.seq = self._coll_seq
            self._coll_seq += 1
        group = self._rt.module._group()
        if group is not None:
            group.append(op)
        else:
            self._submit([op])

    def _check(self, op: Op) -> None:
        if op.dtype not in NCCL_TYPES:
            self._invalid(f"{op.name}: datatype {op.dtype} is not an ncclDataType_t")
        if op.name in ("allReduce", "reduce", "reduceScatter") and op.op not in NCCL_OPS:
            self._invalid(f"{op.name}: op {op.op} is not an ncclRedOp_t")
        if op.name in ("reduce", "broadcast") and not 0 <= op.root < self._size:
            self._invalid(f"{op.name}: root {op.root} outside [0, {self._size})")
        if op.name in ("send", "recv") and not 0 <= op.peer < self._size:
            self._invalid(f"{op.name}: peer {op.peer} outside [0, {self._size})")
        try:
            s = self._rt.stream(op.stream)
        except RuntimeError as exc:
            self._rt.report(f"{op.name}: {exc}")
            raise NcclError(UNHANDLED_CUDA_ERROR) from None
        if s.device is not None and s.device != self._device:
            self._invalid(f"{op.name}: stream of device {s.device} on a device-{self._device} "
                          "communicator")
        nsend, nrecv = self._extents(op)
        self._check_buffer(op, "sendbuff", op.send, nsend)
        self._check_buffer(op, "recvbuff", op.recv, nrecv)
        self._check_overlap(op, nsend, nrecv)

    def _extents(self, op: Op) -> tuple[int, int]:
        """Bytes each buffer must hold (nccl.h): 0 for a buffer the call does not use."""
        item = NCCL_TYPES[op.dtype].itemsize
        n, size = op.count * item, self._size
        if op.name == "allGather":
            return n, n * size
        if op.name == "reduceScatter":
            return n * size, n
        if op.name == "reduce":
            return n, n if self._rank == op.root else 0
        if op.name == "broadcast":
            return (n if self._rank == op.root else 0), n
        if op.name == "send":
            return n, 0
        if op.name == "recv":
            return 0, n
        return n, n

    def _check_buffer(self, op: Op, what: str, ptr: int, nbytes: int) -> None:
        if nbytes == 0 or op.count == 0:
            return
        if ptr == 0:
            self._invalid(f"{op.name}: {what} is NULL")
        a = self._rt.find(ptr, nbytes)
        if a is None:
            self._invalid(f"{op.name}: {what} {ptr:#x}+{nbytes} bytes is not inside one device "
                          "allocation")
        if a.kind != "device" or a.device != self._device:
            self._invalid(f"{op.name}: {what} is {a.kind} memory of device {a.device}, the "
                          f"communicator is on device {self._device}")

    def _check_overlap(self, op: Op, nsend: int, nrecv: int) -> None:
        """Overlapping buffers must be exactly nccl.h's in-place layout."""
        if not nsend or not nrecv or op.send + nsend <= op.recv or op.recv + nrecv <= op.send:
            return
        shift = self._rank * op.count * NCCL_TYPES[op.dtype].itemsize
        if op.name == "allGather":
            legal = op.send == op.recv + shift
        elif op.name == "reduceScatter":
            legal = op.recv == op.send + shift
        else:
            legal = op.send == op.recv
        if not legal:
            self._invalid(f"{op.name}: send and receive buffers overlap but are not NCCL's "
                          "in-place layout")

    def _invalid(self, message: str) -> None:
        self._rt.report(message)
        raise NcclError(INVALID_ARGUMENT)

    # -- execution on the stream
    def _submit(self, ops: list[Op]) -> None:
        first = self._rt.stream(ops[0].stream)
        others = {op.stream for op in ops} - {ops[0].stream}
        if not others:
            first.submit(lambda: self._execute(ops))
            return
        done = threading.Event()

        def run():
            try:
                self._execute(ops)
            finally:
                done.set()

        first.submit(run)
        for handle in others:
            self._rt.stream(handle).submit(lambda: done.wait(self._rt.hang_timeout))

    def _execute(self, ops: list[Op]) -> None:
        try:
            for op in ops:
                if op.name == "send":
                    self._post(f"p2p/{self._rank}->{op.peer}/{op.seq}", op, op.send)
            for op in ops:
                if op.name not in ("send", "recv"):
                    self._collective(op)
            for op in ops:
                if op.name == "recv":
                    self._receive(op)
            for op in ops:
                if op.name == "send":
                    self._fetch(f"p2p/{self._rank}->{op.peer}/{op.seq}/ack",
                                f"send #{op.seq} to rank {op.peer} never received")
        except _Aborted:
            return
        except Misuse as exc:
            self._rt.report(f"rank {self._rank}: {exc}")
            self.async_error = INVALID_USAGE

    def _post(self, key: str, op: Op, ptr: int, nbytes: int | None = None) -> None:
        n = op.count * NCCL_TYPES[op.dtype].itemsize if nbytes is None else nbytes
        data = host_view(ptr, n).tobytes() if ptr else b""
        self._rt.store.set(f"{self._prefix}/{key}", pickle.dumps((op.meta(), data)))

    def _fetch(self, key: str, what: str) -> Any:
        deadline = time.monotonic() + self._rt.hang_timeout
        while True:
            if self._aborted.is_set():
                raise _Aborted
            if self._rt.held.is_set():
                self._aborted.wait(0.05)
                continue
            try:
                raw = self._rt.store.get(f"{self._prefix}/{key}", timeout=0.1)
                return pickle.loads(raw)
            except StoreTimeout:
                if time.monotonic() > deadline:
                    raise Misuse(f"NCCL would hang: {what}") from None

    def _receive(self, op: Op) -> None:
        key = f"p2p/{op.peer}->{self._rank}/{op.seq}"
        meta, data = self._fetch(key, f"recv #{op.seq} from rank {op.peer} never matched")
        _, count, dtype = meta[:3]
        if (count, dtype) != (op.count, op.dtype):
            raise Misuse(f"recv of {op.count} x type {op.dtype} from rank {op.peer} met a send "
                         f"of {count} x type {dtype}")
        host_view(op.recv, len(data))[:] = np.frombuffer(data, np.uint8)
        self._rt.store.set(f"{self._prefix}/{key}/ack", pickle.dumps(True))

    def _collective(self, op: Op) -> None:
        mine_needed = not (op.name == "broadcast" and self._rank != op.root)
        base = f"coll/{op.seq}"
        nsend, _ = self._extents(op)
        self._post(f"{base}/{self._rank}", op, op.send if mine_needed else 0, nsend)
        got = [self._fetch(f"{base}/{r}", f"rank {r} never called collective #{op.seq} "
                           f"({op.name})") for r in range(self._size)]
        for r, (meta, _) in enumerate(got):
            if meta != op.meta():
                raise Misuse(f"collective #{op.seq}: rank {self._rank} called {op.meta()}, "
                             f"rank {r} called {meta}")
        dtype = NCCL_TYPES[op.dtype]
        parts = [np.frombuffer(data, dtype) for _, data in got]
        result = self._combine(op, parts, dtype)
        if result is not None:
            out = host_view(op.recv, result.nbytes, dtype)
            out[:] = result

    def _combine(self, op: Op, parts: list[np.ndarray], dtype: np.dtype) -> np.ndarray | None:
        if op.name == "broadcast":
            return parts[op.root]
        if op.name == "allGather":
            return np.concatenate(parts)
        if op.name == "reduce" and self._rank != op.root:
            return None
        total = parts[0].copy()
        for p in parts[1:]:
            total = NCCL_OPS[op.op](total, p).astype(dtype)
        if op.op == NCCL_AVG:
            total = (total / self._size).astype(dtype)
        if op.name == "reduceScatter":
            return total[self._rank * op.count:(self._rank + 1) * op.count]
        return total


class SplitMixin:
    """``commSplit`` (CuPy >= 13 with NCCL >= 2.18); left out to emulate older bindings."""

    def commSplit(self, color: int, key: int, config: Any = None):
        """Blocking and collective over this communicator, like ncclCommSplit."""
        self._check_alive()
        self._split_seq += 1
        store, base = self._rt.store, f"{self._prefix}/split/{self._split_seq}"
        store.set(f"{base}/{self._rank}", f"{color} {key}")
        keys = [f"{base}/{r}" for r in range(self._size)]
        store.wait(keys, timeout=self._rt.hang_timeout)
        pairs = [tuple(int(v) for v in raw.split()) for raw in store.multi_get(keys)]
        if color == -1:
            return None
        members = sorted((k, r) for r, (c, k) in enumerate(pairs) if c == color)
        new_rank = [r for _, r in members].index(self._rank)
        uid = hashlib.sha512(self._uid + f"{self._split_seq}/{color}".encode()).digest()
        return type(self)(len(members), uid + uid[:64], new_rank)


class _Aborted(Exception):
    """The communicator was aborted while an op waited for its peers."""
