"""A rank whose store stops answering (its host cut off, the process stopped): the error still
reaches the caller at once, and leaving every communicator takes at most a short probe in all,
not a wait per communicator."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from multiproc import spawn

import gpucoll
from gpucoll import PeerFailure, TCPStore
from gpucoll.store import leave_group

STORE = ("import time; from gpucoll.store import TCPStore; "
         "s = TCPStore('127.0.0.1', 0, is_server=True); print(s.port, flush=True); "
         "time.sleep(120)")


@pytest.fixture
def store_process():
    """A store served by a process of its own, which the test may stop: (pid, port)."""
    proc = subprocess.Popen([sys.executable, "-c", STORE], stdout=subprocess.PIPE, text=True)
    try:
        yield proc.pid, int(proc.stdout.readline())
    finally:
        proc.kill()  # also a stopped one
        proc.wait(10)


def stop(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until it is stopped (the signal takes effect asynchronously)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.001)
    raise AssertionError(f"process {pid} did not stop")


def _lose_rank_0_and_the_store(rank, n, port, store_pid):
    """Four communicators (the world and three splits); rank 0 stops the store and dies; rank 1
    returns how long its error took to come and its ``with`` block to end."""
    with gpucoll.init(rank=rank, world_size=n, store=f"tcp://127.0.0.1:{port}",
                      timeout=30) as comm:
        subs = [comm.split(0, rank) for _ in range(3)]
        x = np.ones(4)
        comm.all_reduce(x)
        if rank == 0:
            stop(store_pid)
            os.kill(os.getpid(), signal.SIGKILL)
        lost = None
        try:
            while True:
                comm.all_reduce(x)
                for s in subs:
                    s.all_reduce(x)
        except PeerFailure:
            lost = time.monotonic()
    return time.monotonic() - lost, time.time()


@pytest.mark.timeout(60)
def test_leaving_four_communicators_on_a_stopped_store_takes_under_a_second(store_process):
    pid, port = store_process
    outcomes = spawn(_lose_rank_0_and_the_store, 2, port, pid, check=False, timeout=40)
    ended = time.time()
    assert outcomes[0].exitcode == -signal.SIGKILL
    assert outcomes[1].ok, outcomes[1].trace
    leaving, left_at = outcomes[1].value
    assert leaving < 1.0, f"leaving took {leaving:.2f} s"
    assert ended - left_at < 1.5, f"the process ended {ended - left_at:.2f} s after leaving"


def test_a_store_that_misses_a_deadline_is_stalled_until_it_answers(store_process):
    pid, port = store_process
    store = TCPStore("127.0.0.1", port, timeout=10)
    try:
        assert not store.stalled
        stop(pid)
        with pytest.raises(TimeoutError, match="no reply"):
            store.peek(["k"], timeout=0.2)
        assert store.stalled
        os.kill(pid, signal.SIGCONT)
        assert store.peek(["k"], timeout=10) == [None]
        assert not store.stalled
    finally:
        os.kill(pid, signal.SIGCONT)
        store.close()


def test_leaving_a_group_on_a_stalled_store_waits_for_nothing(store_process):
    pid, port = store_process
    store = TCPStore("127.0.0.1", port, timeout=10)
    try:
        store.set_will("g/gone/0", b"died")
        stop(pid)
        start = time.monotonic()
        leave_group(gpucoll.PrefixStore("g", store), 0, 2)  # the first: one short probe
        first = time.monotonic() - start
        start = time.monotonic()
        for _ in range(4):
            leave_group(gpucoll.PrefixStore("g", store), 0, 2)
        later = time.monotonic() - start
        assert first < 1.0 and later < 0.1, (first, later)
        os.kill(pid, signal.SIGCONT)
        # what the leave sent still arrives, in order: the will withdrawn, then the mark
        assert store.peek(["g/gone/0"], timeout=10) == [b"closed"]
    finally:
        os.kill(pid, signal.SIGCONT)
        store.close()
    with TCPStore("127.0.0.1", port, timeout=10) as other:
        assert other.get("g/gone/0") == b"closed"  # no will overwrote it
