"""The spawn helper itself: results come back in rank order, failures name their rank."""

import os

import pytest
from multiproc import RanksFailed, spawn


def _rank_square(rank, n, offset):
    return rank * rank + offset


def _fail_on_one(rank, n):
    if rank == 1:
        raise ValueError("rank one is unhappy")
    return rank


def _sleep_forever(rank, n):
    import time

    time.sleep(3600)


def _leave_shm(rank, n):
    with open(f"/dev/shm/{os.environ['GPUCOLL_SHM_PREFIX']}-leak", "wb") as f:
        f.write(b"x")


def test_results_come_back_in_rank_order():
    assert spawn(_rank_square, 3, 10) == [10, 11, 14]


def test_a_failing_rank_is_named_with_its_traceback():
    with pytest.raises(RanksFailed, match=r"(?s)### rank 1 of 2.*rank one is unhappy"):
        spawn(_fail_on_one, 2)


def test_outcomes_carry_the_exception_when_not_checking():
    outcomes = spawn(_fail_on_one, 2, check=False)
    assert outcomes[0].ok and outcomes[0].value == 0
    assert isinstance(outcomes[1].error, ValueError)


def test_ranks_past_the_deadline_are_killed():
    with pytest.raises(RanksFailed, match="did not finish"):
        spawn(_sleep_forever, 2, timeout=1.0)


def test_a_killed_rank_reports_its_signal():
    outcomes = spawn(_sleep_forever, 2, timeout=20.0, check=False, kill={0: 0.2, 1: 0.2})
    assert [o.exitcode for o in outcomes] == [-9, -9]


def _leave_a_child(rank, n):
    if os.fork() == 0:
        import time

        time.sleep(3600)
        os._exit(0)


@pytest.mark.slow
def test_a_process_left_behind_is_killed_and_fails_the_test():
    with pytest.raises(AssertionError, match="processes left running"):
        spawn(_leave_a_child, 1)


def test_shared_memory_left_behind_fails_the_test():
    with pytest.raises(AssertionError, match="shared memory left behind"):
        spawn(_leave_shm, 1)
