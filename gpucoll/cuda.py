"""The one seam through which gpucoll touches CUDA: devices, streams, events, memory, NCCL.

Everything the NCCL backend, the staged ring and the device-array adapters need from CuPy (and
from nccl4py, NVIDIA's NCCL binding) goes through the small ``Runtime`` interface below, with
pointers and streams as plain ints. The real implementation (``CupyRuntime``) calls CuPy; tests
install an emulation with ``use_runtime`` so the same backend code runs without a GPU. Nothing
here imports CuPy or nccl4py until a method is called, so ``import gpucoll`` never loads CUDA.

Two CUDA rules shape the interface. The current device and the current stream belong to a
thread, and an event belongs to the device that was current when it was made: code that records
events or allocates for a communicator runs inside ``using_device(comm_device)``. And memory
freed to a pool (CuPy's device pool, its pinned pool) can be handed out again at once, while
work queued on a stream may still read or write it: ``hold(event, ...)`` keeps objects alive
until the event recorded after their last use has completed.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np

# cudaStream_t handles of the default streams (also the CUDA array interface's stream codes)
STREAM_LEGACY = 1
STREAM_PER_THREAD = 2


class Event(Protocol):
    """A recorded CUDA event (``cupy.cuda.Event``): ``done`` queries it, ``synchronize()``
    blocks the host until it has completed."""

    @property
    def done(self) -> bool: ...

    def synchronize(self) -> None: ...


class Runtime(Protocol):
    """What gpucoll asks of CUDA; every pointer and stream is an int handle."""

    name: str

    def available(self) -> tuple[bool, str]: ...

    def device_count(self) -> int: ...

    def set_device(self, device: int) -> None: ...

    def current_device(self) -> int: ...

    def using_device(self, device: int | None) -> contextlib.AbstractContextManager: ...

    def current_stream(self) -> int: ...

    def stream_handle(self, stream: Any) -> int: ...

    def is_capturing(self, stream: int) -> bool: ...

    def stream_device(self, stream: int) -> int | None: ...

    def record_event(self, stream: int) -> Event: ...

    def wait_event(self, stream: int, event: Event) -> None: ...

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None: ...

    def alloc_device(self, nbytes: int, stream: int) -> Any: ...

    def alloc_pinned(self, nbytes: int) -> np.ndarray: ...

    def pointer_device(self, ptr: int) -> int | None: ...

    def reduce_slots(self, op: str, src: int, dst: int, slots: int, count: int,
                     dtype: np.dtype, stream: int) -> None: ...

    def empty(self, shape: tuple, dtype: np.dtype, device: int) -> Any: ...

    def copy(self, dst: Any, src: Any, stream: int) -> None: ...

    def device_identity(self, device: int) -> str: ...

    def nccl(self) -> Any: ...

    def nccl_bindings(self) -> Any: ...

    def stall(self, stream: int) -> Callable[[], None]: ...

    def thread_local_capture(self) -> bool: ...


# cudaError_t codes (CUDA runtime API) of a call refused because a stream is capturing a graph:
# cudaErrorStreamCaptureUnsupported (900) ... cudaErrorStreamCaptureWrongThread (908)
CAPTURE_ERRORS = frozenset(range(900, 909))


def refused_by_capture(exc: BaseException) -> bool:
    """Whether a CUDA call failed only because a stream is capturing a graph (not because the
    device failed): CuPy's ``CUDARuntimeError`` carries the ``cudaError_t`` as ``status``."""
    return getattr(exc, "status", None) in CAPTURE_ERRORS


_thread = threading.local()


def own_thread() -> None:
    """Mark the calling thread as one of gpucoll's own (the NCCL watchdog, the worker that runs
    asynchronous calls): before the first event it queries, it switches itself to CUDA's
    thread-local capture mode (``Runtime.thread_local_capture``). In the default global mode
    an event query from any thread fails and invalidates a graph that another thread captures
    in global mode (``cudaStreamBeginCapture``'s and torch.cuda.graph's default). Touches no
    CUDA itself: a thread that never queries an event never loads it."""
    _thread.own = True


def _isolate() -> None:
    _thread.isolated = True
    try:
        runtime().thread_local_capture()
    except Exception:  # noqa: BLE001 - no CUDA here: a query refused by capture is not done
        pass


def event_done(event: Any) -> bool:
    """Whether ``event``'s work has completed; False also when CUDA refused the query because a
    graph is being captured (the work may still run). A device failure raises."""
    if getattr(_thread, "own", False) and not getattr(_thread, "isolated", False):
        _isolate()
    try:
        return bool(event.done)
    except Exception as exc:
        if refused_by_capture(exc):
            return False
        raise


def stream_handle(stream: Any, current: int) -> int:
    """The cudaStream_t int of ``stream``: None -> ``current``; an int, an object with ``.ptr``
    (CuPy, torch's ``cuda_stream``) or the CUDA stream protocol ``__cuda_stream__``."""
    if stream is None:
        return current
    if isinstance(stream, int) and not isinstance(stream, bool):
        return stream
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        return int(proto()[1])
    for attr in ("ptr", "cuda_stream", "handle"):
        value = getattr(stream, attr, None)
        if isinstance(value, int):
            return value
    raise TypeError(
        f"stream={stream!r} is not a CUDA stream: expected None, an int handle, a cupy.cuda.Stream "
        "or an object with __cuda_stream__"
    )


@functools.lru_cache(maxsize=256)
def cupy_view(ptr: int, count: int, dtype: np.dtype, device: int) -> Any:
    """A CuPy array of ``count`` elements at device address ``ptr``, owning nothing (how the
    runtime runs CuPy's kernels on memory it is given as an address). Building one calls no
    CUDA function; the same four values give the same view (it holds no memory, so reusing it
    is safe)."""
    import cupy

    mem = cupy.cuda.UnownedMemory(ptr, count * dtype.itemsize, None, device_id=device)
    return cupy.ndarray((count,), dtype=dtype, memptr=cupy.cuda.MemoryPointer(mem, 0))


# ---- keeping memory alive until the device is done with it ------------------------------

_held: collections.deque = collections.deque()
_held_lock = threading.Lock()


def hold(event: Any, *objects: Any) -> None:
    """Keep ``objects`` (arrays, pinned buffers, pool blocks) referenced until ``event`` has
    completed, so that no pool hands their memory out while queued work still uses it. Each
    call lets go of everything whose event has completed, wherever it is held: events of other
    streams complete out of order, and one that never does must not pin what comes after."""
    with _held_lock:
        if _held and not _done(_held[0][0]):
            kept = [entry for entry in _held if not _done(entry[0])]
            _held.clear()
            _held.extend(kept)
        while _held and _done(_held[0][0]):
            _held.popleft()
        _held.append((event, objects))


def _done(event: Any) -> bool:
    """Whether what ``event`` guards may be let go: its work completed, or the device failed
    (nothing it queued will run any more). A query refused by a graph capture is not done."""
    try:
        return event_done(event)
    except Exception:  # noqa: BLE001 - a failed device
        return True


# ---- the real runtime --------------------------------------------------------------------

class _DeviceGuard:
    """Make ``device`` current for a block and restore the caller's device afterwards."""

    __slots__ = ("_rt", "_device", "_previous")

    def __init__(self, rt: Any, device: int | None):
        self._rt, self._device, self._previous = rt, device, None

    def __enter__(self) -> None:
        if self._device is not None:
            previous = self._rt.getDevice()
            if previous != self._device:
                self._rt.setDevice(self._device)
                self._previous = previous

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            self._rt.setDevice(self._previous)


_SPIN_SOURCE = r"""
extern "C" __global__ void gpucoll_spin(volatile int* flag, long long max_cycles) {
    long long start = clock64();
    while (*flag == 0 && clock64() - start < max_cycles) { }
}
"""
_SPIN_MAX_CYCLES = 60 * 2_000_000_000  # about a minute: a stall nobody releases ends anyway


class CupyRuntime:
    """The real runtime: CuPy for CUDA, nccl4py (``nccl.core``) for NCCL."""

    name = "cupy"

    def available(self) -> tuple[bool, str]:
        """Whether CuPy can reach at least one device, and why not (never raises).

        Asks CuPy's runtime binding (``cupy.cuda.runtime`` is ``cupy_backends``'), which loads
        in milliseconds, so that machines without a GPU do not pay for importing all of CuPy.
        """
        try:
            from cupy_backends.cuda.api import runtime as rt
        except Exception as exc:  # ImportError, or a broken CUDA install
            return False, f"CuPy is not importable ({type(exc).__name__}: {exc})"
        try:
            count = rt.getDeviceCount()
        except Exception as exc:
            return False, f"CUDA has no usable device ({exc})"
        if count < 1:
            return False, "CUDA reports 0 devices"
        return True, f"{count} CUDA device(s)"

    def device_count(self) -> int:
        ok, _ = self.available()
        if not ok:
            return 0
        return int(_runtime().getDeviceCount())

    def set_device(self, device: int) -> None:
        _runtime().setDevice(device)

    def current_device(self) -> int:
        return int(_runtime().getDevice())

    def using_device(self, device: int | None) -> _DeviceGuard:
        return _DeviceGuard(_runtime(), device)

    def current_stream(self) -> int:
        import cupy

        return int(cupy.cuda.get_current_stream().ptr)

    def stream_handle(self, stream: Any) -> int:
        if stream is None:
            return self.current_stream()
        return stream_handle(stream, 0)

    def is_capturing(self, stream: int) -> bool:
        return bool(_runtime().streamIsCapturing(stream))

    def stream_device(self, stream: int) -> int | None:
        """The device of stream handle ``stream`` (``cuStreamGetDevice``, CUDA 12.8 drivers
        on); None for a default stream (the current device's) or where the driver cannot
        say."""
        if stream in (0, STREAM_LEGACY, STREAM_PER_THREAD):
            return None
        try:
            from cuda.bindings import driver

            err, device = driver.cuStreamGetDevice(driver.CUstream(stream))
        except Exception:  # noqa: BLE001 - no cuda-bindings, or a binding without the call
            return None
        return int(device) if err == driver.CUresult.CUDA_SUCCESS else None

    def record_event(self, stream: int) -> Event:
        import cupy

        event = cupy.cuda.Event(disable_timing=True)
        event.record(_cupy_stream(stream))
        return event

    def wait_event(self, stream: int, event: Event) -> None:
        _cupy_stream(stream).wait_event(event)

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        rt = _runtime()
        rt.memcpyAsync(dst, src, nbytes, rt.memcpyDefault, stream)

    def alloc_device(self, nbytes: int, stream: int) -> Any:
        """Memory from CuPy's pool, allocated while ``stream`` is current so that its reuse is
        ordered after the work queued on that stream."""
        import cupy

        with _cupy_stream(stream):
            return cupy.cuda.alloc(max(nbytes, 1))

    def alloc_pinned(self, nbytes: int) -> np.ndarray:
        import cupy

        mem = cupy.cuda.alloc_pinned_memory(max(nbytes, 1))
        return np.frombuffer(mem, dtype=np.uint8, count=nbytes)

    def pointer_device(self, ptr: int) -> int | None:
        try:
            attrs = _runtime().pointerGetAttributes(ptr)
        except Exception:
            return None
        # cudaMemoryType: 2 device, 3 managed (1 is pinned host memory, 0 unregistered)
        return int(attrs.device) if attrs.type in (2, 3) else None

    def reduce_slots(self, op: str, src: int, dst: int, slots: int, count: int,
                     dtype: np.dtype, stream: int) -> None:
        """dst[:count] = reduce(op) over src viewed as (slots, count), on ``stream``."""
        import cupy

        if count == 0:  # a zero-size array's pointer is NULL: there is nothing to wrap
            return
        dtype = np.dtype(dtype)
        device = self.current_device()
        with _cupy_stream(stream):
            a = cupy_view(src, slots * count, dtype, device).reshape(slots, count)
            fold_slots(_CUPY_UFUNCS[op](cupy), a, cupy_view(dst, count, dtype, device))

    def empty(self, shape: tuple, dtype: np.dtype, device: int) -> Any:
        import cupy

        with cupy.cuda.Device(device):
            return cupy.empty(shape, dtype=dtype)

    def copy(self, dst: Any, src: Any, stream: int) -> None:
        """Copy device array ``src`` into device array ``dst`` (any strides) on ``stream``."""
        import cupy

        with _cupy_stream(stream):
            target = cupy.asarray(dst)
            target[...] = cupy.asarray(src).reshape(target.shape)

    def device_identity(self, device: int) -> str:
        return str(_runtime().deviceGetPCIBusId(device))

    def nccl(self) -> Any:
        import nccl.core

        return nccl.core

    def nccl_bindings(self) -> Any:
        import nccl.bindings.nccl

        return nccl.bindings.nccl

    def stall(self, stream: int) -> Callable[[], None]:
        """Occupy ``stream`` with a kernel that spins until the returned function is called
        (at most about a minute): work queued after it on the stream waits."""
        import cupy

        kernel = cupy.RawKernel(_SPIN_SOURCE, "gpucoll_spin")
        with _cupy_stream(stream):  # the flag is zeroed (a memset) before the kernel reads it
            flag = cupy.zeros(1, cupy.int32)
            kernel((1,), (1,), (flag, np.int64(_SPIN_MAX_CYCLES)))
        side = cupy.cuda.Stream(non_blocking=True)
        one = np.ones(1, np.int32)

        def release() -> None:
            # A copy, not a kernel: under CUDA's lazy module loading (the default since 12.2)
            # the first launch of a kernel waits for the spinning one, which would never end
            rt = _runtime()
            rt.memcpyAsync(flag.data.ptr, one.ctypes.data, 4, rt.memcpyHostToDevice, side.ptr)
            side.synchronize()

        return release

    def thread_local_capture(self) -> bool:
        """Put the calling thread in ``cudaStreamCaptureModeThreadLocal``, so that its event
        queries neither fail nor invalidate a graph another thread captures in the default
        global mode (CUDA runtime API, cudaThreadExchangeStreamCaptureMode: in global mode a
        thread is "prohibited from potentially unsafe API calls" while any other thread
        captures in global mode; in thread-local mode only its own captures count). The
        driver's call, so that it holds whichever CUDA runtime the process loaded. False
        where cuda-bindings is missing."""
        try:
            from cuda.bindings import driver
        except ImportError:
            return False
        mode = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        err, _previous = driver.cuThreadExchangeStreamCaptureMode(mode)
        return err == driver.CUresult.CUDA_SUCCESS


def fold_slots(ufunc: Any, slots: Any, out: Any) -> None:
    """``out`` = ``ufunc`` folded over the rows of ``slots`` in row (rank) order, by binary
    calls with ``out=``: CuPy's ufuncs have no ``reduce`` for most operations (min, max, the
    bitwise ones), and a rank-order fold is what the host ring computes too."""
    out[...] = slots[0]
    for row in slots[1:]:
        ufunc(out, row, out=out)


_CUPY_UFUNCS = {
    "sum": lambda cp: cp.add,
    "avg": lambda cp: cp.add,
    "prod": lambda cp: cp.multiply,
    "min": lambda cp: cp.minimum,
    "max": lambda cp: cp.maximum,
    "band": lambda cp: cp.bitwise_and,
    "bor": lambda cp: cp.bitwise_or,
    "bxor": lambda cp: cp.bitwise_xor,
}


def _runtime() -> Any:
    from cupy.cuda import runtime

    return runtime


_streams: dict[tuple[int, int], Any] = {}


def _cupy_stream(ptr: int) -> Any:
    """CuPy's ``ExternalStream`` for handle ``ptr`` on the current device, made once per pair
    (CuPy 14 deprecates the class, with a warning per object, for ``Stream.from_external``)."""
    device = _runtime().getDevice()
    stream = _streams.get((ptr, device))
    if stream is None:
        import warnings

        import cupy

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            stream = cupy.cuda.ExternalStream(ptr, device)
        if len(_streams) >= 256:
            _streams.clear()
        _streams[(ptr, device)] = stream
    return stream


_lock = threading.Lock()
_current: Runtime | None = None


def runtime() -> Runtime:
    """The runtime in use: CuPy's unless a test installed another with ``use_runtime``."""
    global _current
    if _current is None:
        with _lock:
            if _current is None:
                _current = CupyRuntime()
    return _current


def set_runtime(rt: Runtime | None) -> Runtime | None:
    """Install ``rt`` (None: back to CuPy's) for the whole process; returns the previous one."""
    global _current
    with _lock:
        previous, _current = _current, rt
    return previous


@contextlib.contextmanager
def use_runtime(rt: Runtime) -> Iterator[Runtime]:
    """Run a block with ``rt`` installed, restoring the previous runtime afterwards."""
    previous = set_runtime(rt)
    try:
        yield rt
    finally:
        set_runtime(previous)
