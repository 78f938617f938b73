"""The same collectives on real CUDA devices (marked ``gpu``: skipped where CUDA is absent).

One GPU: a world of one on NCCL (device and NumPy arrays), and the staged ring across two
processes sharing the device.
Several GPUs: NCCL across one process per device. And the self-check, which must pass.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import cuda_available
from multiproc import spawn

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(180)]


def _device_count() -> int:
    if not cuda_available():
        return 0
    import cupy

    return cupy.cuda.runtime.getDeviceCount()


def _suite(rank: int, n: int, addr: str, backend: str) -> list:
    import cupy

    from gpucoll.default import create

    comm = create(backend, rank=rank, world_size=n, store=addr, timeout=60,
                  device=0 if backend == "ring" else None)
    try:
        stream = cupy.cuda.Stream(non_blocking=True)
        x = cupy.arange(1 << 16, dtype=cupy.float32) + rank
        comm.all_reduce(x, stream=stream)
        stream.synchronize()
        want = np.arange(1 << 16, dtype=np.float32) * n + sum(range(n))
        np.testing.assert_array_equal(x.get(), want)
        g = comm.all_gather(cupy.full(3, rank, cupy.int64))
        assert isinstance(g, cupy.ndarray)
        np.testing.assert_array_equal(g.get(), np.repeat(np.arange(n), 3).reshape(n, 3))
        y = cupy.full(5, rank, cupy.int32)
        comm.all_reduce(y, op="bxor")
        work = comm.all_reduce(cupy.ones(4, cupy.complex64), async_op=True)
        np.testing.assert_array_equal(work.synchronize(timeout=60).get(), np.full(4, n))
        t = comm.all_to_all(cupy.arange(n * 2, dtype=cupy.float64).reshape(n, 2) + 10 * rank)
        np.testing.assert_array_equal(t.get()[:, 0], [10 * j + 2 * rank for j in range(n)])
        comm.barrier()
        return [int(v) for v in y.get()]
    finally:
        comm.close()


def test_nccl_world_of_one(store_addr):
    assert spawn(_suite, 1, store_addr, "nccl", timeout=150) == [[0] * 5]


def _numpy_on_nccl(rank: int, n: int, addr: str) -> list:
    """NumPy arrays on the NCCL backend (staged through device memory), synchronous and not,
    beside a CuPy array on the same communicator."""
    import cupy

    from gpucoll.default import create

    comm = create("nccl", rank=rank, world_size=n, store=addr, timeout=60)
    try:
        x = np.arange(1 << 20, dtype=np.float64) + rank
        assert comm.all_reduce(x) is x
        np.testing.assert_array_equal(x, np.arange(1 << 20) * n + sum(range(n)))
        frozen = np.full(3, rank, np.int16)
        frozen.setflags(write=False)
        g = comm.all_gather(frozen)  # int16: no NCCL type, so bytes on the wire
        assert type(g) is np.ndarray
        np.testing.assert_array_equal(g, np.repeat(np.arange(n, dtype=np.int16), 3).reshape(n, 3))
        y = np.full(5, rank + 1, np.int32)
        work = comm.all_reduce(y, op="bxor", async_op=True)
        d = comm.all_reduce(cupy.ones(7, cupy.float32))
        assert work.wait() is y and float(d.sum().get()) == 7 * n
        return [int(v) for v in y]
    finally:
        comm.close()


def test_numpy_arrays_through_nccl_on_a_world_of_one(store_addr):
    assert spawn(_numpy_on_nccl, 1, store_addr, timeout=150) == [[1] * 5]


def _other_libraries(rank: int, n: int, addr: str, library: str) -> str:
    """torch, JAX or Numba device arrays through NCCL, in place and gathered."""
    from gpucoll.default import create

    comm = create("nccl", rank=rank, world_size=n, store=addr, timeout=60)
    try:
        if library == "torch":
            import torch

            t = torch.arange(8, dtype=torch.float32, device="cuda")
            comm.all_reduce(t)
            b = torch.full((16,), 1.5, dtype=torch.bfloat16, device="cuda")
            comm.all_reduce(b, op="max")
            torch.cuda.synchronize()
            assert t.cpu().tolist() == [n * v for v in range(8)]
            assert (b.float().cpu() == 1.5).all()
            g = comm.all_gather(t)
            assert isinstance(g, torch.Tensor) and tuple(g.shape) == (n, 8)
        elif library == "jax":
            import jax.numpy as jnp

            g = comm.all_gather(jnp.arange(6, dtype=jnp.float32))
            np.testing.assert_array_equal(g.get(), np.tile(np.arange(6), (n, 1)))
        else:
            from numba import cuda as numba_cuda

            d = numba_cuda.to_device(np.arange(5, dtype=np.int64))
            comm.all_reduce(d, op="max")
            numba_cuda.synchronize()
            assert d.copy_to_host().tolist() == list(range(5))
        return library
    finally:
        comm.close()


@pytest.mark.parametrize("library", ["torch", "jax", "numba"])
def test_other_libraries_device_arrays_through_nccl(store_addr, library):
    pytest.importorskip(library)
    assert spawn(_other_libraries, 1, store_addr, library, timeout=150) == [library]


@pytest.mark.skipif(_device_count() < 2, reason="needs two or more CUDA devices")
def test_nccl_across_one_process_per_device(store_addr):
    n = min(_device_count(), 4)
    spawn(_suite, n, store_addr, "nccl", timeout=150)


def test_staged_ring_across_processes_sharing_one_device(store_addr):
    spawn(_suite, 2, store_addr, "ring", timeout=150)


def test_auto_picks_nccl_where_every_rank_has_a_gpu(store_server):
    from gpucoll.backends import choose_backend

    name, reason = choose_backend("auto", store_server, 0, 1)
    assert name == "nccl", reason


@pytest.mark.timeout(1800)
def test_the_selftest_passes_on_this_machines_gpus(tmp_path):
    out = tmp_path / "selftest.json"
    run = subprocess.run([sys.executable, "-m", "gpucoll", "selftest", "--json", str(out)],
                         capture_output=True, text=True, timeout=1700)
    assert run.returncode == 0, run.stdout + run.stderr
    assert json.loads(out.read_text())["outcome"] == "passed"
