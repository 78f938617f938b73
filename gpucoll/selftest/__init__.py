"""``gpucoll selftest``: the GPU path checked on this machine's GPUs, with a report to paste
into an issue. For whoever first runs gpucoll on GPUs (also in the Docker image:
``docker run --rm --gpus all --ipc=host gpucoll-bench selftest``).

On real devices it runs, each check in processes of its own:
- all_reduce of every dtype x op x size (0, 1, 1031 and 1 Mi elements), and every other
  collective, on a world of one, against NumPy;
- the same on two ranks sharing GPU 0, where NCCL allows it (NCCL >= 2.30, with
  NCCL_MULTI_RANK_GPU_ENABLE=1, which this sets), and on one rank per GPU when there are several;
- the failure cases on those ranks: a rank that never starts, one that skips a collective, one
  that dies (each must end in an error naming it, within its deadline);
- a stream race (the input written on a busy stream, the collective on another), whether
  ``is_completed()`` tells the truth while the device is busy, and split right after
  asynchronous work;
- all_reduce bus bandwidth, beside nccl-tests' ``all_reduce_perf`` when it is found.

Exit status: 0 every check passed, 1 a check failed, 2 nothing could run (no CUDA device, or
nccl4py missing): the report then says why, and that nothing ran on a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from gpucoll import cuda
from gpucoll.selftest import checks
from gpucoll.selftest.procs import run_ranks
from gpucoll.selftest.report import FAIL, PASS, SKIP, Check, Report, as_json, render

BANDWIDTH_SIZES = (1 << 20, 16 << 20, 64 << 20, 256 << 20)
QUICK_BANDWIDTH_SIZES = (1 << 20, 4 << 20)
SHARED_GPU_ENV = {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}


class _Setup:
    """How a check's ranks run: how many, on which device, with what environment."""

    def __init__(self, name: str, n: int, device: int | None, env: dict[str, str]):
        self.name, self.n, self.device, self.env = name, n, device, env


def run(*, quick: bool = False, nccl_tests: str | None = None, timeout: float = 300.0,
        setup: Callable | None = None) -> Report:
    """Every check this machine allows. ``setup(store_address)`` (tests only) prepares each
    rank process and returns its device-array maker; None: CuPy on the real devices."""
    from gpucoll.backends.nccl.auto import library_version, several_ranks_per_gpu
    from gpucoll.info import collect

    rt = cuda.runtime()
    report = Report(collect(), rt.name)
    ok, why = rt.available()
    if not ok:
        report.note = f"no CUDA device ({why})"
        return report
    try:
        version = library_version(rt.nccl())
    except Exception as exc:  # noqa: BLE001
        report.note = f"nccl4py cannot be loaded ({type(exc).__name__}: {exc})"
        return report
    count = rt.device_count()
    one = _Setup("world of one", 1, 0, {})
    shared = _Setup("2 ranks on GPU 0", 2, 0, SHARED_GPU_ENV) if several_ranks_per_gpu(
        version, SHARED_GPU_ENV) else None
    spread = _Setup(f"{min(count, 8)} ranks, one per GPU", min(count, 8), None, {}) \
        if count >= 2 else None
    multi = spread or shared

    def check(name: str, where: _Setup | None, fn: Callable, *args: Any,
              why_not: str = "") -> None:
        report.checks.append(_run_check(f"{name} ({where.name})" if where else name, where,
                                        fn, args, timeout, setup, why_not))

    check("dtype x op x size", one, checks.matrix, quick)
    check("dtype x op x size", shared, checks.matrix, True,
          why_not=f"NCCL {version} refuses several ranks on one GPU (needs 2.30)")
    check("dtype x op x size", spread, checks.matrix, True, why_not="one GPU only")
    no_multi = "needs two GPUs, or NCCL >= 2.30 for two ranks on one"
    check("a rank that never starts", multi, checks.missing_at_start_up, why_not=no_multi)
    check("a rank that skips a collective", multi, checks.skipped_call, why_not=no_multi)
    check("a rank that dies", multi, checks.dead_peer, why_not=no_multi)
    check("stream race", one, checks.stream_race)
    check("is_completed() while the device is busy", one, checks.honest_completion)
    check("split after async work", multi or one, checks.split_after_async)
    if multi is not None:
        _bandwidth(report, multi, quick, nccl_tests, timeout, setup)
    return report


def _run_check(name: str, where: _Setup | None, fn: Callable, args: tuple, timeout: float,
               setup: Callable | None, why_not: str) -> Check:
    if where is None:
        return Check(name, SKIP, 0.0, why_not)
    start = time.monotonic()
    outcomes = run_ranks(fn, where.n, where.device, *args, timeout=timeout, env=where.env,
                         setup=setup)
    seconds = time.monotonic() - start
    if fn is checks.dead_peer:  # rank 1 dies on purpose
        outcomes = outcomes[:1]
    errors = [f"rank {o.rank}: {o.error or f'exit code {o.exitcode}'}" for o in outcomes
              if not o.ok]
    if errors:
        return Check(name, FAIL, seconds, "; ".join(errors))
    return Check(name, PASS, seconds, str(outcomes[0].value))


def _bandwidth(report: Report, where: _Setup, quick: bool, nccl_tests: str | None,
               timeout: float, setup: Callable | None) -> None:
    sizes = QUICK_BANDWIDTH_SIZES if quick else BANDWIDTH_SIZES
    outcomes = run_ranks(checks.bandwidth, where.n, where.device, sizes, 3 if quick else 20,
                         timeout=timeout, env=where.env, setup=setup)
    if not all(o.ok for o in outcomes):
        report.checks.append(Check(f"bandwidth ({where.name})", FAIL, 0.0, "; ".join(
            f"rank {o.rank}: {o.error or o.exitcode}" for o in outcomes if not o.ok)))
        return
    theirs = nccl_tests_busbw(nccl_tests, where, sizes, timeout)
    report.bandwidth_setup = where.name
    report.bandwidth = [{"bytes": b, "us": us, "busbw": bw, "nccl_tests": theirs.get(b)}
                        for b, us, bw in outcomes[0].value]
    found = "nccl-tests all_reduce_perf beside it" if theirs else (
        "nccl-tests' all_reduce_perf not found (pass --nccl-tests PATH)")
    report.checks.append(Check(f"bandwidth ({where.name})", PASS, 0.0, found))


def nccl_tests_busbw(path: str | None, where: _Setup, sizes: tuple[int, ...],
                     timeout: float) -> dict[int, float]:
    """Out-of-place bus bandwidth per size from nccl-tests' ``all_reduce_perf`` run on the
    same GPUs in one process (``-g``), when it is found; {} otherwise."""
    exe = path or shutil.which("all_reduce_perf")
    if exe is None or not os.access(exe, os.X_OK) or where.device is not None:
        return {}
    cmd = [exe, "-b", str(min(sizes)), "-e", str(max(sizes)), "-f", "4", "-g", str(where.n)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    rows = {}
    for line in out.splitlines():
        fields = line.split()
        if len(fields) >= 8 and fields[0].isdigit() and re.fullmatch(r"[\d.]+", fields[7]):
            rows[int(fields[0])] = float(fields[7])  # size count type redop root time algbw busbw
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpucoll selftest", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="fewer sizes (no 1 Mi-element cases, bandwidth to 4 MiB only)")
    parser.add_argument("--nccl-tests", metavar="PATH",
                        help="nccl-tests' all_reduce_perf (default: found on PATH)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds one check may take (default 300)")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    args = parser.parse_args(argv)
    report = run(quick=args.quick, nccl_tests=args.nccl_tests, timeout=args.timeout)
    print(render(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(as_json(report), f, indent=2)
    return report.status


if __name__ == "__main__":
    sys.exit(main())
