"""The one seam through which gpucoll touches CUDA: devices, streams, events, memory, NCCL.

Everything the NCCL backend, the staged ring and the device-array adapters need from CuPy goes
through the small ``Runtime`` interface below, with pointers and streams as plain ints. The real
implementation (``CupyRuntime``) calls CuPy's runtime bindings; tests install an emulation with
``use_runtime`` so the same backend code runs on machines without a GPU. Nothing here imports
CuPy until a method is called, so ``import gpucoll`` never loads a CUDA library.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np

# cudaError_t values CuPy's runtime.eventQuery returns rather than raises
CUDA_SUCCESS = 0
CUDA_ERROR_NOT_READY = 600
# cudaStream_t handles of the default streams (also the CUDA array interface's stream codes)
STREAM_LEGACY = 1
STREAM_PER_THREAD = 2


class Event(Protocol):
    """A recorded CUDA event: ``done()`` queries, ``synchronize()`` blocks the host."""

    ptr: int

    def done(self) -> bool: ...

    def synchronize(self) -> None: ...


class Runtime(Protocol):
    """What gpucoll asks of CUDA; every pointer and stream is an int handle."""

    name: str

    def available(self) -> tuple[bool, str]: ...

    def device_count(self) -> int: ...

    def set_device(self, device: int) -> None: ...

    def current_device(self) -> int: ...

    def current_stream(self) -> int: ...

    def stream_handle(self, stream: Any) -> int: ...

    def new_stream(self) -> int: ...

    def record_event(self, stream: int) -> Event: ...

    def wait_event(self, stream: int, event: Event) -> None: ...

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None: ...

    def alloc_device(self, nbytes: int, stream: int) -> Any: ...

    def alloc_pinned(self, nbytes: int) -> np.ndarray: ...

    def pointer_device(self, ptr: int) -> int | None: ...

    def reduce_slots(self, op: str, src: int, dst: int, slots: int, count: int,
                     dtype: np.dtype, stream: int) -> None: ...

    def empty(self, shape: tuple, dtype: np.dtype, device: int) -> Any: ...

    def nccl(self) -> Any: ...


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


class _CupyEvent:
    """A cudaEvent_t recorded once; destroyed with the object (timing disabled: cheaper)."""

    __slots__ = ("ptr", "_rt")

    def __init__(self, rt: Any, stream: int):
        self._rt = rt
        self.ptr = rt.eventCreateWithFlags(rt.eventDisableTiming)
        rt.eventRecord(self.ptr, stream)

    def done(self) -> bool:
        status = self._rt.eventQuery(self.ptr)
        if status == CUDA_ERROR_NOT_READY:
            return False
        if status != CUDA_SUCCESS:
            self._rt.check_status(status)
        return True

    def synchronize(self) -> None:
        self._rt.eventSynchronize(self.ptr)

    def __del__(self):
        with contextlib.suppress(Exception):
            self._rt.eventDestroy(self.ptr)


class CupyRuntime:
    """The real runtime: CuPy's CUDA runtime bindings and ``cupy.cuda.nccl``."""

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
        import cupy

        cupy.cuda.Device(device).use()

    def current_device(self) -> int:
        return int(_runtime().getDevice())

    def current_stream(self) -> int:
        import cupy

        return int(cupy.cuda.get_current_stream().ptr)

    def stream_handle(self, stream: Any) -> int:
        if stream is None:
            return self.current_stream()
        return stream_handle(stream, 0)

    def new_stream(self) -> int:
        rt = _runtime()
        return int(rt.streamCreateWithFlags(rt.streamNonBlocking))

    def record_event(self, stream: int) -> Event:
        return _CupyEvent(_runtime(), stream)

    def wait_event(self, stream: int, event: Event) -> None:
        _runtime().streamWaitEvent(stream, event.ptr, 0)

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        rt = _runtime()
        rt.memcpyAsync(dst, src, nbytes, rt.memcpyDefault, stream)

    def alloc_device(self, nbytes: int, stream: int) -> Any:
        """Memory from CuPy's pool, allocated while ``stream`` is current so that its reuse is
        ordered after the work queued on that stream."""
        import cupy

        with _as_cupy_stream(stream):
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

        dtype = np.dtype(dtype)
        with _as_cupy_stream(stream):
            a = _wrap(cupy, src, (slots, count), dtype)
            out = _wrap(cupy, dst, (count,), dtype)
            _CUPY_UFUNCS[op](cupy).reduce(a, axis=0, out=out)

    def empty(self, shape: tuple, dtype: np.dtype, device: int) -> Any:
        import cupy

        with cupy.cuda.Device(device):
            return cupy.empty(shape, dtype=dtype)

    def nccl(self) -> Any:
        from cupy.cuda import nccl

        return nccl


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


def _wrap(cupy: Any, ptr: int, shape: tuple, dtype: np.dtype) -> Any:
    nbytes = int(np.prod(shape)) * dtype.itemsize
    mem = cupy.cuda.UnownedMemory(ptr, nbytes, None)
    return cupy.ndarray(shape, dtype=dtype, memptr=cupy.cuda.MemoryPointer(mem, 0))


class _StreamHandle:
    """A borrowed stream for CuPy's ``Stream.from_external`` (the CUDA stream protocol)."""

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


def _as_cupy_stream(ptr: int) -> Any:
    import cupy

    return cupy.cuda.Stream.from_external(_StreamHandle(ptr))


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
