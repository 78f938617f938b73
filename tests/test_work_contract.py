"""One Work contract on every backend (``gpucoll.work``): the host ring's ``FutureWork`` on host
and on staged device arrays, the NCCL backend's event-backed Work, and ``CompletedWork``."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import work_ranks
from multiproc import spawn
from nccl_emulation import EmulatedRuntime, FakeDeviceArray

from gpucoll import cuda
from gpucoll.arrays import as_ref
from gpucoll.backends.staged import StagedBackend
from gpucoll.errors import CollectiveTimeout
from gpucoll.ops import ReduceOp
from gpucoll.work import CompletedWork, FutureWork

pytestmark = pytest.mark.timeout(120)

CLAUSES = ["pending: not completed",
           "pending: wait(timeout) and synchronize(timeout) raise, call goes on",
           "done: every wait returns the result, completed",
           "failed: every wait raises its error, completed"]


@pytest.mark.parametrize("kind", ["ring", "staged", "nccl"])
def test_every_clause_of_the_work_contract_holds_on(store_addr, kind):
    assert spawn(work_ranks.contract, 2, store_addr, kind, timeout=100) == [CLAUSES, []]


def test_completed_work_keeps_the_contract():
    work = CompletedWork().bind("result", "noop")
    assert work.is_completed()
    assert work.wait() == work.synchronize() == work.result() == "result"
    assert work.wait(timeout=0) == work.synchronize(timeout=0) == "result"


class _OneRankRing:
    """A one-rank host ring that doubles, runs async calls to the end on a thread of its own,
    and leaves the device busy after it (a kernel queued by someone else)."""

    name, rank, size = "ring", 0, 1

    def __init__(self, rt):
        self.rt, self.release = rt, None

    def all_reduce(self, x, op, *, timeout):
        np.multiply(x.host, 2, out=x.host)
        self.release = self.rt.stall(self.rt.current_stream())

    def run_async(self, call, *, stream=None):
        work = FutureWork()
        thread = threading.Thread(target=work.run, args=(call,))
        thread.start()
        thread.join(30)
        return work


def test_staged_work_is_complete_only_once_its_copies_back_are_done(store_addr):
    rt = EmulatedRuntime(store_addr)
    with cuda.use_runtime(rt):
        inner = _OneRankRing(rt)
        staged = StagedBackend(inner)
        x = FakeDeviceArray(np.arange(4, dtype=np.float32), rt)
        ref = as_ref(x, "x")
        work = staged.run_async(lambda: staged.all_reduce(ref, ReduceOp.SUM, timeout=10))
        work.bind(x)
        assert not work.is_completed()  # the ring is done; its copy back to x is queued
        with pytest.raises(CollectiveTimeout):
            work.synchronize(timeout=0.2)
        assert work.wait() is x  # orders the current stream: the host does not wait
        inner.release()
        assert work.synchronize() is x and work.is_completed()
        np.testing.assert_array_equal(x.get(), np.arange(4) * 2)
        assert rt.misuse == []
    rt.close()
