"""Communicator behaviour beyond single results: async ordering, out=, strided inputs, split,
init and the default communicator, closing.

Scenarios that leave the group healthy share one 3-rank spawn (``_scenarios``); each test reads
its scenario's outcome from that run.
"""

from __future__ import annotations

import functools
import threading

import numpy as np
import pytest
from multiproc import spawn

import gpucoll
from gpucoll.store import TCPStore


@pytest.fixture(autouse=True)
def _close_the_default_communicator():
    """A test that fails half-way must not leave its default communicator to the next one."""
    yield
    gpucoll.close()


def async_ops_complete_in_issue_order(comm):
    x = np.ones(5, dtype=np.int64)
    works = [comm.all_reduce(x, async_op=True) for _ in range(3)]  # x -> n, n^2, n^3
    y = np.full(70001, comm.rank, dtype=np.float64)
    works.append(comm.broadcast(y, root=comm.size - 1, async_op=True))
    last = works[-1].wait()
    assert last is y and (y == comm.size - 1).all()
    assert all(w.is_completed() for w in works)
    assert (x == comm.size ** 3).all()


def small_async_calls_among_other_calls_keep_issue_order(comm):
    n, r = comm.size, comm.rank
    total = n * (n + 1) // 2
    x = np.full((2, 3), r + 1, np.int64)  # 2-D: reduced through its flat view
    big = np.ones(300_000, np.int64)  # beyond the small messages
    y = np.full(3, float(r), np.float64)
    works = [comm.all_reduce(x, async_op=True),  # x -> total
             comm.all_reduce(big, async_op=True),
             comm.all_reduce(x, op="prod", async_op=True),  # -> total ** n (n! if run first)
             comm.all_reduce(y, op="avg", async_op=True)]
    z = np.zeros(2, np.int64)
    posted = [comm.send(np.full(2, r, np.int64), (r + 1) % n, async_op=True),
              comm.recv(z, (r - 1) % n, async_op=True)]
    works.append(comm.all_reduce(x, op="max", async_op=True))  # behind posted messages
    assert comm.all_reduce(np.array([1]))[0] == n  # a synchronous call runs after them all
    assert all(w.is_completed() for w in works)
    for w in posted:
        w.wait(timeout=30)
    results = [x, big, x, y, x]
    assert [w.wait(timeout=0) is a for w, a in zip(works, results, strict=True)] == [True] * 5
    assert works[0].result() is x and (x == total ** n).all() and x.shape == (2, 3)
    assert (big == n).all() and (y == (n - 1) / 2).all() and (z == (r - 1) % n).all()
    b = np.full((3, 2), r, np.int16)
    casts = [comm.broadcast(b, root=n - 1, async_op=True),  # b -> n - 1 everywhere
             comm.all_reduce(b, async_op=True),  # -> n * (n - 1): after the broadcast
             comm.broadcast(b, root=0, async_op=True)]  # the same on every rank by then
    assert casts[2].wait() is b and (b == n * (n - 1)).all() and casts[0].is_completed()


def async_work_returns_the_result_array(comm):
    work = comm.all_gather(np.array([comm.rank]), async_op=True)
    out = work.wait()
    assert out.tolist() == [[r] for r in range(comm.size)]
    assert work.result() is out


def sync_call_sees_earlier_async_results(comm):
    x = np.ones(3, dtype=np.int32)
    comm.all_reduce(x, async_op=True)
    total = comm.all_reduce(x)  # runs after the async call, on its result
    assert (total == comm.size * comm.size).all()


def async_validation_errors_raise_at_the_call(comm):
    with pytest.raises(ValueError, match="root=99"):
        comm.broadcast(np.zeros(1), root=99, async_op=True)


def out_buffers_are_filled_and_returned(comm):
    x = np.arange(4, dtype=np.float32) + comm.rank
    out = np.empty((comm.size, 4), dtype=np.float32)
    assert comm.all_gather(x, out=out) is out
    assert out.tolist() == [(np.arange(4) + r).tolist() for r in range(comm.size)]
    red = np.empty(2, dtype=np.float32)
    assert comm.reduce_scatter(np.ones((comm.size, 2), np.float32), out=red) is red
    assert (red == comm.size).all()


def out_of_place_and_in_place_all_reduce_meet_in_one_call(comm):
    x = np.arange(6, dtype=np.int64) + comm.rank
    if comm.rank % 2:  # odd ranks out of place, even ranks in place
        out = np.full(6, -1, np.int64)
        assert comm.all_reduce(x, out=out) is out
        assert x.tolist() == (np.arange(6) + comm.rank).tolist()
        x = out
    else:
        assert comm.all_reduce(x) is x
    assert x.tolist() == sum(np.arange(6) + r for r in range(comm.size)).tolist()


def strided_inputs_are_reduced_and_written_back(comm):
    x = np.zeros((4, 6), dtype=np.int32)
    col = x[:, 1]  # a strided view
    col[:] = comm.rank + 1
    assert comm.all_reduce(col) is col
    assert (x[:, 1] == sum(range(1, comm.size + 1))).all() and (x[:, 0] == 0).all()
    gathered = comm.all_gather(np.arange(10)[::3])
    assert gathered.shape == (comm.size, 4)


def buffer_protocol_objects_work(comm):
    buf = bytearray([comm.rank + 1] * 3)
    comm.all_reduce(buf, op="max")
    assert list(buf) == [comm.size] * 3


def split_by_parity_orders_ranks_by_key(comm):
    sub = comm.split(comm.rank % 2, key=-comm.rank)
    members = [r for r in range(comm.size) if r % 2 == comm.rank % 2]
    assert sub.size == len(members) and sub.backend == comm.backend
    assert sub.rank == sorted(members, reverse=True).index(comm.rank)
    got = sub.all_gather(np.array([comm.rank]))
    assert got.ravel().tolist() == sorted(members, reverse=True)
    sub.close()


def split_with_color_none_returns_none(comm):
    sub = comm.split(None if comm.rank == 0 else 7)
    if comm.rank == 0:
        assert sub is None
    else:
        assert sub.size == comm.size - 1 and sub.rank == comm.rank - 1
        assert int(sub.all_reduce(np.array([1]))[0]) == comm.size - 1
        sub.close()


def split_of_a_split_works(comm):
    sub = comm.split(0)
    subsub = sub.split(sub.rank // 2)
    assert int(subsub.all_reduce(np.array([1]))[0]) == subsub.size
    comm.barrier()
    sub.close()
    assert subsub.closed  # closing a communicator closes those split from it


def bad_arguments_leave_the_group_usable(comm):
    for bad in (lambda: comm.all_reduce(np.zeros(2, np.float32), op="bxor"),
                lambda: comm.reduce_scatter(np.zeros((comm.size + 1, 2))),
                lambda: comm.broadcast(np.zeros(2), root=comm.size),
                lambda: comm.all_gather(np.zeros(2), out=np.zeros((comm.size, 2), np.int8))):
        with pytest.raises((TypeError, ValueError)):
            bad()
    assert int(comm.all_reduce(np.array([1]))[0]) == comm.size


SCENARIOS = [
    async_ops_complete_in_issue_order,
    small_async_calls_among_other_calls_keep_issue_order,
    async_work_returns_the_result_array,
    sync_call_sees_earlier_async_results,
    async_validation_errors_raise_at_the_call,
    out_buffers_are_filled_and_returned,
    out_of_place_and_in_place_all_reduce_meet_in_one_call,
    strided_inputs_are_reduced_and_written_back,
    buffer_protocol_objects_work,
    split_by_parity_orders_ranks_by_key,
    split_with_color_none_returns_none,
    split_of_a_split_works,
    bad_arguments_leave_the_group_usable,
]


def _scenarios(rank: int, n: int, addr: str) -> dict:
    import traceback

    report = {}
    with gpucoll.init("ring", rank=rank, world_size=n, store=addr, timeout=30) as comm:
        for scenario in SCENARIOS:
            try:
                scenario(comm)
                report[scenario.__name__] = None
            except Exception:
                report[scenario.__name__] = traceback.format_exc()
            comm.barrier()
    report["threads"] = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    return report


@functools.cache
def _reports(size: int) -> list[dict]:
    server = TCPStore("127.0.0.1", 0, is_server=True, timeout=60)
    try:
        return spawn(_scenarios, size, f"tcp://127.0.0.1:{server.port}", timeout=120)
    finally:
        server.close()


@pytest.mark.parametrize("scenario", [s.__name__ for s in SCENARIOS])
def test_scenario_on_three_ranks(scenario):
    errors = [f"### rank {r}\n{rep[scenario]}" for r, rep in enumerate(_reports(3))
              if rep[scenario]]
    assert not errors, "\n".join(errors)


def test_no_thread_outlives_close():
    assert all(rep["threads"] == [] for rep in _reports(3)), [r["threads"] for r in _reports(3)]


def _module_level(rank: int, n: int, addr: str) -> list:
    first = gpucoll.init("ring", rank=rank, world_size=n, store=addr, timeout=30)
    assert gpucoll.is_initialized() and gpucoll.get_default() is first
    x = gpucoll.all_reduce(np.array([gpucoll.get_rank() + 1.0]))
    sizes = gpucoll.all_gather(np.array([gpucoll.get_world_size()]))
    with pytest.raises(RuntimeError, match="already initialised"):
        gpucoll.init("ring", rank=rank, world_size=n, store=addr)
    gpucoll.close()
    assert not gpucoll.is_initialized() and first.closed
    second = gpucoll.init(rank=rank, world_size=n, store=addr, timeout=30)  # a fresh namespace
    y = gpucoll.broadcast(np.array([rank]), root=1)
    gpucoll.close()
    return [float(x[0]), sizes.ravel().tolist(), int(y[0]), second.backend]


def test_module_level_functions_act_on_the_default_communicator(store_addr):
    results = spawn(_module_level, 2, store_addr, timeout=60)
    assert results == [[3.0, [2, 2], 1, "ring"]] * 2


def test_functions_before_init_say_to_call_init():
    with pytest.raises(RuntimeError, match=r"call gpucoll.init\(\) first"):
        gpucoll.get_rank()


def test_one_rank_world_needs_no_store_or_launcher():
    with gpucoll.init("ring", rank=0, world_size=1) as comm:
        assert (comm.rank, comm.size) == (0, 1)
        assert comm.all_reduce(np.array([2.5]))[0] == 2.5
        assert comm.scatter(np.arange(3).reshape(1, 3)).tolist() == [0, 1, 2]
        store = comm._owned_store
    assert store._closed  # the communicator closes the store it created
    gpucoll.close()


def test_an_async_all_reduce_of_one_rank_is_complete_when_issued_and_keeps_the_values():
    with gpucoll.init("ring", rank=0, world_size=1) as comm:
        x = np.arange(4.0)
        for op in ("avg", "sum"):  # the first call of an op and dtype has them checked in full
            comm.all_reduce(x, op=op)
        works = [comm.all_reduce(x, op="avg", async_op=True), comm.all_reduce(x, async_op=True)]
        assert [w.is_completed() for w in works] == [True, True]  # no hand-off to a thread
        assert all(w.wait(timeout=0) is x for w in works) and x.tolist() == [0.0, 1.0, 2.0, 3.0]
    gpucoll.close()


def test_init_reads_rank_and_size_from_the_environment(monkeypatch):
    monkeypatch.setenv("GPUCOLL_RANK", "0")
    monkeypatch.setenv("GPUCOLL_WORLD_SIZE", "1")
    with gpucoll.init("ring") as comm:
        assert (comm.rank, comm.size, comm.backend) == (0, 1, "ring")
    gpucoll.close()


def test_init_refuses_rank_without_world_size():
    with pytest.raises(ValueError, match="pass both rank and world_size"):
        gpucoll.init(rank=0)


def test_init_refuses_an_unknown_backend():
    with pytest.raises(ValueError, match=r"backend='mpi' is not a backend; expected one of"):
        gpucoll.init("mpi", rank=0, world_size=1)


def test_init_accepts_a_store_object_and_leaves_it_open(store_server):
    with gpucoll.init("ring", rank=0, world_size=1, store=store_server) as comm:
        comm.barrier()
    gpucoll.close()
    assert store_server.add("still-open", 1) == 1


def _from_launcher_env(rank: int, n: int, addr: str) -> list:
    import os

    os.environ.update({"GPUCOLL_RANK": str(rank), "GPUCOLL_WORLD_SIZE": str(n),
                       "GPUCOLL_LOCAL_RANK": str(rank), "GPUCOLL_LOCAL_WORLD_SIZE": str(n),
                       "GPUCOLL_STORE": addr})
    with gpucoll.init("ring", timeout=30) as comm:
        total = comm.all_reduce(np.array([comm.rank + 1]))
        result = [comm.rank, comm.size, int(total[0])]
    gpucoll.close()
    return result


def test_init_without_arguments_joins_the_group_the_environment_names(store_addr):
    assert spawn(_from_launcher_env, 3, store_addr, timeout=60) == [[0, 3, 6], [1, 3, 6],
                                                                    [2, 3, 6]]


def test_init_with_an_unusable_backend_raises_and_leaves_nothing_open(rt, monkeypatch):
    import gpucoll.default as default
    from gpucoll.store import TCPStore

    def no_nccl4py():  # unusable here whether or not this machine has a GPU
        raise ModuleNotFoundError("No module named 'nccl'")

    monkeypatch.setattr(rt, "nccl", no_nccl4py)
    made = []

    class Recorded(TCPStore):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr("gpucoll.store.TCPStore", Recorded)
    with pytest.raises(gpucoll.BackendUnavailable, match="nccl backend on rank 0"):
        default.init("nccl", rank=0, world_size=1)
    assert not gpucoll.is_initialized()
    assert made and all(store._closed for store in made)


def test_gpucoll_backend_environment_variable_stands_in_for_auto(monkeypatch):
    from gpucoll.backends import requested_name

    monkeypatch.setenv("GPUCOLL_BACKEND", "ring")
    assert requested_name("auto") == "ring" and requested_name("nccl") == "nccl"
    monkeypatch.setenv("GPUCOLL_BACKEND", "gloo")
    with pytest.raises(ValueError, match="backend='gloo' is not a backend"):
        requested_name("auto")


def _torch_cpu_tensors(rank: int, n: int, addr: str) -> list:
    import torch

    with gpucoll.init("ring", rank=rank, world_size=n, store=addr, timeout=30) as comm:
        t = torch.full((3,), float(rank + 1))
        same = comm.all_reduce(t) is t
        gathered = comm.all_gather(torch.tensor([rank]))
    return [same, t.tolist(), type(gathered).__name__, gathered.tolist()]


@pytest.mark.slow
def test_torch_cpu_tensors_are_reduced_in_place_and_new_results_are_numpy(store_addr):
    pytest.importorskip("torch")
    assert spawn(_torch_cpu_tensors, 2, store_addr, timeout=90) == \
        [[True, [3.0, 3.0, 3.0], "ndarray", [[0], [1]]]] * 2


def test_a_closed_communicator_leaves_out_untouched(store_addr):
    comm = gpucoll.init("ring", rank=0, world_size=1, store=store_addr, timeout=10)
    comm.close()
    out = np.full(3, -1.0)
    with pytest.raises(ValueError, match="closed"):
        comm.all_reduce(np.ones(3), out=out)
    assert (out == -1).all()


# -- an uncaught exception --------------------------------------------------------------------
class _Aborts:
    """Stands in for an open communicator: records its aborts."""

    def __init__(self):
        self.reasons: list[str] = []

    def abort(self, reason: str) -> None:
        self.reasons.append(reason)


def _hooked(monkeypatch) -> tuple[_Aborts, list, object]:
    from gpucoll import communicator

    comm, printed = _Aborts(), []
    monkeypatch.setattr(communicator, "_LIVE", {comm})
    return comm, printed, communicator._abort_on_uncaught(lambda *exc: printed.append(exc[1]))


def test_an_uncaught_exception_aborts_every_open_communicator_then_is_printed(monkeypatch):
    comm, printed, hook = _hooked(monkeypatch)
    error = ValueError("the data loader ran dry")
    hook(ValueError, error, None)
    assert comm.reasons == ["uncaught ValueError: the data loader ran dry"]
    assert printed == [error]


def test_an_exception_at_an_interactive_prompt_aborts_nothing(monkeypatch):
    import sys

    comm, printed, hook = _hooked(monkeypatch)
    monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)
    hook(NameError, NameError("a typo"), None)
    assert comm.reasons == [] and len(printed) == 1


def test_the_abort_hook_is_installed_once_in_front_of_the_one_before(monkeypatch):
    import sys

    from gpucoll import communicator

    before = []
    monkeypatch.setattr(sys, "excepthook", lambda *exc: before.append(exc[1]))
    communicator._install_abort_hook()
    hook = sys.excepthook
    communicator._install_abort_hook()
    assert sys.excepthook is hook
    monkeypatch.setattr(communicator, "_LIVE", set())
    hook(KeyError, KeyError("k"), None)
    assert len(before) == 1
