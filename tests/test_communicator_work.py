"""Work handles: what wait() returns and raises, and when a handle counts as completed."""

import threading

import pytest

from gpucoll.errors import CollectiveTimeout, PeerFailure
from gpucoll.work import CompletedWork, FutureWork


def test_wait_returns_the_bound_result_once_the_call_ran():
    work = FutureWork().bind("result", "all_gather on rank 0 of 2")
    ran = []
    work.run(lambda: ran.append(1))
    assert work.is_completed() and work.wait() == "result" and work.result() == "result"
    assert ran == [1]


def test_wait_raises_the_calls_own_error():
    work = FutureWork()
    work.run(lambda: (_ for _ in ()).throw(PeerFailure("rank 1 vanished", peer=1)))
    with pytest.raises(PeerFailure, match="rank 1 vanished"):
        work.wait()
    assert work.is_completed()


def test_a_calls_own_timeout_is_not_mistaken_for_waiting_too_short():
    work = FutureWork()

    def times_out():
        raise CollectiveTimeout("all_reduce on rank 0: deadline passed")

    work.run(times_out)
    with pytest.raises(CollectiveTimeout, match="deadline passed"):
        work.wait(timeout=0.01)


def test_wait_with_a_timeout_on_a_running_call_says_it_still_runs():
    work = FutureWork().bind(None, "barrier on rank 3 of 4")
    with pytest.raises(CollectiveTimeout, match=r"barrier on rank 3 of 4 still running after "
                                                r"waiting 0.01 s"):
        work.wait(timeout=0.01)
    assert not work.is_completed()
    work.run(lambda: None)
    assert work.wait() is None


def test_wait_blocks_until_another_thread_runs_the_call():
    work = FutureWork().bind(42)
    release = threading.Event()
    thread = threading.Thread(target=lambda: (release.wait(10), work.run(lambda: None)))
    thread.start()
    release.set()
    assert work.wait(timeout=10) == 42
    thread.join(10)


def test_failing_before_running_completes_with_that_error():
    work = FutureWork()
    work.fail(PeerFailure("aborted", peer=2))
    with pytest.raises(PeerFailure):
        work.result()


def test_completed_work_is_done_at_once():
    work = CompletedWork().bind([1, 2])
    assert work.is_completed() and work.wait(timeout=0.001) == [1, 2]
    assert "completed" in repr(work)
