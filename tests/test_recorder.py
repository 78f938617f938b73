"""The flight recorder: what it keeps of each call, how much, and what a dump holds."""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest
from multiproc import spawn

import gpucoll
from gpucoll.arrays import as_ref
from gpucoll.dumps import write_files
from gpucoll.ops import ReduceOp
from gpucoll.progress import KIND, Recorder, clock, size_from_env

pytestmark = pytest.mark.timeout(120)


def _call(rec: Recorder, seq: int, ok: bool = True, **fields) -> None:
    """As the communicator records a collective that runs now."""
    rec.signature(seq, KIND["all_reduce"], as_ref(np.zeros(3, np.float32), "x"), fields)
    rec.keep((rec.current, clock()))
    rec.keep(clock() if ok else -clock())


def test_a_record_says_the_call_its_arguments_times_and_state():
    rec = Recorder(8)
    _call(rec, 0, op=ReduceOp.MAX)
    _call(rec, 1, ok=False, op=ReduceOp.SUM)
    rec.signature(2, KIND["broadcast"], None, {"root": 1})
    rec.issued()
    rec.point_to_point(KIND["send"], as_ref(np.zeros(5, np.int64), "x"), 3)
    rec.posted()
    first, failed, issued, posted = rec.records()
    assert {k: first[k] for k in ("call", "seq", "dtype", "count", "op", "state")} == {
        "call": "all_reduce", "seq": 0, "dtype": "float32", "count": 3, "op": "max",
        "state": "done"}
    assert first["queued"] == first["started"] <= first["ended"]
    assert failed["state"] == "failed" and failed["ended"] >= failed["started"]
    assert issued["state"] == "issued" and issued["root"] == 1 and issued["started"] is None
    assert {k: posted[k] for k in ("call", "seq", "dtype", "count", "peer", "state")} == {
        "call": "send", "seq": -1, "dtype": "int64", "count": 5, "peer": 3, "state": "posted"}


def test_an_async_call_is_queued_then_started_then_ended():
    rec = Recorder(8)
    rec.signature(0, KIND["all_reduce"], as_ref(np.zeros(2), "x"), {"op": ReduceOp.SUM})
    n = rec.issued()
    _call(rec, 1)  # a call made while the first waits in the queue
    rec.keep(("S", n, clock()))
    rec.keep(("E", n, clock()))
    queued, now = rec.records()
    assert queued["seq"] == 0 and queued["state"] == "done"
    assert queued["queued"] <= queued["started"] <= queued["ended"]
    assert now["seq"] == 1 and now["state"] == "done"


def test_a_record_keeps_no_array_alive():
    import gc
    import weakref

    rec = Recorder(8)
    x = np.zeros(1000, np.float32)
    gone = weakref.ref(x)
    rec.signature(0, KIND["all_reduce"], as_ref(x, "x"), {"op": ReduceOp.SUM})
    rec.keep((rec.current, clock()))
    rec.keep(clock())
    rec.point_to_point(KIND["send"], as_ref(x, "x"), 1)
    rec.posted()
    del x
    gc.collect()
    assert gone() is None and len(rec.records()) == 2


def test_a_fused_call_whose_ops_differ_by_dtype_records_no_single_op():
    rec = Recorder(8)
    rec.signature(0, KIND["all_reduce_many"], None, {"op": ["max", "sum"]})
    rec.issued()
    (entry,) = rec.records()
    assert "op" not in entry and entry["seq"] == 0


def test_the_recorder_keeps_the_last_n_calls_oldest_first():
    rec = Recorder(5)
    for seq in range(12):
        _call(rec, seq)
    assert [r["seq"] for r in rec.records()] == [7, 8, 9, 10, 11]


def test_a_size_of_zero_keeps_nothing():
    rec = Recorder(0)
    _call(rec, 0)
    assert rec.records() == [] and len(rec.entries) == 0


@pytest.mark.parametrize("raw, size", [("", 2000), ("0", 0), ("17", 17), (" 5 ", 5)])
def test_the_trace_size_comes_from_the_environment(raw, size):
    assert size_from_env({"GPUCOLL_TRACE_SIZE": raw}) == size


@pytest.mark.parametrize("raw", ["-1", "many", "1e3", str(1 << 30)])
def test_a_bad_trace_size_is_an_error_naming_the_variable(raw):
    with pytest.raises(ValueError, match="GPUCOLL_TRACE_SIZE"):
        size_from_env({"GPUCOLL_TRACE_SIZE": raw})


def test_a_bad_trace_size_fails_init_before_anything_is_made(monkeypatch):
    import threading

    before = {t.name for t in threading.enumerate()}
    monkeypatch.setenv("GPUCOLL_TRACE_SIZE", "lots")
    with pytest.raises(ValueError, match="GPUCOLL_TRACE_SIZE='lots'"):
        gpucoll.init("ring", rank=0, world_size=1)
    assert {t.name for t in threading.enumerate()} == before  # no store server, no listener


def _every_kind_of_call(rank, n, addr, directory):
    with gpucoll.init("ring", rank=rank, world_size=n, store=addr, timeout=60) as comm:
        x = np.arange(4, dtype=np.float64)
        comm.all_reduce(x, op="max")
        comm.broadcast(x, root=1)
        comm.all_gather(np.ones(2, np.int32))
        comm.scatter(np.zeros((n, 3), np.int16) if rank == 0 else None, root=0)
        comm.all_reduce(x, async_op=True).wait()
        if rank == 0:
            comm.send(np.ones(5, np.uint8), 1)
        else:
            comm.recv(np.zeros(5, np.uint8), 0)
        work = comm.send(x, 1) if rank == 0 else comm.recv(x, 0, async_op=True)
        if work is not None:
            work.wait()
        with comm.split(0) as sub:
            sub.barrier()
            write_files(directory, "test")


def test_a_dump_holds_every_call_of_every_communicator_of_the_rank(store_addr, tmp_path):
    spawn(_every_kind_of_call, 2, store_addr, str(tmp_path))
    for rank in range(2):
        lines = [json.loads(line) for line in open(tmp_path / f"rank-{rank}.trace.jsonl")]
        process, *rest = lines
        assert process["type"] == "process" and process["rank"] == rank
        assert process["pid"] > 0 and process["reason"] == "test"
        groups = [line for line in rest if line["type"] == "group"]
        assert [g["group"] for g in groups] == ["gpucoll/jobs/anonymous/0",
                                                "gpucoll/jobs/anonymous/0/split/0/0"]
        assert all(g["rank"] == rank and g["size"] == 2 and g["error"] is None
                   for g in groups)
        calls = [line for line in rest if line["type"] == "call"
                 and line["group"] == groups[0]["group"]]
        said = [(c["call"], c["seq"], c.get("dtype"), c.get("count"), c.get("op"),
                 c.get("root"), c.get("peer"), c["state"]) for c in calls]
        p2p = "send" if rank == 0 else "recv"
        assert said == [
            ("all_reduce", 0, "float64", 4, "max", None, None, "done"),
            ("broadcast", 1, "float64", 4, None, 1, None, "done"),
            ("all_gather", 2, "int32", 2, None, None, None, "done"),
            # scatter agrees on the slot layout first (a call of its own), then moves the data;
            # a rank without out= does not know the slot's layout
            *[("scatter", 3, *(("int16", 3) if rank == 0 else (None, None)), None, 0, None,
               "done")] * 2,
            ("all_reduce", 4, "float64", 4, "sum", None, None, "done"),
            (p2p, -1, "uint8", 5, None, None, 1 - rank, "done"),
            (p2p, -1, "float64", 4, None, None, 1 - rank, "done" if rank == 0 else "posted"),
            ("split", 5, None, None, None, None, None, "done"),
        ]
        asynchronous = next(c for c in calls if c["seq"] == 4)
        assert asynchronous["queued"] <= asynchronous["started"] <= asynchronous["ended"]
        assert asynchronous["queued"] < asynchronous["started"]  # queued, then run by the worker
        sub_calls = [line["call"] for line in rest if line["type"] == "call"
                     and line["group"] == groups[1]["group"]]
        assert sub_calls == ["barrier"]


def _no_dump_without_a_directory(rank, n, addr):
    os.chdir(os.environ["WORKDIR"])
    with gpucoll.init("ring", rank=rank, world_size=n, store=addr, timeout=60) as comm:
        comm.barrier()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        with pytest.raises(gpucoll.PeerFailure):
            comm.barrier()


def test_a_failure_writes_no_file_when_no_directory_is_set(store_addr, tmp_path):
    spawn(_no_dump_without_a_directory, 2, store_addr, check=False,
          env={"GPUCOLL_TRACE_DIR": "", "WORKDIR": str(tmp_path)})
    assert os.listdir(tmp_path) == []


def test_a_directory_that_cannot_be_written_is_said_and_nothing_else_breaks(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with gpucoll.init("ring", rank=0, world_size=1) as comm:
        comm.barrier()
        assert write_files(str(blocker), "test") == []
        comm.barrier()
    assert f"could not write its flight recorder to {blocker}/rank-0.trace.jsonl" in \
        capsys.readouterr().err
