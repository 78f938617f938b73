"""One rank of the NCCL backend against the emulation (faults, streams, argument checks), and the
emulation itself behaving as NCCL does: refusing what NCCL refuses, blocking where it blocks."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from nccl_emulation import INVALID_ARGUMENT, FakeDeviceArray, NCCLError

from gpucoll import cuda
from gpucoll.arrays import as_ref
from gpucoll.backends.nccl import NcclBackend
from gpucoll.backends.nccl.driver import DTYPE_CODES, Buf, Calls
from gpucoll.errors import CollectiveTimeout, NcclFailure
from gpucoll.ops import ReduceOp
from gpucoll.store import PrefixStore

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def backend(rt, store_server):
    b = NcclBackend(PrefixStore("one/", store_server), 0, 1, timeout=10)
    yield b
    b.close()


def ref(rt, values, **kw):
    return as_ref(FakeDeviceArray(np.asarray(values), rt, **kw), "x")


def test_a_hung_collective_is_aborted_at_its_deadline(rt, backend):
    release = rt.stall(rt.current_stream())  # the kernel before it never finishes
    x = ref(rt, np.ones(4, np.float32))
    work = backend.run_async(lambda: backend.all_reduce(x, ReduceOp.SUM, timeout=0.3))
    with pytest.raises(CollectiveTimeout, match="all_reduce on rank 0 of 1 did not complete "
                                                "within 0.3 s.*the NCCL communicator was "
                                                "aborted"):
        work.synchronize()
    assert work.is_completed()
    with pytest.raises(CollectiveTimeout):
        backend.broadcast(x, 0, timeout=5)
    release()


def test_close_returns_after_an_abort(rt, backend):
    release = rt.stall(rt.current_stream())
    backend.all_reduce(ref(rt, np.ones(2, np.float32)), ReduceOp.SUM, timeout=30)
    backend.abort("a peer died")
    backend.close()
    backend.close()
    release()


def test_an_asynchronous_nccl_error_names_the_op_and_rank(rt, backend):
    release = rt.stall(rt.current_stream())
    x, out = ref(rt, np.ones(2, np.int32)), ref(rt, np.ones(2, np.int32))
    work = backend.run_async(lambda: backend.all_gather(x, out, timeout=30))
    backend._nc.comm.inject_error(3)  # ncclInternalError, as ncclCommGetAsyncError reports it
    with pytest.raises(NcclFailure, match=r"all_gather on rank 0 of 1: NCCL failed "
                                          r"\(ncclInternalError\)"):
        work.synchronize(timeout=20)
    release()


def test_a_host_array_goes_to_nccl_in_device_memory_and_the_call_waits_for_it(rt, backend):
    x = as_ref(np.arange(3, dtype=np.int32), "x")
    release = rt.stall(rt.current_stream())  # a busy device: the result is not there yet
    started = time.monotonic()
    threading.Timer(0.3, release).start()
    backend.all_reduce(x, ReduceOp.MAX, timeout=10)
    assert time.monotonic() - started >= 0.3  # returned once the copy back was done
    assert [name for name, _ in backend._nc.comm.calls] == ["allreduce"]
    assert backend._host_queue == []
    np.testing.assert_array_equal(x.array, np.arange(3))


def test_a_host_array_call_that_misses_its_deadline_raises_and_leaves_the_array_alone(
        rt, backend):
    x = as_ref(np.arange(4, dtype=np.float32), "x")
    release = rt.stall(rt.current_stream())
    with pytest.raises(CollectiveTimeout, match="all_reduce on rank 0 of 1 did not complete "
                                                "within 0.3 s"):
        backend.all_reduce(x, ReduceOp.SUM, timeout=0.3)
    release()
    np.testing.assert_array_equal(x.array, np.arange(4, dtype=np.float32))


def test_a_buffer_on_another_device_is_refused(rt, backend):
    with pytest.raises(ValueError, match="buffer is on device 1, but rank 0's communicator is "
                                         "on device 0"):
        backend.broadcast(ref(rt, np.ones(3), device=1), 0, timeout=5)


def test_the_device_is_the_local_rank_unless_given(rt, store_server, monkeypatch):
    monkeypatch.setenv("GPUCOLL_LOCAL_RANK", "1")
    b = NcclBackend(PrefixStore("dev/", store_server), 0, 1, timeout=5)
    assert b.device == 1 and b._nc.comm._device == 1
    b.close()
    with pytest.raises(ValueError, match="device=5 on rank 0: expected an int in \\[0, 2\\)"):
        NcclBackend(PrefixStore("dev2/", store_server), 0, 1, timeout=5, device=5)


def test_async_work_wait_orders_the_current_stream_without_blocking(rt, backend):
    x = ref(rt, np.arange(3, dtype=np.float64))
    mine = rt.new_stream()
    release = rt.stall(rt.current_stream())
    work = backend.run_async(lambda: backend.all_reduce(x, ReduceOp.AVG, timeout=5))
    with rt.use_stream(mine):
        work.wait()  # returns while the work is stalled: only the stream waits
        assert not work.is_completed()
        release()
        np.testing.assert_array_equal(x.array.get(), np.arange(3))  # on `mine`, after it
    assert work.is_completed()


# ---- the emulation behaves as NCCL does --------------------------------------------------------

@pytest.fixture
def comm(rt):
    c = rt.nccl().Communicator.init(1, 0, rt.nccl().get_unique_id())
    yield c
    c.destroy()


def calls(rt, comm):
    """NCCL's calls on ``comm`` as the backend makes them (the raw bindings)."""
    return Calls(rt.nccl_bindings(), comm, comm.rank)


def buf(rt, n, dtype=np.float32, offset=0, count=None):
    """A buffer of ``n`` elements and ``count`` of them from ``offset`` as NCCL takes them."""
    arr = FakeDeviceArray(np.zeros(n, dtype), rt)
    return arr, Buf(arr.ptr + offset * arr.dtype.itemsize, n - offset if count is None else count,
                    DTYPE_CODES[arr.dtype.name])


def test_emulation_rejects_unknown_op_codes(rt, comm):
    arr, b = buf(rt, 4)
    with pytest.raises(NCCLError) as info:
        calls(rt, comm).allreduce(b, b, 5, stream=0)
    assert info.value.status == INVALID_ARGUMENT and "op 5" in rt.misuse[0]


def test_emulation_refuses_a_null_handle_and_calls_a_freed_one_a_use_after_free(rt):
    nc = rt.nccl()
    raw = rt.nccl_bindings()
    arr, b = buf(rt, 4)
    with pytest.raises(NCCLError) as info:
        raw.all_reduce(b.ptr, b.ptr, 4, 7, 0, raw.Comm(0), 0)
    assert info.value.status == INVALID_ARGUMENT and rt.misuse == []
    freed = nc.Communicator.init(1, 0, nc.get_unique_id())
    handle = raw.Comm(freed.ptr)
    freed.abort()
    with pytest.raises(NCCLError):
        raw.all_reduce(b.ptr, b.ptr, 4, 7, 0, handle, 0)
    assert any("use after free" in m for m in rt.misuse)
    rt.misuse.clear()


def test_emulation_rejects_a_count_past_the_allocation(rt, comm):
    arr, b = buf(rt, 200, count=1000)
    with pytest.raises(NCCLError):
        calls(rt, comm).allreduce(b, b, 0, stream=0)
    assert "not inside one device allocation" in rt.misuse[0]


def test_emulation_rejects_roots_and_peers_out_of_range(rt, comm):
    arr, b = buf(rt, 4)
    with pytest.raises(NCCLError):
        calls(rt, comm).broadcast(b, b, 1, stream=0)
    with pytest.raises(NCCLError):
        calls(rt, comm).send(b, 3, stream=0)


def test_emulation_rejects_unknown_streams_and_group_end_without_start(rt, comm):
    arr, b = buf(rt, 4)
    with pytest.raises(NCCLError, match="UnhandledCudaError"):
        calls(rt, comm).allreduce(b, b, 0, stream=0xDEAD)
    with pytest.raises(NCCLError, match="InvalidUsage"):
        rt.nccl().group_end()


def test_emulation_keeps_a_refused_calls_error_on_a_non_blocking_communicator(rt):
    nc = rt.nccl()
    comm = nc.Communicator.init(1, 0, nc.get_unique_id(), config=nc.NCCLConfig(blocking=False))
    while comm.get_async_error() == 7:  # ncclInProgress: init runs in the background
        time.sleep(0.001)
    arr, b = buf(rt, 4)
    with pytest.raises(NCCLError):
        calls(rt, comm).allreduce(b, b, 5, stream=0)  # op 5 is no ncclRedOp_t
    assert comm.get_async_error() == INVALID_ARGUMENT
    with pytest.raises(NCCLError) as info:
        calls(rt, comm).allreduce(b, b, 0, stream=0)  # a valid call, refused from now on
    assert info.value.status == INVALID_ARGUMENT
    rt.misuse.clear()
    comm.abort()


def test_emulation_launches_no_kernel_for_a_one_rank_collective(rt, comm):
    """ncclLaunchOneRank: in place nothing at all, out of place one copy on the stream; no
    kernel joins the communicator's queue, and nothing connects."""
    src, a = buf(rt, 4)
    dst, b = buf(rt, 4)
    src[...] = np.arange(4)
    release = rt.stall(0)
    calls(rt, comm).allreduce(a, a, 0, stream=0)
    calls(rt, comm).allreduce(a, b, 4, stream=0)  # ncclAvg of one rank: the values
    assert comm._last_kernel is None and comm._connected == set() and comm._outstanding == 0
    release()
    np.testing.assert_array_equal(dst.get(), np.arange(4))


def test_emulation_rejects_overlap_that_is_not_the_in_place_layout(rt, comm):
    arr, _ = buf(rt, 8)
    with pytest.raises(NCCLError):
        calls(rt, comm).allreduce(Buf(arr.ptr, 4, 7), Buf(arr.ptr + 4, 4, 7), 0, stream=0)
    whole = Buf(arr.ptr, 8, 7)
    calls(rt, comm).allgather(whole, whole, stream=0)  # rank 0's slot is the send buffer: in place
    rt.synchronize()


def test_emulation_reports_a_receive_that_meets_a_send_of_another_count(rt, comm):
    rt.hang_timeout = 0.5
    a4, four = buf(rt, 4)  # the arrays stay referenced while NCCL uses their memory
    a2, two = buf(rt, 2)
    rt.nccl().group_start()
    calls(rt, comm).send(four, 0, stream=0)
    calls(rt, comm).recv(two, 0, stream=0)
    rt.nccl().group_end()
    rt.synchronize()
    assert any("met a send of 4" in m for m in rt.misuse)
    assert comm.get_async_error() == 5  # ncclInvalidUsage


def on_device_1(fn):
    """``fn`` run in a new thread whose current device is 1 (two ranks may not share one)."""
    def run():
        cuda.runtime().set_device(1)
        fn()

    return threading.Thread(target=run)


def test_emulation_blocks_a_blocking_init_until_every_rank_has_entered(rt):
    nc, uid = rt.nccl(), rt.nccl().get_unique_id()
    made = []
    peer = on_device_1(lambda: made.append(nc.Communicator.init(2, 1, uid)))
    peer.start()
    made.append(nc.Communicator.init(2, 0, uid))  # returns once rank 1 has entered too
    peer.join(10)
    assert len(made) == 2 and all(c.is_valid for c in made)


def test_emulation_makes_a_non_blocking_init_return_in_progress_until_the_peers_come(rt):
    nc, uid = rt.nccl(), rt.nccl().get_unique_id()
    config = nc.NCCLConfig(blocking=False)
    first = nc.Communicator.init(2, 0, uid, config=config)
    assert first.get_async_error() == 7  # ncclInProgress: rank 1 has not entered
    with rt.using_device(1):
        second = nc.Communicator.init(2, 1, uid, config=config)
    for c in (first, second):
        while c.get_async_error() == 7:
            threading.Event().wait(0.01)
        assert c.get_async_error() == 0
    first.abort()
    second.abort()


def test_emulation_lets_nccl_comm_blocking_override_the_config_read_once_per_process(
        rt, monkeypatch):
    nc = rt.nccl()
    monkeypatch.setenv("NCCL_COMM_BLOCKING", "1")
    assert nc.blocking(nc.NCCLConfig(blocking=False)) is True  # the variable wins
    monkeypatch.setenv("NCCL_COMM_BLOCKING", "0")  # read once: later changes are not seen
    assert nc.blocking(nc.NCCLConfig(blocking=False)) is True
    assert nc.blocking(None, inherited=False) is True


def test_emulation_without_nccl_comm_blocking_follows_the_config(rt, monkeypatch):
    monkeypatch.delenv("NCCL_COMM_BLOCKING", raising=False)
    nc = rt.nccl()
    assert nc.blocking(nc.NCCLConfig(blocking=False)) is False
    assert nc.blocking(None) is True and nc.blocking(None, inherited=False) is False


def test_nccl_comm_blocking_1_refuses_the_nccl_backend_before_anything_waits(
        rt, store_addr, monkeypatch):
    import gpucoll
    from gpucoll.errors import BackendUnavailable

    monkeypatch.setenv("NCCL_COMM_BLOCKING", "1")
    start = time.monotonic()
    with pytest.raises(BackendUnavailable, match="nccl backend: NCCL_COMM_BLOCKING=1 "
                                                 "is set.*Unset it"):
        gpucoll.init("nccl", rank=0, world_size=2, store=store_addr, timeout=30)
    assert time.monotonic() - start < 5  # rank 1 never comes: a blocking start-up would wait


def test_under_nccl_comm_blocking_1_auto_takes_the_host_ring_and_says_why(rt, monkeypatch):
    import gpucoll

    monkeypatch.setenv("NCCL_COMM_BLOCKING", "1")
    with gpucoll.init("auto", rank=0, world_size=1) as comm:
        assert comm.backend == "ring"
        assert "NCCL_COMM_BLOCKING=1" in comm.backend_reason


def test_emulation_calls_an_abort_under_a_call_of_another_thread_a_use_after_free(rt):
    nc, uid = rt.nccl(), rt.nccl().get_unique_id()
    rt.hang_timeout = 2
    peer = on_device_1(lambda: nc.Communicator.init(2, 1, uid))
    peer.start()
    comm = nc.Communicator.init(2, 0, uid)
    peer.join(10)
    arr, b = buf(rt, 4)
    inside = threading.Thread(target=lambda: pytest.raises(
        NCCLError, calls(rt, comm).allreduce, b, b, 0, stream=0))
    inside.start()  # the first collective: blocks in the call until rank 1 connects (never)
    while not comm._inside:
        threading.Event().wait(0.001)
    comm.abort()
    inside.join(10)
    assert any("use after free" in m for m in rt.misuse)
    rt.misuse.clear()


def test_emulation_reports_a_peer_that_aborted_as_a_remote_error_only_a_while_later(rt):
    nc, uid = rt.nccl(), rt.nccl().get_unique_id()
    arr, b = buf(rt, 4)
    with rt.using_device(1):
        arr1, b1 = buf(rt, 4)
    peer = []

    def rank_1() -> None:
        peer.append(nc.Communicator.init(2, 1, uid))
        calls(rt, peer[0]).allreduce(b1, b1, 0, stream=0)  # connects, with rank 0's call

    thread = on_device_1(rank_1)
    thread.start()
    comm = nc.Communicator.init(2, 0, uid)
    calls(rt, comm).allreduce(b, b, 0, stream=0)
    thread.join(10)
    rt.synchronize()
    calls(rt, comm).allreduce(b, b, 0, stream=0)  # waits on the device for rank 1, who aborts
    peer[0].abort()
    time.sleep(0.3)
    assert comm.get_async_error() == 0  # not yet: the transport has not noticed
    deadline = time.monotonic() + 10
    while comm.get_async_error() == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert comm.get_async_error() == 6  # ncclRemoteError
    comm.abort()
