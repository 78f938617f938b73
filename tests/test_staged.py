"""Device arrays on the host ring: staged through pinned host buffers, results back on the
stream (device memory emulated by host buffers exposing ``__cuda_array_interface__``)."""

from __future__ import annotations

import nccl_ranks
import numpy as np
import pytest
from multiproc import spawn
from nccl_emulation import EmulatedRuntime, FakeDeviceArray

from gpucoll import cuda
from gpucoll.arrays import as_ref
from gpucoll.backends.staged import StagedBackend

pytestmark = pytest.mark.timeout(120)


def test_ring_runs_every_collective_on_device_arrays_in_chunks(store_addr):
    spawn(nccl_ranks.staged_ring_cases, 2, store_addr, timeout=90)


class _Recorder:
    """A one-rank host backend that records what it was handed."""

    name, rank, size = "ring", 0, 1

    def __init__(self):
        self.seen = []

    def all_reduce(self, x, op, *, timeout):
        self.seen.append((x.kind, x.count))
        np.multiply(x.host, 2, out=x.host)


def test_chunks_alternate_between_two_pinned_buffers_and_results_return(store_addr):
    rt = EmulatedRuntime(store_addr)
    with cuda.use_runtime(rt):
        inner = _Recorder()
        b = StagedBackend(inner, chunk_bytes=32)
        x = FakeDeviceArray(np.arange(20, dtype=np.float32), rt)
        b.all_reduce(as_ref(x, "x"), "sum", timeout=10)
        np.testing.assert_array_equal(x.get(), np.arange(20, dtype=np.float32) * 2)
        assert inner.seen == [("host", 8), ("host", 8), ("host", 4)]
        assert rt.misuse == []
    rt.close()


def test_host_arrays_pass_straight_through(store_addr):
    inner = _Recorder()
    x = np.arange(5, dtype=np.int64)
    StagedBackend(inner).all_reduce(as_ref(x, "x"), "sum", timeout=10)
    assert inner.seen == [("host", 5)]
    np.testing.assert_array_equal(x, np.arange(5) * 2)
