"""The Work contract, run by two ranks on one backend (``test_work_contract.py``): rank 1 joins
each call only when rank 0 lets it, so rank 0 can watch a call that is still pending."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from nccl_emulation import EmulatedRuntime, FakeDeviceArray

from gpucoll import cuda
from gpucoll.default import create
from gpucoll.errors import CollectiveTimeout
from gpucoll.store import TCPStore, parse_address


@contextlib.contextmanager
def _communicator(kind: str, rank: int, n: int, addr: str):
    """(communicator, array maker, reader) for ``kind``: the host ring on NumPy arrays, the
    ring on (emulated) device arrays staged through host memory, or NCCL (emulated)."""
    rt = None
    if kind != "ring":
        rt = EmulatedRuntime(addr)
        cuda.set_runtime(rt)
    comm = create("ring" if kind != "nccl" else "nccl", rank=rank, world_size=n, store=addr,
                  timeout=30)
    try:
        if rt is None:
            yield comm, lambda v: np.array(v, np.float32), lambda a: a
        else:
            yield comm, lambda v: FakeDeviceArray(np.array(v, np.float32), rt), \
                lambda a: a.get()
            rt.synchronize()
            assert rt.misuse == [], rt.misuse
    finally:
        comm.close()
        if rt is not None:
            rt.close()
            cuda.set_runtime(None)


def contract(rank: int, n: int, addr: str, kind: str) -> list[str]:
    """Rank 0 checks each clause of the contract; returns the clauses checked."""
    store = TCPStore(*parse_address(addr), timeout=30)
    checked = []
    try:
        with _communicator(kind, rank, n, addr) as (comm, make, read):
            comm.barrier()  # connected: later calls wait on their peers, not in the call
            x = make([rank + 1.0] * 4)
            if rank == 1:
                store.get("go", timeout=30)
                comm.all_reduce(x)
                store.get("done", timeout=30)  # and never joins rank 0's last call
                return checked
            work = comm.all_reduce(x, async_op=True)
            assert not work.is_completed()
            checked.append("pending: not completed")
            for wait in (work.wait, work.synchronize):
                with pytest.raises(CollectiveTimeout):
                    wait(timeout=0.2)
            assert not work.is_completed()
            checked.append("pending: wait(timeout) and synchronize(timeout) raise, call goes on")
            store.set("go", "1")
            assert work.synchronize() is x
            assert work.is_completed()
            np.testing.assert_array_equal(read(x), [3.0] * 4)
            assert work.wait() is x and work.result() is x and work.wait(timeout=5) is x
            checked.append("done: every wait returns the result, completed")
            failing = comm.all_reduce(make([1.0]), async_op=True, timeout=0.5)
            with pytest.raises(CollectiveTimeout) as first:
                failing.synchronize()
            for wait in (failing.wait, failing.result):
                with pytest.raises(type(first.value)):
                    wait()
            assert failing.is_completed()
            checked.append("failed: every wait raises its error, completed")
            return checked
    finally:
        if rank == 0:
            store.set("done", "1")
        store.close()
