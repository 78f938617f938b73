"""Device memory: CuPy arrays, any ``__cuda_array_interface__`` object, CUDA DLPack tensors.

No copies: an ``ArrayRef`` points at the caller's memory. For CAI v3 objects other than CuPy's
the producer ``stream`` is kept so the backend can order its work after it (CuPy arrays carry
no producer stream: CuPy orders work by the current stream, and so does gpucoll). New arrays
come back as the caller's type: CuPy, torch and Numba natively, anything else as CuPy arrays.
CuPy is imported only when an object needs it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from gpucoll import cuda
from gpucoll.arrays import Adapter, ArrayRef, register_adapter

_DLPACK_CUDA = (2, 13)  # DLDeviceType kDLCUDA, kDLCUDAManaged


_LIBRARIES: dict[type, str] = {}
_MISSING = object()
_OWN_ALLOCATORS = ("torch", "numba")  # libraries whose new arrays ``empty`` makes natively


def _library(obj: Any) -> str:
    """The top-level package defining ``obj``'s type ("cupy", "torch", ...), cached per type."""
    kind = type(obj)
    lib = _LIBRARIES.get(kind)
    if lib is None:
        lib = _LIBRARIES[kind] = kind.__module__.split(".", 1)[0]
    return lib


def _dlpack_on_cuda(obj: Any) -> bool:
    device = getattr(obj, "__dlpack_device__", None)
    if device is None or not hasattr(obj, "__dlpack__"):
        return False
    try:
        return int(device()[0]) in _DLPACK_CUDA
    except Exception:
        return False


def _dtype(obj: Any, cai: dict) -> np.dtype:
    """The element type: the object's own ``dtype`` when NumPy understands it (keeps
    bfloat16 apart from other 2-byte void types), else the interface's typestr."""
    own = getattr(obj, "dtype", None)
    if isinstance(own, np.dtype):  # CuPy's, and most others': already the answer
        return own
    if own is not None:
        try:
            return np.dtype(own)
        except TypeError:
            pass
    return np.dtype(cai["typestr"])


def _c_contiguous(shape: tuple, strides: tuple | None, itemsize: int) -> bool:
    if strides is None:
        return True
    expected = itemsize
    for dim, stride in zip(reversed(shape), reversed(strides), strict=True):
        if dim > 1 and stride != expected:
            return False
        expected *= dim
    return True


class DeviceAdapter(Adapter):
    kind = "device"

    def claims(self, obj: Any) -> bool:
        return hasattr(obj, "__cuda_array_interface__") or _dlpack_on_cuda(obj)

    def ref_if_claimed(self, obj: Any, name: str, copy: bool) -> ArrayRef | None:
        # the interface is often a property building a new dict: read it once, not three times
        cai = getattr(obj, "__cuda_array_interface__", _MISSING)
        if cai is not _MISSING:
            return self._ref(obj, obj, cai, name, copy)
        return self.ref(obj, name, copy=copy) if _dlpack_on_cuda(obj) else None

    def ref(self, obj: Any, name: str, *, copy: bool) -> ArrayRef:
        source = obj
        if not hasattr(obj, "__cuda_array_interface__"):  # DLPack only: view it through CuPy
            import cupy

            obj = cupy.from_dlpack(obj)
        return self._ref(source, obj, obj.__cuda_array_interface__, name, copy)

    def _ref(self, source: Any, obj: Any, cai: dict, name: str, copy: bool) -> ArrayRef:
        """The reference to ``source``, whose CAI view is ``obj`` with interface ``cai``."""
        shape = tuple(cai["shape"])
        dtype = _dtype(obj, cai)
        strides = cai.get("strides")
        if strides is not None and not _c_contiguous(shape, strides, dtype.itemsize):
            if not copy:
                raise ValueError(
                    f"{name} must be C-contiguous; got shape {shape} with strides "
                    f"{strides} (pass a contiguous copy)"
                )
            return self.ref(_contiguous_copy(obj), name, copy=False)
        ptr = int(cai["data"][0])
        count = math.prod(shape)
        stream = None if _library(obj) == "cupy" else cai.get("stream")
        return ArrayRef(source, "device", ptr, shape, dtype, count, count * dtype.itemsize,
                        None, _device_of(obj, ptr), stream)

    def empty_ref(self, ref: ArrayRef, shape: tuple[int, ...]) -> ArrayRef:
        if _library(ref.array) in _OWN_ALLOCATORS:  # their arrays carry their own stream
            return super().empty_ref(ref, shape)
        rt = cuda.runtime()
        device = ref.device if ref.device is not None else rt.current_device()
        new = rt.empty(shape, ref.dtype, device)
        # fresh memory from the runtime (CuPy's pool): nothing produced it, so no stream
        count = math.prod(shape)
        return ArrayRef(new, "device", _pointer(new), shape, ref.dtype, count,
                        count * ref.dtype.itemsize, None, device, None)

    def empty(self, ref: ArrayRef, shape: tuple[int, ...]) -> Any:
        lib, like = _library(ref.array), ref.array
        if lib == "torch":
            import torch

            return torch.empty(shape, dtype=like.dtype, device=like.device)
        if lib == "numba":
            from numba import cuda as numba_cuda

            return numba_cuda.device_array(shape, dtype=ref.dtype)
        device = ref.device if ref.device is not None else cuda.runtime().current_device()
        return cuda.runtime().empty(shape, ref.dtype, device)

    def new(self, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        rt = cuda.runtime()
        return rt.empty(tuple(shape), np.dtype(dtype), rt.current_device())

    def view(self, ref: ArrayRef, start: int, count: int) -> ArrayRef:
        size = ref.dtype.itemsize
        return ArrayRef(ref.array, "device", ref.ptr + start * size, (count,), ref.dtype, count,
                        count * size, None, ref.device, ref.stream)

    def write_back(self, ref: ArrayRef, obj: Any) -> None:
        import cupy

        if _library(obj) == "torch":
            obj.copy_(ref.array.reshape(obj.shape))
            return
        target = cupy.asarray(obj)
        target[...] = cupy.asarray(ref.array).reshape(target.shape)


def _pointer(new: Any) -> int:
    """The device address of an array the runtime just allocated."""
    if _library(new) == "cupy":
        return int(new.data.ptr)  # cheaper than building CuPy's interface dict
    return int(new.__cuda_array_interface__["data"][0])


def _contiguous_copy(obj: Any) -> Any:
    if _library(obj) == "torch":
        return obj.contiguous()
    import cupy

    return cupy.ascontiguousarray(cupy.asarray(obj))


def _device_of(obj: Any, ptr: int) -> int | None:
    """The device ordinal holding ``ptr`` (CuPy arrays know it; else ask CUDA)."""
    device = getattr(obj, "device", None)
    if device is None:
        return cuda.runtime().pointer_device(ptr) if ptr else None
    ident = getattr(device, "id", None)
    if isinstance(ident, int):
        return ident
    index = getattr(device, "index", None)  # torch.device
    if isinstance(index, int):
        return index
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    return cuda.runtime().pointer_device(ptr) if ptr else None


register_adapter(DeviceAdapter(), priority=10)
