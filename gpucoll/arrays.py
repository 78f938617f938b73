"""What the communicator hands a backend: ``ArrayRef``, a flat view of the caller's array.

``as_ref(obj, name)`` asks each registered adapter, highest priority first, whether it knows the
object; two are registered here: the device adapter (``DeviceAdapter``), asked first, and the
host adapter (``HostAdapter``).

Host memory is a NumPy array or anything NumPy can view without copying: an object with the
buffer protocol (bytearray, memoryview, array.array, ...), ``__array_interface__``, or DLPack on
the CPU (a CPU torch tensor). bfloat16 arrays are NumPy arrays of ml_dtypes' dtype and need
nothing special.

Device memory is a CuPy array, any ``__cuda_array_interface__`` object or a CUDA DLPack tensor,
used without copies; for objects other than CuPy's the producer stream (CUDA array interface v3,
or torch's current stream) is kept so that the backend orders its work after it, and what the
interface cannot describe (torch's bfloat16, JAX's) is read from DLPack. New arrays come back as
the caller's type (CuPy, torch and Numba natively, anything else as CuPy arrays), and CuPy is
imported only when an object needs it.
"""

from __future__ import annotations

import abc
import ctypes
import dataclasses
import math
from typing import Any, ClassVar

import numpy as np

from gpucoll import cuda

# Every dtype the collectives accept, by NumPy name (bfloat16 is ml_dtypes').
SUPPORTED_DTYPES = (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
)
_SUPPORTED = frozenset(SUPPORTED_DTYPES)


@dataclasses.dataclass(frozen=True, slots=True, init=False)
class ArrayRef:
    """A C-contiguous buffer: the caller's object and where its elements live.

    ``host`` is a flat NumPy view for host memory (None for device memory); ``device`` the CUDA
    device ordinal; ``stream`` the producer stream a ``__cuda_array_interface__`` v3 object names.
    """

    array: Any
    kind: str
    _ptr: int | None  # None: read from ``host`` when first asked (see ``ptr``)
    shape: tuple[int, ...]
    dtype: np.dtype
    count: int
    nbytes: int
    host: np.ndarray | None = None
    device: int | None = None
    stream: int | None = None

    def __init__(self, array: Any, kind: str, ptr: int | None, shape: tuple[int, ...],
                 dtype: np.dtype,
                 count: int, nbytes: int, host: np.ndarray | None = None,
                 device: int | None = None, stream: int | None = None):
        # Two are built per call: the slots' own setters cost half of the frozen dataclass's
        # generated __init__ (which goes through object.__setattr__ by name).
        _set_array(self, array)
        _set_kind(self, kind)
        _set_ptr(self, ptr)
        _set_shape(self, shape)
        _set_dtype(self, dtype)
        _set_count(self, count)
        _set_nbytes(self, nbytes)
        _set_host(self, host)
        _set_device(self, device)
        _set_stream(self, stream)

    @property
    def ptr(self) -> int:
        """The address of the first element. A host reference reads it from its NumPy view
        only when asked (NumPy's array interface costs over a microsecond per call, and
        collectives on host memory rarely need the address)."""
        ptr = self._ptr
        if ptr is None:
            ptr = self.host.__array_interface__["data"][0]
            _set_ptr(self, ptr)
        return ptr

    @property
    def writable(self) -> bool:
        """False for read-only host memory (bytes, read-only NumPy views)."""
        return self.host is None or self.host.flags.writeable


(_set_array, _set_kind, _set_ptr, _set_shape, _set_dtype, _set_count, _set_nbytes, _set_host,
 _set_device, _set_stream) = (getattr(ArrayRef, f.name).__set__
                              for f in dataclasses.fields(ArrayRef))


class Adapter(abc.ABC):
    """Turns one family of array objects into ``ArrayRef`` and allocates more of them."""

    kind: ClassVar[str]

    @abc.abstractmethod
    def claims(self, obj: Any) -> bool:
        """Cheap test: is ``obj`` an array of this family?"""

    @abc.abstractmethod
    def ref(self, obj: Any, name: str, *, copy: bool) -> ArrayRef:
        """A reference to ``obj``'s elements; a non-contiguous ``obj`` is copied when ``copy``,
        else ValueError naming ``name``."""

    def ref_if_claimed(self, obj: Any, name: str, copy: bool) -> ArrayRef | None:
        """``ref(obj, ...)`` when this adapter claims ``obj``, else None (one step, so that an
        adapter can read the object's array interface once for both)."""
        return self.ref(obj, name, copy=copy) if self.claims(obj) else None

    @abc.abstractmethod
    def empty(self, ref: ArrayRef, shape: tuple[int, ...]) -> Any:
        """A new, uninitialised array like ``ref``'s (same library, dtype and device)."""

    def empty_ref(self, ref: ArrayRef, shape: tuple[int, ...]) -> ArrayRef:
        """A reference to ``empty(ref, shape)``; adapters that know the new array's layout
        build it directly instead of reading the new array's interface back."""
        return self.ref(self.empty(ref, shape), "out", copy=False)

    @abc.abstractmethod
    def new(self, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        """A new, uninitialised array of this family's default library (device: the current
        device), for a rank that has no array to imitate (scatter's non-roots)."""

    @abc.abstractmethod
    def view(self, ref: ArrayRef, start: int, count: int) -> ArrayRef:
        """Elements ``start:start+count`` of ``ref`` as a flat reference, without copying."""

    @abc.abstractmethod
    def write_back(self, ref: ArrayRef, obj: Any, stream: Any = None) -> None:
        """Copy ``ref``'s elements into ``obj``, the strided array ``ref`` was copied from
        (device arrays: on ``stream``, default the current stream)."""


_adapters: list[tuple[int, Adapter]] = []
_ordered: list[Adapter] = []  # _adapters' adapters, highest priority first
_by_kind: dict[str, Adapter] = {}


def register_adapter(adapter: Adapter, *, priority: int = 0) -> None:
    """Add an adapter; higher ``priority`` is asked first (device adapters sit above host)."""
    _adapters.append((priority, adapter))
    _adapters.sort(key=lambda item: -item[0])
    _ordered[:] = [a for _, a in _adapters]
    _by_kind.setdefault(adapter.kind, adapter)


def as_ref(obj: Any, name: str, *, copy: bool = False) -> ArrayRef:
    """A reference to the array ``obj``, the argument called ``name`` in error messages.

    Raises TypeError when ``obj`` is not an array any adapter knows, ValueError when it is not
    C-contiguous and ``copy`` is False (with ``copy`` the reference is to a contiguous copy:
    ``ref.array is not obj`` then, and ``write_back`` returns results into ``obj``).
    """
    if type(obj) is np.ndarray:  # the common case, ahead of the registry walk
        return _host.ref(obj, name, copy=copy)
    for adapter in _ordered:
        ref = adapter.ref_if_claimed(obj, name, copy)
        if ref is not None:
            return ref
    hint = ""
    if isinstance(obj, (list, tuple)):  # collectives move memory a Python sequence does not have
        hint = (f": make it one with numpy.asarray({name}) (cupy.asarray({name}) for device "
                f"memory) and keep that array, into which in-place calls write their result")
    raise TypeError(
        f"{name} must be an array (NumPy, CuPy, or an object with the buffer protocol, "
        f"__array_interface__, __cuda_array_interface__ or DLPack), got {type(obj).__name__}"
        f"{hint}"
    )


def adapter_for(ref: ArrayRef) -> Adapter:
    return _by_kind[ref.kind]


def flat_view(ref: ArrayRef, start: int, count: int) -> ArrayRef:
    """Elements ``start:start+count`` of a flat reference, sharing its memory."""
    if start < 0 or count < 0 or start + count > ref.count:
        raise ValueError(f"flat_view [{start}:{start + count}] outside {ref.count} elements")
    return _by_kind[ref.kind].view(ref, start, count)


def empty_like(ref: ArrayRef, shape: tuple[int, ...]) -> Any:
    """A new array of the caller's kind (NumPy for host, same library and device otherwise)."""
    return _by_kind[ref.kind].empty(ref, tuple(shape))


def empty_ref(ref: ArrayRef, shape: tuple[int, ...]) -> ArrayRef:
    """``as_ref(empty_like(ref, shape), "out")``, built without reading the new array back."""
    return _by_kind[ref.kind].empty_ref(ref, tuple(shape))


def new_array(kind: str, shape: tuple[int, ...], dtype: np.dtype) -> Any:
    """A new array of ``kind`` ("host": NumPy) when there is no reference to imitate."""
    return _by_kind[kind].new(tuple(shape), dtype)


def write_back(ref: ArrayRef, obj: Any, stream: Any = None) -> None:
    """Copy a contiguous stand-in's elements back into the caller's non-contiguous ``obj``
    (device arrays: on ``stream``, after the call that filled the stand-in)."""
    _by_kind[ref.kind].write_back(ref, obj, stream)


_dtype_verdicts: dict[np.dtype, bool] = {}  # reading dtype.name costs microseconds per call


def check_dtype(dtype: np.dtype, name: str) -> None:
    """TypeError unless collectives support ``dtype`` (native byte order, a listed type)."""
    ok = _dtype_verdicts.get(dtype)
    if ok is None:
        ok = _dtype_verdicts[dtype] = dtype.name in _SUPPORTED and dtype.isnative
    if not ok:
        shown = dtype.name if dtype.isnative else dtype.str
        raise TypeError(f"{name} has unsupported dtype {shown}; expected native-endian one "
                        f"of: {', '.join(SUPPORTED_DTYPES)}")


def dtype_from_name(name: str) -> np.dtype:
    """The dtype for a ``SUPPORTED_DTYPES`` name (bfloat16 needs ml_dtypes)."""
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise TypeError('bfloat16 arrays need the ml_dtypes package: pip install '
                            '"gpucoll[cuda12]" (or pip install ml_dtypes)') from None
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


# ---- host memory: NumPy arrays and anything NumPy can view without copying -----------------------

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


_host = HostAdapter()
register_adapter(_host, priority=0)


# ---- device memory: CuPy arrays, __cuda_array_interface__ objects, CUDA DLPack tensors -----------

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
            return self.ref(_device_contiguous_copy(obj, shape, dtype, device, stream), name,
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


def _device_contiguous_copy(obj: Any, shape: tuple, dtype: np.dtype, device: int | None,
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


__all__ = [
    "Adapter",
    "ArrayRef",
    "SUPPORTED_DTYPES",
    "adapter_for",
    "as_ref",
    "check_dtype",
    "dtype_from_name",
    "empty_like",
    "empty_ref",
    "flat_view",
    "new_array",
    "register_adapter",
    "write_back",
]
