"""``gpucoll selftest``: honest without a GPU (says nothing ran, exit status 2), and every check
it would run on GPUs exercised through the emulation (where they pass, and fail when results
are wrong)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import selftest_emulation
from conftest import cuda_available
from nccl_emulation import EmulatedRuntime

from gpucoll import cuda, selftest
from gpucoll.selftest import render

pytestmark = pytest.mark.timeout(300)

CHECKS = [
    "dtype x op x size (world of one)",
    "dtype x op x size, NumPy arrays (world of one)",
    "dtype x op x size (2 ranks on GPU 0)",
    "dtype x op x size (2 ranks, one per GPU)",
    "a rank that never starts (2 ranks, one per GPU)",
    "a rank that skips a collective (2 ranks, one per GPU)",
    "a rank that dies (2 ranks, one per GPU)",
    "stream race (world of one)",
    "is_completed() while the device is busy (world of one)",
    "split after async work (2 ranks, one per GPU)",
    "bandwidth (2 ranks, one per GPU)",
]


@pytest.mark.skipif(cuda_available(), reason="checks the machine without a GPU")
def test_without_a_gpu_it_says_nothing_ran_and_exits_2(tmp_path):
    out = tmp_path / "selftest.json"
    run = subprocess.run([sys.executable, "-m", "gpucoll", "selftest", "--json", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "Traceback" not in run.stderr
    assert "**Nothing ran on a GPU: no CUDA device (CUDA has no usable device" in run.stdout
    report = json.loads(out.read_text())
    assert (report["outcome"], report["status"], report["checks"]) == ("nothing ran", 2, [])


NO_GPU_STACK = ("cupy", "cupy_backends", "cupy_backends.cuda", "cupy_backends.cuda.api",
                "cupy_backends.cuda.api.runtime", "nccl", "nccl.core", "cuda", "cuda.bindings")


def test_without_cupy_or_nccl4py_it_says_nothing_ran_and_exits_2():
    """As in the CPU image, or after a plain ``pip install gpucoll``: no CUDA stack at all."""
    hide = f"import sys; sys.modules.update(dict.fromkeys({NO_GPU_STACK!r}))"
    run = subprocess.run([sys.executable, "-c", f"{hide}; from gpucoll.__main__ import main; "
                          "raise SystemExit(main(['selftest']))"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "Traceback" not in run.stderr
    assert "CuPy unavailable" in run.stdout and "NCCL unavailable" in run.stdout
    assert "**Nothing ran on a GPU: no CUDA device (CuPy is not importable" in run.stdout


@pytest.fixture
def emulated(store_addr):
    rt = EmulatedRuntime(store_addr, devices=2)
    with cuda.use_runtime(rt):
        yield rt
    rt.close()


@pytest.mark.slow
def test_every_check_runs_and_passes_through_the_emulation(emulated):
    report = selftest.run(quick=True, timeout=120, setup=selftest_emulation.setup)
    text = render(report)
    assert [c.name for c in report.checks] == CHECKS, text
    assert report.outcome == "passed" and report.status == 0, text
    assert "gpucoll's CUDA runtime: emulated" in text
    assert [row["bytes"] for row in report.bandwidth] == list(selftest.QUICK_BANDWIDTH_SIZES)
    details = {c.name: c.detail for c in report.checks}
    assert "rank 1" in details["a rank that never starts (2 ranks, one per GPU)"]
    assert details["a rank that dies (2 ranks, one per GPU)"].startswith("PeerFailure")


@pytest.mark.slow
def test_wrong_results_fail_the_checks_that_compare_them(emulated):
    report = selftest.run(quick=True, timeout=120, setup=selftest_emulation.setup_wrong)
    failed = {c.name for c in report.checks if c.status == "fail"}
    assert {"dtype x op x size (world of one)", "stream race (world of one)",
            "split after async work (2 ranks, one per GPU)"} <= failed
    assert report.status == 1 and "**failed**" in render(report)


def ranks_checks(n: int) -> list[str]:
    where = f"({n} ranks on 1 GPU(s))"
    return [f"{name} {where}" for name in (
        "dtype x op x size", "dtype x op x size, NumPy arrays", "uneven and object collectives",
        "batch_isend_irecv", "async Work", "split after async work", "new_group",
        "torch and JAX arrays", "a rank that never starts", "a rank that skips a collective",
        "a rank killed during a call", "a stopped rank (SIGSTOP)",
        "shrink after a rank is killed")]


@pytest.fixture
def one_gpu(store_addr):
    rt = EmulatedRuntime(store_addr, devices=1)
    with cuda.use_runtime(rt):
        yield rt
    rt.close()


def _passes_on_ranks(n: int, setup) -> None:
    report = selftest.run(quick=True, timeout=120, setup=setup, ranks=n)
    text = render(report)
    assert [c.name for c in report.checks] == ranks_checks(n), text
    statuses = {c.name: c.status for c in report.checks}
    torch_jax = f"torch and JAX arrays ({n} ranks on 1 GPU(s))"
    assert statuses.pop(torch_jax) == "skip", text  # the emulation has no torch or JAX GPU
    assert set(statuses.values()) == {"pass"}, text
    assert report.status == 0, text
    details = {c.name.rsplit(" (", 1)[0]: c.detail for c in report.checks}
    assert details["a rank killed during a call"].startswith("PeerFailure"), text
    assert "rank 1" in details["a stopped rank (SIGSTOP)"], text
    assert "rank 1" in details["a rank that never starts"], text
    assert f"shrunk to {n - 1} rank(s)" in details["shrink after a rank is killed"], text


@pytest.mark.slow  # about 20 s on two cores
def test_selftest_on_2_ranks_sharing_one_gpu_runs_and_passes(one_gpu):
    _passes_on_ranks(2, selftest_emulation.setup_one_gpu)


@pytest.mark.slow
def test_selftest_on_4_ranks_sharing_one_gpu_runs_and_passes(one_gpu):
    _passes_on_ranks(4, selftest_emulation.setup_one_gpu)


@pytest.mark.slow
def test_selftest_on_2_ranks_sharing_one_gpu_with_nccl_before_2_30(one_gpu):
    _passes_on_ranks(2, selftest_emulation.setup_one_gpu_nccl_2_28)


@pytest.mark.slow
def test_selftest_on_ranks_fails_the_checks_that_compare_results(one_gpu):
    report = selftest.run(quick=True, timeout=120, setup=selftest_emulation.setup_wrong,
                          ranks=2)
    failed = {c.name.rsplit(" (", 1)[0] for c in report.checks if c.status == "fail"}
    assert {"dtype x op x size", "uneven and object collectives", "batch_isend_irecv",
            "async Work", "new_group"} <= failed, render(report)
    assert report.status == 1


@pytest.mark.parametrize("ranks", [1, 0, True, "2"])
def test_selftest_refuses_fewer_than_two_ranks(ranks):
    with pytest.raises(ValueError, match="expected an int of at least 2"):
        selftest.run(ranks=ranks)
