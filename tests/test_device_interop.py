"""Device arrays of other libraries, as they describe themselves: torch's bfloat16 (CUDA array
interface typestr ``<V2``, the dtype in DLPack), arrays that only speak DLPack (JAX), tensors
that require grad (their interface raises), and where bfloat16 users get ml_dtypes."""

from __future__ import annotations

import ctypes
import pathlib
import sys
import types

import numpy as np
import pytest
from nccl_emulation import FakeDeviceArray

from gpucoll.arrays import as_ref, dtype_from_name
from gpucoll.default import create

BF16 = dtype_from_name("bfloat16")
ROOT = pathlib.Path(__file__).resolve().parents[1]


# ---- a DLPack capsule, made the way a producer library makes one ------------------------------

class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


_NAME = b"dltensor"
_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype = ctypes.py_object
_new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class DLPackDevice:
    """A CUDA tensor that speaks DLPack (and, optionally, a CUDA array interface): ``code``
    and ``bits`` are its DLPack dtype (4, 16: bfloat16)."""

    def __init__(self, memory: FakeDeviceArray, code: int, bits: int, shape: tuple):
        self.memory, self.shape, self.device_id = memory, shape, memory.device
        self._shape = (ctypes.c_int64 * len(shape))(*shape)
        self._managed = _DLManagedTensor()
        t = self._managed.dl_tensor
        t.data, t.ndim, t.shape = memory.ptr, len(shape), self._shape
        t.device = _DLDevice(2, memory.device)  # kDLCUDA
        t.dtype = _DLDataType(code, bits, 1)

    def __dlpack__(self, stream=None):
        return _new_capsule(ctypes.addressof(self._managed), _NAME, None)

    def __dlpack_device__(self):
        return (2, self.device_id)


class TorchLikeBfloat16(DLPackDevice):
    """A torch CUDA bfloat16 tensor: its interface says ``<V2``, only DLPack says bfloat16."""

    dtype = "torch.bfloat16"

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": "<V2", "data": (self.memory.ptr, False),
                "strides": None, "version": 2}


class RequiresGrad:
    """A torch tensor that requires grad: the interface raises, ``detach()`` is the same
    memory without it."""

    def __init__(self, memory: FakeDeviceArray):
        self.memory = memory

    @property
    def __cuda_array_interface__(self):
        raise RuntimeError("Can't get __cuda_array_interface__ on Variable that requires grad.")

    def detach(self):
        return self.memory


def _bf16_memory(rt, values):
    return FakeDeviceArray(np.array(values, BF16).view(np.uint16), rt)


def test_a_bfloat16_tensor_described_as_V2_takes_its_dtype_from_dlpack(rt):
    memory = _bf16_memory(rt, [1.5, 2.5, 3.0])
    ref = as_ref(TorchLikeBfloat16(memory, 4, 16, (3,)), "x")
    assert (ref.dtype, ref.shape, ref.ptr, ref.device) == (BF16, (3,), memory.ptr, 0)


def test_an_array_that_speaks_only_dlpack_is_read_from_its_capsule(rt):
    memory = _bf16_memory(rt, [[1, 2], [3, 4]])
    ref = as_ref(DLPackDevice(memory, 4, 16, (2, 2)), "x")
    assert (ref.dtype, ref.shape, ref.count, ref.ptr) == (BF16, (2, 2), 4, memory.ptr)
    ints = FakeDeviceArray(np.arange(6, dtype=np.int32), rt)
    assert as_ref(DLPackDevice(ints, 0, 32, (6,)), "x").dtype == np.int32


def test_a_tensor_that_requires_grad_is_used_through_detach(rt):
    memory = FakeDeviceArray(np.ones(3, np.float32), rt)
    source = RequiresGrad(memory)
    ref = as_ref(source, "x")
    assert ref.array is source and ref.ptr == memory.ptr and ref.dtype == np.float32


def test_a_torch_tensors_producer_stream_is_torchs_current_stream(rt, monkeypatch):
    stream = types.SimpleNamespace(cuda_stream=0x5150)
    torch = types.SimpleNamespace(cuda=types.SimpleNamespace(current_stream=lambda dev: stream))
    monkeypatch.setitem(sys.modules, "torch", torch)
    memory = FakeDeviceArray(np.ones(3, np.float32), rt)
    cai = {"shape": (3,), "typestr": "<f4", "data": (memory.ptr, False), "strides": None,
           "version": 2}  # torch's interface names no stream
    tensor_type = type("Tensor", (), {"__module__": "torch", "dtype": "torch.float32",
                                      "device": types.SimpleNamespace(index=0),
                                      "__cuda_array_interface__": cai})
    ref = as_ref(tensor_type(), "x")
    assert (ref.stream, ref.device, ref.dtype) == (0x5150, 0, np.float32)


def test_bfloat16_from_every_kind_of_producer_reaches_nccl_as_bfloat16(rt, store_addr):
    with create("nccl", rank=0, world_size=1, store=store_addr, timeout=10) as comm:
        for make in (lambda m: TorchLikeBfloat16(m, 4, 16, (3,)),
                     lambda m: DLPackDevice(m, 4, 16, (3,))):
            memory = _bf16_memory(rt, [1.5, 2.5, 3.0])
            comm.all_reduce(make(memory))
            assert comm._backend._nc.comm.calls[-1][1]["dtype"] == 9  # ncclBfloat16
            np.testing.assert_array_equal(memory.get().view(BF16), [1.5, 2.5, 3.0])
    assert rt.misuse == []


def test_bfloat16_users_get_ml_dtypes_with_the_gpu_extra():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert any(dep.startswith("ml_dtypes") for dep in extras["cuda12"])


def test_without_ml_dtypes_bfloat16_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)
    with pytest.raises(TypeError, match="bfloat16 arrays need the ml_dtypes package"):
        dtype_from_name("bfloat16")
