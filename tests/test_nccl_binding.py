"""The real CuPy and NCCL on this machine: the binding the backend calls, the unique id in the
store, what ``auto`` and ``gpucoll info`` say without a GPU."""

from __future__ import annotations

import json
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from conftest import cuda_available

from gpucoll.backends import nccl_boot, nccl_types
from gpucoll.backends.nccl_auto import nccl_version
from gpucoll.ops import ReduceOp

nccl = pytest.importorskip("cupy.cuda.nccl")

# every attribute of cupy.cuda.nccl / NcclCommunicator / cupy.cuda.runtime that gpucoll calls
NCCL_MODULE = ["NcclCommunicator", "NcclError", "get_unique_id", "get_version",
               "get_build_version", "groupStart", "groupEnd", "available"]
COMMUNICATOR = ["allReduce", "reduce", "broadcast", "allGather", "reduceScatter", "send", "recv",
                "commSplit", "abort", "check_async_error", "destroy"]
RUNTIME = ["getDeviceCount", "getDevice", "eventCreateWithFlags", "eventDisableTiming",
           "eventRecord", "eventQuery", "eventSynchronize", "eventDestroy", "streamWaitEvent",
           "streamCreateWithFlags", "streamNonBlocking", "memcpyAsync", "memcpyDefault",
           "pointerGetAttributes", "check_status", "driverGetVersion", "runtimeGetVersion",
           "getDeviceProperties", "deviceGetPCIBusId"]
CUPY = ["get_current_stream", "Device", "alloc", "alloc_pinned_memory", "UnownedMemory",
        "MemoryPointer"]


def test_every_cupy_and_nccl_attribute_the_backend_uses_exists():
    import cupy
    from cupy.cuda import runtime

    missing = [f"nccl.{a}" for a in NCCL_MODULE if not hasattr(nccl, a)]
    missing += [f"NcclCommunicator.{a}" for a in COMMUNICATOR
                if not hasattr(nccl.NcclCommunicator, a)]
    missing += [f"runtime.{a}" for a in RUNTIME if not hasattr(runtime, a)]
    missing += [f"cupy.cuda.{a}" for a in CUPY if not hasattr(cupy.cuda, a)]
    missing += [] if hasattr(cupy.cuda.Stream, "from_external") else ["Stream.from_external"]
    missing += [] if hasattr(cupy, "from_dlpack") else ["cupy.from_dlpack"]
    assert missing == []


def test_communicator_methods_take_the_arguments_the_backend_passes():
    doc = {name: getattr(nccl.NcclCommunicator, name).__doc__.splitlines()[0]
           for name in ("allReduce", "reduce", "broadcast", "allGather", "reduceScatter",
                        "send", "recv", "commSplit")}
    assert "(self, intptr_t sendbuf, intptr_t recvbuf, size_t count, int datatype, int op, " \
           "intptr_t stream)" in doc["allReduce"]
    assert "int op, int root, intptr_t stream)" in doc["reduce"]
    assert "int datatype, int root, intptr_t stream)" in doc["broadcast"]
    assert "size_t count, int datatype, intptr_t stream)" in doc["allGather"]
    assert "size_t recvcount, int datatype, int op, intptr_t stream)" in doc["reduceScatter"]
    assert "(self, intptr_t sendbuf, size_t count, int datatype, int peer, intptr_t stream)" \
        in doc["send"]
    assert "(self, intptr_t recvbuf, size_t count, int datatype, int peer, intptr_t stream)" \
        in doc["recv"]
    assert "(self, int color, int key" in doc["commSplit"]


def test_dtype_and_op_codes_match_cupys_constants():
    pairs = {"int8": "NCCL_INT8", "uint8": "NCCL_UINT8", "int32": "NCCL_INT32",
             "uint32": "NCCL_UINT32", "int64": "NCCL_INT64", "uint64": "NCCL_UINT64",
             "float16": "NCCL_FLOAT16", "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64",
             "bfloat16": "NCCL_BFLOAT16"}
    for name, const in pairs.items():
        assert nccl_types.DTYPE_CODES[name] == getattr(nccl, const), name
    ops = {ReduceOp.SUM: "NCCL_SUM", ReduceOp.PROD: "NCCL_PROD", ReduceOp.MAX: "NCCL_MAX",
           ReduceOp.MIN: "NCCL_MIN", ReduceOp.AVG: "NCCL_AVG"}
    for op, const in ops.items():
        assert nccl_types.OP_CODES[op] == getattr(nccl, const), op


def test_fp8_codes_match_the_wheels_nccl_h():
    import nvidia.nccl

    header = (next(iter(nvidia.nccl.__path__)) + "/include/nccl.h")
    text = open(header).read()
    assert "ncclFloat8e4m3 = 10" in text and "ncclFloat8e5m2 = 11" in text
    assert nccl_types.DTYPE_CODES[np.dtype(ml_dtypes.float8_e4m3fn).name] == 10


def test_complex_sums_travel_as_float_pairs_and_complex_prod_is_refused():
    plan = nccl_types.reduce_plan(ReduceOp.AVG, np.dtype(np.complex64), "all_reduce")
    assert (plan.native, plan.code, plan.op, plan.factor) == (True, 7, 4, 2)
    with pytest.raises(TypeError, match="all_reduce.*'prod'.*complex128"):
        nccl_types.reduce_plan(ReduceOp.PROD, np.dtype(np.complex128), "all_reduce")


def test_the_real_unique_id_travels_through_the_store(store_server):
    sent = nccl_boot.share_unique_id(store_server, 0, 2, nccl, timeout=5)
    got = nccl_boot.share_unique_id(store_server, 1, 2, nccl, timeout=5)
    assert len(sent) == 128 and got == sent
    assert nccl_boot.uid_to_bytes(nccl_boot.uid_to_tuple(sent)) == sent  # CuPy < 14's form


@pytest.mark.skipif(cuda_available(), reason="checks the machine without a GPU")
def test_the_real_communicator_needs_a_gpu():
    with pytest.raises(nccl.NcclError, match="NCCL_ERROR_UNHANDLED_CUDA_ERROR"):
        nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)


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
    assert info["nccl"]["library"] == nccl_version(nccl.get_version())
    assert info["auto_backend"] == "ring" and "no usable device" in info["auto_reason"]
    text = subprocess.run([sys.executable, "-m", "gpucoll", "info"], capture_output=True,
                          text=True, timeout=60)
    assert text.returncode == 0 and "auto backend  ring" in text.stdout

