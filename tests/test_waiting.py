"""No wait is silent: a wait longer than GPUCOLL_WAIT_LOG seconds (default 10) prints one line on
stderr, and another every interval, naming the call, this rank and the ranks it waits for.

The tests shorten the interval (GPUCOLL_WAIT_LOG=0.2) and make the missing rank arrive only once
the waiting rank has said it waits for it, so each wait ends normally: nothing depends on timing.
"""

from __future__ import annotations

import io
import sys
import threading
import time

import numpy as np
import pytest
from multiproc import spawn

import gpucoll
from gpucoll.errors import CollectiveTimeout
from gpucoll.progress import DEFAULT_INTERVAL, Waiting, interval
from gpucoll.store import TCPStore

FAST = {"GPUCOLL_WAIT_LOG": "0.2"}


class Said(io.TextIOBase):
    """Stands in for stderr: keeps the lines, and sets ``key`` in the store at the first line
    that contains ``marker`` (the cue for the missing rank to arrive)."""

    def __init__(self, store, key: str, marker: str):
        self.store, self.key, self.marker, self.text = store, key, marker, ""

    def write(self, s: str) -> int:
        if self.marker in s and self.marker not in self.text:
            self.store.set(self.key, b"1")
        self.text += s
        return len(s)


def _client(addr: str) -> TCPStore:
    host, port = addr.removeprefix("tcp://").rsplit(":", 1)
    return TCPStore(host, int(port), timeout=30)


def _late_start(rank, n, addr):
    """Rank 1 calls init only after rank 0 said that it waits for rank 1."""
    store = _client(addr)
    if rank == 1:
        store.get("cue", timeout=30)
        with gpucoll.init("ring", rank=rank, world_size=n, store=addr, timeout=30):
            return ""
    said = sys.stderr = Said(store, "cue", "for rank 1")
    with gpucoll.init("ring", rank=rank, world_size=n, store=addr, timeout=30):
        return said.text


def test_start_up_waiting_for_a_rank_says_which_one_every_interval(store_addr):
    text, _ = spawn(_late_start, 2, store_addr, env=FAST, timeout=60)
    line = text.splitlines()[0]
    assert line.startswith("gpucoll: start-up on rank 0 of 2: still waiting after "), text
    assert line.endswith(" s for rank 1 (gives up at 30 s)"), text


def _late_collective(rank, n, addr, call):
    """Rank 1 enters the collective only after rank 0 said that it waits for it."""
    store = _client(addr)
    said = None
    with gpucoll.init("ring", rank=rank, world_size=n, store=addr, timeout=30) as comm:
        if rank == 1:
            store.get("cue", timeout=30)
        else:
            said = sys.stderr = Said(store, "cue", "rank 1")
        if call == "all_reduce":
            result = comm.all_reduce(np.ones(4)).tolist()
        else:
            result = comm.monitored_barrier()
        sys.stderr = sys.__stderr__
        return result, said.text if said else ""


def test_a_collective_waiting_for_a_rank_names_it_and_then_completes(store_addr):
    (result, text), _ = spawn(_late_collective, 2, store_addr, "all_reduce", env=FAST,
                              timeout=60)
    assert result == [2.0] * 4
    line = text.splitlines()[0]
    assert line.startswith("gpucoll: all_reduce #0 on rank 0: still waiting after "), text
    assert "to receive from rank 1 (0 of 32 bytes done)" in line or \
        "to send to rank 1" in line, text


def test_a_store_wait_names_the_rank_missing(store_addr):
    (_, text), _ = spawn(_late_collective, 2, store_addr, "monitored_barrier", env=FAST,
                         timeout=60)
    assert "gpucoll: monitored_barrier #0 on rank 0 of 2: still waiting after " in text, text
    assert " s for rank 1 (gives up at 30 s)" in text, text


def _quiet_timeout(rank, n, addr):
    sys.stderr = said = io.StringIO()
    try:
        gpucoll.init("ring", rank=0, world_size=2, store=addr, timeout=1.0)
    except CollectiveTimeout as exc:
        return said.getvalue(), str(exc)
    return said.getvalue(), None


def test_zero_silences_the_lines_and_a_start_up_timeout_says_never_arrived(store_addr):
    [(text, err)] = spawn(_quiet_timeout, 1, store_addr, env={"GPUCOLL_WAIT_LOG": "0"},
                          timeout=60)
    assert text == ""
    assert "start-up on rank 0 of 2: rank 1 never arrived" in err
    assert "NCCL" not in err


def test_a_rank_whose_rank_0_never_started_says_rank_0_never_arrived():
    from gpucoll.rendezvous import Rendezvous, connect_store

    with TCPStore("127.0.0.1", 0, is_server=True) as server:
        port = server.port  # free, and nothing listens there once the server is closed
    rdv = Rendezvous(1, 2, 1, 2, "127.0.0.1", port, False, None, "gpucoll")
    with pytest.raises(CollectiveTimeout, match=r"start-up on rank 1 of 2: rank 0 never "
                                                r"arrived \(it hosts the job's store at "):
        connect_store(rdv, timeout=0.5)


def test_the_interval_comes_from_the_environment():
    assert interval({}) == DEFAULT_INTERVAL == 10.0
    assert interval({"GPUCOLL_WAIT_LOG": "2.5"}) == 2.5
    assert interval({"GPUCOLL_WAIT_LOG": "0"}) is None


@pytest.mark.parametrize("bad", ["soon", "-1", "nan", "inf"])
def test_a_bad_interval_is_a_value_error_naming_the_variable(bad):
    with pytest.raises(ValueError, match=f"GPUCOLL_WAIT_LOG='{bad}': expected the seconds"):
        interval({"GPUCOLL_WAIT_LOG": bad})


def test_init_rejects_a_bad_interval_before_it_waits(monkeypatch):
    monkeypatch.setenv("GPUCOLL_WAIT_LOG", "soon")
    with pytest.raises(ValueError, match="GPUCOLL_WAIT_LOG"):
        gpucoll.init("ring", rank=0, world_size=2, store="tcp://127.0.0.1:1", timeout=1)


def test_lines_are_rate_limited_to_one_per_interval(capsys):
    w = Waiting("barrier on rank 3 of 4", timeout=60, start=100.0, every=10.0)
    said = [w.tick(lambda: "for rank 2", now=t) for t in (105.0, 110.0, 111.0, 119.9, 120.0)]
    assert said == [False, True, False, False, True]
    assert capsys.readouterr().err.splitlines() == [
        "gpucoll: barrier on rank 3 of 4: still waiting after 10 s for rank 2 (gives up at 60 s)",
        "gpucoll: barrier on rank 3 of 4: still waiting after 20 s for rank 2 (gives up at 60 s)"]


def test_a_detail_that_fails_does_not_break_the_wait(capsys):
    w = Waiting("x", start=0.0, every=1.0)
    assert w.tick(lambda: 1 / 0, now=2.0)
    assert "could not tell whom" in capsys.readouterr().err


class _Event:
    done = False


class _Lines(io.TextIOBase):
    """A stand-in stderr that keeps what is written and says when a line came."""

    def __init__(self):
        super().__init__()
        self.text, self.seen = "", threading.Event()

    def write(self, s: str) -> int:
        self.text += s
        self.seen.set()
        return len(s)


def _nccl_wait_lines(monkeypatch, size: int, positions=None) -> tuple[str, str]:
    """The long-wait lines of an NCCL watchdog of ``size`` ranks whose call stays unfinished
    for one line (interval 0.2 s), and the error it would give at the deadline."""
    from gpucoll.backends.nccl.backend import Pending, Watchdog

    monkeypatch.setenv("GPUCOLL_WAIT_LOG", "0.2")
    lines = _Lines()
    monkeypatch.setattr(sys, "stderr", lines)
    failures = []
    dog = Watchdog(0, size, lambda op: None, failures.append, positions=positions)
    event = _Event()
    pending = Pending(event, deadline=time.monotonic() + 300, opname="all_reduce #0",
                      timeout=300.0)
    try:
        dog.add(pending)
        assert lines.seen.wait(30)
    finally:
        event.done = True
        dog.close()
    assert failures == []
    return lines.text, str(dog.expired(pending))


def test_an_unfinished_nccl_call_says_where_the_ranks_are(monkeypatch):
    class Positions:  # what the store's progress records would say
        def diagnose(self):
            return "rank 1 is behind, before its first collective; rank 0 is in all_reduce #0"

        def publish(self):
            pass

    text, _ = _nccl_wait_lines(monkeypatch, 2, Positions())
    assert text.splitlines()[0].startswith(
        "gpucoll: all_reduce #0 on rank 0 of 2: still waiting after ")
    assert "(where the ranks are: rank 1 is behind, before its first collective; rank 0 is in " \
           "all_reduce #0) (gives up at 300 s)" in text


def test_an_unfinished_nccl_call_on_one_rank_says_it_waits_for_the_device(monkeypatch):
    text, error = _nccl_wait_lines(monkeypatch, 1)
    waits = "(one rank: it waits for the device, for work queued before it on its stream)"
    assert "all_reduce #0 on rank 0 of 1: still waiting after " in text
    assert waits in text and waits[1:-1] in error
