"""Job after job on one long-lived store: each communicator gets a namespace of its own that
every rank of its group agrees on, whatever the jobs before left behind, and deletes it when
its last rank closes it."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
from multiproc import spawn
from store_wire import standalone_store

import gpucoll
from gpucoll import TCPStore


def _job(rank: int, n: int, addr: str, plan: dict) -> list[float]:
    """One rank of a job: join the group at ``addr``, all_reduce, close. ``plan["crash"]``
    names a rank that kills itself after its first all_reduce; ``plan["env"]`` starts from
    the launcher's variables instead of explicit arguments."""
    if plan.get("env"):
        os.environ.update(GPUCOLL_RANK=str(rank), GPUCOLL_WORLD_SIZE=str(n), GPUCOLL_STORE=addr)
        comm = gpucoll.init("ring", timeout=plan.get("timeout", 60))
    else:
        comm = gpucoll.init("ring", rank=rank, world_size=n, store=addr,
                            timeout=plan.get("timeout", 60))
    with comm:
        x = np.full(4, rank + 1.0)
        comm.all_reduce(x)
        if rank == plan.get("crash"):
            os.kill(os.getpid(), signal.SIGKILL)
        comm.barrier()
        return x.tolist()


def run_job(addr: str, n: int, **plan) -> list:
    env = {"GPUCOLL_JOB_ID": plan.pop("job")} if "job" in plan else None
    return spawn(_job, n, addr, plan, timeout=90, env=env, check="crash" not in plan)


def total(n: int) -> list[float]:
    return [float(n * (n + 1) // 2)] * 4


@pytest.fixture(params=["gpucoll store", "TCPStore server"])
def long_lived(request, store_server):
    """A store that outlives the jobs: the standalone command, or a server of the test's own;
    yields (address, a client of it)."""
    if request.param == "TCPStore server":
        yield f"tcp://127.0.0.1:{store_server.port}", store_server
        return
    with standalone_store() as (_, port, _):
        with TCPStore("127.0.0.1", port, timeout=30) as client:
            yield f"tcp://127.0.0.1:{port}", client


# ----------------------------------------------------------------------------- jobs in a row
def test_jobs_one_after_another_each_start_and_leave_no_keys(long_lived):
    addr, store = long_lived
    assert run_job(addr, 2) == [total(2)] * 2
    assert run_job(addr, 2, env=True) == [total(2)] * 2
    assert run_job(addr, 3) == [total(3)] * 3
    assert store.num_keys() == 0


def test_jobs_after_a_job_that_crashed_half_way_start_and_run(long_lived):
    addr, store = long_lived
    crashed = run_job(addr, 3, crash=2)
    assert crashed[2].exitcode == -signal.SIGKILL
    assert all(isinstance(o.error, gpucoll.PeerFailure) for o in crashed[:2])
    assert store.num_keys() > 0  # the crashed job's namespace, marked by its dead rank
    assert run_job(addr, 2) == [total(2)] * 2
    assert run_job(addr, 3) == [total(3)] * 3
    assert store.num_keys() == 0  # the second job cleared what the crashed one left


def _dies_during_start_up(rank: int, n: int, addr: str) -> None:
    """Rank 0 joins the group and is killed while it waits for rank 1, which never comes."""
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=lambda: gpucoll.init("ring", rank=0, world_size=n, store=addr,
                                                 timeout=60), daemon=True).start()
    host, port = gpucoll.store.parse_address(addr)
    with TCPStore(host, port, timeout=30) as probe:
        probe.wait(["gpucoll/jobs/anonymous/0/member/0"], timeout=30)
    os.kill(os.getpid(), signal.SIGKILL)


def test_jobs_after_a_job_that_crashed_during_start_up_start_and_run(long_lived):
    addr, store = long_lived
    outcomes = spawn(_dies_during_start_up, 2, addr, timeout=60, check=False)
    assert [o.exitcode for o in outcomes] == [-signal.SIGKILL] * 2
    assert store.get("gpucoll/jobs/anonymous/0/gone/0", timeout=10) == b"died"
    assert run_job(addr, 2) == [total(2)] * 2
    assert run_job(addr, 2) == [total(2)] * 2
    assert store.num_keys() == 0


def test_jobs_with_their_own_ids_share_one_store_at_the_same_time(store_addr, store_server):
    results: dict[str, list] = {}
    jobs = [threading.Thread(target=lambda j=j: results.__setitem__(
        j, run_job(store_addr, 2, job=j))) for j in ("first", "second")]
    for t in jobs:
        t.start()
    for t in jobs:
        t.join(120)
    assert results == {"first": [total(2)] * 2, "second": [total(2)] * 2}
    assert store_server.num_keys() == 0


# ----------------------------------------------------------------------------- keys at close
def _cycles(rank: int, n: int, addr: str, cycles: int) -> int:
    """``cycles`` communicators in a row, each used (a split and a scatter now and then)."""
    for i in range(cycles):
        with gpucoll.init("ring", rank=rank, world_size=n, store=addr, timeout=60) as comm:
            x = np.ones(2)
            comm.all_reduce(x)
            if i % 10 == 0:
                with comm.split(0, key=-rank) as sub:
                    sub.all_reduce(x)
                comm.scatter(np.zeros((n, 2)) if rank == 0 else None, root=0)
    return cycles


def test_100_init_close_cycles_leave_no_more_keys_than_before(store_addr, store_server):
    store_server.set("unrelated", b"kept")
    before = store_server.num_keys()
    assert spawn(_cycles, 2, store_addr, 100, timeout=110) == [100, 100]
    assert store_server.num_keys() == before


def test_a_signature_checked_communicator_leaves_no_keys_either(store_addr, store_server):
    assert spawn(_cycles, 2, store_addr, 3, timeout=60, env={"GPUCOLL_DEBUG": "1"}) == [3, 3]
    assert store_server.num_keys() == 0


# ----------------------------------------------------------------------------- start-up errors
def _start(rank: int, n: int, addr: str, sizes: list[int], timeout: float) -> str:
    try:
        with gpucoll.init("ring", rank=rank, world_size=sizes[rank], store=addr,
                          timeout=timeout):
            return "started"
    except gpucoll.GpucollError as exc:
        return f"{type(exc).__name__}: {exc}"


def test_ranks_given_different_world_sizes_are_both_told_so(store_addr):
    # the rank that comes second refuses the group; the one waiting there learns it at once
    # (a deadline that load cannot reach: the test would take 60 s if the waiter were not told)
    said = spawn(_start, 2, store_addr, [2, 3], 60.0, timeout=90)
    for s in said:
        assert s.startswith("RendezvousError") and "world size 2" in s and "world size 3" in s, said


def test_a_rank_waiting_at_start_up_stops_when_the_launcher_stops_the_job(store_addr):
    from gpucoll.rendezvous import LAUNCHER_ABORT, launcher_abort
    from gpucoll.store import parse_address

    with TCPStore(*parse_address(store_addr), timeout=30) as store:
        store.set(LAUNCHER_ABORT, launcher_abort(1, 1, "rank 1 exited with status 1"))
        start = time.monotonic()
        said = _start(0, 2, store_addr, [2, 2], 60.0)
    assert said == ("PeerFailure: start-up on rank 0 of 2: the launcher is stopping the job: "
                    "rank 1 exited with status 1"), said
    assert time.monotonic() - start < 30


def _one_dies_while_another_never_comes(rank: int, n: int, addr: str) -> str:
    host, port = gpucoll.store.parse_address(addr)
    with TCPStore(host, port, timeout=60) as probe:
        if rank == 1:  # never joins while the others wait
            probe.wait(["test/release"], timeout=60)
            return "away"
        if rank == 2:
            threading.Thread(target=lambda: gpucoll.init(
                "ring", rank=2, world_size=n, store=addr, timeout=60), daemon=True).start()
            # dies once it and rank 0 have joined (dead before rank 0 came, it would look
            # like the leftovers of an earlier job, which rank 0 skips)
            probe.wait([f"gpucoll/jobs/anonymous/0/member/{r}" for r in (0, 2)], timeout=30)
            os.kill(os.getpid(), signal.SIGKILL)
        start = time.monotonic()
        said = _start(rank, n, addr, [n] * n, 60.0)
        probe.set("test/release", b"1")
        return f"{said} ({time.monotonic() - start:.1f} s)"


def test_a_rank_that_dies_during_start_up_is_named_by_the_others_at_once(store_addr):
    outcomes = spawn(_one_dies_while_another_never_comes, 3, store_addr, timeout=90,
                     check=False)
    said = outcomes[0].value
    assert said.startswith("PeerFailure: rank 2 died during start-up on rank 0 of 3"), said
    assert float(said.rsplit("(", 1)[1].split()[0]) < 15, said
