"""The job's event loop: start the ranks, watch them, and stop them all when one fails.

Rank exits and signals to the launcher arrive on one queue. The first rank to fail is the root
cause: the others get ``grace`` seconds to end on their own (they usually notice the dead peer
and print why), then SIGTERM, then after ``grace`` more SIGKILL. A signal to the launcher is
forwarded to every rank; a second SIGINT kills them at once. ``timeout`` bounds the whole job.
In a job of several nodes, a failure on another node stops this node's ranks the same way.
With ``keep_going`` a rank that fails is reported and the others go on.

When ``timeout`` passes, the launcher first asks ``gpucoll doctor`` where every rank is (and
prints the answer under the ranks' output); SIGUSR1 asks it the same while the job runs on.
The ranks write their flight-recorder dumps into the job's trace directory.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import secrets
import signal
import sys
import tempfile
import time

from gpucoll.launch import checkup, report
from gpucoll.launch.config import LaunchConfig
from gpucoll.launch.environ import rank_env
from gpucoll.launch.jobstore import RemoteAbort
from gpucoll.launch.output import Console, RankOutput
from gpucoll.launch.procs import Exit, RankProcess
from gpucoll.launch.signals import DIAGNOSE, Received, signals_to
from gpucoll.rendezvous import store_url

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

    def __init__(self, cfg: LaunchConfig, gpus: list[str], console: Console):
        self.cfg = cfg
        self.gpus = gpus
        self.console = console
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.ranks: list[RankProcess] = []
        self.exits: dict[int, Exit] = {}
        self.sent: dict[int, int] = {}  # rank -> last signal the launcher sent it
        self.first_failure: Exit | None = None
        self.interrupt: Received | None = None
        self.timed_out = False
        self.remote: RemoteAbort | None = None
        self.on_failure = lambda status, reason: None  # tells the other nodes
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
        checkup.clear_dumps(self.trace_dir)  # an earlier job's would mix with this one's
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
            proc.start(argv, env, self.events)

    # ---- supervise ---------------------------------------------------------------------

    def supervise(self) -> int:
        """Run until every rank has exited; return the launcher's exit status."""
        with signals_to(self.events):
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
                self._note(f"rank {event.rank} failed ({report.describe(event.returncode)}); "
                           f"the other ranks go on (--keep-going)")
                if self.first_failure is None:
                    self.first_failure = event
            elif event.returncode != 0 and self._is_failure(event):
                self.first_failure = event
                self._schedule_stop(term_after=self.cfg.grace)
                self.on_failure(report.exit_status(event.returncode),
                                f"rank {event.rank} on node {self.cfg.node_rank} failed "
                                f"({report.describe(event.returncode)})")
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
                d.term = time.monotonic()
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
        known = checkup.facts(self.ranks, self.exits, self.start, self.sent)
        return checkup.run_doctor(self.store_url, self.token, self.trace_dir, known)

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
            return report.exit_status(self.first_failure.returncode)
        if self.timed_out:
            self._report_timeout()
            self._point_at_dumps()
            return report.TIMEOUT_EXIT
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
        self._note(report.root_cause(
            first.rank, proc.local_rank, self.cfg.node_rank, proc.pid, first.returncode,
            first.time - self.start, proc.output.last_stderr(), others), raw=True)

    def _kept_going(self) -> int:
        """The status of a job that went on after losing ranks: the first rank that exited
        with an error code fails it; ranks lost to a signal do not, when another finished."""
        ended = sorted(self.exits.values(), key=lambda e: e.time)
        coded = [e for e in ended if e.returncode > 0 and e.rank not in self.sent]
        finished = sorted(e.rank for e in ended if e.returncode == 0)
        lost = sorted(e.rank for e in ended if e.returncode < 0 and e.rank not in self.sent)
        if coded:
            return report.exit_status(coded[0].returncode)
        if finished:
            self._note(f"--keep-going: {_ranks(lost)} lost, {_ranks(finished)} finished; the "
                       f"job succeeds")
            return 0
        return report.exit_status(self.first_failure.returncode)

    def _point_at_dumps(self) -> None:
        """Say where the ranks' dumps are, and leave the launcher's facts beside them."""
        dumps = [f for f in os.listdir(self.trace_dir) if f.endswith(".trace.jsonl")] \
            if os.path.isdir(self.trace_dir) else []
        if dumps:
            if not self.diagnosis:  # else keep what the launcher knew when the job hung
                checkup.save_facts(self.trace_dir, checkup.facts(self.ranks, self.exits,
                                                                 self.start, self.sent))
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
        how = report.describe(ended.returncode) if ended else "did not exit"
        if proc.rank in self.sent:
            return (f"rank {proc.rank}: stopped by the launcher "
                    f"({signal.Signals(self.sent[proc.rank]).name}), {how}")
        return f"rank {proc.rank}: {how}"

    def _note(self, text: str, raw: bool = False) -> None:
        msg = text if raw else f"gpucoll run: {text}"
        self.console.write("stderr", (msg + "\n").encode())


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def console() -> Console:
    return Console(sys.stdout.buffer, sys.stderr.buffer)
