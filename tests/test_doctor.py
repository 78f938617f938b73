"""`gpucoll doctor` on real multi-process jobs that go wrong: a stopped rank, a rank that skips a
call, a rank that calls another collective, a killed rank; from the ranks' dump files, live
through the store while the job hangs, and after the job from what the store kept. Each test
asserts what the doctor prints and its exit status.

Ranks coordinate through the test's own store (``_side``), never by sleeping.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from multiproc import spawn

import gpucoll
import gpucoll.doctor
from gpucoll.errors import CollectiveMismatch, CollectiveTimeout, PeerFailure

pytestmark = pytest.mark.timeout(180)

LONG = 60.0
SHORT = 3.0  # the timeout of the calls that are meant to time out


def _side(addr: str):
    from gpucoll.store import TCPStore, parse_address

    host, port = parse_address(addr)
    return TCPStore(host, port, timeout=LONG)


def _open(rank: int, n: int, addr: str, timeout: float = LONG):
    return gpucoll.init("ring", rank=rank, world_size=n, store=addr, timeout=timeout)


def doctor(capsys, *args: str) -> tuple[int, str]:
    """Run ``gpucoll doctor ARGS`` in this process: (exit status, what it printed)."""
    code = gpucoll.doctor.main(list(args))
    out = capsys.readouterr()
    return code, out.out + out.err


def dumps(directory) -> list[str]:
    return sorted(f for f in os.listdir(directory) if f.endswith(".trace.jsonl"))


# -- a stopped rank ----------------------------------------------------------------------------

def _one_rank_stops(rank, n, addr, timeout):
    """Three all_reduces and a barrier; then the last rank stops itself (SIGSTOP) and the
    others call all_reduce #4, which times out. The last survivor to time out kills it."""
    side = _side(addr)
    with _open(rank, n, addr, timeout) as comm:
        x = np.ones(4, np.float32)
        for _ in range(3):
            comm.all_reduce(x)
        comm.barrier()
        if rank == n - 1:
            side.set("stopped", str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)
        side.set(f"entering/{rank}", "1")
        try:
            comm.all_reduce(x)
        except (CollectiveTimeout, PeerFailure) as exc:
            if side.add("failed", 1) == n - 1:
                os.kill(int(side.get("stopped")), signal.SIGKILL)
            return type(exc).__name__


def test_a_stopped_rank_is_named_behind_from_the_dumps(store_addr, tmp_path, capsys):
    outcomes = spawn(_one_rank_stops, 3, store_addr, SHORT, check=False,
                     env={"GPUCOLL_TRACE_DIR": str(tmp_path)})
    assert [o.value for o in outcomes[:2]] == ["CollectiveTimeout"] * 2
    assert dumps(tmp_path) == ["rank-0.trace.jsonl", "rank-1.trace.jsonl"]
    code, out = doctor(capsys, str(tmp_path))
    assert code == 1, out
    headline = out.splitlines()[1]
    assert "rank 2 is behind: before call #4 (after barrier #3)" in headline, out
    assert "ranks 0, 1 are in all_reduce #4 (failed)" in headline, out
    assert "diverged:     #4 (all_reduce): ranks 0, 1 entered it, rank 2 did not" in out
    assert "raised CollectiveTimeout" in out and "records:      ranks 0, 1 (dump file); " \
        "rank 2: none" in out


def _stops_and_waits(rank, n, addr):
    """As ``_one_rank_stops`` with a long timeout: the job hangs until the test kills the
    stopped rank."""
    side = _side(addr)
    with _open(rank, n, addr) as comm:
        x = np.ones(4, np.float32)
        for _ in range(3):
            comm.all_reduce(x)
        comm.barrier()
        if rank == n - 1:
            side.set("stopped", str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)
        try:
            comm.all_reduce(x)
        except PeerFailure as exc:
            return exc.peer


def _until(capsys, want: list[str], *args: str) -> tuple[int, str]:
    """Ask the doctor until its output has every one of ``want`` (the ranks may still be on
    their way into the hang); the last answer."""
    deadline = time.monotonic() + LONG
    while True:
        code, out = doctor(capsys, *args)
        if all(w in out for w in want) or time.monotonic() > deadline:
            return code, out


def test_a_stopped_rank_is_named_live_through_the_store_while_the_job_hangs(
        store_addr, store_server, capsys):
    import threading

    result = {}
    job = threading.Thread(target=lambda: result.setdefault(
        "outcomes", spawn(_stops_and_waits, 3, store_addr, timeout=120, check=False)))
    job.start()
    try:
        store_server.wait(["stopped"], timeout=LONG)
        code, out = _until(capsys, ["ranks 0, 1 are in all_reduce #4 for"], store_addr,
                           "--wait", "2")
    finally:
        os.kill(int(store_server.get("stopped")), signal.SIGKILL)
        job.join(130)
    assert code == 1, out
    assert "rank 2 is behind: before call #4 (after barrier #3), did not answer (stopped, or " \
           "hung holding the interpreter?); ranks 0, 1 are in all_reduce #4" in out
    assert "(read from its memory by a peer)" in out  # its own record, read while it stopped
    assert "records:  ranks 0, 1 (answer); rank 2: none" in out
    assert [o.value for o in result["outcomes"][:2]] == [2, 2]


# -- ranks that disagree -------------------------------------------------------------------------

def _skips_a_call(rank, n, addr):
    """all_reduce and barrier in turn; rank 1 skips the all_reduce of the third round, so its
    barrier meets the others' all_reduce #4."""
    with _open(rank, n, addr) as comm:
        x = np.ones(4, np.float32)
        try:
            for step in range(4):
                if not (rank == 1 and step == 2):
                    comm.all_reduce(x)
                comm.barrier()
        except CollectiveMismatch as exc:
            return str(exc)


def _calls_another_collective(rank, n, addr):
    """Three all_reduces; then rank 1 calls broadcast where the others call all_reduce."""
    with _open(rank, n, addr) as comm:
        x = np.ones(4, np.float32)
        try:
            for _ in range(3):
                comm.all_reduce(x)
            if rank == 1:
                comm.broadcast(x, root=0)
            else:
                comm.all_reduce(x)
        except CollectiveMismatch as exc:
            return str(exc)


@pytest.mark.parametrize("scenario, seq, odd", [
    (_skips_a_call, 4, "rank 1 called barrier()"),
    (_calls_another_collective, 3, "rank 1 called broadcast(float32, 4 elements, root=0)"),
])
def test_ranks_that_disagree_are_named_on_each_side(store_addr, tmp_path, capsys, scenario,
                                                    seq, odd):
    outcomes = spawn(scenario, 3, store_addr, env={"GPUCOLL_TRACE_DIR": str(tmp_path)})
    assert all(outcomes)  # every rank raised CollectiveMismatch
    code, out = doctor(capsys, str(tmp_path))
    assert code == 1, out
    # rank 0 or rank 2 may not have entered #seq yet when the others' failure reached it
    headline = out.splitlines()[1]
    assert headline.startswith(f"  ranks disagree on collective #{seq}: "), out
    assert odd in headline and " called all_reduce(float32, 4 elements, op=sum)" in headline
    assert f"diverged:     #{seq}" in out
    code, out = doctor(capsys, str(tmp_path), "--json")
    verdict, = json.loads(out)
    assert code == 1 and verdict["problem"] and verdict["size"] == 3
    assert odd in verdict["details"]["mismatch"]


# -- a killed rank -------------------------------------------------------------------------------

def _one_rank_dies(rank, n, addr):
    """Three all_reduces; once every rank has said they are done (a rank that dies right after
    its own call can fail a slower peer's), the last rank dies before all_reduce #3."""
    side = _side(addr)
    with _open(rank, n, addr) as comm:
        x = np.ones(4, np.float32)
        for _ in range(3):
            comm.all_reduce(x)
        if rank == n - 1:
            side.wait([f"done/{r}" for r in range(n - 1)], timeout=LONG)
            os.kill(os.getpid(), signal.SIGKILL)
        side.set(f"done/{rank}", "1")
        try:
            comm.all_reduce(x)
        except PeerFailure as exc:
            return exc.peer


def test_a_killed_rank_is_named_from_the_dumps_and_from_the_store_after_the_job(
        store_addr, tmp_path, capsys):
    outcomes = spawn(_one_rank_dies, 4, store_addr, check=False,
                     env={"GPUCOLL_TRACE_DIR": str(tmp_path)})
    # a survivor may also hear first that another survivor gave up (and name that one)
    assert all(o.value is not None for o in outcomes[:3]) and 3 in [o.value for o in outcomes]
    assert outcomes[3].exitcode == -signal.SIGKILL
    code, out = doctor(capsys, str(tmp_path))
    assert code == 1, out
    headline = out.splitlines()[1]
    assert headline.startswith("  rank 3 died or lost its connection, as rank"), out
    assert headline.endswith("(PeerFailure); ranks 0, 1, 2 are in all_reduce #3 (failed)"), out
    assert "failed first: rank 3 died or lost its connection" in out
    assert "raised PeerFailure naming rank 3" in out
    # the store kept the dead rank's will and the survivors' summaries
    code, out = doctor(capsys, store_addr, "--wait", "0.2")
    assert code == 1, out
    assert out.splitlines()[1] == ("  rank 3 died (its process ended or lost the store); "
                                   "ranks 0, 1, 2 are in all_reduce #3 (failed), closed their "
                                   "communicators"), out
    assert "records:      ranks 0, 1, 2 (store summary); rank 3: none" in out


# -- a healthy job -------------------------------------------------------------------------------

def _works_then_waits(rank, n, addr):
    side = _side(addr)
    with _open(rank, n, addr) as comm:
        x = np.ones(4, np.float32)
        for _ in range(5):
            comm.all_reduce(x)
        side.set(f"idle/{rank}", "1")
        side.wait(["go"], timeout=LONG)
    return float(x[0])


def test_a_healthy_job_gets_a_clean_bill_of_health(store_addr, store_server, capsys):
    import threading

    result = {}
    job = threading.Thread(target=lambda: result.setdefault(
        "values", spawn(_works_then_waits, 3, store_addr, timeout=120)))
    job.start()
    try:
        store_server.wait([f"idle/{r}" for r in range(3)], timeout=LONG)
        # every rank answers, so the doctor returns at the last answer: the wait only bounds
        # a loaded machine's slowest rank
        code, out = doctor(capsys, store_addr, "--wait", "60")
    finally:
        store_server.set("go", "1")
        job.join(130)
    assert code == 0, out
    assert "no problem found: ranks 0, 1, 2 are before call #5 (after all_reduce #4)" in out
    assert result["values"] == [243.0] * 3


# -- SIGUSR1 -------------------------------------------------------------------------------------

def _busy_until_told(rank, n, addr):
    """all_reduce in a loop (so SIGUSR1 lands inside calls, with locks held) until told."""
    side = _side(addr)
    with _open(rank, n, addr) as comm:
        side.set(f"pid/{rank}", str(os.getpid()))
        x = np.ones(4, np.float64)
        calls = 0
        while True:
            comm.all_reduce(x)
            x /= n
            calls += 1
            stop = np.array([side.check(["stop"])], np.int32)
            comm.all_reduce(stop, op="max")
            if stop[0]:
                return calls, float(x[0])


def test_sigusr1_dumps_every_rank_mid_call_and_the_job_goes_on(store_addr, store_server,
                                                               tmp_path):
    import threading

    result = {}
    job = threading.Thread(target=lambda: result.setdefault("values", spawn(
        _busy_until_told, 2, store_addr, timeout=120,
        env={"GPUCOLL_TRACE_DIR": str(tmp_path)})))
    job.start()
    try:
        pids = [int(store_server.get(f"pid/{r}", timeout=LONG)) for r in range(2)]
        deadline = time.monotonic() + LONG
        while len(dumps(tmp_path)) < 2 and time.monotonic() < deadline:
            for pid in pids:
                os.kill(pid, signal.SIGUSR1)  # again and again, wherever the rank is
            time.sleep(0.05)  # pace the signals (the loop waits on the dumps, not on this)
    finally:
        store_server.set("stop", "1")
        job.join(130)
    assert dumps(tmp_path) == ["rank-0.trace.jsonl", "rank-1.trace.jsonl"]
    for r, (calls, value) in enumerate(result["values"]):
        assert calls > 0 and value == 1.0
        lines = [json.loads(line) for line in open(tmp_path / f"rank-{r}.trace.jsonl")]
        assert lines[0]["type"] == "process" and lines[0]["reason"] == "SIGUSR1"
        assert lines[1]["type"] == "group" and lines[1]["rank"] == r
        assert {line["call"] for line in lines[2:]} == {"all_reduce"}


# -- a dump never waits for a peer ---------------------------------------------------------------

def test_a_failure_dumps_at_once_while_the_store_is_stopped(store_addr, store_server, tmp_path):
    """The ranks' own store is stopped (SIGSTOP): a rank that dies still makes the others
    raise within seconds, each writing its dump file; its summary waits for the store."""
    from store_wire import standalone_store

    with standalone_store() as store:
        jobs_addr = f"tcp://127.0.0.1:{store.port}"
        import threading

        result = {}
        job = threading.Thread(target=lambda: result.setdefault("outcomes", spawn(
            _ranks_on, 3, jobs_addr, store_addr, timeout=120, check=False,
            env={"GPUCOLL_TRACE_DIR": str(tmp_path)})))
        job.start()
        try:
            store_server.wait([f"ready/{r}" for r in range(3)], timeout=LONG)
            os.kill(store.proc.pid, signal.SIGSTOP)
            store_server.set("store-stopped", "1")
            store_server.wait(["raised/0", "raised/1"], timeout=LONG)
            assert dumps(tmp_path) == ["rank-0.trace.jsonl", "rank-1.trace.jsonl"]
        finally:
            os.kill(store.proc.pid, signal.SIGCONT)
            job.join(130)
    took = [o.value for o in result["outcomes"][:2]]
    assert all(t is not None and t < 5.0 for t in took), result["outcomes"]


def _ranks_on(rank, n, jobs_addr, side_addr):
    side = _side(side_addr)
    with _open(rank, n, jobs_addr) as comm:
        x = np.ones(4, np.float32)
        comm.all_reduce(x)
        side.set(f"ready/{rank}", "1")
        side.wait(["store-stopped"], timeout=LONG)
        if rank == n - 1:
            os.kill(os.getpid(), signal.SIGKILL)
        start = time.monotonic()
        try:
            comm.all_reduce(x)
        except PeerFailure:
            took = time.monotonic() - start
            side.set(f"raised/{rank}", "1")
            return took


# -- the timeline --------------------------------------------------------------------------------

def test_the_timeline_has_a_row_per_rank_and_a_slice_per_call(store_addr, tmp_path, capsys):
    spawn(_one_rank_stops, 3, store_addr, SHORT, check=False,
          env={"GPUCOLL_TRACE_DIR": str(tmp_path / "dumps")})
    trace = tmp_path / "trace.json"
    code, out = doctor(capsys, str(tmp_path / "dumps"), "--timeline", str(trace))
    assert code == 1 and f"timeline written to {trace}" in out
    events = json.loads(trace.read_text())["traceEvents"]
    rows = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert rows == {"rank 0", "rank 1"}
    for pid in (0, 1):
        slices = [e for e in events if e["ph"] == "X" and e["pid"] == pid]
        assert [s["name"] for s in slices] == ["all_reduce #0", "all_reduce #1",
                                               "all_reduce #2", "barrier #3",
                                               "all_reduce #4 (failed)"]
        assert all(s["dur"] >= 0 and s["ts"] >= 0 for s in slices)
        assert slices[-1]["dur"] > slices[0]["dur"]  # it waited for the stopped rank
        assert any(e["ph"] == "i" and e["name"] == "CollectiveTimeout" and e["pid"] == pid
                   for e in events)


# -- what the command says when there is nothing to read -----------------------------------------

def test_the_doctor_says_why_it_has_nothing_to_read(tmp_path, capsys):
    code, out = doctor(capsys, str(tmp_path / "nowhere"))
    assert code == 2 and "no such directory" in out
    code, out = doctor(capsys, str(tmp_path))
    assert code == 2 and "no flight-recorder dumps (rank-*.trace.jsonl) there" in out
    (tmp_path / "rank-0.trace.jsonl").write_text("not json\n")
    code, out = doctor(capsys, str(tmp_path))
    assert code == 2 and "rank-0.trace.jsonl: not a flight-recorder dump" in out


def test_the_doctor_of_an_empty_store_says_no_rank_answered(store_addr, capsys):
    code, out = doctor(capsys, store_addr, "--wait", "0.2")
    assert code == 2 and "no rank of job 'anonymous' answered" in out


def test_garbage_in_the_store_is_left_out_not_trusted(store_server, store_addr, capsys):
    slot = "gpucoll/jobs/anonymous/0"
    store_server.multi_set([f"{slot}/size", f"{slot}/member/0", f"{slot}/trace/0",
                            f"{slot}/trace/1", "gpucoll/jobs/anonymous/1/size"],
                           ["2", "x", b"\xff not json", json.dumps({"groups": [[{
                               "type": "group", "group": slot, "rank": "one"}]]}), "many"])
    code, out = doctor(capsys, store_addr, "--wait", "0.2")
    assert code == 1, out
    assert "ranks 0, 1: did not answer" in out
    assert "(2 answer(s) or summaries in the store were not flight records" in out


def test_gpucoll_lists_the_doctor_command():
    proc = subprocess.run([sys.executable, "-m", "gpucoll", "--help"], capture_output=True,
                          text=True, timeout=60)
    assert "doctor" in proc.stdout


def test_a_ranks_listener_keeps_serving_however_late_the_thread_that_made_it_runs(store_server):
    from gpucoll.dumps import _Listener
    from gpucoll.store import TCPStore

    class Flight:  # a communicator's flight, as far as the listener holds it (weakly)
        pass

    flight = Flight()
    with TCPStore("127.0.0.1", store_server.port, timeout=10) as base:
        listener = _Listener(base, "gpucoll/jobs/late", flight)
        time.sleep(1.0)  # the maker is slow to run again, as on a loaded machine
        try:
            assert listener._thread.is_alive()  # it would have ended, seeing no communicator
        finally:
            listener.stop()
            listener.join(10)
    assert not listener._thread.is_alive()
