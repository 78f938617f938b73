"""Host memory: NumPy arrays and anything NumPy can view without copying.

That is an object with the buffer protocol (bytearray, memoryview, array.array, ...),
``__array_interface__``, or DLPack on the CPU (a CPU torch tensor). bfloat16 arrays are NumPy
arrays of ml_dtypes' dtype and need nothing special.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gpucoll.arrays import Adapter, ArrayRef

_DLPACK_CPU = 1  # DLDeviceType kDLCPU


def _dlpack_on_cpu(obj: Any) -> bool:
    device = getattr(obj, "__dlpack_device__", None)
    if device is None or not hasattr(obj, "__dlpack__"):
        return False
    try:
        return int(device()[0]) == _DLPACK_CPU
    except Exception:
        return False


def _has_buffer(obj: Any) -> bool:
    try:
        memoryview(obj).release()
    except TypeError:
        return False
    return True


def to_numpy(obj: Any) -> np.ndarray:
    """A NumPy view of a host array object (no copy)."""
    if isinstance(obj, np.ndarray):
        return obj
    if hasattr(obj, "__array_interface__"):
        return np.asarray(obj)
    if _dlpack_on_cpu(obj):
        return np.from_dlpack(obj)
    return np.asarray(memoryview(obj))


def _contiguous_copy(arr: np.ndarray, name: str) -> np.ndarray:
    """A C-contiguous copy of a strided view (read-only if the view is, so that an op which
    writes into its input refuses it before anything is sent). A copy larger than the memory
    available is a MemoryError naming the argument and the bytes, not an allocation that the
    kernel's out-of-memory killer ends."""
    need = arr.size * arr.itemsize
    if need > _available_bytes():
        raise _too_big(arr, name, need)
    try:
        copy = np.ascontiguousarray(arr)
    except MemoryError:
        raise _too_big(arr, name, need) from None
    if not arr.flags.writeable:
        copy.flags.writeable = False
    return copy


def _too_big(arr: np.ndarray, name: str, need: int) -> MemoryError:
    return MemoryError(
        f"{name} is a non-contiguous view (shape {arr.shape}, strides {arr.strides}) whose "
        f"contiguous copy would need {need} bytes ({need / 2**30:.1f} GiB), more than this "
        f"machine has available; pass a contiguous array, or a smaller one")


def _available_bytes() -> int:
    """MemAvailable from /proc/meminfo (no limit where it cannot be read)."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 1 << 62


class HostAdapter(Adapter):
    kind = "host"

    def claims(self, obj: Any) -> bool:
        if isinstance(obj, np.ndarray) or hasattr(obj, "__array_interface__"):
            return True
        if hasattr(obj, "__cuda_array_interface__"):
            return False
        return _dlpack_on_cpu(obj) or _has_buffer(obj)

    def ref(self, obj: Any, name: str, *, copy: bool) -> ArrayRef:
        if isinstance(obj, np.generic):
            raise TypeError(
                f"{name} is a NumPy scalar ({type(obj).__name__}), which is immutable: a "
                f"collective could not return its result in it; pass an array, e.g. "
                f"np.array([{name}]) or np.asarray({name}).reshape(1)")
        arr = to_numpy(obj)
        if not arr.flags.c_contiguous:
            if not copy:
                raise ValueError(
                    f"{name} must be C-contiguous; got shape {arr.shape} with strides "
                    f"{arr.strides} (pass np.ascontiguousarray({name}))"
                )
            arr = obj = _contiguous_copy(arr, name)
        flat = arr.ravel()  # a view: arr is C-contiguous
        return ArrayRef(obj, "host", None, arr.shape, arr.dtype, flat.size, arr.nbytes, flat)

    def empty(self, ref: ArrayRef, shape: tuple[int, ...]) -> np.ndarray:
        return np.empty(shape, ref.dtype)

    def new(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        return np.empty(shape, dtype)

    def view(self, ref: ArrayRef, start: int, count: int) -> ArrayRef:
        part = ref.host[start:start + count]
        return ArrayRef(part, "host", None, (count,), ref.dtype, count,
                        count * ref.dtype.itemsize, part)

    def write_back(self, ref: ArrayRef, obj: Any, stream: Any = None) -> None:
        np.copyto(to_numpy(obj), ref.host.reshape(ref.shape))
