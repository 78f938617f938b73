"""Device memory: CuPy arrays, any ``__cuda_array_interface__`` object, CUDA DLPack tensors.

No copies: an ``ArrayRef`` points at the caller's memory. For objects other than CuPy's the
producer ``stream`` is kept so that the backend orders its work after it: the stream a CUDA
array interface v3 names, and for torch tensors (whose interface is v2) torch's current stream.
CuPy arrays carry none: CuPy orders work by the current stream, and so does gpucoll.

Where the array interface cannot say what an object holds, DLPack does: torch describes
bfloat16 as the ambiguous ``<V2``, JAX offers no interface for it, and objects that speak only
DLPack are read straight from their DLPack capsule. A torch tensor that requires grad is used
through ``detach()`` (the same memory), as torch.distributed does. New arrays come back as the
caller's type: CuPy, torch and Numba natively, anything else as CuPy arrays. CuPy is imported
only when an object needs it.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

import numpy as np

from gpucoll import cuda
from gpucoll.arrays import Adapter, ArrayRef, dtype_from_name, register_adapter

_DLPACK_CUDA = (2, 13)  # DLDeviceType kDLCUDA, kDLCUDAManaged


_LIBRARIES: dict[type, str] = {}
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


def _interface(obj: Any) -> tuple[Any, dict | None]:
    """(the object to read, its ``__cuda_array_interface__``), or (obj, None) without one.

    torch raises RuntimeError for a tensor that requires grad: its ``detach()`` is the same
    memory. Other failures (JAX has no interface for bfloat16) leave DLPack to describe it.
    """
    try:
        return obj, obj.__cuda_array_interface__
    except AttributeError:
        return obj, None
    except RuntimeError:
        detach = getattr(obj, "detach", None)
        if detach is None:
            if _dlpack_on_cuda(obj):
                return obj, None
            raise
        view = detach()
        return view, view.__cuda_array_interface__
    except Exception:  # noqa: BLE001 - the interface refused this dtype: try DLPack
        if _dlpack_on_cuda(obj):
            return obj, None
        raise


def _dtype(obj: Any, cai: dict) -> np.dtype:
    """The element type: the object's own ``dtype`` when NumPy understands it, else the
    interface's typestr, else (``<V2`` and the like say only the size) DLPack's."""
    own = getattr(obj, "dtype", None)
    if isinstance(own, np.dtype):  # CuPy's, and most others': already the answer
        return own
    if own is not None:
        try:
            return np.dtype(own)
        except TypeError:
            pass
    dtype = np.dtype(cai["typestr"])
    if dtype.kind == "V" and _dlpack_on_cuda(obj):
        dtype = read_dlpack(obj).dtype
    return dtype


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
        return hasattr(type(obj), "__cuda_array_interface__") or \
            "__cuda_array_interface__" in getattr(obj, "__dict__", ()) or _dlpack_on_cuda(obj)

    def ref_if_claimed(self, obj: Any, name: str, copy: bool) -> ArrayRef | None:
        # the interface is often a property building a new dict: read it once, not three times
        view, cai = _interface(obj)
        if cai is not None:
            return self._ref(obj, view, cai, name, copy)
        return self._dlpack_ref(obj, name, copy) if _dlpack_on_cuda(obj) else None

    def ref(self, obj: Any, name: str, *, copy: bool) -> ArrayRef:
        ref = self.ref_if_claimed(obj, name, copy)
        if ref is None:
            raise TypeError(f"{name} is not a device array (no __cuda_array_interface__ and "
                            f"no CUDA DLPack), got {type(obj).__name__}")
        return ref

    def _ref(self, source: Any, obj: Any, cai: dict, name: str, copy: bool) -> ArrayRef:
        """The reference to ``source``, whose CAI view is ``obj`` with interface ``cai``."""
        shape = tuple(cai["shape"])
        dtype = _dtype(obj, cai)
        strides = cai.get("strides")
        ptr = int(cai["data"][0])
        lib = _library(obj)
        stream = None if lib == "cupy" else cai.get("stream")
        if stream is None and lib == "torch":
            stream = _torch_stream(obj)
        device = _device_of(obj, ptr)
        if strides is not None and not _c_contiguous(shape, strides, dtype.itemsize):
            if not copy:
                raise ValueError(
                    f"{name} must be C-contiguous; got shape {shape} with strides "
                    f"{strides} (pass a contiguous copy)"
                )
            return self.ref(_contiguous_copy(obj, shape, dtype, device, stream), name,
                            copy=False)
        count = math.prod(shape)
        return ArrayRef(source, "device", ptr, shape, dtype, count, count * dtype.itemsize,
                        None, device, stream)

    def _dlpack_ref(self, obj: Any, name: str, copy: bool) -> ArrayRef:
        """A reference read from ``obj``'s DLPack capsule (no CuPy involved)."""
        t = read_dlpack(obj)
        if not _c_contiguous(t.shape, t.strides, t.dtype.itemsize):
            raise ValueError(f"{name} must be C-contiguous; got shape {t.shape} with strides "
                             f"{t.strides} (pass a contiguous copy)")
        count = math.prod(t.shape)
        return ArrayRef(obj, "device", t.ptr, t.shape, t.dtype, count, count * t.dtype.itemsize,
                        None, t.device, None)

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

    def write_back(self, ref: ArrayRef, obj: Any, stream: Any = None) -> None:
        """Copy the contiguous stand-in into ``obj`` on ``stream`` (after the call that filled
        it); the stand-in stays referenced until that copy is done."""
        rt = cuda.runtime()
        with rt.using_device(ref.device):
            s = rt.stream_handle(stream)
            if _library(obj) == "torch":
                import torch

                with torch.cuda.stream(torch.cuda.ExternalStream(s)):
                    obj.copy_(ref.array.reshape(obj.shape))
            else:
                rt.copy(obj, ref.array, s)
            cuda.hold(rt.record_event(s), ref.array)


def _pointer(new: Any) -> int:
    """The device address of an array the runtime just allocated."""
    if _library(new) == "cupy":
        return int(new.data.ptr)  # cheaper than building CuPy's interface dict
    return int(new.__cuda_array_interface__["data"][0])


def _contiguous_copy(obj: Any, shape: tuple, dtype: np.dtype, device: int | None,
                     producer: int | None) -> Any:
    """A C-contiguous copy of a strided device array, queued on the current stream (after
    ``producer``, the stream that made ``obj``), which the backend orders its work after."""
    if _library(obj) == "torch":
        return obj.contiguous()
    rt = cuda.runtime()
    with rt.using_device(device):
        new = rt.empty(shape, dtype, rt.current_device())
        s = rt.current_stream()
        if producer is not None and producer != s:
            rt.wait_event(s, rt.record_event(producer))
        rt.copy(new, obj, s)
    return new


def _torch_stream(obj: Any) -> int | None:
    """torch's current stream on the tensor's device: what produced it, as torch sees it."""
    try:
        import torch

        return int(torch.cuda.current_stream(obj.device).cuda_stream)
    except Exception:  # noqa: BLE001 - a tensor torch cannot place: no producer to wait for
        return None


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


# ---- DLPack, read without a consumer library --------------------------------------------

class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):  # the first member of DLManagedTensor (dlpack.h)
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_DL_KINDS = {0: "int", 1: "uint", 2: "float", 5: "complex"}  # DLDataTypeCode; 4 bfloat, 6 bool
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


class DLTensorInfo:
    """What a DLPack capsule says of a tensor: address, shape, strides (bytes), dtype, device."""

    def __init__(self, ptr: int, shape: tuple, strides: tuple | None, dtype: np.dtype,
                 device: int):
        self.ptr, self.shape, self.strides, self.dtype, self.device = (
            ptr, shape, strides, dtype, device)


def read_dlpack(obj: Any) -> DLTensorInfo:
    """Read ``obj.__dlpack__()`` without consuming it: the capsule's own destructor releases it,
    and the memory stays valid as long as ``obj`` lives (ArrayRef keeps it)."""
    capsule = obj.__dlpack__()
    t = _DLTensor.from_address(_capsule_pointer(capsule, b"dltensor"))
    code, bits, lanes = t.dtype.code, t.dtype.bits, t.dtype.lanes
    if lanes != 1:
        raise TypeError(f"DLPack tensor with {lanes} lanes per element is not supported")
    if code == 4 and bits == 16:
        dtype = dtype_from_name("bfloat16")
    elif code == 6:
        dtype = np.dtype(np.bool_)
    elif code in _DL_KINDS:
        dtype = np.dtype(f"{_DL_KINDS[code]}{bits}")
    else:
        raise TypeError(f"DLPack dtype code {code} with {bits} bits is not supported")
    shape = tuple(t.shape[i] for i in range(t.ndim))
    strides = None if not t.strides else tuple(t.strides[i] * dtype.itemsize
                                                  for i in range(t.ndim))
    return DLTensorInfo((t.data or 0) + t.byte_offset, shape, strides, dtype, t.device.device_id)


register_adapter(DeviceAdapter(), priority=10)
