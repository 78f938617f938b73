"""``gpucoll bench``: nccl-tests-style bandwidth of gpucoll's collectives (and its peers').

From a shell it is the driver: it measures the ceilings, starts each library's ranks and shows
all. gpucoll's and gloo's ranks are started through ``gpucoll run`` (which also sets torchrun's
environment), mpi's through ``mpirun``. Each job's rank 0 appends events to a file the driver
follows, so table lines appear as they are measured. A job that writes nothing new for longer
than one collective's timeout (plus start-up) is stopped: nothing waits forever.

Inside a job it is a rank: it opens a library, runs the sweep and reports from rank 0. Two ways
in. Started by the driver (``--results FILE`` given): one library per job, rank 0 writes events
to FILE. Started by the user under ``gpucoll run`` (or any launcher that sets the environment):
gpucoll's sweep, then each asked-for peer that can share the processes (gloo), all printed by
rank 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from gpucoll import cuda
from gpucoll.bench.engine import (
    Case,
    Engine,
    case_total,
    cases,
    device_available,
    measure_ceilings,
    memory_for,
)
from gpucoll.bench.libraries import GpucollLibrary, machine, make_peer, peer_available
from gpucoll.bench.options import BenchOptions, check_outputs, parse_args, rank_argv
from gpucoll.bench.session import Console, EventFile, Progress, replay


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    opts = parse_args(argv)
    check_outputs(opts)
    if opts.results or inside_job():
        return as_rank(opts, argv)
    return drive(opts, argv)


# ---- from a shell: the driver --------------------------------------------------------------------

STARTUP_S = 60.0  # allowance for imports and rendezvous before the first event
POLL_S = 0.1


def default_ranks() -> int:
    """Every visible GPU when CuPy can use them, else 2 ranks on the host ring."""
    return cuda.runtime().device_count() or 2


def command(library: str, nranks: int, opts: BenchOptions, results: str) -> list[str]:
    """The command that starts ``nranks`` ranks of ``library``'s sweep."""
    ranks = ["-m", "gpucoll", "bench", *rank_argv(opts), "--library", library,
             "--results", results]
    if library == "mpi":
        root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
        return ["mpirun", *root, "--oversubscribe", "-n", str(nranks), sys.executable, *ranks]
    return [sys.executable, "-m", "gpucoll.run", "-n", str(nranks), *ranks]


def job_env(opts: BenchOptions) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # one core per rank for every library
    if opts.transport != "auto":
        env["GPUCOLL_TRANSPORT"] = opts.transport
    return env


class Follower:
    """Reads the complete lines appended to a file since the last call."""

    def __init__(self, path: str):
        self.path, self.offset, self.partial = path, 0, ""

    def lines(self) -> list[str]:
        try:
            with open(self.path) as f:
                f.seek(self.offset)
                data = f.read()
                self.offset = f.tell()
        except FileNotFoundError:
            return []
        text = self.partial + data
        *complete, self.partial = text.split("\n")
        return [line for line in complete if line.strip()]


def run_job(library: str, nranks: int, opts: BenchOptions, console: Console) -> None:
    """Start one library's ranks, show their results live, and stop them if they stall."""
    with tempfile.TemporaryDirectory(prefix="gpucoll-bench-") as tmp:
        results = os.path.join(tmp, "events.jsonl")
        proc = subprocess.Popen(command(library, nranks, opts, results), env=job_env(opts),
                                stdout=sys.stderr, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        follower = Follower(results)
        try:
            state = _follow(proc, follower, console, opts.timeout + STARTUP_S)
        finally:  # a stall, Ctrl-C or any error here: the job (its own session) must not linger
            if proc.poll() is None:
                _stop(proc)
        code = proc.wait()
        for line in follower.lines():
            _feed(line, console, state)
    _conclude(library, nranks, code, state, console)


def _follow(proc: subprocess.Popen, follower: Follower, console: Console,
            stall_s: float) -> dict[str, Any]:
    state: dict[str, Any] = {"start": False, "finish": False, "stalled": False}
    last = time.monotonic()
    while proc.poll() is None:
        lines = follower.lines()
        for line in lines:
            _feed(line, console, state)
        console.progress.tick()
        if lines:
            last = time.monotonic()
        elif time.monotonic() - last > stall_s:
            state["stalled"] = True
            break
        time.sleep(POLL_S)
    return state


def _feed(line: str, console: Console, state: dict[str, Any]) -> None:
    state[replay(line, console)] = True


def _conclude(library: str, nranks: int, code: int, state: dict[str, Any],
              console: Console) -> None:
    why = (f"no result for {console.opts.timeout + STARTUP_S:.0f} s; stopped" if state["stalled"]
           else f"the ranks exited with status {code}")
    if not state["start"]:
        console.fail(library, nranks, why)
    elif not state["finish"]:
        console.finish(why)
    elif code != 0 and not console.runs[-1].get("error"):
        console.runs[-1]["error"] = why
        console.print(f"# error: {why}")


def _stop(proc: subprocess.Popen) -> None:
    """End the job we started: its whole process group, politely first."""
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def drive(opts: BenchOptions, argv: list[str]) -> int:
    """From a shell: the ceilings, then each library's ranks, then the comparison and files."""
    nranks = opts.ranks or default_ranks()
    console = Console(opts, argv, progress=Progress(0, opts.progress))
    device = device_available()
    console.machine(machine(), measure_ceilings(device) if opts.ceilings else [])
    for library in ("gpucoll", *opts.peers):
        reason = None if library == "gpucoll" else peer_available(library)
        if reason is not None:
            console.fail(library, nranks, reason)
            continue
        console.progress.restart(case_total(opts, nranks))
        run_job(library, nranks, opts, console)
    return console.close()


# ---- inside a job: the ranks ---------------------------------------------------------------------

def open_library(name: str, opts: BenchOptions) -> tuple[Any, Any]:
    """Construct library ``name`` (collective) and the memory its buffers live in."""
    if name == "gpucoll":
        lib = GpucollLibrary.from_env(opts.backend, opts.transport, opts.timeout)
        device = opts.memory == "device" or (opts.memory == "auto" and
                                             lib.comm.backend == "nccl")
        return lib, memory_for("device" if device else "host")
    device = name == "gloo" and wants_device(opts)
    return make_peer(name, opts.timeout, device), memory_for("device" if device else "host")


def wants_device(opts: BenchOptions) -> bool:
    if opts.memory != "auto":
        return opts.memory == "device"
    try:
        import torch

        return bool(torch.cuda.is_available()) and device_available()
    except ImportError:
        return False


def sweep(lib: Any, mem: Any, opts: BenchOptions, sink: Any | None) -> None:
    """Every case of ``opts`` on this rank; rank 0's ``sink`` gets the events."""
    progress = getattr(sink, "progress", None)  # rank 0's console: redraw between loops
    engine = Engine(lib, mem, opts, tick=progress.tick if progress else None)
    devices = engine.rank_info()
    if sink is not None:
        sink.start({**lib.describe(), "ranks": lib.size, "memory": mem.kind,
                    "devices": devices})
    error = None
    try:
        for case in cases(opts, lib.size):
            if isinstance(case, Case):
                result = engine.run(case)
                if sink is not None:
                    sink.result(result)
            elif sink is not None:
                sink.skip(case)
    except BaseException as exc:
        error = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        if sink is not None:
            sink.finish(error)


def run_for_driver(opts: BenchOptions) -> int:
    """One library's sweep in a job the driver started; events go to ``opts.results``."""
    lib, mem = open_library(opts.library, opts)
    try:
        sweep(lib, mem, opts, EventFile(opts.results) if lib.rank == 0 else None)
    finally:
        lib.close()
    return 0


def run_in_job(opts: BenchOptions, argv: list[str]) -> int:
    """The whole benchmark inside ranks someone else started; rank 0 prints everything."""
    lib, mem = open_library("gpucoll", opts)
    console = None
    if lib.rank == 0:
        total = case_total(opts, lib.size)
        console = Console(opts, argv, progress=Progress(total, opts.progress))
        console.machine(machine(), [])
        if opts.ranks is not None and opts.ranks != lib.size:
            console.print(f"# note: -g {opts.ranks} ignored: the job has {lib.size} ranks")
    try:
        sweep(lib, mem, opts, console)
    finally:
        lib.close()
    for name in opts.peers:
        _peer_in_job(name, opts, console, lib.size)
    if console is None:
        return 0
    if opts.ceilings:  # the other ranks are done: the cores are free to measure
        console.ceilings(measure_ceilings(mem.kind == "device"))
    return console.close()


def _peer_in_job(name: str, opts: BenchOptions, console: Console | None, size: int) -> None:
    """Peer ``name``'s sweep in the job's processes, when that peer can start inside them."""
    reason = peer_available(name)
    if name == "mpi" and not any(k in os.environ for k in ("OMPI_COMM_WORLD_RANK", "PMI_RANK")):
        reason = "mpi needs ranks started by mpirun: run `gpucoll bench --peer mpi` outside a job"
    torchrun = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if name == "gloo" and not all(k in os.environ for k in torchrun):
        reason = "gloo needs torchrun's environment (gpucoll run or torchrun sets it)"
    if reason is not None:
        if console is not None:
            console.fail(name, size, reason)
        return
    lib, mem = open_library(name, opts)
    if console is not None:
        console.progress.restart(case_total(opts, lib.size))
    try:
        sweep(lib, mem, opts, console)
    finally:
        lib.close()


def inside_job(environ: dict[str, str] | None = None) -> bool:
    """True in a rank some launcher started (gpucoll run, torchrun, mpirun, MPICH)."""
    env = os.environ if environ is None else environ
    return any(k in env for k in ("GPUCOLL_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")) or (
        "RANK" in env and "WORLD_SIZE" in env)


def as_rank(opts: BenchOptions, argv: list[str]) -> int:
    """Inside a job: the driver's sweep (``--results``) or the whole benchmark."""
    if opts.results:
        return run_for_driver(opts)
    code = run_in_job(opts, argv)
    sys.stdout.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
