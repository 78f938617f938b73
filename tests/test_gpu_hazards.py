"""What a GPU does to careless code, checked through the emulation: one or more tests per defect
of the GPU path (hangs, stream order and lifetimes, the current device, aborting, interop, split,
``auto`` on a shared GPU, zero-size arrays, the staged ring's pipeline, avg, NCCL's result codes
and CUDA graph capture). The Work contract has its own file (``test_work_contract.py``)."""

from __future__ import annotations

import re
import threading
import time

import hazard_ranks
import numpy as np
import pytest
from multiproc import spawn
from nccl_emulation import FakeDeviceArray

from gpucoll.arrays import as_ref
from gpucoll.backends.nccl.driver import TIMEOUT
from gpucoll.backends.staged import StagedBackend
from gpucoll.default import create
from gpucoll.errors import BackendUnavailable, CollectiveTimeout, GpucollError, UsageError
from gpucoll.ops import ReduceOp

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def solo(rt, store_addr):
    """A one-rank NCCL communicator on device 0 of the emulation."""
    comm = create("nccl", rank=0, world_size=1, store=store_addr, timeout=10)
    yield comm
    comm.close()
    assert rt.misuse == []


def dev(rt, values, **kw):
    return FakeDeviceArray(np.asarray(values), rt, **kw)


# ---- 1. no call hangs: a missing or dead peer is an error naming it, within the deadline -----

@pytest.mark.parametrize("dies", [False, True], ids=["never-enters", "dies"])
def test_start_up_without_a_peer_in_nccl_fails_within_the_deadline_naming_it(store_addr, dies):
    message = spawn(hazard_ranks.start_up_without_a_peer, 2, store_addr, dies, timeout=60,
                    check=not dies)
    message = message[0] if not dies else message[0].value
    if dies:
        assert message.startswith("PeerFailure: rank 1 died during NCCL start-up"), message
    else:
        assert message.startswith("CollectiveTimeout: NCCL start-up on rank 0 of 2 did not "
                                  "complete within 1.5 s"), message
        assert "rank 1 never entered it" in message


@pytest.mark.parametrize("dies", [False, True], ids=["never-comes", "dies"])
def test_a_first_call_without_its_peer_fails_in_the_call_within_the_deadline(store_addr, dies):
    outcomes = spawn(hazard_ranks.first_call_without_a_peer, 2, store_addr, dies, timeout=60,
                     check=False)
    message = outcomes[0].value
    assert outcomes[0].ok, outcomes[0].trace
    if dies:
        assert message.startswith("PeerFailure: rank 1 died during all_reduce on rank 0 of 2")
    else:
        assert message.startswith("CollectiveTimeout: all_reduce on rank 0 of 2 did not "
                                  "complete within 1.5 s (NCCL was still connecting"), message
        assert "rank 1 is behind, before its first collective" in message


def test_a_split_whose_peer_never_enters_fails_within_the_deadline(store_addr):
    message = spawn(hazard_ranks.split_without_a_peer, 2, store_addr, timeout=60)[0]
    assert message.startswith("CollectiveTimeout: split on rank 0 of 2 did not complete "
                              "within 1.5 s"), message


def test_a_peer_that_dies_during_a_call_is_named_long_before_the_deadline(store_addr):
    outcomes = spawn(hazard_ranks.peer_dies_during_a_call, 2, store_addr, timeout=60,
                     check=False)
    assert outcomes[0].ok, outcomes[0].trace
    assert outcomes[0].value.startswith("rank 1 died during all_reduce on rank 0 of 2")


# ---- 2. stream order and buffer lifetimes ------------------------------------------------

def test_stream_argument_is_ordered_after_the_current_stream_that_wrote_the_data(rt, solo):
    x = dev(rt, np.zeros(4, np.float32))
    source = dev(rt, np.arange(4, dtype=np.float32))
    release = rt.stall(rt.current_stream())  # the current stream is busy ...
    rt.memcpy_async(x.ptr, source.ptr, 16, rt.current_stream())  # ... then writes x
    s = rt.new_stream()
    out = solo.all_gather(x, stream=s)
    release()
    np.testing.assert_array_equal(out.get(stream=s), [np.arange(4)])


def test_an_input_dropped_after_an_async_call_stays_alive_until_the_call_is_done(rt, solo):
    with rt.paused():
        work = solo.all_gather(dev(rt, np.arange(256, dtype=np.float64)), async_op=True)
        decoy = dev(rt, np.full(256, -1.0))  # would get the input's block if it were freed
    out = work.wait()
    np.testing.assert_array_equal(out.get(), [np.arange(256)])
    assert decoy.get()[0] == -1.0


def test_a_strided_input_is_copied_back_on_the_calls_stream_and_outlives_that_copy(store_addr):
    got = spawn(hazard_ranks.strided_write_back, 2, store_addr, timeout=60)
    assert got[0][::2] == [10.0, 14.0, 18.0, 22.0] and got[1][1::2] == [11.0, 13.0, 15.0, 17.0]


# ---- 3. every call runs on the communicator's device, whatever the caller's -----------------

def test_a_call_inside_another_devices_context_is_complete_only_when_its_work_is(rt, solo):
    x = dev(rt, np.ones(4, np.float32), device=0)
    release = rt.stall(0)  # device 0's default stream, where the call's work goes
    with rt.using_device(1):
        work = solo.all_reduce(x, async_op=True)
        assert rt.current_device() == 1  # the caller's device is restored
        rt.record_event(0).synchronize()  # device 1's stream is idle: an event there is done
        assert not work.is_completed()
        release()
        work.synchronize()
        assert work.is_completed()


def _refused_by_nccl(*args, **kwargs):
    raise GpucollError("all_reduce on rank 0: refused by NCCL")


@pytest.mark.parametrize("where", ["checks", "nccl"])
def test_a_call_that_fails_restores_the_callers_device_and_records_nothing(rt, solo, where,
                                                                           monkeypatch):
    """Refused by its checks (a buffer on another device) or inside NCCL: either way no event
    is left for the watchdog and the caller's device is current again."""
    backend = solo._backend
    last = backend._last
    if where == "checks":
        x, error, match = dev(rt, np.ones(2, np.float32), device=1), ValueError, "on device 1"
    else:
        monkeypatch.setattr(backend._nc, "call", _refused_by_nccl)
        x, error, match = dev(rt, np.ones(2, np.float32), device=0), GpucollError, "by NCCL"
    with rt.using_device(1):
        with pytest.raises(error, match=match):
            backend.all_reduce(as_ref(x, "x"), ReduceOp.SUM, timeout=5)
        assert rt.current_device() == 1
    assert backend._last is last and backend._watchdog.outstanding() == []


def test_a_stream_of_another_device_is_refused_before_nccl_and_the_communicator_stays_usable(
        rt, solo):
    with rt.using_device(1):
        elsewhere = rt.new_stream()
    x = dev(rt, np.ones(2, np.float32))
    with pytest.raises(ValueError, match="stream=0x[0-9a-f]+ is a stream of device 1, but rank 0's "
                                         "communicator is on device 0"):
        solo.all_reduce(x, stream=elsewhere)
    assert solo._backend._nc.comm.calls == []
    np.testing.assert_array_equal(solo.all_reduce(x).get(), [1, 1])


def test_a_call_from_another_thread_is_complete_only_when_its_work_is(rt, store_addr):
    comm = create("nccl", rank=0, world_size=1, store=store_addr, timeout=10, device=1)
    try:
        with rt.using_device(1):
            x = dev(rt, np.ones(4, np.float32))
            release = rt.stall(0)
        seen = []

        def other_thread() -> None:  # its current device is 0
            work = comm.all_reduce(x, async_op=True)
            rt.record_event(0).synchronize()  # device 0's stream is idle: an event there is done
            seen.append(work.is_completed())
            release()
            work.synchronize()
            seen.append(work.is_completed())

        t = threading.Thread(target=other_thread)
        t.start()
        t.join(30)
        assert seen == [False, True]
    finally:
        comm.close()
    assert rt.misuse == []


def test_the_staged_ring_runs_on_its_arrays_device_whatever_the_callers(rt):
    with rt.using_device(1):
        s = rt.new_stream()
        x = dev(rt, np.arange(6, dtype=np.float32))
    staged = StagedBackend(_Doubler(), chunk_bytes=8)
    staged.all_reduce(as_ref(x, "x"), ReduceOp.SUM, timeout=10, stream=s)  # from device 0
    with rt.using_device(1):
        np.testing.assert_array_equal(x.get(stream=s), np.arange(6) * 2)


# ---- 4. abort once, from a point where no call is inside NCCL ---------------------------------

def test_the_watchdog_never_aborts_the_communicator_under_a_call(store_addr):
    message = spawn(hazard_ranks.watchdog_against_a_call_inside_nccl, 2, store_addr,
                    timeout=60)[0]
    assert message.startswith("CollectiveTimeout: all_reduce on rank 0 of 2 did not complete "
                              "within 0.5 s"), message


def test_a_failed_communicator_is_aborted_exactly_once_however_often_it_is_ended(rt, solo):
    release = rt.stall(0)
    work = solo.all_reduce(dev(rt, np.ones(2, np.float32)), async_op=True, timeout=0.3)
    with pytest.raises(CollectiveTimeout):
        work.synchronize()
    solo._backend.abort("and again")
    nccl_comm = solo._backend._nc.comm
    solo.close()
    release()
    assert nccl_comm.abort_calls == 1


def test_an_abort_from_another_thread_waits_until_no_call_is_inside_nccl(rt, solo):
    driver = solo._backend._nc
    nccl_comm, enqueue = driver.comm, driver.calls.allreduce
    inside, leave, aborting = threading.Event(), threading.Event(), threading.Event()

    def slow_allreduce(*args, **kwargs):  # a call that stays inside NCCL until let go
        with nccl_comm._inside_call("allreduce"):
            inside.set()
            leave.wait(30)
        return enqueue(*args, **kwargs)

    class NotingLock:  # tells the test when the aborting thread reaches the lock
        def __init__(self, lock):
            self.lock = lock

        def __enter__(self):
            if threading.current_thread() is aborter:
                aborting.set()
            return self.lock.__enter__()

        def __exit__(self, *exc):
            return self.lock.__exit__(*exc)

    def abort() -> None:
        try:
            solo._backend.abort("from another thread")
        finally:
            aborting.set()

    raised = []

    def call() -> None:  # its first collective: the abort may find it connecting, and end it
        try:
            solo.all_reduce(dev(rt, np.ones(2, np.float32)))
        except GpucollError as exc:
            raised.append(str(exc))

    driver.calls.allreduce = slow_allreduce
    driver._lock = NotingLock(driver._lock)
    caller = threading.Thread(target=call)
    aborter = threading.Thread(target=abort)
    caller.start()
    assert inside.wait(30)
    aborter.start()
    assert aborting.wait(30)  # the abort is under way (or, unguarded, already done)
    leave.set()
    caller.join(30)
    aborter.join(30)
    # stopped exactly once: revoked where NCCL can revoke (it can here), else aborted
    assert rt.misuse == [] and nccl_comm.abort_calls + nccl_comm.revoked == 1
    assert solo._backend.failure() is not None
    assert raised in ([], ["nccl backend on rank 0 aborted: from another thread"])


# ---- 6. interop: the device a rank picks --------------------------------------------------

LAUNCHERS = {
    "gpucoll": {"GPUCOLL_RANK": "5", "GPUCOLL_WORLD_SIZE": "8", "GPUCOLL_LOCAL_RANK": "1",
                "GPUCOLL_LOCAL_WORLD_SIZE": "4"},
    "torchrun": {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"},
    "openmpi": {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
                "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"},
    "mpich": {"PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4"},
    "slurm": {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
              "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_NODEID": "1"},
}


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_the_device_a_rank_picks_is_the_local_rank_it_reports(rt, monkeypatch, launcher):
    from gpucoll import rendezvous
    from gpucoll.backends.nccl.backend import pick_device

    for var in [v for env in LAUNCHERS.values() for v in env] + ["GPUCOLL_STORE"]:
        monkeypatch.delenv(var, raising=False)
    for var, value in LAUNCHERS[launcher].items():
        monkeypatch.setenv(var, value)
    monkeypatch.setenv("GPUCOLL_STORE", "tcp://127.0.0.1:1")
    rt.devices = 8
    assert rendezvous.from_env().local_rank == 1
    assert pick_device(rt, 5, None) == 1


# ---- 7. split: outstanding work, one meaning of colour ----------------------------------------

def _released_when_waited_on(monkeypatch, works_and_stalls):
    """Let each stalled call's stream go only once the host waits for that call's event (as
    split's drain must): a split that does not wait meets the call still outstanding."""
    from gpucoll.backends.nccl import backend as nccl_backend

    wait = nccl_backend.wait_event

    def waiting(event, *args, **kwargs):
        for work, release in works_and_stalls:
            if event is work._pending.event:
                release()
        return wait(event, *args, **kwargs)

    monkeypatch.setattr(nccl_backend, "wait_event", waiting)


def test_split_waits_for_this_ranks_outstanding_work_before_nccl_splits(rt, solo, monkeypatch):
    release = rt.stall(0)
    work = solo.all_reduce(dev(rt, np.ones(8, np.float32)), async_op=True)  # outstanding
    _released_when_waited_on(monkeypatch, [(work, release)])
    try:
        sub = solo.split(0)
    finally:
        release()
    assert work.is_completed()
    sub.close()
    assert rt.misuse == []  # the emulation reports a split with work outstanding


def test_split_waits_for_outstanding_work_on_every_stream_not_only_the_last(rt, solo,
                                                                           monkeypatch):
    """NCCL runs one communicator's kernels in issue order whatever their streams, but a call's
    own work after NCCL's (here the local reduction of a bitwise all_reduce) can still be
    outstanding on its stream when a later call on another stream is done."""
    a, b = rt.new_stream(), rt.new_stream()
    releases, reduce_slots = [], rt.reduce_slots

    def held(*args, **kwargs):  # the reduction waits behind a stall of its stream
        releases.append(rt.stall(args[-1]))
        reduce_slots(*args, **kwargs)

    monkeypatch.setattr(rt, "reduce_slots", held)
    first = solo.all_reduce(dev(rt, np.ones(8, np.int32)), op="band", async_op=True, stream=a)
    monkeypatch.setattr(rt, "reduce_slots", reduce_slots)
    last = solo.all_reduce(dev(rt, np.ones(8, np.float32)), async_op=True, stream=b)
    last.synchronize()  # done, while the first call's reduction still waits on its stream
    assert not first.is_completed()
    _released_when_waited_on(monkeypatch, [(first, releases[0])])
    try:
        sub = solo.split(0)
        drained = first.is_completed()
    finally:
        releases[0]()
    assert drained
    sub.close()
    assert rt.misuse == []


@pytest.mark.parametrize("backend", ["ring", "nccl"])
@pytest.mark.parametrize("colour", [-1, 2**31, 2**40, -2**40])
def test_any_int_is_a_colour_on_every_backend(store_addr, backend, colour):
    got = spawn(hazard_ranks.colours, 2, store_addr, backend, colour, timeout=60)
    assert got == [(1, 2, 1), (0, 2, 1)]  # key=-rank: rank 1 first


# ---- 8. auto and ranks that share a GPU ---------------------------------------------------

def test_auto_picks_the_ring_for_ranks_that_would_share_a_gpu_and_says_why(store_addr,
                                                                            monkeypatch):
    monkeypatch.delenv("NCCL_MULTI_RANK_GPU_ENABLE", raising=False)
    got = spawn(hazard_ranks.auto_on_one_gpu, 2, store_addr, timeout=60,
                env={"GPUCOLL_BACKEND": "", "NCCL_MULTI_RANK_GPU_ENABLE": ""})
    for name, reason, total in got:
        assert (name, total) == ("ring", 3.0)
        assert "ranks 0, 1 would share GPU" in reason
        assert "backend='nccl' runs NCCL there" in reason


def test_without_nccl4py_nccl_is_unavailable_and_auto_picks_the_ring_saying_why(
        rt, store_addr, monkeypatch):
    def no_nccl4py():
        raise ModuleNotFoundError("No module named 'nccl'")

    monkeypatch.setattr(rt, "nccl", no_nccl4py)
    monkeypatch.delenv("GPUCOLL_BACKEND", raising=False)
    with pytest.raises(BackendUnavailable, match=re.escape(
            "nccl backend on rank 0: nccl4py cannot be loaded (ModuleNotFoundError: No module "
            "named 'nccl'); install gpucoll[cuda12]")):
        create("nccl", rank=0, world_size=1, store=store_addr, timeout=10)
    with create("auto", rank=0, world_size=1, store=store_addr, timeout=10) as comm:
        assert comm.backend == "ring"
        assert comm.backend_reason.startswith("auto: the host ring, because rank 0 cannot use "
                                              "NCCL: nccl4py cannot be loaded")


# ---- 9. zero-size arrays --------------------------------------------------------------------

def test_every_collective_takes_zero_size_device_arrays(store_addr):
    shapes = spawn(hazard_ranks.zero_size, 2, store_addr, timeout=60)
    assert shapes[0] == [(2, 0), (0,), (2, 0), (2, 0), (0,)] * 3
    assert shapes[1] == [(2, 0), (0,), (2, 0), None, (0,)] * 3


# ---- 10. the staged ring: copies overlap the ring, pinned memory outlives its copies ----------

class _Doubler:
    """A one-rank host backend whose all_reduce doubles; ``on_chunk(k)`` runs at chunk k."""

    name, rank, size = "ring", 0, 1

    def __init__(self, on_chunk=None):
        self.chunks = 0
        self.on_chunk = on_chunk

    def all_reduce(self, x, op, *, timeout):
        if self.on_chunk is not None:
            self.on_chunk(self.chunks)
        self.chunks += 1
        np.multiply(x.host, 2, out=x.host)

    def all_gather(self, x, out, *, timeout):
        out.host[...] = x.host


def test_the_ring_works_on_the_next_chunk_while_a_chunks_copy_back_is_queued(rt):
    releases = []

    def on_chunk(k: int) -> None:
        if k == 0:  # the device is busy from here on: chunk 0's copy back waits
            releases.append(rt.stall(rt.current_stream()))
        if k == 1:  # reached while chunk 0's copy back is still queued
            releases.pop()()

    staged = StagedBackend(_Doubler(on_chunk), chunk_bytes=16)
    x = dev(rt, np.arange(12, dtype=np.float32))  # 3 chunks of 4
    staged.all_reduce(as_ref(x, "x"), ReduceOp.SUM, timeout=5)
    np.testing.assert_array_equal(x.get(), np.arange(12) * 2)
    assert rt.misuse == []


def test_pinned_buffers_outlive_the_copies_that_still_read_them(rt):
    s1 = rt.new_stream()
    releases = []
    staged = StagedBackend(_Doubler(lambda k: releases.append(rt.stall(s1)) if k == 0 else None),
                           chunk_bytes=1 << 20)
    x1 = dev(rt, np.arange(16, dtype=np.float32))
    staged.all_reduce(as_ref(x1, "x"), ReduceOp.SUM, timeout=5, stream=s1)  # copy back queued
    staged.inner.on_chunk = None
    x2 = dev(rt, np.full(64, 7.0, np.float32))  # larger: new pinned buffers replace the pair
    staged.all_reduce(as_ref(x2, "x"), ReduceOp.SUM, timeout=5)
    x3 = dev(rt, np.full(16, -5.0, np.float32))  # staged whole: new pinned buffers again
    out3 = dev(rt, np.zeros(16, np.float32))
    staged.all_gather(as_ref(x3, "x"), as_ref(out3, "out"), timeout=5)
    releases.pop()()
    np.testing.assert_array_equal(x1.get(stream=s1), np.arange(16) * 2)
    np.testing.assert_array_equal(x2.get(), np.full(64, 14.0))
    np.testing.assert_array_equal(out3.get(), np.full(16, -5.0))


# ---- 11. avg: what each backend computes, at the tolerance that follows -----------------------

@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("backend", ["nccl", "ring"])
def test_avg_is_within_the_derived_tolerance_of_the_exact_mean(store_addr, backend, dtype):
    got = spawn(hazard_ranks.avg_values, 3, store_addr, backend, dtype, timeout=60)
    assert got[0] == got[1] == got[2]


def test_the_gpu_docs_say_what_avg_computes_on_each_backend_and_the_tolerance():
    import pathlib

    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "gpus.md").read_text()
    section = text[text.index("### avg"):]
    assert "fl(1/n)" in section and "then divided" in section
    assert "(n + 1)" in section and "eps" in section


# ---- 12. NCCL's result codes; CUDA graph capture ----------------------------------------------

def test_an_asynchronous_ncclTimeout_is_a_collective_timeout_naming_it(rt, solo):
    release = rt.stall(0)
    work = solo.all_reduce(dev(rt, np.ones(2, np.float32)), async_op=True)
    solo._backend._nc.comm.inject_error(TIMEOUT)
    with pytest.raises(CollectiveTimeout, match=re.escape("all_reduce on rank 0 of 1: NCCL "
                                                          "failed (ncclTimeout)")):
        work.synchronize(timeout=20)
    release()


def test_a_collective_on_a_capturing_stream_is_refused_before_anything_is_enqueued(rt, solo):
    s = rt.new_stream()
    x = dev(rt, np.ones(2, np.float32))
    with rt.capturing(s), pytest.raises(UsageError, match="capturing a CUDA graph"):
        solo.all_reduce(x, stream=s)
    assert solo._backend._nc.comm.calls == []
    staged = StagedBackend(_Doubler())
    with rt.capturing(s), pytest.raises(UsageError, match="capturing a CUDA graph"):
        staged.all_reduce(as_ref(x, "x"), ReduceOp.SUM, timeout=5, stream=s)
    assert staged.inner.chunks == 0


def _counting(rt, monkeypatch, *names):
    """Count the runtime's calls of ``names`` (allocations, copies) from here on."""
    seen = {name: 0 for name in names}
    for name in names:
        real = getattr(rt, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            seen[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(rt, name, counted)
    return seen


def test_a_numpy_collective_on_a_capturing_stream_is_refused_before_anything_is_staged(
        rt, solo, monkeypatch):
    s = rt.new_stream()
    seen = _counting(rt, monkeypatch, "alloc_pinned", "alloc_device", "memcpy_async")
    x = np.ones(1 << 16, np.float32)
    with rt.capturing(s), pytest.raises(UsageError, match="capturing a CUDA graph"):
        solo.all_reduce(x, stream=s)
    assert seen == {"alloc_pinned": 0, "alloc_device": 0, "memcpy_async": 0}
    assert solo._backend._nc.comm.calls == [] and (x == 1).all()


def test_a_numpy_array_a_collective_writes_is_staged_through_one_pinned_buffer(
        rt, solo, monkeypatch):
    seen = _counting(rt, monkeypatch, "alloc_pinned")
    x = np.arange(1 << 16, dtype=np.float32)
    solo.all_reduce(x)
    assert seen["alloc_pinned"] == 1 and (x == np.arange(1 << 16)).all()


def test_a_held_buffer_is_let_go_once_its_event_completes_though_an_earlier_one_never_does():
    import gc
    import types
    import weakref

    from gpucoll import cuda

    class Buffer:
        pass

    stuck, done = types.SimpleNamespace(done=False), types.SimpleNamespace(done=True)
    first, later = Buffer(), Buffer()
    gone = weakref.ref(later)
    cuda.hold(stuck, first)  # an event that never completes (a stalled stream)
    cuda.hold(done, later)
    del later
    pending = types.SimpleNamespace(done=False)
    cuda.hold(pending, Buffer())  # any later hold lets go of it
    gc.collect()
    try:
        assert gone() is None
        assert any(first in objects for _, objects in cuda._held)
    finally:
        stuck.done = pending.done = True
        cuda.hold(done)


# ---- CUDA graphs captured by other threads in global mode ------------------------------------

def test_the_watchdog_polls_without_invalidating_a_graph_another_thread_captures(rt, solo):
    s = rt.new_stream()
    release = rt.stall(s)  # the call stays unfinished: the watchdog keeps querying its event
    work = solo.all_reduce(dev(rt, np.ones(2, np.float32)), stream=s, async_op=True)
    with rt.capturing(rt.new_stream()) as capture:  # global mode: CUDA's and torch's default
        time.sleep(0.3)
    release()
    work.synchronize(timeout=10)
    assert capture.invalidated is None
    assert solo._backend.failure() is None


def test_a_held_buffer_stays_while_a_capture_refuses_the_query_of_its_event(rt):
    import gc
    import weakref

    from gpucoll import cuda

    class Buffer:
        pass

    s = rt.new_stream()
    release = rt.stall(s)
    unfinished, buffer = rt.record_event(s), Buffer()
    kept = weakref.ref(buffer)
    cuda.hold(unfinished, buffer)
    del buffer
    capturing, end = threading.Event(), threading.Event()

    def capture() -> None:
        with rt.capturing(rt.new_stream()):
            capturing.set()
            end.wait(10)

    other = threading.Thread(target=capture)
    other.start()
    capturing.wait(10)
    try:
        cuda.hold(unfinished)  # this thread's query is refused: the event is not done
        gc.collect()
        assert kept() is not None
    finally:
        end.set()
        other.join()
        release()
        unfinished.synchronize()
        cuda.hold(rt.record_event(s))


# ---- one communicator's calls run in issue order, whatever their streams ---------------------

def test_a_collective_after_a_receive_posted_before_its_send_completes(store_addr):
    assert spawn(hazard_ranks.receive_then_collective, 2, store_addr, True,
                 timeout=60) == ["done", "done"]


def test_a_collective_held_back_by_an_unmatched_receive_times_out_on_every_rank(store_addr):
    got = spawn(hazard_ranks.receive_then_collective, 2, store_addr, False, timeout=60)
    assert all(g.startswith("CollectiveTimeout: all_reduce on rank") for g in got), got


def test_a_rank_whose_call_timed_out_is_named_to_its_live_peers_at_once(store_addr):
    said = spawn(hazard_ranks.stuck_peer_of_a_timed_out_rank, 2, store_addr, timeout=60)[1]
    seconds, _, text = said.partition(" s: ")
    assert float(seconds) < 5, said
    assert "rank 0's NCCL communicator failed: all_reduce on rank 0 of 2 did not complete " \
           "within 1 s" in text, said


def test_close_stops_waiting_for_a_destroy_that_does_not_return_at_its_deadline(rt, store_addr):
    comm = create("nccl", rank=0, world_size=1, store=store_addr, timeout=1)
    handle, stuck = comm._backend._nc.comm, threading.Event()
    destroy = handle.destroy

    def hanging() -> None:  # the driver never returns from ncclCommDestroy
        stuck.wait(20)
        destroy()

    handle.destroy = hanging
    started = time.monotonic()
    try:
        comm.close()
        assert time.monotonic() - started < 5
    finally:
        stuck.set()


def test_a_later_call_that_must_connect_another_algorithm_waits_for_it(store_addr):
    for before, after, right in spawn(hazard_ranks.a_later_call_that_connects, 2, store_addr,
                                      timeout=60):
        assert before == [("coll", "tree")] and after == [("coll", "ring")] and right


@pytest.mark.parametrize("own", [True, False], ids=["gpucoll-thread", "other-thread"])
def test_only_gpucolls_own_threads_query_events_in_thread_local_capture_mode(rt, own):
    """gpucoll's polling threads (the NCCL watchdog, the ring's worker, which runs the staged
    ring's asynchronous calls) leave a graph captured elsewhere intact; a thread of the
    program's, in CUDA's default global mode, invalidates it, as CUDA does."""
    from gpucoll import cuda

    event, seen = rt.record_event(rt.new_stream()), []
    rt.synchronize()  # the event has completed

    def poll() -> None:
        if own:
            cuda.own_thread()
        seen.append(cuda.event_done(event))

    with rt.capturing(rt.new_stream()) as capture:
        thread = threading.Thread(target=poll)
        thread.start()
        thread.join(10)
    assert (capture.invalidated is None) is own
    assert seen == [own]  # refused by the capture: not done (though it is)
