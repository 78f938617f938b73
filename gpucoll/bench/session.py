"""Where a sweep's events go: straight to the console, or to a file the driver replays.

A sweep reports four events: ``start(run)`` (the library's description), ``skip(text)``,
``result(Result)`` and ``finish(error)``. ``Console`` prints nccl-tests' tables as results
arrive and keeps every run for the comparison, JSON, CSV and plot at the end. ``EventFile`` is
what rank 0 writes when ``gpucoll bench`` started the ranks: one JSON object a line, flushed, so
the driver shows lines as they come and keeps those written before any crash.

The console shows a one-line progress bar for long sweeps, drawn on the terminal of the process
that shows it. From a shell that terminal is stderr. Rank 0 of a job started by ``gpucoll run``
has only pipes (the launcher prefixes and forwards its lines), so the launcher names its own
terminal in ``GPUCOLL_TTY`` and the bar is drawn there directly, in place; the launcher clears
the line before each line it forwards, so the bar never splits one. By default the bar shows on
a terminal only, once the sweep has run a few seconds; ``--progress`` shows it at once (on a
stream that is no terminal, as one line per finished table line).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from typing import Any, TextIO

from gpucoll.bench import report
from gpucoll.bench.engine import Result
from gpucoll.bench.options import BenchOptions
from gpucoll.launch.supervisor import TTY_ENV


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
            peak = report.peak_line(self._results, self.doc["ceilings"])
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
