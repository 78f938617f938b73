"""How the ring backend fails: dead, aborting and interrupted peers, deadlines, and what is left
behind (the spawn helper fails a test whose ranks leave shared memory in /dev/shm)."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
from multiproc import spawn
from test_ring import open_backend, ref
from tiers import grid

from gpucoll.errors import CollectiveTimeout, GpucollError, PeerFailure
from gpucoll.ops import ReduceOp

LONG = 60.0  # a deadline no passing test gets near: failures must be noticed without it


def _signal_self_soon(sig: int) -> None:
    """Deliver ``sig`` to this process from another thread while the main one communicates."""
    threading.Thread(target=lambda: (time.sleep(0.2), os.kill(os.getpid(), sig)),
                     daemon=True).start()


def _loop_until_error(b, victim: int, rank: int, sig: int, async_calls: bool = False):
    """All ranks all_reduce large arrays (``async_calls``: each started with ``run_async`` and
    waited for); ``victim`` is signalled in the middle of that."""
    x = np.ones(1 << 20, np.float32)
    call = lambda: b.all_reduce(ref(x), ReduceOp.SUM, timeout=LONG)  # noqa: E731
    if rank == victim:
        _signal_self_soon(sig)
    try:
        for _ in range(100_000):
            x[:] = 1
            if async_calls:
                b.run_async(call).wait()
            else:
                call()
    except (GpucollError, KeyboardInterrupt) as exc:
        return exc
    return None


def _survive_a_killed_peer(rank, n, addr, transport, victim):
    store, b = open_backend(rank, n, addr, transport, timeout=LONG)
    try:
        err = _loop_until_error(b, victim, rank, signal.SIGKILL)
        threads = sorted(t.name for t in threading.enumerate() if t.name.startswith("gpucoll"))
        try:  # poisoned: the next call fails at once
            b.barrier(timeout=LONG)
            later = None
        except GpucollError as exc:
            later = exc
        work = b.run_async(lambda: b.barrier(timeout=LONG))
        try:
            work.wait(LONG)
            async_err = None
        except GpucollError as exc:
            async_err = exc
        return err, later, async_err, threads
    finally:
        b.close()
        store.close()


@pytest.mark.parametrize("transport", grid(["shm", "tcp"], "shm"))
def test_killed_peer_makes_every_survivor_raise_peer_failure_naming_it(store_addr, transport):
    outcomes = spawn(_survive_a_killed_peer, 3, store_addr, transport, 1, timeout=40,
                     check=False)
    assert outcomes[1].exitcode == -signal.SIGKILL
    for rank in (0, 2):
        assert outcomes[rank].ok, outcomes[rank].trace
        err, *_ = outcomes[rank].value
        assert isinstance(err, PeerFailure) and err.peer == 1, repr(err)
        assert "rank 1" in str(err)


def test_calls_after_a_peer_failure_fail_at_once(store_addr):
    outcomes = spawn(_survive_a_killed_peer, 2, store_addr, "shm", 1, timeout=40, check=False)
    _, later, async_err, _ = outcomes[0].value
    assert isinstance(later, PeerFailure) and later.peer == 1
    assert "barrier" in str(later)
    assert isinstance(async_err, PeerFailure) and async_err.peer == 1


def test_a_failure_releases_threads_and_connections_before_close(store_addr):
    outcomes = spawn(_survive_a_killed_peer, 2, store_addr, "tcp", 1, timeout=40, check=False)
    *_, threads = outcomes[0].value
    assert threads == []


def _send_to_self(rank, n, addr):
    store, b = open_backend(rank, n, addr, "shm")
    try:
        try:
            b.send(ref(np.zeros(3, np.float32)), rank, timeout=30)
        except ValueError as exc:
            message = str(exc)
        b.barrier(timeout=30)  # still usable
        return message
    finally:
        b.close()
        store.close()


def test_sending_to_oneself_is_a_value_error_that_leaves_the_backend_usable(store_addr):
    messages = spawn(_send_to_self, 2, store_addr, timeout=30)
    assert "dst=0 on rank 0" in messages[0]


def _interrupted(rank, n, addr, async_calls=False):
    # a process started in the background by a shell inherits SIGINT ignored: Python then
    # installs no KeyboardInterrupt handler, and the interrupt this test sends would be lost
    signal.signal(signal.SIGINT, signal.default_int_handler)
    store, b = open_backend(rank, n, addr, "shm", timeout=LONG)
    try:
        return _loop_until_error(b, 0, rank, signal.SIGINT, async_calls)
    finally:
        b.close()
        store.close()


def test_interrupted_rank_raises_keyboard_interrupt_and_its_peers_peer_failure(store_addr):
    errors = spawn(_interrupted, 3, store_addr, timeout=40)
    assert isinstance(errors[0], KeyboardInterrupt)
    for err in errors[1:]:
        assert isinstance(err, PeerFailure) and err.peer == 0, repr(err)


def test_a_rank_interrupted_while_waiting_for_async_calls_does_the_same(store_addr):
    # the waiting thread runs most of these calls itself: the interrupt strikes inside them
    errors = spawn(_interrupted, 3, store_addr, True, timeout=40)
    assert isinstance(errors[0], KeyboardInterrupt)
    for err in errors[1:]:
        assert isinstance(err, PeerFailure) and err.peer == 0, repr(err)


def _time_out_on_rank0(rank, n, addr):
    store, b = open_backend(rank, n, addr, "shm", timeout=LONG)
    try:
        if rank == 0:
            try:  # a receive only: nothing of this call reaches rank 1, which joins later
                b.broadcast(ref(np.zeros(4, np.float32)), 1, timeout=0.3)
            except CollectiveTimeout as exc:
                return exc
            finally:
                store.set("rank0-done", "1")
            return None
        store.get("rank0-done", timeout=LONG)  # rank 1 joins only after rank 0 gave up
        try:  # rank 0 sends nothing, so this waits until rank 0's abort arrives
            b.all_reduce(ref(np.zeros(1 << 16, np.float32)), ReduceOp.SUM, timeout=LONG)
        except CollectiveTimeout as exc:
            return exc
        return None
    finally:
        b.close()
        store.close()


def test_missing_peer_raises_collective_timeout_naming_op_rank_and_peer(store_addr):
    err, _ = spawn(_time_out_on_rank0, 2, store_addr, timeout=40)
    assert isinstance(err, CollectiveTimeout) and isinstance(err, TimeoutError)
    assert "broadcast on rank 0" in str(err) and "rank 1" in str(err)


def test_a_rank_that_timed_out_makes_its_peers_fail_fast_with_the_same_diagnosis(store_addr):
    first, err = spawn(_time_out_on_rank0, 2, store_addr, timeout=40)
    assert isinstance(err, CollectiveTimeout), repr(err)
    assert "rank 0 failed" in str(err) and str(first).split(": ", 1)[1] in str(err)


def _abort_while_waiting(rank, n, addr):
    store, b = open_backend(rank, n, addr, "tcp", timeout=LONG)
    try:
        if rank == 1:
            store.get("rank0-done", timeout=LONG)
            return None
        threading.Thread(target=lambda: (time.sleep(0.2), b.abort("user asked")),
                         daemon=True).start()
        try:
            b.all_reduce(ref(np.zeros(4, np.float32)), ReduceOp.SUM, timeout=LONG)
        except GpucollError as exc:
            return exc
        finally:
            store.set("rank0-done", "1")
        return None
    finally:
        b.close()
        store.close()


def test_abort_fails_the_call_in_flight_and_close_still_returns(store_addr):
    err, _ = spawn(_abort_while_waiting, 2, store_addr, timeout=40)
    assert isinstance(err, GpucollError) and "user asked" in str(err)


def _close_twice(rank, n, addr):
    store, b = open_backend(rank, n, addr, "shm")
    b.barrier(timeout=30)
    b.close()
    b.close()
    try:
        b.barrier(timeout=1)
    except GpucollError as exc:
        return str(exc)
    finally:
        store.close()
    return None


def test_close_is_idempotent_and_later_calls_say_closed(store_addr):
    messages = spawn(_close_twice, 2, store_addr, timeout=30)
    assert all("closed" in m for m in messages)


def _threads_and_fds():
    return set(threading.enumerate()), set(os.listdir("/proc/self/fd"))


def _resources_after_close(rank, n, addr, transport):
    threads, fds = _threads_and_fds()
    store, b = open_backend(rank, n, addr, transport)
    b.run_async(lambda: b.barrier(timeout=30)).wait(30)
    b.close()
    store.close()
    threads_after, fds_after = _threads_and_fds()
    return [t.name for t in threads_after - threads], sorted(fds_after - fds)


@pytest.mark.parametrize("transport", grid(["shm", "tcp"], "shm"))
def test_close_leaves_no_thread_or_descriptor_behind(store_addr, transport):
    for new_threads, new_fds in spawn(_resources_after_close, 3, store_addr, transport,
                                      timeout=30):
        assert new_threads == [] and new_fds == []


def _close_during_a_call(rank, n, addr):
    store, b = open_backend(rank, n, addr, "shm", timeout=LONG)
    try:
        if rank == 1:
            store.get("rank0-done", timeout=LONG)
            return None
        outcome = []

        def stuck():
            try:
                b.all_reduce(ref(np.zeros(4, np.float32)), ReduceOp.SUM, timeout=LONG)
            except GpucollError as exc:
                outcome.append(exc)

        caller = threading.Thread(target=stuck)
        caller.start()
        b.close()  # rank 1 never joins: close ends the call (or it starts closed) at once
        caller.join(LONG)
        store.set("rank0-done", "1")
        return outcome
    finally:
        b.close()
        store.close()


def test_close_ends_a_call_stuck_in_another_thread(store_addr):
    outcome, _ = spawn(_close_during_a_call, 2, store_addr, timeout=30)
    assert len(outcome) == 1 and "closed" in str(outcome[0])


def _peer_closed_early(rank, n, addr, transport):
    store, b = open_backend(rank, n, addr, transport, timeout=LONG)
    try:
        if rank == 1:
            b.close()  # leaves without joining the all_reduce below
            store.set("rank1-closed", "1")
            return None
        store.get("rank1-closed", timeout=LONG)
        try:
            b.all_reduce(ref(np.zeros(1000, np.float32)), ReduceOp.SUM, timeout=LONG)
        except PeerFailure as exc:
            return exc
        return None
    finally:
        b.close()
        store.close()


@pytest.mark.parametrize("transport", grid(["shm", "tcp"], "shm"))
def test_waiting_on_a_peer_that_closed_is_a_peer_failure_not_a_hang(store_addr, transport):
    err, _ = spawn(_peer_closed_early, 2, store_addr, transport, timeout=30)
    assert isinstance(err, PeerFailure) and err.peer == 1, repr(err)
    assert "closed" in str(err)


def _fork_then_die(rank, n, addr):
    store, b = open_backend(rank, n, addr, "shm", timeout=LONG)
    try:
        if rank == 1:
            # a child process (think data loader) inherits this rank's descriptors and outlives
            # it; only the fork handler keeps the rank's death visible to its peers
            if os.fork() == 0:
                _wait_then_exit(addr)
            store.set("forked", "1")
            os.kill(os.getpid(), signal.SIGKILL)
        store.get("forked", timeout=LONG)
        try:
            b.all_reduce(ref(np.zeros(1 << 16, np.float32)), ReduceOp.SUM, timeout=LONG)
        except PeerFailure as exc:
            return exc
        finally:
            store.set("survivor-done", "1")
        return None
    finally:
        b.close()
        store.close()


def _wait_then_exit(addr: str) -> None:
    from gpucoll.store import TCPStore

    try:
        host, port = addr.removeprefix("tcp://").rsplit(":", 1)
        with TCPStore(host, int(port), timeout=25) as own:
            own.get("survivor-done", timeout=25)
    finally:
        os._exit(0)


def test_a_dead_rank_is_noticed_even_if_its_forked_child_lives_on(store_addr):
    outcomes = spawn(_fork_then_die, 2, store_addr, timeout=15, check=False)
    err = outcomes[0].value
    assert isinstance(err, PeerFailure) and err.peer == 1, outcomes[0].trace or repr(err)


def _close_with_the_lock_left_taken(rank, n, addr):
    store, b = open_backend(rank, n, addr, "shm", timeout=LONG)
    try:
        b.all_reduce(ref(np.ones(4, np.float32)), ReduceOp.SUM, timeout=LONG)
        if rank == 0:  # as an interrupt between taking the driver lock and the call leaves it
            b._lock.acquire()
        start = time.monotonic()
        b.close()
        return time.monotonic() - start
    finally:
        store.close()


def test_close_ends_even_when_an_interrupt_left_the_driver_lock_taken(store_addr):
    seconds = spawn(_close_with_the_lock_left_taken, 2, store_addr, timeout=40)
    assert seconds[0] < 10 and seconds[1] < 10, seconds
