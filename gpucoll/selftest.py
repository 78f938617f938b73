"""``gpucoll selftest``: the GPU path checked on this machine's GPUs, with a report to paste
into an issue. For whoever first runs gpucoll on GPUs (also in the Docker image:
``docker run --rm --gpus all --ipc=host gpucoll-bench selftest``).

On real devices it runs, each check in processes of its own:
- all_reduce of every dtype x op x size (0, 1, 1031 and 1 Mi elements), and every other
  collective, on a world of one, against NumPy; then the same on NumPy arrays, which the NCCL
  backend stages through device memory;
- the same on two ranks sharing GPU 0 (backend="nccl" arranges that with NCCL), and on one
  rank per GPU when there are several;
- the failure cases on those ranks: a rank that never starts, one that skips a collective, one
  that dies (each must end in an error naming it, within its deadline);
- a stream race (the input written on a busy stream, the collective on another), whether
  ``is_completed()`` tells the truth while the device is busy, and split right after
  asynchronous work;
- all_reduce bus bandwidth, beside nccl-tests' ``all_reduce_perf`` when it is found.

``--ranks N`` runs instead the checks of N ranks sharing the machine's GPUs through
backend="nccl" (``run_ranks_suite``; ranks on one GPU as ``gpucoll.backends.nccl`` arranges):
the matrix on device and on NumPy arrays, uneven and object collectives, batch_isend_irecv,
async Work, split, new_group, torch and JAX arrays where installed with GPU support, and the
faults (a rank that never starts, skips a call, is killed during one, is stopped; shrink
after a loss), each named within its bound.

Exit status: 0 every check passed, 1 a check failed, 2 nothing could run (no CUDA device, or
nccl4py missing): the report then says why, and that nothing ran on a GPU.

``gpucoll info`` (at the end of this module) is the quick look that comes first: CuPy, CUDA,
NCCL (through nccl4py), the devices, and the backend ``auto`` would pick and why. Every probe
catches its own failure and reports it as text, so it prints a full report (and exits 0) on a
machine without a GPU, without CuPy or without NCCL; the self-check's report starts with it.

What is here, in this order:

- the command and ``run``: which checks this machine allows, on how many ranks and GPUs, and
  nccl-tests' bandwidth beside gpucoll's;
- running one check's ranks: fresh processes (spawned, so no CUDA state is inherited), a store
  of their own on a free port, a deadline, and nothing left running afterwards;
- the checks, the ranks' bodies: each runs in a process of its own, ``fn(rank, n, addr,
  arrays, device, *args)`` (``device`` None: the rank's local rank), and returns a short text
  for the report or raises. ``arrays`` makes and reads device arrays (``CupyArrays``: CuPy on
  the real devices; the tests pass an emulated one). Everything else goes through gpucoll's
  public API and ``gpucoll.cuda``;
- the report: what ran where, each check's result, and bandwidth beside nccl-tests', as
  Markdown to paste into an issue (and as JSON).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from gpucoll import cuda
from gpucoll.arrays import SUPPORTED_DTYPES, dtype_from_name
from gpucoll.backends.nccl.backend import library_version, local_verdict
from gpucoll.default import create
from gpucoll.errors import CollectiveTimeout, GpucollError, PeerFailure
from gpucoll.ops import ReduceOp, check_op_dtype
from gpucoll.store import TCPStore
from gpucoll.transport import shm

# -- which checks run where, and the command --------------------------------------------------
BANDWIDTH_SIZES = (1 << 20, 16 << 20, 64 << 20, 256 << 20)
QUICK_BANDWIDTH_SIZES = (1 << 20, 4 << 20)


class _Setup:
    """How a check's ranks run: how many, on which device, with what environment."""

    def __init__(self, name: str, n: int, device: int | None, env: dict[str, str]):
        self.name, self.n, self.device, self.env = name, n, device, env


def run(*, quick: bool = False, nccl_tests: str | None = None, timeout: float = 300.0,
        setup: Callable | None = None, ranks: int | None = None) -> Report:
    """Every check this machine allows; with ``ranks``, the checks of ``ranks`` ranks sharing
    this machine's GPUs instead (``run_ranks_suite``). ``setup(store_address)`` (tests only)
    prepares each rank process and returns its device-array maker; None: CuPy on the real
    devices."""
    if ranks is not None and (isinstance(ranks, bool) or not isinstance(ranks, int)
                              or ranks < 2):
        raise ValueError(f"ranks={ranks!r}: expected an int of at least 2")

    rt = cuda.runtime()
    report = Report(collect(), rt.name)
    ok, why = rt.available()
    if not ok:
        report.note = f"no CUDA device ({why})"
        return report
    try:
        library_version(rt.nccl())  # loads NCCL, or says why it cannot
    except Exception as exc:  # noqa: BLE001
        report.note = f"nccl4py cannot be loaded ({type(exc).__name__}: {exc})"
        return report
    count = rt.device_count()
    if ranks is not None:
        run_ranks_suite(report, _Setup(f"{ranks} ranks on {count} GPU(s)", ranks, None, {}),
                        quick, timeout, setup)
        return report
    one = _Setup("world of one", 1, 0, {})
    shared = _Setup("2 ranks on GPU 0", 2, 0, {})
    spread = _Setup(f"{min(count, 8)} ranks, one per GPU", min(count, 8), None, {}) \
        if count >= 2 else None
    multi = spread or shared

    def check(name: str, where: _Setup | None, fn: Callable, *args: Any,
              why_not: str = "") -> None:
        report.checks.append(_run_check(f"{name} ({where.name})" if where else name, where,
                                        fn, args, timeout, setup, why_not))

    check("dtype x op x size", one, matrix, quick)
    check("dtype x op x size, NumPy arrays", one, host_matrix, quick)
    check("dtype x op x size", shared, matrix, True)
    check("dtype x op x size", spread, matrix, True, why_not="one GPU only")
    check("a rank that never starts", multi, missing_at_start_up)
    check("a rank that skips a collective", multi, skipped_call)
    check("a rank that dies", multi, dead_peer)
    check("stream race", one, stream_race)
    check("is_completed() while the device is busy", one, honest_completion)
    check("split after async work", multi, split_after_async)
    _bandwidth(report, multi, quick, nccl_tests, timeout, setup)
    return report


def run_ranks_suite(report: Report, where: _Setup, quick: bool, timeout: float,
                    setup: Callable | None) -> None:
    """``gpucoll selftest --ranks N``: every check on N ranks through backend="nccl", the
    ranks sharing this machine's GPUs (rank r drives GPU r modulo their number)."""

    def check(name: str, fn: Callable, *args: Any) -> None:
        report.checks.append(_run_check(f"{name} ({where.name})", where, fn, args, timeout,
                                        setup, ""))

    check("dtype x op x size", matrix, quick)
    check("dtype x op x size, NumPy arrays", host_matrix, quick)
    check("uneven and object collectives", uneven_and_objects)
    check("batch_isend_irecv", batch_ring)
    check("async Work", async_work)
    check("split after async work", split_after_async)
    check("new_group", new_group_of_evens)
    check("torch and JAX arrays", other_libraries)
    check("a rank that never starts", missing_at_start_up)
    check("a rank that skips a collective", skipped_call)
    check("a rank killed during a call", dead_peer)
    check("a stopped rank (SIGSTOP)", stopped_peer)
    check("shrink after a rank is killed", shrink_after_loss)


def _run_check(name: str, where: _Setup | None, fn: Callable, args: tuple, timeout: float,
               setup: Callable | None, why_not: str) -> Check:
    if where is None:
        return Check(name, SKIP, 0.0, why_not)
    start = time.monotonic()
    outcomes = run_ranks(fn, where.n, where.device, *args, timeout=timeout, env=where.env,
                         setup=setup)
    seconds = time.monotonic() - start
    if fn in LOSES_RANK_1:  # rank 1 dies or stops on purpose
        outcomes = [o for o in outcomes if o.rank != 1]
    errors = [f"rank {o.rank}: {o.error or f'exit code {o.exitcode}'}" for o in outcomes
              if not o.ok]
    if errors:
        return Check(name, FAIL, seconds, "; ".join(errors))
    if isinstance(outcomes[0].value, Skipped):
        return Check(name, SKIP, seconds, str(outcomes[0].value))
    return Check(name, PASS, seconds, str(outcomes[0].value))


def _bandwidth(report: Report, where: _Setup, quick: bool, nccl_tests: str | None,
               timeout: float, setup: Callable | None) -> None:
    sizes = QUICK_BANDWIDTH_SIZES if quick else BANDWIDTH_SIZES
    outcomes = run_ranks(bandwidth, where.n, where.device, sizes, 3 if quick else 20,
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
    parser.add_argument("--ranks", type=int, metavar="N",
                        help="instead, check N ranks (2 or more) sharing this machine's GPUs "
                             "through backend='nccl': collectives, groups, faults")
    args = parser.parse_args(argv)
    if args.ranks is not None and args.ranks < 2:
        parser.error(f"--ranks {args.ranks}: expected 2 or more")
    report = run(quick=args.quick, nccl_tests=args.nccl_tests, timeout=args.timeout,
                 ranks=args.ranks)
    print(render(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(as_json(report), f, indent=2)
    return report.status


# -- running one check's ranks ----------------------------------------------------------------
_CTX = mp.get_context("spawn")


@dataclasses.dataclass
class Outcome:
    """What one rank returned (``value``), or why it did not (``error``; ``exitcode``)."""

    rank: int
    value: Any = None
    error: str = ""
    exitcode: int | None = None

    @property
    def ok(self) -> bool:
        return not self.error and self.exitcode == 0


def _rank(fn: Callable, rank: int, n: int, addr: str, args: tuple, env: dict[str, str],
          setup: Callable | None, conn: Any) -> None:
    os.environ.update(env)
    try:
        if setup is not None:
            arrays = setup(addr)
        else:
            arrays = CupyArrays()
        conn.send((fn(rank, n, addr, arrays, *args), ""))
    except BaseException as exc:  # noqa: BLE001 - reported in the parent
        conn.send((None, f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()


def run_ranks(fn: Callable, n: int, *args: Any, timeout: float, env: dict[str, str] | None = None,
              setup: Callable | None = None) -> list[Outcome]:
    """``fn(rank, n, store_address, arrays, *args)`` in ``n`` processes; ranks still running
    at the deadline are killed and reported so."""
    server = TCPStore("127.0.0.1", 0, is_server=True, timeout=timeout)
    addr = f"tcp://127.0.0.1:{server.port}"
    procs, pipes = [], []
    try:
        for rank in range(n):
            parent, child = _CTX.Pipe(duplex=False)
            p = _CTX.Process(target=_rank, args=(fn, rank, n, addr, args, env or {}, setup,
                                                 child), daemon=True)
            p.start()
            child.close()
            procs.append(p)
            pipes.append(parent)
        return _collect(procs, pipes, time.monotonic() + timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
        server.close()


def _collect(procs: list, pipes: list, deadline: float) -> list[Outcome]:
    outcomes = [Outcome(rank) for rank in range(len(procs))]
    pending = set(range(len(procs)))
    while pending and time.monotonic() < deadline:
        ready = mp.connection.wait([pipes[r] for r in pending] + [procs[r].sentinel
                                                                  for r in pending], 0.1)
        for r in list(pending):
            if pipes[r] in ready:
                try:
                    outcomes[r].value, outcomes[r].error = pipes[r].recv()
                except EOFError:
                    pass
            if pipes[r] in ready or procs[r].sentinel in ready:
                procs[r].join(10)
                outcomes[r].exitcode = procs[r].exitcode
                pending.discard(r)
    for r in pending:
        outcomes[r].error = "still running at the deadline (killed)"
    return outcomes


# -- the checks: the ranks' bodies ------------------------------------------------------------
SIZES = (0, 1, 1031, 1 << 20)  # elements: empty, one, odd, 4-8 MiB
QUICK_SIZES = (0, 1, 1031)


class CupyArrays:
    """Device arrays on the real devices, through CuPy."""

    def __init__(self) -> None:
        self._streams: dict[int, Any] = {}  # streams made here live as long as the check

    def put(self, host: np.ndarray) -> Any:
        import cupy

        return cupy.asarray(host)

    def get(self, x: Any, stream: int | None = None) -> np.ndarray:
        """A host copy, made on ``stream`` (default: the current stream)."""
        return x.get(stream=None if stream is None else self._streams[stream])

    def new_stream(self) -> int:
        import cupy

        s = cupy.cuda.Stream(non_blocking=True)
        self._streams[int(s.ptr)] = s
        return int(s.ptr)

    def current(self, stream: int) -> Any:
        """A context in which ``stream`` (made by ``new_stream``) is the current stream."""
        return self._streams[stream]


def _values(dtype: np.dtype, shape: tuple, rank: int) -> np.ndarray:
    """Exactly representable values, different on each rank, small enough for any sum."""
    base = (np.arange(int(np.prod(shape))) % 5 + rank + 1).reshape(shape)
    if dtype.kind == "b":
        return (base % 2).astype(bool)
    if dtype.kind == "c":
        return (base + 1j * base).astype(dtype)
    return base.astype(dtype)


def _expected(op: ReduceOp, parts: list[np.ndarray]) -> np.ndarray:
    if op is ReduceOp.AVG:
        return np.mean([p.astype(np.complex128) for p in parts], axis=0)
    fn = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum,
          "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}[op.value]
    out = parts[0]
    for p in parts[1:]:
        out = fn(out, p)
    return out.astype(parts[0].dtype)


def _close(got: np.ndarray, want: np.ndarray, op: ReduceOp, n: int) -> bool:
    if op is not ReduceOp.AVG:
        return np.array_equal(got, want)
    import ml_dtypes

    eps = float(ml_dtypes.finfo(got.real.dtype if got.dtype.kind == "c" else got.dtype).eps)
    return np.allclose(got.astype(np.complex128), want, rtol=(n + 1) * eps, atol=0)


def _cases(quick: bool) -> Iterator[tuple[np.dtype, ReduceOp, int]]:
    for name in SUPPORTED_DTYPES:
        dtype = dtype_from_name(name)
        for op in ReduceOp:
            try:
                check_op_dtype(op, dtype, "all_reduce")
            except TypeError:
                continue
            for size in QUICK_SIZES if quick else SIZES:
                yield dtype, op, size


def matrix(rank: int, n: int, addr: str, arrays: Any, device: int | None, quick: bool) -> str:
    """Every dtype x op x size of all_reduce on NCCL, then every other collective once, against
    NumPy; the cases NCCL refuses (e.g. complex prod) are counted, not failed."""
    comm = create("nccl", rank=rank, world_size=n, store=addr, timeout=60, device=device)
    wrong, refused, done = [], 0, 0
    with comm:
        for dtype, op, size in _cases(quick):
            try:
                x = arrays.put(_values(dtype, (size,), rank))
                comm.all_reduce(x, op=op)
            except TypeError:
                refused += 1
                continue
            want = _expected(op, [_values(dtype, (size,), r) for r in range(n)])
            if not _close(arrays.get(x), want, op, n):
                wrong.append(f"all_reduce {op.value} {dtype.name} x{size}")
            done += 1
        wrong += _others(comm, arrays, rank, n)
    if wrong:
        raise AssertionError(f"{len(wrong)} wrong: {', '.join(wrong[:8])}")
    return f"{done} all_reduce cases and 7 other collectives right ({refused} refused by NCCL)"


class NumpyArrays:
    """Host arrays: what ``matrix`` checks when it is given NumPy arrays instead of device ones."""

    def put(self, host: np.ndarray) -> np.ndarray:
        return host.copy()

    def get(self, x: np.ndarray, stream: int | None = None) -> np.ndarray:
        return x


def host_matrix(rank: int, n: int, addr: str, arrays: Any, device: int | None,
                quick: bool) -> str:
    """``matrix`` on NumPy arrays through the NCCL backend."""
    return matrix(rank, n, addr, NumpyArrays(), device, quick)


def _others(comm: Any, arrays: Any, rank: int, n: int) -> list[str]:
    """broadcast, reduce, all_gather, gather, scatter, reduce_scatter, all_to_all: the wrong."""
    wrong = []
    mine = _values(np.dtype(np.float32), (n, 3), rank)
    every = [_values(np.dtype(np.float32), (n, 3), r) for r in range(n)]

    def check(name: str, got: Any, want: np.ndarray) -> None:
        if got is not None and not np.array_equal(arrays.get(got), want):
            wrong.append(name)

    x = arrays.put(mine)
    comm.broadcast(x, root=n - 1)
    check("broadcast", x, every[n - 1])
    x = arrays.put(mine)
    comm.reduce(x, root=0)
    check("reduce", x if rank == 0 else None, sum(every))
    check("all_gather", comm.all_gather(arrays.put(mine)), np.stack(every))
    check("gather", comm.gather(arrays.put(mine), root=0), np.stack(every))
    check("scatter", comm.scatter(arrays.put(every[0]) if rank == 0 else None, root=0),
          every[0][rank])
    check("reduce_scatter", comm.reduce_scatter(arrays.put(mine)), sum(every)[rank])
    check("all_to_all", comm.all_to_all(arrays.put(mine)), np.stack([e[rank] for e in every]))
    return wrong


class RankOneAway:
    """Rank 1 stays away from rank 0's calls, for the checks of a peer that never comes or dies
    (on two ranks). On rank 1, ``stays_away`` exits at once (``dies``) or waits until rank 0 is
    done, which rank 0 says in the store on leaving the ``with`` block however it leaves, so
    that rank 1 never outlives a failed rank 0 by its wait. Without a store, rank 1 just
    returns."""

    def __init__(self, rank: int, store: Any = None, key: str = "selftest/done",
                 wait: float = 60.0):
        self.rank, self.store, self.key, self.wait = rank, store, key, wait

    def __enter__(self) -> RankOneAway:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.rank == 0 and self.store is not None:
            self.store.set(self.key, "1")

    def stays_away(self, *, dies: bool = False) -> bool:
        """True on rank 1, once rank 0 is done (the caller then returns); False on rank 0."""
        if self.rank != 1:
            return False
        if dies:
            os._exit(0)
        if self.store is not None:
            self.store.get(self.key, timeout=self.wait)
        return True


def fails_without_rank_1(what: str, errors: type[BaseException] | tuple, call: Callable[[], Any],
                         *, named: bool = False) -> BaseException:
    """The error ``call()`` (``what``, on rank 0 while rank 1 is away) must raise, one of
    ``errors`` (with ``named``: naming rank 1); an AssertionError when it completes."""
    try:
        call()
    except errors as exc:
        if named and "rank 1" not in str(exc):
            raise AssertionError(f"the {type(exc).__name__} does not name rank 1: {exc}") from exc
        return exc
    raise AssertionError(f"{what} without rank 1 completed")


def missing_at_start_up(rank: int, n: int, addr: str, arrays: Any, device: int | None) -> str:
    """Rank 1 never starts: rank 0's start-up must end within its 3 s deadline naming it. The
    other ranks wait longer, and fail too (naming rank 1, or rank 0, which left first)."""
    if RankOneAway(rank).stays_away():
        return ""
    start = time.monotonic()
    if rank != 0:
        exc = fails_without_rank_1("start-up", (CollectiveTimeout, PeerFailure), lambda: create(
            "nccl", rank=rank, world_size=n, store=addr, timeout=3 + SLACK, device=device))
        return f"{type(exc).__name__}: {exc}"
    exc = fails_without_rank_1("start-up", CollectiveTimeout, lambda: create(
        "nccl", rank=rank, world_size=n, store=addr, timeout=3, device=device), named=True)
    return _within(f"CollectiveTimeout after {time.monotonic() - start:.1f} s (deadline 3 s): "
                   f"{exc}", start, 3 + SLACK)


def skipped_call(rank: int, n: int, addr: str, arrays: Any, device: int | None) -> str:
    """Rank 1 skips an all_reduce: rank 0's must fail by its 2 s deadline, then every later
    call fails at once; both close without hanging."""
    from gpucoll.store import TCPStore, parse_address

    store = TCPStore(*parse_address(addr), timeout=60)
    comm = create("nccl", rank=rank, world_size=n, store=addr, timeout=60, device=device)
    try:
        with RankOneAway(rank, store, "selftest/skipped") as away:
            x = arrays.put(np.ones(1024, np.float32))
            comm.barrier()
            if away.stays_away():
                return ""
            start = time.monotonic()
            exc = fails_without_rank_1("an all_reduce", CollectiveTimeout, lambda: (
                comm.all_reduce(x, async_op=True, timeout=2).synchronize()))
            took = time.monotonic() - start
            try:
                comm.all_reduce(x)
            except GpucollError:
                pass
            else:
                raise AssertionError("the aborted communicator took another call") from exc
            return _within(f"CollectiveTimeout after {took:.1f} s (deadline 2 s): {exc}",
                           start, 2 + SLACK, took)
    finally:
        comm.close()
        store.close()


SLACK = 3.0  # seconds a fault check allows past its deadline (a loaded machine)
PEER_FAILURE_BOUND = 5.0  # a dead peer is named "within about a second" (docs/gpus.md)
IN_CALL = "selftest/in-call/{}"


class Skipped(str):
    """A rank's answer for a check this machine cannot run (the report says skip, and why)."""


def _within(text: str, start: float, bound: float, took: float | None = None) -> str:
    """``text``, or an AssertionError when the error came later than ``bound`` seconds."""
    took = time.monotonic() - start if took is None else took
    if took > bound:
        raise AssertionError(f"named only after {took:.1f} s (bound {bound:.0f} s): {text}")
    return text


def _signal_rank_1_in_call(store: Any, rank: int, n: int, sig: int) -> None:
    """Rank 1 publishes its pid, waits until every other rank is about to enter its call (and a
    little more), then sends itself ``sig``; every other rank says it is about to enter."""
    if rank != 1:
        store.set(IN_CALL.format(rank), "1")
        return
    store.set("selftest/pid", str(os.getpid()))
    store.wait([IN_CALL.format(r) for r in range(n) if r != 1], timeout=60)
    time.sleep(0.5)
    os.kill(os.getpid(), sig)


def dead_peer(rank: int, n: int, addr: str, arrays: Any, device: int | None) -> str:
    """Rank 1 is killed (SIGKILL) while the others are in an all_reduce: they must name it
    within about a second, long before the call's 60 s deadline."""
    import signal

    from gpucoll.store import TCPStore, parse_address

    store = TCPStore(*parse_address(addr), timeout=60)
    comm = create("nccl", rank=rank, world_size=n, store=addr, timeout=60, device=device)
    with comm:
        x = arrays.put(np.ones(1024, np.float32))
        comm.barrier()
        _signal_rank_1_in_call(store, rank, n, signal.SIGKILL)
        start = time.monotonic()
        exc = fails_without_rank_1("an all_reduce", PeerFailure,
                                   lambda: comm.all_reduce(x, async_op=True).synchronize(),
                                   named=True)
        took = time.monotonic() - start
    store.close()
    return _within(f"PeerFailure after {took:.1f} s: {exc}", start, PEER_FAILURE_BOUND, took)


def stopped_peer(rank: int, n: int, addr: str, arrays: Any, device: int | None) -> str:
    """Rank 1 is stopped (SIGSTOP) while the others are in an all_reduce: alive but silent, so
    their call must end by its 3 s deadline naming it; rank 0 then kills it."""
    import signal

    from gpucoll.store import TCPStore, parse_address

    store = TCPStore(*parse_address(addr), timeout=60)
    comm = create("nccl", rank=rank, world_size=n, store=addr, timeout=60, device=device)
    x = arrays.put(np.ones(1024, np.float32))
    comm.barrier()
    _signal_rank_1_in_call(store, rank, n, signal.SIGSTOP)
    if rank == 1:
        return ""  # not reached: rank 0 kills this process
    start = time.monotonic()
    exc = fails_without_rank_1("an all_reduce", CollectiveTimeout, lambda: comm.all_reduce(
        x, async_op=True, timeout=3).synchronize(), named=True)
    took = time.monotonic() - start
    comm.close()
    store.set(f"selftest/timed-out/{rank}", "1")
    if rank == 0:
        store.wait([f"selftest/timed-out/{r}" for r in range(n) if r != 1], timeout=60)
        os.kill(int(store.get("selftest/pid", timeout=60)), signal.SIGKILL)
    store.close()
    return _within(f"CollectiveTimeout after {took:.1f} s (deadline 3 s): {exc}", start,
                   3 + SLACK, took)


def shrink_after_loss(rank: int, n: int, addr: str, arrays: Any, device: int | None) -> str:
    """Rank 1 is killed during an all_reduce; the others shrink the group and all_reduce on
    what is left (with ncclCommShrink where NCCL has it, else a fresh communicator of the
    survivors: it must work either way)."""
    import signal

    from gpucoll.store import TCPStore, parse_address

    store = TCPStore(*parse_address(addr), timeout=60)
    comm = create("nccl", rank=rank, world_size=n, store=addr, timeout=60, device=device)
    x = arrays.put(np.ones(1024, np.float32))
    comm.barrier()
    _signal_rank_1_in_call(store, rank, n, signal.SIGKILL)
    fails_without_rank_1("an all_reduce", PeerFailure,
                         lambda: comm.all_reduce(x, async_op=True).synchronize(), named=True)
    sub = comm.shrink(timeout=30)
    try:
        y = arrays.put(np.array([rank + 1.0], np.float32))
        sub.all_reduce(y)
        total, size = float(arrays.get(y)[0]), sub.size
    finally:
        sub.close()
        comm.close()
        store.close()
    want = sum(r + 1.0 for r in range(n) if r != 1)
    if (size, total) != (n - 1, want):
        raise AssertionError(f"the shrunk group has {size} rank(s) and sums to {total}; "
                             f"expected {n - 1} and {want}")
    return f"shrunk to {size} rank(s) without rank 1; its all_reduce is right"


def uneven_and_objects(rank: int, n: int, addr: str, arrays: Any, device: int | None) -> str:
    """all_gather_v, reduce_scatter_v and all_to_all_v with a different row count per rank,
    then the object collectives, against NumPy and Python."""
    comm = create("nccl", rank=rank, world_size=n, store=addr, timeout=60, device=device)
    rows = [(r % 3) + 1 for r in range(n)]  # 1, 2, 3, 1, ... rows on rank r
    part = [_values(np.dtype(np.float32), (rows[r], 4), r) for r in range(n)]
    wrong = []
    with comm:
        got = comm.all_gather_v(arrays.put(part[rank]))
        if not all(np.array_equal(arrays.get(g), p) for g, p in zip(got, part, strict=True)):
            wrong.append("all_gather_v")
        full = [_values(np.dtype(np.int64), (sum(rows), 2), r) for r in range(n)]
        got = comm.reduce_scatter_v(arrays.put(full[rank]), rows)
        lo = sum(rows[:rank])
        if not np.array_equal(arrays.get(got), sum(full)[lo:lo + rows[rank]]):
            wrong.append("reduce_scatter_v")
        chunks = [_values(np.dtype(np.int32), (rows[j], 3), rank * n + j) for j in range(n)]
        got = comm.all_to_all_v([arrays.put(c) for c in chunks])
        want = [_values(np.dtype(np.int32), (rows[rank], 3), j * n + rank) for j in range(n)]
        if not all(np.array_equal(arrays.get(g), w) for g, w in zip(got, want, strict=True)):
            wrong.append("all_to_all_v")
        mine = {"rank": rank, "text": "x" * (rank * 100)}
        if comm.all_gather_object(mine) != [{"rank": r, "text": "x" * (r * 100)}
                                            for r in range(n)]:
            wrong.append("all_gather_object")
        if comm.broadcast_object(mine if rank == n - 1 else None, root=n - 1) != {
                "rank": n - 1, "text": "x" * ((n - 1) * 100)}:
            wrong.append("broadcast_object")
    if wrong:
        raise AssertionError(f"wrong: {', '.join(wrong)}")
    return f"all_gather_v, reduce_scatter_v, all_to_all_v ({rows[:n]} rows), objects right"


def batch_ring(rank: int, n: int, addr: str, arrays: Any, device: int | None) -> str:
    """batch_isend_irecv: each rank sends to the next and receives from the previous, in one
    batch, both directions."""
    from gpucoll.batch import P2POp

    comm = create("nccl", rank=rank, world_size=n, store=addr, timeout=60, device=device)
    nxt, prev = (rank + 1) % n, (rank - 1) % n
    with comm:
        a, b = arrays.put(np.zeros(1000, np.float64)), arrays.put(np.zeros(7, np.int32))
        works = comm.batch_isend_irecv([
            P2POp("isend", arrays.put(np.full(1000, rank, np.float64)), nxt),
            P2POp("irecv", a, prev),
            P2POp("isend", arrays.put(np.full(7, rank, np.int32)), prev),
            P2POp("irecv", b, nxt)])
        for w in works:
            w.wait()
        if not (np.all(arrays.get(a) == prev) and np.all(arrays.get(b) == nxt)):
            raise AssertionError("batch_isend_irecv delivered the wrong data")
    return "a ring of sends and receives both ways in one batch"


def async_work(rank: int, n: int, addr: str, arrays: Any, device: int | None) -> str:
    """Eight all_reduces in flight at once, waited on in reverse order (``wait``: the current
    stream waits), read back, then each ``synchronize``d and completed."""
    comm = create("nccl", rank=rank, world_size=n, store=addr, timeout=60, device=device)
    with comm:
        xs = [arrays.put(np.full(4096, rank + i, np.float32)) for i in range(8)]
        works = [comm.all_reduce(x, async_op=True) for x in xs]
        for w in reversed(works):
            w.wait()
        for i, x in enumerate(xs):
            if not np.all(arrays.get(x) == sum(r + i for r in range(n))):
                raise AssertionError(f"async all_reduce #{i} is wrong")
        for w in works:
            w.synchronize()
        if not all(w.is_completed() for w in works):
            raise AssertionError("a synchronized Work says it is not completed")
    return "8 async all_reduces in flight, each right"


def new_group_of_evens(rank: int, n: int, addr: str, arrays: Any, device: int | None) -> str:
    """new_group of the even ranks: its all_reduce sums only them; the odd ranks get None."""
    comm = create("nccl", rank=rank, world_size=n, store=addr, timeout=60, device=device)
    evens = list(range(0, n, 2))
    with comm:
        group = comm.new_group(evens)
        if (group is None) != (rank % 2 == 1):
            raise AssertionError(f"rank {rank} got {group!r} from new_group({evens})")
        if group is not None:
            with group:
                y = arrays.put(np.array([rank + 1.0], np.float64))
                group.all_reduce(y)
                if float(arrays.get(y)[0]) != sum(r + 1.0 for r in evens):
                    raise AssertionError(f"new_group({evens})'s all_reduce is wrong")
        comm.barrier()
    return f"new_group({evens}) sums its members only"


def other_libraries(rank: int, n: int, addr: str, arrays: Any, device: int | None) -> str:
    """all_reduce on a torch CUDA tensor and on a JAX GPU array, where they are installed with
    GPU support; Skipped where neither is."""
    makers, missing = [], []
    try:
        import torch

        if not torch.cuda.is_available():
            raise ImportError("torch has no CUDA")
        makers.append(("torch", lambda a: torch.as_tensor(a, device=f"cuda:{comm_device()}"),
                       lambda t: t.cpu().numpy()))
    except ImportError as exc:
        missing.append(f"torch ({exc})")
    try:
        import jax

        if not jax.devices("gpu"):
            raise ImportError("JAX sees no GPU")
        makers.append(("JAX", lambda a: jax.device_put(a, jax.devices("gpu")[comm_device()]),
                       np.asarray))
    except Exception as exc:  # noqa: BLE001 - JAX raises RuntimeError without a GPU
        missing.append(f"JAX ({type(exc).__name__}: {exc})")
    if not makers:
        return Skipped("neither installed with GPU support: " + "; ".join(missing))
    comm = create("nccl", rank=rank, world_size=n, store=addr, timeout=60, device=device)

    def comm_device() -> int:
        return cuda.runtime().current_device()

    done = []
    with comm:
        for name, make, read in makers:
            x = make(np.full(1000, rank + 1.0, np.float32))
            out = comm.all_reduce(x)
            got = read(out if out is not None else x)
            if not np.all(got == n * (n + 1) / 2):
                raise AssertionError(f"all_reduce on a {name} array is wrong")
            done.append(name)
    return f"all_reduce right on {', '.join(done)} arrays" + (
        f" (not installed with GPU support: {'; '.join(missing)})" if missing else "")


LOSES_RANK_1 = (dead_peer, stopped_peer, shrink_after_loss)


def stream_race(rank: int, n: int, addr: str, arrays: Any, device: int | None) -> str:
    """x is written on a busy current stream and the collective runs on another: it must read
    what was written, not what was there before."""
    rt = cuda.runtime()
    comm = create("nccl", rank=rank, world_size=n, store=addr, timeout=60, device=device)
    with comm:
        x = arrays.put(np.zeros(1 << 16, np.float32))
        src = arrays.put(np.full(1 << 16, rank + 1.0, np.float32))
        producer, other = arrays.new_stream(), arrays.new_stream()
        ptr = lambda a: int(a.__cuda_array_interface__["data"][0])  # noqa: E731
        with arrays.current(producer):
            release = rt.stall(producer)
            rt.memcpy_async(ptr(x), ptr(src), 4 << 16, producer)
            out = comm.all_gather(x, stream=other)
            release()
        got = arrays.get(out, other)
    want = np.repeat(np.arange(1.0, n + 1.0, dtype=np.float32), 1 << 16).reshape(n, -1)
    if not np.array_equal(got, want):
        raise AssertionError("the collective read x before the busy stream had written it")
    return "the collective waited for the stream that wrote its input"


def honest_completion(rank: int, n: int, addr: str, arrays: Any, device: int | None) -> str:
    """is_completed() is False while the device is busy before the call, True after."""
    rt = cuda.runtime()
    comm = create("nccl", rank=rank, world_size=n, store=addr, timeout=60, device=device)
    with comm:
        x = arrays.put(np.ones(1024, np.float32))
        comm.barrier()
        s = arrays.new_stream()
        with arrays.current(s):
            release = rt.stall(s)
            work = comm.all_reduce(x, async_op=True)
            busy = work.is_completed()
            release()
            work.synchronize()
        if busy or not work.is_completed():
            raise AssertionError(f"is_completed() said {busy} while the device was busy and "
                                 f"{work.is_completed()} after synchronize()")
    return "False while the stream was busy, True after synchronize()"


def split_after_async(rank: int, n: int, addr: str, arrays: Any, device: int | None) -> str:
    """split() right after asynchronous work, then a collective on the new communicator."""
    comm = create("nccl", rank=rank, world_size=n, store=addr, timeout=60, device=device)
    with comm:
        x = arrays.put(np.ones(1 << 20, np.float32))
        comm.all_reduce(x, async_op=True)
        sub = comm.split(0, key=-rank)
        y = arrays.put(np.array([rank + 1.0], np.float32))
        sub.all_reduce(y)
        total = float(arrays.get(y)[0])
        sub.close()
    if total != n * (n + 1) / 2:
        raise AssertionError(f"the split communicator's sum is {total}")
    return f"split of {n} rank(s) after async work; its all_reduce is right"


def bandwidth(rank: int, n: int, addr: str, arrays: Any, device: int | None,
              sizes: tuple[int, ...], iters: int) -> list[tuple[int, float, float]]:
    """(bytes, microseconds per all_reduce, bus GB/s) of float32 all_reduce, nccl-tests' way:
    bus bandwidth = bytes / time * 2 (n - 1) / n."""
    comm = create("nccl", rank=rank, world_size=n, store=addr, timeout=120, device=device)
    rows = []
    with comm:
        for nbytes in sizes:
            x = arrays.put(np.ones(nbytes // 4, np.float32))
            comm.all_reduce(x)
            comm.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                comm.all_reduce(x)
            comm.barrier()
            seconds = (time.perf_counter() - start) / iters
            factor = 2 * (n - 1) / n if n > 1 else 0.0
            rows.append((nbytes, seconds * 1e6, nbytes / seconds * factor / 1e9))
    return rows


# -- the report -------------------------------------------------------------------------------
PASS, FAIL, SKIP = "pass", "fail", "skip"
EXIT = {"passed": 0, "failed": 1, "nothing ran": 2}


@dataclasses.dataclass
class Check:
    name: str
    status: str
    seconds: float
    detail: str


@dataclasses.dataclass
class Report:
    """Everything ``gpucoll selftest`` found; ``note`` says why nothing ran, if nothing did."""

    environment: dict[str, Any]
    runtime: str
    checks: list[Check] = dataclasses.field(default_factory=list)
    bandwidth: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    bandwidth_setup: str = ""
    note: str = ""

    @property
    def outcome(self) -> str:
        if self.note:
            return "nothing ran"
        return "failed" if any(c.status == FAIL for c in self.checks) else "passed"

    @property
    def status(self) -> int:
        """The exit status: 0 every check passed, 1 one failed, 2 nothing could run."""
        return EXIT[self.outcome]


def render(report: Report) -> str:
    env = report.environment
    nccl = env.get("nccl")
    nccl = (f"NCCL {nccl['library']} (nccl4py {nccl['nccl4py']})" if isinstance(nccl, dict)
            else f"NCCL {nccl}")
    lines = [
        "### gpucoll selftest",
        "",
        f"gpucoll {env.get('gpucoll')}, Python {env.get('python')}, CuPy {env.get('cupy')}, "
        f"{nccl}",
        f"CUDA driver {env.get('cuda_driver')}, runtime {env.get('cuda_runtime')}; "
        f"gpucoll's CUDA runtime: {report.runtime}",
    ]
    lines += device_lines(env.get("devices"), "devices: ")
    if report.note:
        lines += ["", f"**Nothing ran on a GPU: {report.note}.**",
                  "", f"exit status {report.status} (2: nothing could run)"]
        return "\n".join(lines)
    lines += ["", "| check | result | time | detail |", "|---|---|---|---|"]
    lines += [f"| {c.name} | {c.status} | {c.seconds:.1f} s | {_cell(c.detail)} |"
              for c in report.checks]
    if report.bandwidth:
        lines += ["", f"all_reduce, float32, {report.bandwidth_setup}; bus bandwidth as "
                      "nccl-tests computes it (bytes / time * 2(n-1)/n):", "",
                  "| size (B) | gpucoll time (us) | gpucoll busbw (GB/s) | "
                  "nccl-tests busbw (GB/s) |", "|---:|---:|---:|---:|"]
        for row in report.bandwidth:
            theirs = row.get("nccl_tests")
            lines.append(f"| {row['bytes']} | {row['us']:.1f} | {row['busbw']:.2f} | "
                         f"{'-' if theirs is None else f'{theirs:.2f}'} |")
    counts = {s: sum(c.status == s for c in report.checks) for s in (PASS, FAIL, SKIP)}
    lines += ["", f"**{report.outcome}**: {counts[PASS]} passed, {counts[FAIL]} failed, "
                  f"{counts[SKIP]} skipped (exit status {report.status})"]
    return "\n".join(lines)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "/")[:300]


def as_json(report: Report) -> dict[str, Any]:
    data = dataclasses.asdict(report)
    data["outcome"], data["status"] = report.outcome, report.status
    return data



# -- gpucoll info: what this machine can do ----------------------------------------------
INFO_HELP = ("what this machine can do: CuPy, CUDA, NCCL (through nccl4py), devices, the backend "
             "auto would pick and why")


def _cuda_version(code: int) -> str:
    """CUDA's integer version as text: 12090 -> "12.9"; 0 means no driver."""
    return "none" if not code else f"{code // 1000}.{code % 1000 // 10}"


def _probe(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - a report line, never a traceback
        return f"unavailable ({type(exc).__name__}: {exc})"


def _cupy_version() -> str:
    import cupy

    return cupy.__version__


def _runtime() -> Any:
    from cupy_backends.cuda.api import runtime

    return runtime


def devices() -> list[dict[str, Any]]:
    """Index, name, memory, compute capability and PCI bus id of every visible CUDA device."""
    rt = _runtime()
    found = []
    for i in range(rt.getDeviceCount()):
        props = rt.getDeviceProperties(i)
        name = props["name"]
        found.append({
            "index": i,
            "name": name.decode() if isinstance(name, bytes) else str(name),
            "memory_gib": round(props["totalGlobalMem"] / 2**30, 1),
            "compute_capability": f"{props['major']}.{props['minor']}",
            "pci_bus_id": _probe(lambda i=i: rt.deviceGetPCIBusId(i)),
        })
    return found


def _nccl() -> dict[str, str]:
    import nccl.core as nc

    return {"library": library_version(nc), "nccl4py": str(nc.get_version().nccl4py)}


def collect() -> dict[str, Any]:
    """Everything ``gpucoll info`` reports, as a JSON-able dict (never raises)."""
    from gpucoll import __version__

    verdict = local_verdict()
    usable, why = verdict["ok"], verdict["why"]
    exchange, how = shm.exchange()
    return {
        "gpucoll": __version__,
        "python": sys.version.split()[0],
        "cupy": _probe(_cupy_version),
        "cuda_driver": _probe(lambda: _cuda_version(_runtime().driverGetVersion())),
        "cuda_runtime": _probe(lambda: _cuda_version(_runtime().runtimeGetVersion())),
        "nccl": _probe(_nccl),
        "devices": _probe(devices),
        "auto_backend": "nccl" if usable else "ring",
        "auto_reason": (f"this process can use NCCL ({why}); auto picks it when every rank can"
                        if usable else f"NCCL is not usable here: {why}"),
        "small_exchange": exchange,  # the host ring's, on shared memory
        "small_exchange_note": how,
    }


def device_lines(devices: Any, head: str) -> list[str]:
    """The report's lines about the devices ``collect`` found (or the text saying why none)."""
    if not isinstance(devices, list):
        return [f"{head}{devices}"]
    return [f"{head}{len(devices)}"] + [
        f"  [{d['index']}] {d['name']}, {d['memory_gib']} GiB, sm {d['compute_capability']}, "
        f"{d['pci_bus_id']}" for d in devices]


def render_info(info: dict[str, Any]) -> str:
    """``gpucoll info``'s report as text, one line per item."""
    nccl = info["nccl"]
    if isinstance(nccl, dict):
        nccl = f"library {nccl['library']} (nccl4py {nccl['nccl4py']})"
    lines = [
        f"gpucoll       {info['gpucoll']} (Python {info['python']})",
        f"CuPy          {info['cupy']}",
        f"CUDA driver   {info['cuda_driver']}",
        f"CUDA runtime  {info['cuda_runtime']}",
        f"NCCL          {nccl}",
    ]
    lines += device_lines(info["devices"], "devices       ")
    lines.append(f"auto backend  {info['auto_backend']}: {info['auto_reason']}")
    lines.append(f"shm exchange  {info['small_exchange']}")
    if info["small_exchange_note"]:
        lines.append(f"              {info['small_exchange_note']}")
    return "\n".join(lines)


def info_main(argv: list[str] | None = None) -> int:
    """``gpucoll info``."""
    parser = argparse.ArgumentParser(prog="gpucoll info", description=INFO_HELP)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    info = collect()
    print(json.dumps(info, indent=2) if args.json else render_info(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
