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
from nccl_emulation import EmulatedRuntime, two_ranks_per_gpu

from gpucoll import cuda, selftest
from gpucoll.selftest import render

pytestmark = pytest.mark.timeout(300)

CHECKS = [
    "dtype x op x size (world of one)",
    "dtype x op x size, NumPy arrays (world of one)",
    # skipped, and named without the setting, where the installed NCCL is older than 2.30
    "dtype x op x size (2 ranks on GPU 0)" if two_ranks_per_gpu() else "dtype x op x size",
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
