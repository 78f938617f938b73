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

Where a sweep's events go is here too: ``Console`` prints nccl-tests' tables as results arrive
and writes the comparison, JSON, CSV and plot at the end; ``EventFile`` is what rank 0 writes for
the driver, which ``replay`` feeds to its console; ``Progress`` is the one-line progress bar.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, TextIO

from gpucoll import cuda
from gpucoll.bench import report
from gpucoll.bench.engine import (
    Case,
    Engine,
    Result,
    case_total,
    cases,
    device_available,
    measure_ceilings,
    memory_for,
)
from gpucoll.bench.libraries import GpucollLibrary, machine, make_peer, peer_available
from gpucoll.bench.options import BenchOptions, check_outputs, parse_args, rank_argv
from gpucoll.launch.supervisor import TTY_ENV


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
    return [sys.executable, "-m", "gpucoll", "run", "-n", str(nranks), *ranks]


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
    """Whether the gloo peer's job runs torch's NCCL on device memory: ``--memory``, else
    (auto) when every rank of this host has a GPU of its own, which torch's NCCL needs."""
    if opts.memory != "auto":
        return opts.memory == "device"
    try:
        import torch

        local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or 1)
        return (bool(torch.cuda.is_available()) and device_available()
                and torch.cuda.device_count() >= local)
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


# ---- where a sweep's events go: the console, or the driver's event file --------------------------
# A sweep reports four events: start(run) (the library's description), skip(text), result(Result)
# and finish(error). Console prints nccl-tests' tables as results arrive and keeps every run for
# the comparison, JSON, CSV and plot at the end. EventFile is what rank 0 writes when `gpucoll
# bench` started the ranks: one JSON object a line, flushed, so the driver shows lines as they
# come and keeps those written before any crash.

def now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


class EventFile:
    """Rank 0's events as JSON lines in ``path``."""

    def __init__(self, path: str):
        self.f = open(path, "a", buffering=1)

    def _put(self, kind: str, **fields: Any) -> None:
        self.f.write(json.dumps({"kind": kind, **fields}) + "\n")
        self.f.flush()

    def start(self, run: dict[str, Any]) -> None:
        self._put("start", run=run)

    def skip(self, text: str) -> None:
        self._put("skip", text=text)

    def result(self, r: Result) -> None:
        self._put("result", result=r.to_json())

    def finish(self, error: str | None = None) -> None:
        self._put("finish", error=error)
        self.f.close()


def replay(line: str, sink: Any) -> str:
    """Feed one line of an ``EventFile`` to ``sink`` (a Console); return the event's kind."""
    event = json.loads(line)
    kind = event["kind"]
    if kind == "start":
        sink.start(event["run"])
    elif kind == "skip":
        sink.skip(event["text"])
    elif kind == "result":
        sink.result(Result.from_json(event["result"]))
    elif kind == "finish":
        sink.finish(event["error"])
    return kind


class Console:
    """Prints tables as results arrive; holds the whole document for the files at the end."""

    def __init__(self, opts: BenchOptions, argv: list[str], out: TextIO | None = None,
                 progress: Progress | None = None):
        self.opts, self.out = opts, out or sys.stdout
        self.progress = progress or Progress(0, False, self.out)
        self.doc: dict[str, Any] = {
            "tool": "gpucoll bench", "format": 1, "argv": list(argv), "start_time": now(),
            "config": _config(opts), "machine": {}, "ceilings": [], "runs": []}
        self._op: str | None = None
        self._results: list[Result] = []

    @property
    def runs(self) -> list[dict[str, Any]]:
        return self.doc["runs"]

    def print(self, *lines: str) -> None:
        self.progress.clear()
        for line in lines:
            self.out.write(line + "\n")
        self.out.flush()

    def machine(self, machine: dict[str, Any], ceilings: list[dict[str, Any]]) -> None:
        self.doc["machine"], self.doc["ceilings"] = machine, list(ceilings)
        self.print(*report.machine_lines(machine, ceilings), "#")

    def ceilings(self, ceilings: list[dict[str, Any]]) -> None:
        self.doc["ceilings"] = list(ceilings)
        self.print(*(report.ceiling_line(c) for c in ceilings), "#")

    def start(self, run: dict[str, Any]) -> None:
        run = {**run, "results": [], "skipped": [], "error": None}
        self.runs.append(run)
        self.print(report.config_line(self.opts, run["ranks"]), report.timing_line(self.opts),
                   *report.run_header(run), "#")

    def skip(self, text: str) -> None:
        self.runs[-1]["skipped"].append(text)
        self.print(f"# {text}")

    def result(self, r: Result) -> None:
        if r.op != self._op:
            self._close_table()
            self._op = r.op
            self.print(f"# Collective test starting: {r.op} ({self.runs[-1]['library']})",
                       *report.table_head())
        self._results.append(r)
        self.runs[-1]["results"].append(r.to_json())
        self.print(report.table_row(r))
        self.progress.step(f"{self.runs[-1]['library']} {r.op} {report.human_size(r.size)}")

    def _close_table(self) -> None:
        if self._op is not None:
            self.print(*report.table_footer(self._results))
            peak = report.peak_line(self._results, self.doc["ceilings"],
                                    self.runs[-1].get("memory", "host"))
            if peak:
                self.print(peak)
            summary = report.summary(self._results)
            self.runs[-1].setdefault("summary", {})[self._op] = summary
        self._op, self._results = None, []

    def finish(self, error: str | None = None) -> None:
        self._close_table()
        if error:
            self.runs[-1]["error"] = error
            self.print(f"# error: {error}", "#")

    def fail(self, library: str, ranks: int, error: str) -> None:
        """A library that could not run at all (not installed, or its ranks failed to start)."""
        self.runs.append({"library": library, "ranks": ranks, "results": [], "skipped": [],
                          "error": error})
        self.print(f"# Library {library}: not run: {error}", "#")

    def close(self) -> int:
        """Comparison tables, then the files asked for; returns the exit status."""
        self.progress.close()
        self.doc["end_time"] = now()
        for op in self.opts.ops:
            lines = report.comparison(self.runs, op)
            if lines:
                self.print(*lines)
        self._write_files()
        return 1 if any(_failed(run) for run in self.runs if run["library"] == "gpucoll") else 0

    def _write_files(self) -> None:
        if self.opts.json:
            report.write_json(self.opts.json, self.doc)
            self.print(f"# Wrote JSON to {self.opts.json}")
        if self.opts.csv:
            report.write_csv(self.opts.csv, self.runs)
            self.print(f"# Wrote CSV to {self.opts.csv}")
        if self.opts.plot:
            from gpucoll.bench.report import plot

            plot(self.opts.plot, self.runs, self.doc["ceilings"], title=_title(self.doc))
            self.print(f"# Wrote plot to {self.opts.plot}")


def _failed(run: dict[str, Any]) -> bool:
    wrong = any((d.get(k) or {}).get("nwrong") for d in run["results"]
                for k in ("out_of_place", "in_place"))
    return bool(run.get("error")) or wrong


def _title(doc: dict[str, Any]) -> str:
    m = doc.get("machine", {})
    return f"gpucoll bench on {m.get('host', '?')} ({m.get('cpu', '?')}, {m.get('cores')} cores)"


def _config(opts: BenchOptions) -> dict[str, Any]:
    return {"ops": list(opts.ops), "minimum_bytes": opts.minbytes,
            "maximum_bytes": opts.maxbytes, "step_factor": opts.stepfactor,
            "step_bytes": opts.stepbytes, "iterations": opts.iters,
            "warmup_iters": opts.warmup, "time_per_cell": opts.time, "loops": opts.loops,
            "warmup_time": opts.warmup_time, "validation": opts.check,
            "datatypes": list(opts.dtypes), "redops": list(opts.redops),
            "average": opts.average, "backend": opts.backend, "transport": opts.transport,
            "memory": opts.memory, "peers": list(opts.peers)}


# ---- the progress bar ----------------------------------------------------------------------------
# Drawn on the terminal of the process that shows it. From a shell that terminal is stderr. Rank
# 0 of a job started by `gpucoll run` has only pipes (the launcher prefixes and forwards its
# lines), so the launcher names its own terminal in GPUCOLL_TTY and the bar is drawn there
# directly, in place; the launcher clears the line before each line it forwards, so the bar never
# splits one. By default the bar shows on a terminal only, once the sweep has run a few seconds;
# `--progress` shows it at once (on a stream that is no terminal, as one line per finished table
# line).

WIDTH = 28
AUTO_DELAY = 2.0  # seconds before an unrequested bar appears: short sweeps never flicker
REDRAW = 0.5  # seconds between redraws from tick()
ERASE = "\r\x1b[K"  # carriage return, then clear to the end of the line


def terminal() -> tuple[TextIO, bool]:
    """Where the bar goes: the launcher's terminal when it named one, else stderr.

    Returns the stream and whether this process opened it (and must close it).
    """
    path = os.environ.get(TTY_ENV)
    if path:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NOCTTY)
        except OSError:
            pass
        else:
            return os.fdopen(fd, "w"), True
    return sys.stderr, False


class Progress:
    """``step(label)`` after each table line, ``tick()`` in between, ``clear()`` before other
    output, ``close()`` at the end."""

    def __init__(self, total: int = 0, enabled: bool | None = None,
                 stream: TextIO | None = None):
        self.stream, self._owned = (stream, False) if stream is not None else terminal()
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())
        self.enabled = self.live if enabled is None else enabled
        self.delay = AUTO_DELAY if enabled is None else 0.0
        self.shown = False
        self.label = "starting"
        self.restart(total)

    def restart(self, total: int) -> None:
        """Count from zero towards ``total`` table lines (the next library's sweep)."""
        self.total, self.done, self.t0, self.drawn = total, 0, time.monotonic(), 0.0

    def step(self, label: str) -> None:
        self.done += 1
        self.label = label
        if not self.enabled:
            return
        if self.live:
            self._draw()
        else:
            self.stream.write(self.line(label) + "\n")
            self.stream.flush()

    def tick(self) -> None:
        """Redraw (elapsed time moves on) if the bar is live and was not drawn just now."""
        if self.enabled and self.live and time.monotonic() - self.drawn >= REDRAW:
            self._draw()

    def _draw(self) -> None:
        now = time.monotonic()
        if now - self.t0 < self.delay and not self.shown:
            return
        self.stream.write(ERASE + self.line(self.label))
        self.stream.flush()
        self.shown, self.drawn = True, now

    def line(self, label: str) -> str:
        frac = min(1.0, self.done / self.total) if self.total else 0.0
        filled = int(frac * WIDTH)
        elapsed = time.monotonic() - self.t0
        eta = f", ~{elapsed / frac - elapsed:.0f}s left" if frac > 0 else ""
        return (f"[{'#' * filled}{'.' * (WIDTH - filled)}] {self.done}/{self.total or '?'} "
                f"{label[:40]:<40} {elapsed:5.0f}s{eta}")

    def clear(self) -> None:
        """Erase the bar (before other output goes to the same terminal)."""
        if self.shown:
            self.stream.write(ERASE)
            self.stream.flush()
            self.shown = False
            self.drawn = 0.0

    def close(self) -> None:
        self.clear()
        if self._owned:
            self.stream.close()
            self._owned = False


if __name__ == "__main__":
    sys.exit(main())
