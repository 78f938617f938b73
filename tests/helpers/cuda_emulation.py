"""An emulated CUDA runtime: what a GPU does to careless code, on host memory.

``CudaEmulation`` implements ``gpucoll.cuda.Runtime`` with host memory standing in for device
memory. It models what makes GPU code wrong in ways a CPU test would not otherwise see:

- **Devices per thread.** Each thread has a current device (0 at first) and, per device, a
  current stream (the legacy default stream, 0, at first). Streams and events belong to the
  device that was current when they were made: recording an event of one device on a stream of
  another is ``cudaErrorInvalidResourceHandle``, and the default stream handles 0, 1 and 2 mean
  the current device's default stream.
- **Timelines.** A stream is a thread that runs its queue in order, later than the work was
  enqueued. ``paused()`` holds every stream (a busy GPU) and ``stall(stream)`` one, so that a
  test decides when queued work runs: work that is not ordered after what it reads, reads it
  too early. Every stream behaves as a non-blocking one (no implicit synchronisation with the
  legacy default stream): stricter than CUDA.
- **A memory pool that reuses at once.** Device and pinned memory come from a pool that gives a
  freed block to the next allocation of its size straight away, as CuPy's pools do, so that work
  still queued on memory whose owner was dropped reads or overwrites someone else's data.
- **Capture.** ``capturing(stream, mode)`` makes ``is_capturing`` true for a stream while a
  thread captures it, and models CUDA's capture interaction modes (CUDA runtime API,
  ``cudaThreadExchangeStreamCaptureMode`` and ``cudaStreamCaptureMode``): a thread is
  "prohibited from potentially unsafe API calls" when it captures itself (in any mode but
  relaxed) or when its own mode is global (every thread's default) and another thread captures
  in global mode (``cudaStreamBeginCapture``'s default, and torch.cuda.graph's); a thread in
  thread-local mode (``thread_local_capture()``) ignores other threads' captures. An event query
  is such a call (NCCL-NOTES.md: torch's NCCL watchdog switches to thread-local mode around
  its queries for this reason): it fails with ``cudaErrorStreamCaptureUnsupported`` and
  invalidates the capture (CUDA C++ Programming Guide, CUDA Graphs, "Invalidation": an invalid
  operation during capture invalidates the associated graphs, and cudaStreamEndCapture then
  returns an error and no graph), which ``Capture.invalidated`` records.

What a GPU would hang on (an event never recorded, a stall never released) ends after
``hang_timeout`` seconds with an entry in ``misuse``, which tests expect to stay empty.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import threading
import time
from typing import Any

import numpy as np

from gpucoll import cuda

DEFAULT_STREAMS = (0, cuda.STREAM_LEGACY, cuda.STREAM_PER_THREAD)
_CLASS = 512  # the pool's size classes, in bytes


class Misuse(AssertionError):
    """Something a real GPU would hang on or silently corrupt."""


def host_view(ptr: int, nbytes: int, dtype: Any = np.uint8) -> np.ndarray:
    """A writable NumPy view of ``nbytes`` at address ``ptr``."""
    if nbytes == 0:
        return np.empty(0, dtype)
    return np.frombuffer((ctypes.c_char * nbytes).from_address(ptr), dtype=dtype)


def cai_view(obj: Any) -> np.ndarray:
    """A NumPy view of a ``__cuda_array_interface__`` object's elements (any strides)."""
    cai = obj.__cuda_array_interface__
    dtype, shape, ptr = np.dtype(cai["typestr"]), tuple(cai["shape"]), cai["data"][0]
    if 0 in shape:
        return np.empty(shape, dtype)
    strides = cai.get("strides")
    if strides is None:
        return host_view(ptr, int(np.prod(shape)) * dtype.itemsize, dtype).reshape(shape)
    span = sum((n - 1) * st for n, st in zip(shape, strides, strict=True)) + dtype.itemsize
    return np.ndarray(shape, dtype, buffer=host_view(ptr, span), strides=strides)


# ---- memory ----------------------------------------------------------------------------------

class Block:
    """A block of the pool; its host memory lives as long as the pool (a GPU pool keeps memory
    it freed), so a stale pointer reads whatever the block holds now."""

    __slots__ = ("base", "nbytes", "device", "kind", "_mem")

    def __init__(self, nbytes: int, device: int | None, kind: str):
        self._mem = np.zeros(nbytes, np.uint8)
        self.base = self._mem.__array_interface__["data"][0]
        self.nbytes, self.device, self.kind = nbytes, device, kind


class Lease:
    """Ownership of a block: when the last reference goes, the block is free for the next
    allocation (at once)."""

    def __init__(self, pool: Pool, block: Block):
        self.pool, self.block = pool, block

    def __del__(self):
        self.pool.free(self.block)  # may run inside the pool's own methods (garbage collection)


class Pool:
    """Blocks by (kind, device, size class); a freed block goes to the next allocation of its
    class, last freed first."""

    def __init__(self):
        self._free: dict[tuple, list[Block]] = collections.defaultdict(list)
        self._live: dict[int, Block] = {}
        self._lock = threading.Lock()
        # blocks freed but not yet filed: a lease can be dropped by the garbage collector while
        # this thread holds the lock, so freeing only queues the block (deque.append is atomic)
        self._freed: collections.deque[Block] = collections.deque()

    def lease(self, nbytes: int, device: int | None, kind: str) -> Lease:
        size = max(_CLASS, -(-nbytes // _CLASS) * _CLASS)
        with self._lock:
            self._file_freed()
            free = self._free[(kind, device, size)]
            block = free.pop() if free else Block(size, device, kind)
            self._live[block.base] = block
        return Lease(self, block)

    def free(self, block: Block) -> None:
        self._freed.append(block)

    def _file_freed(self) -> None:
        while self._freed:
            block = self._freed.popleft()
            self._live.pop(block.base, None)
            self._free[(block.kind, block.device, block.nbytes)].append(block)

    def find(self, ptr: int, nbytes: int) -> Block | None:
        """The live block holding ``[ptr, ptr + nbytes)``, if any."""
        with self._lock:
            self._file_freed()
            for b in list(self._live.values()):
                if b.base <= ptr and ptr + nbytes <= b.base + b.nbytes:
                    return b
        return None


class DeviceBuffer:
    """Device memory from ``alloc_device`` (``.ptr``), back in the pool with the object."""

    def __init__(self, lease: Lease):
        self._lease, self.ptr = lease, lease.block.base


class FakeDeviceArray:
    """Host memory posing as a device array: ``__cuda_array_interface__`` v3, with a producer
    ``stream`` when given. Made from data, its contents are written at once (as a pageable
    copy to the device is); indexing gives strided views of the same memory."""

    def __init__(self, data: Any, rt: CudaEmulation, device: int | None = None,
                 stream: int | None = None, dtype: Any = None, *, _view: Any = None,
                 _lease: Any = None):
        self._rt = rt
        self.device = rt.current_device() if device is None else device
        self.stream = stream
        if _view is None:
            src = np.array(data, dtype=dtype, copy=True, order="C")
            _lease = rt.pool.lease(src.nbytes, self.device, "device") if src.nbytes else None
            _view = np.empty(src.shape, src.dtype) if _lease is None else np.ndarray(
                src.shape, src.dtype, buffer=host_view(_lease.block.base, src.nbytes))
            _view[...] = src
        self._lease, self._view = _lease, _view
        self.ptr = _view.__array_interface__["data"][0] if _lease is not None else 0

    shape = property(lambda self: self._view.shape)
    dtype = property(lambda self: self._view.dtype)
    size = property(lambda self: self._view.size)

    @property
    def __cuda_array_interface__(self) -> dict:
        v = self._view
        strides = None if v.flags.c_contiguous else v.strides
        return {"shape": v.shape, "typestr": v.dtype.str, "data": (self.ptr, False),
                "version": 3, "strides": strides, "stream": self.stream}

    def __getitem__(self, index: Any) -> FakeDeviceArray:
        return FakeDeviceArray(None, self._rt, self.device, self.stream,
                               _view=self._view[index], _lease=self._lease)

    def reshape(self, *shape: Any) -> FakeDeviceArray:
        return FakeDeviceArray(None, self._rt, self.device, self.stream,
                               _view=self._view.reshape(*shape), _lease=self._lease)

    def __setitem__(self, index: Any, value: Any) -> None:
        """A write from the host, as a kernel on the current stream (here waited for)."""
        view = self._view
        with self._rt.using_device(self.device):
            self._rt.run_on(self._rt.current_stream(), lambda: view.__setitem__(index, value))

    def get(self, stream: int | None = None) -> np.ndarray:
        """A host copy made on ``stream`` (default: the current stream), like
        ``cupy.ndarray.get``: it sees only work ordered before it on that stream."""
        out = np.empty(self.shape, self.dtype)
        view = self._view
        with self._rt.using_device(self.device):
            self._rt.run_on(self._rt.stream_handle(stream), lambda: np.copyto(out, view))
        return out


# ---- streams and events ------------------------------------------------------------------------

class CudaError(RuntimeError):
    """A failed CUDA runtime call, with its ``cudaError_t`` as ``status`` (as CuPy's
    ``CUDARuntimeError``)."""

    def __init__(self, status: int, name: str, text: str):
        super().__init__(f"{name}: {text}")
        self.status = status


CAPTURE_UNSUPPORTED = 900  # cudaErrorStreamCaptureUnsupported (driver_types.h)


class Capture:
    """One stream capture: its stream, the thread that began it, its mode ("global",
    "thread_local" or "relaxed"), and whether an unsafe call invalidated it."""

    def __init__(self, stream: int, mode: str):
        self.stream, self.mode, self.thread = stream, mode, threading.get_ident()
        self.invalidated: str | None = None


class EmuEvent:
    """A CUDA event of ``device``; ``done`` until recorded, then once its marker has run.
    Querying it is a potentially unsafe call under capture (``CudaEmulation.unsafe_call``)."""

    def __init__(self, device: int, rt: CudaEmulation | None = None):
        self.device, self._rt = device, rt
        self._flag = threading.Event()
        self._flag.set()
        self.ptr = id(self)

    @property
    def done(self) -> bool:
        if self._rt is not None:
            self._rt.unsafe_call("cudaEventQuery")
        return self._flag.is_set()

    def synchronize(self) -> None:
        if not self._flag.wait(60):
            raise Misuse("event never completed (a GPU would block here forever)")


class EmuStream:
    """A CUDA stream of ``device``: a thread running queued callables in order."""

    def __init__(self, rt: CudaEmulation, handle: int, device: int):
        self.rt, self.handle, self.device = rt, handle, device
        self._queue: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"emu-stream-{device}-{handle:#x}")
        self._thread.start()

    def submit(self, fn: Any) -> None:
        with self._cond:
            self._queue.append(fn)
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                fn = self._queue.popleft()
            if fn is None:
                return
            self.rt.gate()
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - reported to the test via misuse
                self.rt.report(f"stream {self.handle:#x}: {type(exc).__name__}: {exc}")


class _Using:
    def __init__(self, rt: CudaEmulation, device: int | None):
        self.rt, self.device, self.previous = rt, device, None

    def __enter__(self) -> None:
        if self.device is not None:
            self.previous = self.rt.current_device()
            self.rt.set_device(self.device)

    def __exit__(self, *exc: object) -> None:
        if self.previous is not None:
            self.rt.set_device(self.previous)


# ---- the runtime -------------------------------------------------------------------------------

class CudaEmulation:
    """``gpucoll.cuda.Runtime`` on host memory (see the module docstring)."""

    name = "emulated"

    def __init__(self, devices: int = 8, hang_timeout: float = 30.0):
        self.devices, self.hang_timeout = devices, hang_timeout
        self.misuse: list[str] = []
        self.pool = Pool()
        self._streams: dict[tuple[int, int], EmuStream] = {}
        self._next_stream = 0x1000
        self._lock = threading.RLock()
        self._local = threading.local()
        self._running = threading.Event()
        self._running.set()
        self._captures: dict[int, Capture] = {}

    def report(self, message: str) -> None:
        self.misuse.append(message)

    # -- devices and streams
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

    def using_device(self, device: int | None) -> _Using:
        return _Using(self, device)

    def current_stream(self) -> int:
        return self._current().get(self.current_device(), 0)

    def _current(self) -> dict[int, int]:
        streams = getattr(self._local, "streams", None)
        if streams is None:
            streams = self._local.streams = {}
        return streams

    @contextlib.contextmanager
    def use_stream(self, handle: int):
        """Make ``handle`` the current stream of its device in this thread (``with s:``)."""
        device = self.stream(handle).device
        current = self._current()
        previous = current.get(device, 0)
        current[device] = handle
        try:
            yield handle
        finally:
            current[device] = previous

    def stream_handle(self, stream: Any) -> int:
        return cuda.stream_handle(stream, self.current_stream())

    def new_stream(self) -> int:
        """A new stream of the current device."""
        with self._lock:
            handle = self._next_stream
            self._next_stream += 0x10
            self._streams[(-1, handle)] = EmuStream(self, handle, self.current_device())
        return handle

    def stream(self, handle: int) -> EmuStream:
        """The stream behind ``handle`` (a default handle: the current device's)."""
        with self._lock:
            if handle in DEFAULT_STREAMS:
                key = (self.current_device(), 0)
                if key not in self._streams:
                    self._streams[key] = EmuStream(self, 0, key[0])
                return self._streams[key]
            s = self._streams.get((-1, handle))
        if s is None:
            raise RuntimeError(f"cudaErrorInvalidResourceHandle: unknown stream {handle:#x}")
        return s

    def stream_device(self, stream: int) -> int | None:
        """The device a stream belongs to; None for a default handle (the current device's)
        or an unknown one."""
        if stream in DEFAULT_STREAMS:
            return None
        with self._lock:
            s = self._streams.get((-1, stream))
        return None if s is None else s.device

    def is_capturing(self, stream: int) -> bool:
        return stream in self._captures

    @contextlib.contextmanager
    def capturing(self, stream: int, mode: str = "global"):
        """``stream`` is capturing a CUDA graph, begun by this thread in ``mode``, inside the
        block; yields the ``Capture``."""
        capture = self._captures[stream] = Capture(stream, mode)
        try:
            yield capture
        finally:
            self._captures.pop(stream, None)

    def thread_local_capture(self) -> bool:
        """``cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureModeThreadLocal)`` for the
        calling thread: other threads' captures no longer prohibit its calls."""
        self._local.capture_mode = "thread_local"
        return True

    def unsafe_call(self, name: str) -> None:
        """A potentially unsafe API call from this thread: refused, invalidating the captures
        that prohibit it, when CUDA's capture modes say so (module docstring)."""
        me, mode = threading.get_ident(), getattr(self._local, "capture_mode", "global")
        against = [c for c in list(self._captures.values())
                   if (c.thread == me and c.mode != "relaxed")
                   or (c.thread != me and mode == "global" and c.mode == "global")]
        if not against:
            return
        for c in against:
            c.invalidated = c.invalidated or f"{name} from thread {me} in {mode} mode"
        raise CudaError(CAPTURE_UNSUPPORTED, "cudaErrorStreamCaptureUnsupported",
                        "operation not permitted when stream is capturing")

    # -- timelines
    def gate(self) -> None:
        """Called by a stream before each item: wait while the device is paused."""
        if not self._running.wait(self.hang_timeout):
            self.report("the device stayed paused past the hang timeout")

    @contextlib.contextmanager
    def paused(self):
        """No stream runs anything while the block runs (the GPU is busy); then all resume."""
        self._running.clear()
        try:
            yield
        finally:
            self._running.set()

    def stall(self, stream: int) -> Any:
        """Block ``stream`` until the returned function is called (a kernel that spins)."""
        go = threading.Event()
        self.stream(stream).submit(lambda: self._await(go, "a stall never released"))
        return go.set

    def record_event(self, stream: int) -> EmuEvent:
        """A new event of the current device, recorded on ``stream``."""
        event = EmuEvent(self.current_device(), self)
        s = self.stream(stream)
        if s.device != event.device:
            raise RuntimeError(f"cudaErrorInvalidResourceHandle: an event of device "
                               f"{event.device} recorded on a stream of device {s.device}")
        event._flag.clear()
        s.submit(event._flag.set)
        return event

    def wait_event(self, stream: int, event: EmuEvent) -> None:
        self.stream(stream).submit(lambda: self._await(event._flag, "a stream waits for an "
                                                                    "event"))

    def run_on(self, stream: int, fn: Any) -> None:
        """Run ``fn`` on ``stream`` and block the host until it has (a synchronous copy)."""
        done = threading.Event()

        def step() -> None:
            try:
                fn()
            finally:
                done.set()

        self.stream(stream).submit(step)
        self._await(done, "a synchronous copy")

    def _await(self, flag: threading.Event, what: str) -> None:
        if not flag.wait(self.hang_timeout):
            raise Misuse(f"{what} that never completes (a GPU would hang)")

    # -- memory
    def alloc_device(self, nbytes: int, stream: int) -> DeviceBuffer:
        return DeviceBuffer(self.pool.lease(max(nbytes, 1), self.current_device(), "device"))

    def alloc_pinned(self, nbytes: int) -> np.ndarray:
        lease = self.pool.lease(max(nbytes, 1), None, "pinned")
        raw = (ctypes.c_char * max(nbytes, 1)).from_address(lease.block.base)
        raw.lease = lease  # the view below keeps it; the block is free once the view is gone
        return np.frombuffer(raw, np.uint8)[:nbytes]

    def pointer_device(self, ptr: int) -> int | None:
        b = self.pool.find(ptr, 1)
        return b.device if b is not None and b.kind == "device" else None

    def _check(self, ptr: int, nbytes: int, what: str) -> None:
        if nbytes and self.pool.find(ptr, nbytes) is None:
            raise RuntimeError(f"cudaErrorInvalidValue: {what} {ptr:#x}+{nbytes} is not inside "
                               "any allocation")

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._check(dst, nbytes, "memcpy destination")
        self._check(src, nbytes, "memcpy source")
        self.stream(stream).submit(lambda: ctypes.memmove(dst, src, nbytes))

    def copy(self, dst: Any, src: Any, stream: int) -> None:
        target, source = cai_view(dst), cai_view(src)
        self.stream(stream).submit(lambda: np.copyto(target, source.reshape(target.shape)))

    def reduce_slots(self, op: str, src: int, dst: int, slots: int, count: int,
                     dtype: np.dtype, stream: int) -> None:
        dtype = np.dtype(dtype)
        for ptr, n in ((src, slots * count), (dst, count)):
            if ptr == 0:  # what wrapping a NULL pointer in CuPy does
                raise RuntimeError("cudaErrorInvalidValue: cudaPointerGetAttributes(NULL)")
            self._check(ptr, n * dtype.itemsize, "reduce_slots buffer")
        ufunc = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum,
                 "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}[op]

        def run():
            a = host_view(src, slots * count * dtype.itemsize, dtype).reshape(slots, count)
            out = host_view(dst, count * dtype.itemsize, dtype)
            cuda.fold_slots(ufunc, a, out)

        self.stream(stream).submit(run)

    def empty(self, shape: tuple, dtype: np.dtype, device: int) -> FakeDeviceArray:
        """Uninitialised: a reused block still holds what its last owner left there."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        lease = self.pool.lease(nbytes, device, "device") if nbytes else None
        view = np.empty(shape, dtype) if lease is None else np.ndarray(
            shape, dtype, buffer=host_view(lease.block.base, nbytes))
        return FakeDeviceArray(None, self, device, _view=view, _lease=lease)

    def device_identity(self, device: int) -> str:
        return f"emulated:{device:04x}"

    def nccl(self) -> Any:
        raise ImportError("this emulation has no NCCL")

    def nccl_bindings(self) -> Any:
        raise ImportError("this emulation has no NCCL")

    # -- for tests
    def synchronize(self, timeout: float = 60.0) -> None:
        """Block until every stream ran everything queued so far."""
        deadline = time.monotonic() + timeout
        with self._lock:
            streams = list(self._streams.values())
        for s in streams:
            done = threading.Event()
            s.submit(done.set)
            if not done.wait(max(0.0, deadline - time.monotonic())):
                raise Misuse(f"stream {s.handle:#x} did not drain within {timeout} s")

    def close(self) -> None:
        self._running.set()
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        for s in streams:
            s.submit(None)
