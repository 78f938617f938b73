"""The job's event loop: start the ranks, watch them, and stop them all when one fails.

Rank exits and signals to the launcher arrive on one queue. The first rank to fail is the root
cause: the others get ``grace`` seconds to end on their own (they usually notice the dead peer
and print why), then SIGTERM, then after ``grace`` more SIGKILL. A signal to the launcher is
forwarded to every rank; a second SIGINT kills them at once. ``timeout`` bounds the whole job.
In a job of several nodes, a failure on another node stops this node's ranks the same way.
With ``keep_going`` a rank that fails is reported and the others go on.

When ``timeout`` passes, the launcher first asks ``gpucoll doctor`` where every rank is (and
prints the answer under the ranks' output); SIGUSR1 asks it the same while the job runs on. The
ranks write their flight-recorder dumps into the job's trace directory.

Also here, in the order the loop uses them:

- each rank's process: started in its own process group (so the launcher signals a rank
  together with anything it started, and the terminal's Ctrl-C reaches the ranks only through
  the launcher), reaped by a thread, and on Linux killed if the launcher itself dies;
- its output, line by line: ``[rank 3] ...`` on the launcher's stdout or stderr. Each pipe is
  drained by its own thread, as bytes (binary-safe). Complete lines are written in one call
  under a lock shared by every rank, so lines of different ranks never mix; a rank's partial
  writes wait until their line is complete (or its output ends). With ``--tee`` every line also
  goes, unprefixed, to that rank's log file. A rank may draw a progress line straight onto the
  launcher's terminal (named to it in ``GPUCOLL_TTY``): on a terminal each line written here
  first clears the line the cursor is on, so such a bar never splits a rank's line;
- signals to the launcher (SIGINT, SIGTERM, SIGHUP, and SIGUSR1 that asks for a diagnosis and
  stops nothing), which only post an event (``SimpleQueue.put`` is safe in a signal handler), so
  the loop decides;
- how it tells what happened: exit codes, signal names, the root-cause report;
- asking ``gpucoll doctor`` about the job: the launcher first writes what it knows of its
  ranks' processes (``launcher.json`` in the job's trace directory: pid, running or stopped,
  how a finished one ended), then runs the doctor against the job's store in a process of its
  own (the doctor is a command above the launcher), which asks every rank for its flight
  recorder; each rank also writes its dump into the trace directory.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import ctypes.util
import dataclasses
import json
import os
import queue
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any, BinaryIO

from gpucoll.dumps import FACTS_FILE
from gpucoll.launch.config import Binding, LaunchConfig, rank_env
from gpucoll.progress import ranks_text
from gpucoll.rendezvous import store_url

# ---- how the launcher tells what happened --------------------------------------------------------

TIMEOUT_EXIT = 124  # like coreutils `timeout`


def exit_status(returncode: int) -> int:
    """The shell's view of a return code: 128+N for a process killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def describe(returncode: int) -> str:
    """``exit code 3`` or ``signal SIGSEGV (exit 139)``."""
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"signal {name} (exit {exit_status(returncode)})"


def root_cause(rank: int, local_rank: int, node_rank: int, pid: int | None, returncode: int,
               elapsed: float, stderr_tail: list[str], others: list[str],
               stopped: list[int] | None = None) -> str:
    """The block printed when a rank fails: the first failure, then what became of the rest.
    ``stopped``: ranks that were stopped (SIGSTOP, a debugger) when it failed: the likelier
    cause, since a rank that waited for one fails first and the stopped one never does."""
    bar = "=" * 72
    if stopped:
        title = (f"gpucoll run: rank {rank} failed first, while {ranks_text(stopped)} "
                 f"{'was' if len(stopped) == 1 else 'were'} stopped (SIGSTOP or a debugger): "
                 f"likely the root cause")
    else:
        title = f"gpucoll run: rank {rank} failed first (root cause: first observed failure)"
    lines = [
        bar,
        title,
        bar,
        f"  rank        : {rank} (local rank {local_rank} on node {node_rank}, pid {pid})",
        f"  exit        : {describe(returncode)}",
        f"  after       : {elapsed:.1f} s",
    ]
    if stderr_tail:
        lines.append(f"  last {len(stderr_tail)} line(s) of its stderr:")
        lines += [f"    {line}" for line in stderr_tail]
    else:
        lines.append("  its stderr was empty")
    if others:
        lines.append("  other ranks:")
        lines += [f"    {line}" for line in others]
    lines.append(bar)
    return "\n".join(lines)


# ---- signals to the launcher ---------------------------------------------------------------------

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
DIAGNOSE = signal.SIGUSR1


@dataclasses.dataclass(frozen=True)
class Received:
    """A signal the launcher received."""

    signum: int

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


@contextlib.contextmanager
def signals_to(events: queue.SimpleQueue) -> Iterator[None]:
    """While active, each of :data:`FORWARDED` and :data:`DIAGNOSE` is put on ``events``
    instead of its default."""
    previous = {}
    handler = lambda signum, frame: events.put(Received(signum))
    try:
        for sig in (*FORWARDED, DIAGNOSE):
            previous[sig] = signal.signal(sig, handler)
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


# ---- rank output ---------------------------------------------------------------------------------

MAX_LINE = 1 << 16  # a longer line is cut so a rank cannot buffer without bound
TAIL_LINES = 20  # stderr lines kept per rank for the failure report
TAIL_WIDTH = 400  # characters of each such line shown in the report
ERASE_LINE = b"\r\x1b[K"  # carriage return, clear to the end of the line
TTY_ENV = "GPUCOLL_TTY"


class Console:
    """Where prefixed lines go: the launcher's stdout and stderr, one writer at a time."""

    def __init__(self, stdout: BinaryIO, stderr: BinaryIO):
        self.streams = {"stdout": stdout, "stderr": stderr}
        self.ttys = {name: _tty_path(s) for name, s in self.streams.items()}
        self.lock = threading.Lock()

    def terminal_env(self) -> dict[str, str]:
        """``GPUCOLL_TTY``: the terminal the launcher's stderr shows, where a rank may draw a
        progress line directly (its own stderr is a pipe); empty when stderr is no terminal."""
        tty = self.ttys["stderr"]
        return {TTY_ENV: tty} if tty else {}

    def write(self, stream: str, data: bytes) -> None:
        out = self.streams[stream]
        if self.ttys[stream]:
            data = ERASE_LINE + data
        with self.lock:
            try:
                out.write(data)
                out.flush()
            except (BrokenPipeError, ValueError):
                pass  # nobody reads any more (e.g. `| head`); keep draining the ranks


def _tty_path(stream: BinaryIO) -> str | None:
    try:
        fd = stream.fileno()
        return os.ttyname(fd) if os.isatty(fd) else None
    except (OSError, ValueError, AttributeError):  # no file descriptor (tests pass BytesIO)
        return None


class RankOutput:
    """Pumps one rank's stdout and stderr to the console (and its log), keeping a stderr tail."""

    def __init__(self, rank: int, console: Console, log_path: str | None = None):
        self.rank = rank
        self.prefix = f"[rank {rank}] ".encode()
        self.console = console
        self.tail: collections.deque[bytes] = collections.deque(maxlen=TAIL_LINES)
        self.log = open(log_path, "wb") if log_path else None  # closed in join()
        self.log_lock = threading.Lock()
        self.threads: list[threading.Thread] = []

    def start(self, stream: str, fd: int) -> None:
        """Drain ``fd`` (a pipe the rank writes as ``stream``) until the rank closes it."""
        t = threading.Thread(target=self._pump, args=(stream, fd),
                             name=f"gpucoll-out-{self.rank}-{stream}", daemon=True)
        t.start()
        self.threads.append(t)

    def join(self, timeout: float) -> None:
        """Wait for the pipes to reach their end (the rank and its children have exited)."""
        for t in self.threads:
            t.join(timeout)
        if self.log is not None:
            with self.log_lock:
                self.log.close()

    def last_stderr(self) -> list[str]:
        """The rank's last stderr lines as text, each cut to :data:`TAIL_WIDTH` characters."""
        lines = [line.decode(errors="replace") for line in self.tail]
        return [t if len(t) <= TAIL_WIDTH else t[:TAIL_WIDTH] + " [...]" for t in lines]

    def _pump(self, stream: str, fd: int) -> None:
        pending = b""
        try:
            while chunk := os.read(fd, 1 << 16):
                lines = (pending + chunk).split(b"\n")
                pending = lines.pop()
                while len(pending) >= MAX_LINE:
                    lines.append(pending[:MAX_LINE])
                    pending = pending[MAX_LINE:]
                for line in lines:
                    self._emit(stream, line)
        except OSError:
            pass
        finally:
            if pending:
                self._emit(stream, pending)
            os.close(fd)

    def _emit(self, stream: str, line: bytes) -> None:
        self.console.write(stream, self.prefix + line + b"\n")
        if stream == "stderr":
            self.tail.append(line)
        if self.log is not None:
            with self.log_lock:
                if not self.log.closed:
                    self.log.write(line + b"\n")
                    self.log.flush()


# ---- rank processes ------------------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1


def _die_with_parent_hook():
    """A preexec function making the child receive SIGKILL when the launcher dies (Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    # Resolved now, before any fork: the child only makes the call.
    return lambda: prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


_DIE_WITH_PARENT = _die_with_parent_hook()


def _preexec(cpus: frozenset[int] | None):
    """The child's set-up before it runs the rank: die with the launcher, and keep to ``cpus``
    (set before exec, so every thread the rank ever starts inherits it)."""
    if not cpus:
        return _DIE_WITH_PARENT
    die = _DIE_WITH_PARENT or (lambda: None)

    def setup() -> None:
        die()
        os.sched_setaffinity(0, cpus)

    return setup


@dataclasses.dataclass(frozen=True)
class Exit:
    """A rank that ended: its return code as Popen reports it (negative: killed by a signal)."""

    rank: int
    returncode: int
    time: float


class RankProcess:
    """A running rank with its output pumps; exits are posted to a queue shared by the job."""

    def __init__(self, rank: int, local_rank: int, output: RankOutput):
        self.rank = rank
        self.local_rank = local_rank
        self.output = output
        self.proc: subprocess.Popen | None = None
        self.started = 0.0

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def start(self, argv: list[str], env: dict[str, str], exits: queue.Queue,
              cpus: frozenset[int] | None = None) -> None:
        """Start the rank (pinned to ``cpus`` when given); its exit is put on ``exits`` as an
        :class:`Exit`."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            self.proc = subprocess.Popen(
                argv, env=env, stdin=subprocess.DEVNULL, stdout=out_w, stderr=err_w,
                start_new_session=True, preexec_fn=_preexec(cpus))
        except BaseException:
            for fd in (out_r, err_r):
                os.close(fd)
            raise
        finally:
            os.close(out_w)
            os.close(err_w)
        self.started = time.monotonic()
        self.output.start("stdout", out_r)
        self.output.start("stderr", err_r)
        threading.Thread(target=self._wait, args=(exits,), daemon=True,
                         name=f"gpucoll-wait-{self.rank}").start()

    def _wait(self, exits: queue.Queue) -> None:
        code = self.proc.wait()
        exits.put(Exit(self.rank, code, time.monotonic()))

    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the rank's whole process group (a no-op once it is gone)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


@dataclasses.dataclass(frozen=True)
class RemoteAbort:
    """Another node's launcher stopped the job: its exit status and why."""

    status: int
    reason: str


# ---- asking the doctor about the job -------------------------------------------------------------

DOCTOR_WAIT_S = 5.0  # how long the ranks get to answer (a loaded machine is slow to)
DOCTOR_LIMIT_S = 30.0  # the doctor's whole run, at most


def process_state(pid: int | None) -> str:
    """``running``, ``stopped`` (SIGSTOP or a debugger) or ``gone``, from /proc."""
    if pid is None:
        return "gone"
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"
    return {"T": "stopped", "t": "stopped", "Z": "gone", "X": "gone"}.get(state, "running")


def clear_dumps(trace_dir: str) -> None:
    """Remove the dumps and facts an earlier job left in ``trace_dir`` (and nothing else)."""
    try:
        names = os.listdir(trace_dir)
    except OSError:
        return
    for name in names:
        if name == FACTS_FILE or (name.startswith("rank-") and name.endswith(".trace.jsonl")):
            try:
                os.unlink(os.path.join(trace_dir, name))
            except OSError:
                pass


def save_facts(trace_dir: str, known: dict[str, Any]) -> str:
    """Write ``known`` (the launcher's facts about its ranks) where ``gpucoll doctor DIR``
    finds it; its path."""
    path = os.path.join(trace_dir, FACTS_FILE)
    os.makedirs(trace_dir, exist_ok=True)
    with open(path, "w") as f:
        json.dump(known, f, indent=1)
    return path


def run_doctor(store_url: str, token: str, trace_dir: str, known: dict[str, Any]) -> str:
    """The doctor's report on the job (its stdout and stderr), with ``known`` facts saved
    beside the ranks' dumps first."""
    try:
        path = save_facts(trace_dir, known)
    except OSError as exc:
        return f"gpucoll doctor: could not write the launcher's facts in {trace_dir}: {exc}"
    argv = [sys.executable, "-m", "gpucoll", "doctor", store_url, "--facts", path,
            "--wait", str(DOCTOR_WAIT_S)]
    env = {**os.environ, "GPUCOLL_STORE_TOKEN": token}
    try:
        done = subprocess.run(argv, env=env, capture_output=True, text=True,
                              timeout=DOCTOR_LIMIT_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"gpucoll doctor: did not finish: {exc}"
    return (done.stdout + done.stderr).rstrip("\n")


# ---- the job -------------------------------------------------------------------------------------

OUTPUT_DRAIN = 5.0  # seconds to wait for a finished rank's last output


@dataclasses.dataclass
class Deadlines:
    """Monotonic times at which the loop must act; None when not scheduled."""

    job: float | None = None
    term: float | None = None
    kill: float | None = None

    def next(self) -> float | None:
        due = [t for t in (self.job, self.term, self.kill) if t is not None]
        return min(due) if due else None


class Job:
    """One node's share of a job: ``nproc`` ranks under supervision."""

    def __init__(self, cfg: LaunchConfig, gpus: list[str], console: Console,
                 binds: list[Binding] | None = None):
        self.cfg = cfg
        self.gpus = gpus
        self.binds = binds
        self.console = console
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.ranks: list[RankProcess] = []
        self.exits: dict[int, Exit] = {}
        self.sent: dict[int, int] = {}  # rank -> last signal the launcher sent it
        self.first_failure: Exit | None = None
        self.stopped: list[int] = []  # ranks stopped (SIGSTOP) when the first failure came
        self.interrupt: Received | None = None
        self.timed_out = False
        self.remote: RemoteAbort | None = None
        self.on_failure = lambda status, rank, reason: None  # tells the other nodes
        self.deadlines = Deadlines()
        self.start = 0.0
        self.store_url = ""
        self.token = ""
        self.trace_dir = ""
        self.diagnosis = ""  # the doctor's report when --timeout passed

    # ---- start -------------------------------------------------------------------------

    def launch(self, store: tuple[str, int], token: str, torch_port: int) -> None:
        """Start every local rank with its environment and output pumps."""
        if self.cfg.tee:
            os.makedirs(self.cfg.tee, exist_ok=True)
        self.store_url, self.token = store_url(*store), token
        self.trace_dir = self.cfg.tee or os.environ.get("GPUCOLL_TRACE_DIR") or ""
        if not self.trace_dir:  # a name only: the first rank that writes a dump makes it
            self.trace_dir = os.path.join(tempfile.gettempdir(),
                                          f"gpucoll-run-{os.getpid()}-{secrets.token_hex(4)}")
        clear_dumps(self.trace_dir)  # an earlier job's would mix with this one's
        self.start = time.monotonic()
        if self.cfg.timeout is not None:
            self.deadlines.job = self.start + self.cfg.timeout
        argv = self.cfg.command()
        for local in range(self.cfg.nproc):
            rank = self.cfg.global_rank(local)
            log = os.path.join(self.cfg.tee, f"rank-{rank}.log") if self.cfg.tee else None
            proc = RankProcess(rank, local, RankOutput(rank, self.console, log))
            self.ranks.append(proc)
            env = {**os.environ, **rank_env(self.cfg, local, store, token, torch_port,
                                             self.gpus), "GPUCOLL_TRACE_DIR": self.trace_dir}
            env.pop(TTY_ENV, None)  # an outer launcher's terminal is not necessarily ours
            env.update(self.console.terminal_env())
            bind = self.binds[local] if self.binds else None
            if bind is not None:
                env.update(bind.env)
            proc.start(argv, env, self.events, cpus=bind.cpus if bind else None)

    # ---- supervise ---------------------------------------------------------------------

    def supervise(self) -> int:
        """Run until every rank has exited; return the launcher's exit status. The caller
        holds ``signals_to(self.events)`` from before the first rank starts, so that a signal
        that comes while ranks start is forwarded too (not the launcher's death)."""
        while len(self.exits) < len(self.ranks):
            self._handle(self._next_event())
            self._act_on_deadlines()
        return self._finish()

    def _next_event(self):
        due = self.deadlines.next()
        wait = None if due is None else max(0.0, due - time.monotonic())
        try:
            return self.events.get(timeout=wait)
        except queue.Empty:
            return None

    def _handle(self, event) -> None:
        if isinstance(event, Exit):
            self.exits[event.rank] = event
            if event.returncode != 0 and self.cfg.keep_going and event.rank not in self.sent:
                self._note(f"rank {event.rank} failed ({describe(event.returncode)}); "
                           f"the other ranks go on (--keep-going)")
                if self.first_failure is None:
                    self.first_failure = event
            elif event.returncode != 0 and self._is_failure(event):
                self.first_failure = event
                self.stopped = [p.rank for p in self._running()
                                if process_state(p.pid) == "stopped"]
                self._schedule_stop(term_after=self.cfg.grace)
                self.on_failure(exit_status(event.returncode), event.rank,
                                f"rank {event.rank} on node {self.cfg.node_rank} failed "
                                f"({describe(event.returncode)})")
        elif isinstance(event, Received):
            self._on_signal(event)
        elif isinstance(event, RemoteAbort) and self._quiet():
            self.remote = event
            self._note(f"stopping this node's ranks: {event.reason}")
            self._schedule_stop(term_after=self.cfg.grace)

    def _is_failure(self, event: Exit) -> bool:
        # Only the first failure counts, and not an exit the launcher itself caused.
        return self._quiet() and event.rank not in self.sent

    def _quiet(self) -> bool:
        """Nothing has gone wrong yet: no failure, signal, timeout or abort from elsewhere."""
        return (self.first_failure is None and self.interrupt is None and not self.timed_out
                and self.remote is None)

    def _on_signal(self, event: Received) -> None:
        if event.signum == DIAGNOSE:
            self._note(f"gpucoll run: received SIGUSR1: asking gpucoll doctor about the job\n"
                       f"{self._checkup()}", raw=True)
            return
        if (self.interrupt is not None and event.signum == signal.SIGINT
                and self.interrupt.signum == signal.SIGINT):
            self._note(f"second {event.name}: killing every rank")
            self._signal_running(signal.SIGKILL)
            return
        if self.interrupt is None:
            self.interrupt = event
            self._note(f"received {event.name}: forwarding it to every rank "
                       f"(Ctrl-C again kills them)")
        self._signal_running(event.signum)
        self.deadlines.kill = time.monotonic() + self.cfg.grace

    def _schedule_stop(self, term_after: float) -> None:
        if self.deadlines.term is None and self.deadlines.kill is None:
            self.deadlines.term = time.monotonic() + term_after

    def _act_on_deadlines(self) -> None:
        now = time.monotonic()
        d = self.deadlines
        if d.job is not None and now >= d.job:
            d.job = None
            if self._running():
                self.timed_out = True
                self._note(f"job timed out after {self.cfg.timeout:g} s; asking gpucoll doctor "
                           f"why, then stopping ranks {[p.rank for p in self._running()]}")
                self.diagnosis = self._checkup()
                d.term = now = time.monotonic()
        if d.term is not None and now >= d.term:
            d.term = None
            self._signal_running(signal.SIGTERM)
            d.kill = now + self.cfg.grace
        if d.kill is not None and now >= d.kill:
            d.kill = None
            self._signal_running(signal.SIGKILL)

    def _checkup(self) -> str:
        """The doctor's report on this job (node 0 only: it hosts the store every rank of
        the job answers through)."""
        if self.cfg.node_rank != 0:
            return "gpucoll run: the diagnosis is node 0's (its launcher hosts the job's store)"
        return run_doctor(self.store_url, self.token, self.trace_dir, self._facts())

    def _facts(self) -> dict:
        """What the launcher knows of each of its ranks, as the doctor reads it: pid, running
        or stopped, how a finished one ended, and the signal the launcher itself sent one (its
        end is then the launcher's doing)."""
        out = {}
        wall = time.time() - time.monotonic()  # monotonic -> epoch seconds
        for proc in self.ranks:
            ended = self.exits.get(proc.rank)
            if ended is not None:
                fact = {"pid": proc.pid, "state": "exited", "returncode": ended.returncode,
                        "how": describe(ended.returncode), "time": round(ended.time + wall, 3),
                        "after_s": round(ended.time - self.start, 2)}
            else:
                fact = {"pid": proc.pid, "state": process_state(proc.pid)}
            if proc.rank in self.sent:
                fact["stopped_by_launcher"] = signal.Signals(self.sent[proc.rank]).name
            out[str(proc.rank)] = fact
        return {"ranks": out}

    def _running(self) -> list[RankProcess]:
        return [p for p in self.ranks if p.rank not in self.exits]

    def _signal_running(self, sig: int) -> None:
        for proc in self._running():
            self.sent[proc.rank] = sig
            proc.signal(sig)

    # ---- finish ------------------------------------------------------------------------

    def cleanup(self) -> None:
        """Kill whatever is left (ranks and their children) and collect the last output."""
        for proc in self.ranks:
            proc.signal(signal.SIGKILL)  # the group: children a rank left behind
        for proc in self.ranks:
            if proc.proc is not None:
                try:
                    proc.proc.wait(timeout=OUTPUT_DRAIN)
                except Exception:  # noqa: BLE001 - best effort on the way out
                    pass
            proc.output.join(OUTPUT_DRAIN)

    def _finish(self) -> int:
        self.cleanup()
        if self.first_failure is not None:
            self._report_failure(self.first_failure)
            self._point_at_dumps()
            if self.cfg.keep_going:
                return self._kept_going()
            return exit_status(self.first_failure.returncode)
        if self.timed_out:
            self._report_timeout()
            self._point_at_dumps()
            return TIMEOUT_EXIT
        if self.interrupt is not None:
            self._note(f"interrupted by {self.interrupt.name}: "
                       + "; ".join(self._fate(p) for p in self.ranks))
            return 128 + self.interrupt.signum
        if self.remote is not None:
            return self.remote.status
        return 0

    def _report_failure(self, first: Exit) -> None:
        proc = self.ranks[first.rank - self.cfg.global_rank(0)]
        others = [self._fate(p) for p in self.ranks if p is not proc]
        self._note(root_cause(
            first.rank, proc.local_rank, self.cfg.node_rank, proc.pid, first.returncode,
            first.time - self.start, proc.output.last_stderr(), others, self.stopped), raw=True)

    def _kept_going(self) -> int:
        """The status of a job that went on after losing ranks: the first rank that exited
        with an error code fails it; ranks lost to a signal do not, when another finished."""
        ended = sorted(self.exits.values(), key=lambda e: e.time)
        coded = [e for e in ended if e.returncode > 0 and e.rank not in self.sent]
        finished = sorted(e.rank for e in ended if e.returncode == 0)
        lost = sorted(e.rank for e in ended if e.returncode < 0 and e.rank not in self.sent)
        if coded:
            return exit_status(coded[0].returncode)
        if finished:
            self._note(f"--keep-going: {ranks_text(lost)} lost, {ranks_text(finished)} "
                       f"finished; the job succeeds")
            return 0
        return exit_status(self.first_failure.returncode)

    def _point_at_dumps(self) -> None:
        """Say where the ranks' dumps are, and leave the launcher's facts beside them."""
        dumps = [f for f in os.listdir(self.trace_dir) if f.endswith(".trace.jsonl")] \
            if os.path.isdir(self.trace_dir) else []
        if dumps:
            if not self.diagnosis:  # else keep what the launcher knew when the job hung
                save_facts(self.trace_dir, self._facts())
            self._note(f"flight recorders of {len(dumps)} rank(s) in {self.trace_dir}; "
                       f"`gpucoll doctor {self.trace_dir}` reads them")

    def _report_timeout(self) -> None:
        hung = [p for p in self.ranks if p.rank in self.sent]
        lines = [f"gpucoll run: job timed out after {self.cfg.timeout:g} s (--timeout); "
                 f"ranks still running then were stopped:"]
        for p in hung:
            lines.append(f"  {self._fate(p)}")
            lines += [f"      {line}" for line in p.output.last_stderr()[-5:]]
        if self.diagnosis:
            lines += ["gpucoll run: what gpucoll doctor found when the job timed out:",
                      self.diagnosis]
        self._note("\n".join(lines), raw=True)

    def _fate(self, proc: RankProcess) -> str:
        ended = self.exits.get(proc.rank)
        how = describe(ended.returncode) if ended else "did not exit"
        if proc.rank in self.sent:
            how = f"stopped by the launcher ({signal.Signals(self.sent[proc.rank]).name}), {how}"
        if proc.rank in self.stopped:
            how = f"stopped (SIGSTOP or a debugger) when the job failed; then {how}"
        return f"rank {proc.rank}: {how}"

    def _note(self, text: str, raw: bool = False) -> None:
        msg = text if raw else f"gpucoll run: {text}"
        self.console.write("stderr", (msg + "\n").encode())


def console() -> Console:
    return Console(sys.stdout.buffer, sys.stderr.buffer)
