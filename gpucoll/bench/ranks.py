"""The rank side of `gpucoll bench`: open a library, run the sweep, report from rank 0.

Two ways in. Started by the ``gpucoll bench`` driver (``--results FILE`` given): one library per
job, rank 0 writes events to FILE. Started by the user under ``gpucoll run`` (or any launcher
that sets the environment): gpucoll's sweep, then each asked-for peer that can share the
processes (gloo), all printed by rank 0.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from gpucoll.bench import ceilings, peers
from gpucoll.bench.engine import Case, Engine, case_total, cases
from gpucoll.bench.libraries import GpucollLibrary, machine
from gpucoll.bench.memory import device_available, memory_for
from gpucoll.bench.options import BenchOptions
from gpucoll.bench.progress import Progress
from gpucoll.bench.session import Console, EventFile


def open_library(name: str, opts: BenchOptions) -> tuple[Any, Any]:
    """Construct library ``name`` (collective) and the memory its buffers live in."""
    if name == "gpucoll":
        lib = GpucollLibrary.from_env(opts.backend, opts.transport, opts.timeout)
        device = opts.memory == "device" or (opts.memory == "auto" and
                                             lib.comm.backend == "nccl")
        return lib, memory_for("device" if device else "host")
    device = name == "gloo" and wants_device(opts)
    return peers.make(name, opts.timeout, device), memory_for("device" if device else "host")


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
        console.ceilings(ceilings.measure(mem.kind == "device"))
    return console.close()


def _peer_in_job(name: str, opts: BenchOptions, console: Console | None, size: int) -> None:
    """Peer ``name``'s sweep in the job's processes, when that peer can start inside them."""
    reason = peers.available(name)
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


def main(opts: BenchOptions, argv: list[str]) -> int:
    if opts.results:
        return run_for_driver(opts)
    code = run_in_job(opts, argv)
    sys.stdout.flush()
    return code
