"""The real nccl4py, NCCL and CuPy on this machine: the binding the backend calls (names,
signatures, codes, how errors and "in progress" come back), the unique id in the store, and
what ``auto`` and ``gpucoll info`` say without a GPU."""

from __future__ import annotations

import contextlib
import inspect
import json
import subprocess
import sys
import types

import numpy as np
import pytest
from conftest import cuda_available
from cuda_emulation import host_view

from gpucoll import cuda
from gpucoll.arrays import SUPPORTED_DTYPES, dtype_from_name
from gpucoll.backends.nccl import backend as nccl_backend
from gpucoll.backends.nccl import driver
from gpucoll.backends.nccl.backend import library_version
from gpucoll.errors import CollectiveTimeout, NcclFailure, PeerFailure
from gpucoll.ops import ReduceOp

nc = pytest.importorskip("nccl.core")
bindings = pytest.importorskip("nccl.bindings.nccl")

# how the backend (and the emulation) call nccl4py: method -> its parameters, in order
SIGNATURES = {
    "init": ["nranks", "rank", "unique_id", "config"],
    "split": ["self", "color", "key", "config"],
    "abort": ["self"],
    "finalize": ["self"],
    "destroy": ["self"],
    "get_async_error": ["self"],
}
MODULE = ["Communicator", "NCCLConfig", "UniqueId", "NcclInvalid", "get_unique_id",
          "get_version", "group_start", "group_end"]
RUNTIME = ["getDeviceCount", "getDevice", "setDevice", "streamIsCapturing", "memcpyAsync",
           "memcpyDefault", "pointerGetAttributes", "deviceGetPCIBusId", "driverGetVersion",
           "runtimeGetVersion", "getDeviceProperties"]
CUPY = ["get_current_stream", "Device", "alloc", "alloc_pinned_memory", "UnownedMemory",
        "MemoryPointer", "Event", "ExternalStream", "Stream"]


def test_every_nccl4py_name_the_backend_uses_exists_with_its_parameters():
    assert [name for name in MODULE if not hasattr(nc, name)] == []
    for method, params in SIGNATURES.items():
        assert list(inspect.signature(getattr(nc.Communicator, method)).parameters) == params
    assert isinstance(nc.Communicator.is_valid, property)
    assert isinstance(nc.Communicator.ptr, property)
    assert nc.NCCLConfig(blocking=False).blocking is False


def _null_communicator_calls() -> driver.Calls:
    """Rank 0's calls, as the backend makes them, through the real bindings on a NULL
    ncclComm_t (``ptr`` 0)."""
    return driver.Calls(bindings, types.SimpleNamespace(ptr=0), 0)


@pytest.mark.parametrize("call, args", [
    ("allreduce", (0,)), ("reduce", (0, 0)), ("reduce", (0, 1)), ("broadcast", (0,)),
    ("broadcast", (1,)), ("allgather", ()), ("reduce_scatter", (0,))])
def test_the_real_bindings_take_each_collective_as_the_backend_calls_it(call, args):
    """NCCL itself answers: the arguments got through nccl4py's conversions (addresses,
    counts, codes, the handle, the stream) and the library refused the NULL communicator."""
    host = np.zeros(8, np.float32)
    buf = driver.Buf(host.ctypes.data, 4, driver.DTYPE_CODES["float32"])
    with pytest.raises(bindings.NCCLError) as info:
        getattr(_null_communicator_calls(), call)(buf, buf, *args, stream=0)
    assert info.value.status == 4  # ncclInvalidArgument


@pytest.mark.parametrize("call", ["send", "recv"])
def test_the_real_bindings_take_send_and_recv_as_the_backend_calls_them(call):
    host = np.zeros(4, np.int64)
    buf = driver.Buf(host.ctypes.data, 4, driver.DTYPE_CODES["int64"])
    with pytest.raises(bindings.NCCLError) as info:
        getattr(_null_communicator_calls(), call)(buf, 1, stream=0)
    assert info.value.status == 4


def test_every_cupy_name_the_runtime_uses_exists():
    import cupy
    from cupy.cuda import runtime

    missing = [f"runtime.{a}" for a in RUNTIME if not hasattr(runtime, a)]
    missing += [f"cupy.cuda.{a}" for a in CUPY if not hasattr(cupy.cuda, a)]
    missing += [] if hasattr(cupy, "RawKernel") else ["cupy.RawKernel"]
    assert missing == []
    assert isinstance(cupy.cuda.Event.done, property)  # cuda.Event's protocol: .done


def test_dtype_and_op_codes_are_nccl4pys():
    for name, code in driver.DTYPE_CODES.items():
        assert nc.NcclDataType.from_numpy_dtype(dtype_from_name(name)) == code, name
    for op, code in driver.OP_CODES.items():
        assert nc.NcclRedOp[op.name] == code, op


def test_the_dtype_table_lists_only_dtypes_gpucoll_accepts():
    assert set(driver.DTYPE_CODES) <= set(SUPPORTED_DTYPES)


class _CupyLikeUfunc:
    """A ufunc as CuPy 14 has it: a binary call with ``out=`` works, ``reduce`` does not
    (it raises for minimum, maximum and the bitwise ones)."""

    def __init__(self, ufunc: np.ufunc):
        self._ufunc = ufunc

    def __call__(self, a, b, out=None):
        return self._ufunc(a, b, out=out)

    def reduce(self, *args, **kwargs):
        raise NotImplementedError(f"`cupy_{self._ufunc.__name__}.reduce` is not supported yet")


@pytest.mark.parametrize("op", ["sum", "prod", "min", "max", "band", "bor", "bxor"])
def test_the_real_runtime_folds_gathered_slots_with_what_cupys_ufuncs_offer(op, monkeypatch):
    names = ("add", "multiply", "minimum", "maximum", "bitwise_and", "bitwise_or", "bitwise_xor")
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(
        **{name: _CupyLikeUfunc(getattr(np, name)) for name in names}))
    monkeypatch.setattr(cuda, "_cupy_stream", lambda ptr: contextlib.nullcontext())
    monkeypatch.setattr(cuda, "cupy_view", lambda ptr, count, dtype, device: host_view(
        ptr, count * dtype.itemsize, dtype))
    monkeypatch.setattr(cuda.CupyRuntime, "current_device", lambda self: 0)
    slots = np.array([[5, 3, 12, -7], [6, 9, 10, 2], [7, 1, 3, -1]], np.int32)
    out = np.zeros(4, np.int32)
    cuda.CupyRuntime().reduce_slots(op, slots.ctypes.data, out.ctypes.data, 3, 4, slots.dtype, 0)
    ufunc = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum,
             "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}[op]
    np.testing.assert_array_equal(out, ufunc.reduce(slots, axis=0))


def test_complex_sums_travel_as_float_pairs_and_complex_prod_is_refused():
    plan = driver.reduce_plan(ReduceOp.AVG, np.dtype(np.complex64), "all_reduce")
    assert (plan.native, plan.code, plan.op, plan.factor) == (True, 7, 4, 2)  # float32 pairs
    with pytest.raises(TypeError, match="all_reduce.*'prod'.*complex128"):
        driver.reduce_plan(ReduceOp.PROD, np.dtype(np.complex128), "all_reduce")


def test_in_progress_is_not_an_error_and_every_other_result_code_is_one():
    bindings.check_status(7)  # ncclInProgress: how a non-blocking call comes back
    for status in (1, 2, 3, 4, 5, 6, 8):
        with pytest.raises(bindings.NCCLError) as info:
            bindings.check_status(status)
        assert info.value.status == status


def test_every_nccl_result_code_becomes_a_gpucoll_error_naming_it():
    for status, name in driver.RESULT_NAMES.items():
        err = driver.translate(bindings.NCCLError(status), "all_reduce", 1, 4)
        assert f"all_reduce on rank 1 of 4: NCCL failed ({name})" in str(err)
    assert isinstance(driver.translate(bindings.NCCLError(6), "x", 0, 2), PeerFailure)
    assert isinstance(driver.translate(bindings.NCCLError(8), "x", 0, 2), CollectiveTimeout)
    inprogress = driver.translate(bindings.NCCLError(7), "x", 0, 2)
    assert isinstance(inprogress, NcclFailure) and inprogress.status == 7
    refused = driver.translate(nc.NcclInvalid("recvbuf too small"), "x", 0, 2)
    assert refused.status is None and "NCCL failed (refused): recvbuf too small" in str(refused)


def test_the_real_unique_id_travels_through_the_store(store_server):
    sent = nccl_backend.share_unique_id(store_server, 0, nc, 5, None)
    got = nccl_backend.share_unique_id(store_server, 1, nc, 5, None)
    assert len(sent) == 128 and got == sent
    assert bytes(nc.UniqueId.from_bytes(got)) == sent


def test_the_library_version_is_the_wheels():
    assert library_version(nc).count(".") == 2


@pytest.mark.skipif(cuda_available(), reason="checks the machine without a GPU")
def test_the_real_communicator_needs_a_gpu():
    with pytest.raises(bindings.NCCLError, match="UnhandledCudaError"):
        nc.Communicator.init(1, 0, nc.get_unique_id(), config=nc.NCCLConfig(blocking=False))


@pytest.mark.skipif(cuda_available(), reason="checks the machine without a GPU")
def test_nccl_backend_without_a_gpu_is_unavailable_and_says_why(store_server):
    from gpucoll.backends.nccl import NcclBackend
    from gpucoll.errors import BackendUnavailable

    with pytest.raises(BackendUnavailable, match="rank 0: CUDA has no usable device"):
        NcclBackend(store_server, 0, 1, timeout=5)


@pytest.mark.skipif(cuda_available(), reason="checks the machine without a GPU")
def test_auto_chooses_the_ring_here_and_says_why(store_server):
    from gpucoll.backends import choose_backend

    name, reason = choose_backend("auto", store_server, 0, 1)
    assert name == "ring"
    assert "rank 0 cannot use NCCL: CUDA has no usable device" in reason


@pytest.mark.skipif(cuda_available(), reason="checks the machine without a GPU")
def test_gpucoll_info_reports_versions_and_the_auto_choice_without_a_traceback():
    run = subprocess.run([sys.executable, "-m", "gpucoll", "info", "--json"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    info = json.loads(run.stdout)
    assert info["nccl"]["library"] == library_version(nc)
    assert info["nccl"]["nccl4py"] == str(nc.get_version().nccl4py)
    assert info["auto_backend"] == "ring" and "no usable device" in info["auto_reason"]
    text = subprocess.run([sys.executable, "-m", "gpucoll", "info"], capture_output=True,
                          text=True, timeout=60)
    assert text.returncode == 0 and "auto backend  ring" in text.stdout
