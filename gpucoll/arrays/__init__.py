"""What the communicator hands a backend: ``ArrayRef``, a flat view of the caller's array.

``as_ref(obj, name)`` asks each registered adapter, highest priority first, whether it knows the
object; the host adapter (``HostAdapter``, here) is always there, device adapters
(``arrays/device.py``) register when that module is first imported, which ``as_ref`` does lazily
for anything that is not a NumPy array.

Host memory is a NumPy array or anything NumPy can view without copying: an object with the
buffer protocol (bytearray, memoryview, array.array, ...), ``__array_interface__``, or DLPack on
the CPU (a CPU torch tensor). bfloat16 arrays are NumPy arrays of ml_dtypes' dtype and need
nothing special.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
import importlib.util
from typing import Any, ClassVar

import numpy as np

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
_plugins_loaded = False
_PLUGINS = ("gpucoll.arrays.device",)


def register_adapter(adapter: Adapter, *, priority: int = 0) -> None:
    """Add an adapter; higher ``priority`` is asked first (device adapters sit above host)."""
    _adapters.append((priority, adapter))
    _adapters.sort(key=lambda item: -item[0])
    _ordered[:] = [a for _, a in _adapters]
    _by_kind.setdefault(adapter.kind, adapter)


def _load_plugins() -> None:
    global _plugins_loaded
    _plugins_loaded = True
    for module in _PLUGINS:
        if importlib.util.find_spec(module) is not None:
            importlib.import_module(module)


def as_ref(obj: Any, name: str, *, copy: bool = False) -> ArrayRef:
    """A reference to the array ``obj``, the argument called ``name`` in error messages.

    Raises TypeError when ``obj`` is not an array any adapter knows, ValueError when it is not
    C-contiguous and ``copy`` is False (with ``copy`` the reference is to a contiguous copy:
    ``ref.array is not obj`` then, and ``write_back`` returns results into ``obj``).
    """
    if type(obj) is np.ndarray:  # the common case, ahead of the registry walk
        return _host.ref(obj, name, copy=copy)
    if not _plugins_loaded:
        _load_plugins()
    for adapter in _ordered:
        ref = adapter.ref_if_claimed(obj, name, copy)
        if ref is not None:
            return ref
    raise TypeError(
        f"{name} must be an array (NumPy, CuPy, or an object with the buffer protocol, "
        f"__array_interface__, __cuda_array_interface__ or DLPack), got {type(obj).__name__}"
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
    if kind not in _by_kind and not _plugins_loaded:
        _load_plugins()
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
