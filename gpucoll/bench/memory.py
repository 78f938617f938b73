"""Where benchmark buffers live (NumPy host arrays or CuPy device arrays) and how loops are timed.

Host loops are timed with the monotonic clock around the calls, which return once done. Device
loops are timed with CUDA events recorded on the current stream around the enqueued calls, then
one synchronize: the time the GPU took, as nccl-tests measures it, not the time to enqueue.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from gpucoll import cuda


class HostMemory:
    """NumPy buffers; operations complete when the call returns."""

    kind = "host"

    def empty(self, count: int, dtype: np.dtype) -> np.ndarray:
        return np.empty(count, dtype)

    def write(self, dst: np.ndarray, src: np.ndarray) -> None:
        np.copyto(dst, src)

    def fill(self, dst: np.ndarray, value: float) -> None:
        dst.fill(value)

    def read(self, src: np.ndarray) -> np.ndarray:
        return np.asarray(src)

    def synchronize(self) -> None:
        pass

    def label(self) -> str:
        return "cpu"

    def timer(self) -> HostTimer:
        return HostTimer()


class HostTimer:
    """Wall time of a loop of calls that finish before they return."""

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def stop(self) -> float:
        """Seconds since ``start()``."""
        return time.perf_counter() - self._t0


class DeviceMemory:
    """CuPy buffers on the current device; work is ordered on the current stream."""

    kind = "device"

    def __init__(self) -> None:
        import cupy

        self.cupy = cupy

    def empty(self, count: int, dtype: np.dtype) -> Any:
        if np.dtype(dtype).name == "bfloat16":
            raise ValueError("datatype bfloat16: CuPy has no bfloat16 arrays; use --memory host")
        return self.cupy.empty(count, dtype)

    def write(self, dst: Any, src: np.ndarray) -> None:
        dst.set(np.ascontiguousarray(src))

    def fill(self, dst: Any, value: float) -> None:
        dst.fill(value)

    def read(self, src: Any) -> np.ndarray:
        return self.cupy.asnumpy(src)

    def synchronize(self) -> None:
        self.cupy.cuda.get_current_stream().synchronize()

    def label(self) -> str:
        dev = self.cupy.cuda.Device()
        name = self.cupy.cuda.runtime.getDeviceProperties(dev.id)["name"]
        return f"cuda:{dev.id} [{dev.pci_bus_id}] {name.decode(errors='replace')}"

    def timer(self) -> CudaEventTimer:
        return CudaEventTimer(self.cupy)


class CudaEventTimer:
    """GPU time between two events on the current stream."""

    def __init__(self, cupy: Any) -> None:
        self.cupy = cupy
        self._start = cupy.cuda.Event()
        self._end = cupy.cuda.Event()

    def start(self) -> None:
        self._start.record(self.cupy.cuda.get_current_stream())

    def stop(self) -> float:
        """Seconds of GPU time since ``start()``; waits for the recorded work to finish."""
        self._end.record(self.cupy.cuda.get_current_stream())
        self._end.synchronize()
        return self.cupy.cuda.get_elapsed_time(self._start, self._end) / 1e3


def device_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device (never raises)."""
    return cuda.runtime().available()[0]


def memory_for(kind: str) -> HostMemory | DeviceMemory:
    """The buffers for ``--memory host|device``."""
    if kind == "device":
        if not device_available():
            raise ValueError("--memory device needs CuPy and a CUDA device; none is visible")
        return DeviceMemory()
    return HostMemory()
