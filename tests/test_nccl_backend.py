"""One rank of the NCCL backend against the emulation: faults, streams, argument checks, and
the emulation itself refusing what NCCL refuses."""

from __future__ import annotations

import numpy as np
import pytest
from nccl_emulation import EmulatedRuntime, FakeDeviceArray, NcclError

from gpucoll import cuda
from gpucoll.arrays import as_ref
from gpucoll.backends.nccl import NcclBackend
from gpucoll.backends.nccl_watch import NcclFailure
from gpucoll.errors import CollectiveTimeout
from gpucoll.ops import ReduceOp
from gpucoll.store import PrefixStore

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def rt(store_addr):
    runtime = EmulatedRuntime(store_addr, devices=2, hang_timeout=10)
    with cuda.use_runtime(runtime):
        yield runtime
    runtime.close()


@pytest.fixture
def backend(rt, store_server):
    b = NcclBackend(PrefixStore("one/", store_server), 0, 1, timeout=10)
    yield b
    b.close()


def ref(rt, values, **kw):
    return as_ref(FakeDeviceArray(np.asarray(values), rt, **kw), "x")


def test_a_hung_collective_is_aborted_at_its_deadline(rt, backend):
    rt.held.set()  # the emulated peers never arrive
    x = ref(rt, np.ones(4, np.float32))
    work = backend.run_async(lambda: backend.all_reduce(x, ReduceOp.SUM, timeout=0.3))
    with pytest.raises(CollectiveTimeout, match="all_reduce on rank 0 of 1 did not complete "
                                                "within 0.3 s; the NCCL communicator was aborted"):
        work.synchronize()
    assert work.is_completed()
    with pytest.raises(CollectiveTimeout):
        backend.broadcast(x, 0, timeout=5)


def test_close_returns_after_an_abort(rt, backend):
    rt.held.set()
    backend.all_reduce(ref(rt, np.ones(2, np.float32)), ReduceOp.SUM, timeout=30)
    backend.abort("a peer died")
    backend.close()
    backend.close()


def test_an_asynchronous_nccl_error_names_the_op_and_rank(rt, backend):
    rt.held.set()
    backend.all_gather(ref(rt, np.ones(2, np.int32)), ref(rt, np.ones(2, np.int32)), timeout=30)
    backend._comm.async_error = 3  # ncclInternalError, as ncclCommGetAsyncError reports it
    work = backend.run_async(lambda: None)
    with pytest.raises(NcclFailure, match="all_gather on rank 0 of 1: NCCL failed "
                                          r"\(ncclInternalError\)"):
        work.synchronize(timeout=20)


def test_host_arrays_are_refused_before_anything_is_enqueued(rt, backend):
    with pytest.raises(TypeError, match="needs device arrays"):
        backend.all_reduce(as_ref(np.ones(3), "x"), ReduceOp.SUM, timeout=5)
    assert backend._comm.calls == []


def test_a_buffer_on_another_device_is_refused(rt, backend):
    with pytest.raises(ValueError, match="buffer is on device 1, but rank 0's communicator is "
                                         "on device 0"):
        backend.broadcast(ref(rt, np.ones(3), device=1), 0, timeout=5)


def test_the_device_is_the_local_rank_unless_given(rt, store_server, monkeypatch):
    monkeypatch.setenv("GPUCOLL_LOCAL_RANK", "1")
    b = NcclBackend(PrefixStore("dev/", store_server), 0, 1, timeout=5)
    assert b.device == 1 and b._comm.device_id() == 1
    b.close()
    with pytest.raises(ValueError, match="device=5 on rank 0: expected an int in \\[0, 2\\)"):
        NcclBackend(PrefixStore("dev2/", store_server), 0, 1, timeout=5, device=5)


def test_async_work_wait_orders_the_current_stream_without_blocking(rt, backend):
    x = ref(rt, np.arange(3, dtype=np.float64))
    work = backend.run_async(lambda: backend.all_reduce(x, ReduceOp.AVG, timeout=5))
    mine = rt.new_stream()
    with rt.use_stream(mine):
        work.wait()
    rt.synchronize()
    assert work.is_completed()
    np.testing.assert_array_equal(x.array.get(), np.arange(3))


# ---- the emulation refuses what NCCL refuses ------------------------------------------------

@pytest.fixture
def comm(rt):
    c = rt.nccl().NcclCommunicator(1, rt.nccl().get_unique_id(), 0)
    yield c
    c.destroy()


def test_emulation_rejects_unknown_datatype_and_op_codes(rt, comm):
    buf = FakeDeviceArray(np.zeros(4, np.float32), rt)
    with pytest.raises(NcclError, match="INVALID_ARGUMENT"):
        comm.allReduce(buf.ptr, buf.ptr, 4, 12, 0, 0)
    with pytest.raises(NcclError, match="INVALID_ARGUMENT"):
        comm.allReduce(buf.ptr, buf.ptr, 4, 7, 5, 0)
    assert "datatype 12" in rt.misuse[0] and "op 5" in rt.misuse[1]


def test_emulation_rejects_a_count_past_the_allocation(rt, comm):
    buf = FakeDeviceArray(np.zeros(4, np.float32), rt)
    with pytest.raises(NcclError):
        comm.allReduce(buf.ptr, buf.ptr, 5, 7, 0, 0)
    assert "not inside one device allocation" in rt.misuse[0]


def test_emulation_rejects_roots_and_peers_out_of_range(rt, comm):
    buf = FakeDeviceArray(np.zeros(4, np.float32), rt)
    with pytest.raises(NcclError):
        comm.broadcast(buf.ptr, buf.ptr, 4, 7, 1, 0)
    with pytest.raises(NcclError):
        comm.send(buf.ptr, 4, 7, 3, 0)


def test_emulation_rejects_unknown_streams_and_group_end_without_start(rt, comm):
    buf = FakeDeviceArray(np.zeros(4, np.float32), rt)
    with pytest.raises(NcclError, match="UNHANDLED_CUDA_ERROR"):
        comm.allReduce(buf.ptr, buf.ptr, 4, 7, 0, 0xDEAD)
    with pytest.raises(NcclError, match="INVALID_USAGE"):
        rt.nccl().groupEnd()


def test_emulation_rejects_overlap_that_is_not_the_in_place_layout(rt, comm):
    buf = FakeDeviceArray(np.zeros(8, np.float32), rt)
    with pytest.raises(NcclError):
        comm.allReduce(buf.ptr, buf.ptr + 4, 4, 7, 0, 0)
    comm.allGather(buf.ptr, buf.ptr, 8, 7, 0)  # rank 0's slot is the send buffer: in place
    rt.synchronize()


def test_emulation_reports_a_send_nobody_receives(rt, comm, store_addr):
    rt.hang_timeout = 0.5
    buf = FakeDeviceArray(np.zeros(4, np.float32), rt)
    rt.nccl().groupStart()
    comm.send(buf.ptr, 4, 7, 0, 0)
    comm.recv(buf.ptr, 2, 7, 0, 0)  # count 2 against a send of 4
    rt.nccl().groupEnd()
    rt.synchronize()
    assert any("met a send of 4" in m for m in rt.misuse)
    with pytest.raises(NcclError, match="INVALID_USAGE"):
        comm.check_async_error()
