"""Where a sweep's events go: straight to the console, or to a file the driver replays.

A sweep reports four events: ``start(run)`` (the library's description), ``skip(text)``,
``result(Result)`` and ``finish(error)``. ``Console`` prints nccl-tests' tables as results
arrive and keeps every run for the comparison, JSON, CSV and plot at the end. ``EventFile`` is
what rank 0 writes when ``gpucoll bench`` started the ranks: one JSON object a line, flushed, so
the driver shows lines as they come and keeps those written before any crash.
"""

from __future__ import annotations

import datetime
import json
import sys
from typing import Any, TextIO

from gpucoll.bench import report
from gpucoll.bench.engine import Result
from gpucoll.bench.options import BenchOptions
from gpucoll.bench.progress import Progress


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
            from gpucoll.bench.plot import plot

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
