"""``gpucoll doctor``: read every rank's flight recorder and say what went wrong.

    gpucoll doctor DIR                      the dumps ranks wrote (GPUCOLL_TRACE_DIR, --tee DIR)
    gpucoll doctor tcp://host:port          a live job, through its store, while it hangs
    gpucoll doctor SOURCE --timeline t.json also write a Chrome trace of every rank's calls

Exit status: 0 when nothing is wrong, 1 when the doctor found a problem, 2 when it could not
read anything.

What is here, in this order:

- the command: its arguments, the evidence read (``gpucoll.dumps`` reads it: the dump files
  in a directory, or a live job's answers and summaries through its store), and the verdicts
  in words or as JSON;
- the diagnosis: the verdict on each communicator of the job. For one group it finds:
    - where every rank is (its progress record, or a same-host peer's read of it when the
      rank cannot answer) and which ranks are behind, and for how long the others have waited;
    - the first sequence number at which the ranks diverged: the first collective some rank
      never entered while others did, or that ranks called with different signatures;
    - signatures that do not match, naming the ranks on each side;
    - which rank failed first and how (its error, or its death as the store's will or the
      launcher saw it), and what the others raised after.
  A verdict is a problem when ranks disagree, a rank failed, died or cannot be reached, or
  ranks at different calls have waited longer than ``patience`` seconds;
- the timeline: every rank's recorded calls as one Chrome trace (Trace Event Format), for
  Perfetto or chrome://tracing: a row per rank, a slice per call from its start to its end.
  Each rank is a process (``rank R``, in job-rank order) and each communicator it belongs to a
  thread of it, so a job with one communicator has one row per rank. A call still running when
  the record was taken lasts until then; a failed call says so in its name and arguments, and
  the error is an instant event at the moment it was raised. Times are microseconds from the
  earliest call in the trace.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from typing import Any

from gpucoll.dumps import (
    Evidence,
    EvidenceError,
    Group,
    RankRecord,
    ask_store,
    read_dir,
    read_facts,
)
from gpucoll.errors import GpucollError
from gpucoll.progress import IN_CALL, Position, ranks_text
from gpucoll.store import CLOSED_AFTER, aborted_reason, relayed_failure

# -- the command ------------------------------------------------------------------------------
WAIT_S = 3.0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpucoll doctor", description="Say which rank is stuck where, which ranks "
        "disagree, and which failed first, from the ranks' flight recorders.",
        epilog="Exit status: 0 nothing wrong, 1 a problem found, 2 nothing could be read.")
    p.add_argument("source", metavar="DIR|tcp://HOST:PORT",
                   help="a directory of rank-R.trace.jsonl dumps, or a running job's store")
    p.add_argument("--timeline", metavar="FILE",
                   help="also write every rank's calls as a Chrome trace (Perfetto, "
                   "chrome://tracing)")
    p.add_argument("--job", default=None,
                   help="the job's id in the store (default: GPUCOLL_JOB_ID, else the one "
                   "`gpucoll run` and plain init use, 'anonymous')")
    p.add_argument("--token", default=None,
                   help="the store's token (default: GPUCOLL_STORE_TOKEN)")
    p.add_argument("--wait", type=float, default=WAIT_S, metavar="S",
                   help=f"how long a live job's ranks get to answer (default {WAIT_S:g})")
    p.add_argument("--patience", type=float, default=PATIENCE_S, metavar="S",
                   help="ranks at different calls are a problem once one has waited this "
                   f"long (default {PATIENCE_S:g})")
    p.add_argument("--facts", metavar="FILE",
                   help="what a launcher knows of its ranks' processes (JSON, as `gpucoll "
                   "run` writes it to launcher.json)")
    p.add_argument("--json", action="store_true", help="print the verdicts as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        evidence = _read(args)
    except (EvidenceError, GpucollError, OSError) as exc:
        print(f"gpucoll doctor: {exc}", file=sys.stderr)
        return 2
    verdicts = diagnose(evidence, args.patience)
    if args.timeline:
        with open(args.timeline, "w") as f:
            json.dump(chrome_trace(evidence), f)
    if args.json:
        print(json.dumps([{"group": v.group, "size": v.size, "backend": v.backend,
                           "problem": v.problem, "headline": v.headline,
                           "details": dict(v.details)} for v in verdicts], indent=2))
    else:
        print(_text(evidence, verdicts, args.timeline))
    return 1 if any(v.problem for v in verdicts) else 0


def _read(args: argparse.Namespace):
    if args.source.startswith("tcp://"):
        from gpucoll.rendezvous import job_id
        from gpucoll.store import TCPStore, parse_address

        host, port = parse_address(args.source)
        job = args.job or job_id() or "anonymous"
        with TCPStore(host, port, timeout=5.0 + max(args.wait, 0.0), token=args.token) as store:
            evidence = ask_store(store, job.replace("/", "_"), args.wait)
        if not evidence.groups:
            raise EvidenceError(f"no rank of job {job!r} answered at {args.source}, and the "
                                f"store holds no communicator of it (another --job?)")
    else:
        evidence = read_dir(args.source)
    if args.facts:
        evidence.facts = read_facts(args.facts)
    return evidence


def _text(evidence, verdicts, timeline: str | None) -> str:
    problems = sum(v.problem for v in verdicts)
    head = (f"gpucoll doctor: {len(verdicts)} communicator(s) in {evidence.source}: "
            f"{problems} with a problem" if problems else
            f"gpucoll doctor: {len(verdicts)} communicator(s) in {evidence.source}: "
            f"no problem found")
    first = next((v for v in verdicts if v.problem), verdicts[0] if verdicts else None)
    lines = [head] + ([f"  {first.headline}"] if first is not None else []) + [""]
    lines += [v.text(headline=v is not first) for v in verdicts]
    if evidence.unreadable:
        lines.append(f"\n({evidence.unreadable} answer(s) or summaries in the store were not "
                     f"flight records and were left out)")
    if timeline:
        lines.append(f"\ntimeline written to {os.path.abspath(timeline)} (open it in "
                     f"https://ui.perfetto.dev or chrome://tracing)")
    return "\n".join(lines)


# -- the diagnosis ----------------------------------------------------------------------------
PATIENCE_S = 1.0
_SIGNATURE = ("call", "dtype", "count", "root", "op")
_WILDCARDS = ("dtype", "count")  # scatter's non-roots may not know the slot's layout


@dataclasses.dataclass
class Verdict:
    """What the doctor says of one group: a one-line headline and the findings under it."""

    group: str
    size: int
    backend: str
    problem: bool
    headline: str
    details: list[tuple[str, str]]  # (label, text)

    def text(self, headline: bool = True) -> str:
        """The verdict in lines; ``headline=False`` leaves out the headline (said above)."""
        lines = [f"group {self.group} ({self.size} ranks, {self.backend}): "
                 f"{'PROBLEM' if self.problem else 'ok'}"]
        if headline:
            lines.append(f"  {self.headline}")
        width = max((len(label) for label, _ in self.details), default=0)
        lines += [f"    {label + ':':<{width + 1}} {text}" for label, text in self.details]
        return "\n".join(lines)


def diagnose(evidence: Evidence, patience: float = PATIENCE_S) -> list[Verdict]:
    """A verdict per group, the job's first group first."""
    return [_Case(g, evidence, patience).verdict()
            for g in sorted(evidence.groups.values(), key=lambda g: (g.name.count("/"), g.name))]


class _Case:
    """One group under examination."""

    def __init__(self, group: Group, evidence: Evidence, patience: float):
        self.g, self.patience = group, patience
        self.live = evidence.asked_at > 0
        self.records = group.ranks
        self.now = max([evidence.asked_at] + [r.taken for r in self.records.values()])
        self.facts = {r: f for r in range(group.size)
                      if (f := evidence.facts.get(self._family(r))) is not None}
        self.positions: dict[int, Position] = {}
        for r in range(group.size):
            if r in self.records:
                self.positions[r] = self.records[r].position
            else:
                read = [rec.peers[r] for rec in self.records.values() if r in rec.peers]
                if read:
                    self.positions[r] = read[0]

    def _family(self, r: int) -> int | None:
        if r in self.records:
            return self.records[r].family
        if self.g.name.count("/") == 3:  # a job's own group: ranks are the job's ranks
            return r
        return None

    # -- findings --------------------------------------------------------------------------
    def verdict(self) -> Verdict:
        mismatch = self.mismatch()
        first = self.first_failure()
        behind, spread = self.behind()
        details = [("where", self.where())]
        diverged = self.divergence(mismatch)
        if diverged:
            details.append(("diverged", diverged))
        if mismatch:
            details.append(("mismatch", mismatch[1]))
        if first:
            details.append(("failed first", first[0]))
            if first[1]:
                details.append(("then", first[1]))
        details.append(("records", self.sources()))
        lost = self.lost()
        waited = self.longest_wait()
        stalled = spread and (waited is None or waited >= self.patience)
        problem = bool(mismatch or first or lost or stalled)
        if mismatch:
            headline = f"ranks disagree on collective #{mismatch[0]}: {mismatch[1]}"
        elif spread and problem:
            headline = behind
        elif lost:
            headline = lost
        elif first:
            headline = first[0]
        elif spread:
            headline = (f"no problem found: the ranks are at different calls, but none has "
                        f"waited {self.patience:g} s (the job is moving): {behind}")
        else:
            headline = f"no problem found: {self.where()}"
        return Verdict(self.g.name, self.g.size, self.g.backend, problem, headline, details)

    def note(self, r: int) -> str:
        """How rank ``r`` fares beyond its position: died, closed, stopped, silent."""
        fact, gone = self.facts.get(r, {}), self.g.gone.get(r)
        if fact.get("stopped_by_launcher") and fact.get("state") == "exited":
            return f"stopped by the launcher ({fact['stopped_by_launcher']}) afterwards"
        if _failed_exit(fact):
            verb = "died" if fact.get("returncode", -1) < 0 else "exited"
            return f"{verb} ({fact.get('how', 'its process ended')})"
        if gone == "died":
            return "died (its process ended or lost the store)"
        if gone == "closed":
            return "closed its communicator"
        if (why := aborted_reason(gone)) is not None:
            relayed = relayed_failure(why)
            if relayed is not None and relayed[1].startswith(CLOSED_AFTER):
                return "closed its communicator"  # after the failure its error named
            return f"aborted its communicator: {why}"
        if fact.get("state") == "stopped":
            return "is stopped (process state T: SIGSTOP, or a debugger)"
        if r not in self.records:
            blamers = sorted(o for o, rec in self.records.items() if rec.error
                             and rec.error.get("peer") == r
                             and rec.error.get("type") == "PeerFailure")
            if blamers:
                return (f"died or lost its connection, as {ranks_text(blamers)} found "
                        f"(PeerFailure)")
            if self.live:
                return "did not answer (stopped, or hung holding the interpreter?)"
            return "left no record (stopped, hung, or killed before it could write one?)"
        return ""

    def where(self) -> str:
        """Every rank's position in one line, the rank(s) furthest behind first."""
        groups: dict[tuple[int, str, str], list[int]] = {}
        silent: dict[str, list[int]] = {}
        for r in range(self.g.size):
            p = self.positions.get(r)
            note = self.note(r)
            if p is None:
                silent.setdefault(note or "left no record", []).append(r)
                continue
            text = p.where()
            if not p.responsive and r not in self.records:
                text += " (read from its memory by a peer)"
            groups.setdefault((p.order, text, note), []).append(r)
        parts = []
        for (_, text, note), rs in sorted(groups.items()):
            waits = [w for r in rs if (w := self._waited(r)) is not None and w >= 0.1]
            if waits:
                text += f" for {max(waits):.1f} s"
            parts.append(f"{ranks_text(rs)} {'is' if len(rs) == 1 else 'are'} {text}"
                         + (f", {_plural(note, len(rs))}" if note else ""))
        parts += [f"{ranks_text(rs)}: {note}, position unknown" for note, rs in silent.items()]
        return "; ".join(parts)

    def _waited(self, r: int) -> float | None:
        rec = self.records.get(r)
        if rec is None or rec.position.state != IN_CALL:
            return None
        since = rec.running_since()
        return None if since is None else max(rec.taken - since, 0.0) / 1e6

    def longest_wait(self) -> float | None:
        waits = [w for r in self.records if (w := self._waited(r)) is not None]
        return max(waits) if waits else None

    def behind(self) -> tuple[str, bool]:
        """(who is behind and where the others are, whether the ranks are at different
        places at all)."""
        places: dict[int, list[int]] = {}
        for r, p in sorted(self.positions.items()):
            places.setdefault(p.order, []).append(r)
        if len(places) < 2:
            return "", False
        parts = []
        for i, (_, ranks) in enumerate(sorted(places.items())):
            verb = "is" if len(ranks) == 1 else "are"
            if i == 0:
                verb += " behind:"
            parts.append(f"{ranks_text(ranks)} {verb} {self._place(ranks)}")
        return "; ".join(parts), True

    def _place(self, ranks: list[int]) -> str:
        """Where ``ranks`` (all at one position) are, with what else is known of them."""
        text = self.positions[ranks[0]].where()
        notes: dict[str, list[int]] = {}
        for r in ranks:
            if self.note(r):
                notes.setdefault(self.note(r), []).append(r)
        if list(notes.values()) == [ranks]:  # one note for all of them
            return f"{text}, {_plural(next(iter(notes)), len(ranks))}"
        if notes:
            text += " (" + "; ".join(f"{ranks_text(rs)} {_plural(n, len(rs))}"
                                     for n, rs in notes.items()) + ")"
        return text

    def divergence(self, mismatch: tuple[int, str] | None) -> str:
        """The first collective that not every rank entered alike."""
        reached = {r: p.seq for r, p in self.positions.items()}
        candidates = []
        if reached and len(set(reached.values())) > 1:
            seq = min(reached.values()) + 1
            went = sorted(r for r, s in reached.items() if s >= seq)
            stayed = sorted(r for r, s in reached.items() if s < seq)
            call = self._call_at(seq, went)
            candidates.append((seq, f"#{seq}{f' ({call})' if call else ''}: {ranks_text(went)} "
                                    f"entered it, {ranks_text(stayed)} did not"))
        if mismatch:
            candidates.append((mismatch[0], f"#{mismatch[0]}: the ranks called different "
                                            f"collectives (see mismatch)"))
        if not candidates:
            return ""
        return min(candidates)[1]

    def _call_at(self, seq: int, ranks: list[int]) -> str:
        for r in ranks:
            for call in self.records.get(r, _NONE).calls:
                if call.get("seq") == seq:
                    return call["call"]
        for r in ranks:
            p = self.positions[r]
            if p.seq == seq:
                return p.where().split(" #")[0].removeprefix("in ")
        return ""

    def mismatch(self) -> tuple[int, str] | None:
        """(seq, who called what) for the first collective the ranks' records disagree on."""
        by_seq: dict[int, dict[int, dict[str, Any]]] = {}
        for r, rec in self.records.items():
            for call in rec.calls:
                if call.get("seq", -1) >= 0:
                    by_seq.setdefault(call["seq"], {})[r] = call
        for seq in sorted(by_seq):
            calls = by_seq[seq]
            if len(calls) < 2:
                continue
            classes: list[tuple[dict[str, Any], list[int]]] = []
            for r, call in sorted(calls.items()):
                for sig, members in classes:
                    if _compatible(sig, call):
                        members.append(r)
                        break
                else:
                    classes.append((call, [r]))
            if len(classes) > 1:
                classes.sort(key=lambda c: (-len(c[1]), c[1]))
                return seq, "; ".join(f"{ranks_text(rs)} called {describe(sig)}"
                                      for sig, rs in classes)
        return None

    def lost(self) -> str:
        """A headline for ranks that died or cannot be reached, or ""."""
        died = [r for r in range(self.g.size) if self.note(r).startswith(("died", "exited"))]
        silent = [r for r in range(self.g.size) if r not in died and r not in self.records
                  and self.g.gone.get(r) != "closed"]
        stopped = [r for r in range(self.g.size) if self.facts.get(r, {}).get("state")
                   == "stopped"]
        parts = []
        for r in died:
            p = self.positions.get(r)
            where = f" {p.where()}" if p is not None else ""
            parts.append(f"rank {r} {self.note(r)}{where}")
        quiet = sorted(set(silent) | set(stopped))
        if quiet:
            for r in quiet:
                p = self.positions.get(r)
                parts.append(f"rank {r} {self.note(r)}" + (f", {p.where()}" if p is not None
                                                           else ""))
        if not parts:
            return ""
        others: dict[int, list[int]] = {}
        for r in sorted(self.positions):
            if r not in died and r not in quiet:
                others.setdefault(self.positions[r].order, []).append(r)
        parts += [f"{ranks_text(rs)} {'is' if len(rs) == 1 else 'are'} {self._place(rs)}"
                  for _, rs in sorted(others.items())]
        return "; ".join(parts)

    def first_failure(self) -> tuple[str, str] | None:
        """(the first failure in words, what the others raised after), or None."""
        events = []
        for r, rec in self.records.items():
            if rec.error:
                events.append((rec.error.get("time") or rec.taken, r, "error"))
        # a rank that others' errors name died before them, whenever its launcher saw it end
        blamed: dict[int, float] = {}
        for t, r, _ in events:
            peer = self.records[r].error.get("peer")
            if isinstance(peer, int) and peer != r:
                blamed[peer] = min(blamed.get(peer, t), t)
        for r in range(self.g.size):
            fact = self.facts.get(r, {})
            ended = float(fact["time"]) * 1e6 if _failed_exit(fact) and fact.get("time") \
                else None
            if r in self.records and self.records[r].error:
                continue  # its error says how it failed; its exit followed from it
            if r in blamed and self.note(r).startswith(("died", "exited")):
                events.append((min(blamed[r], ended or blamed[r]) - 1, r, "death"))
            elif ended is not None:
                events.append((ended, r, "death"))
        if not events:
            return None
        # an error a rank only relayed (another rank's failure, told to it) is not the first,
        # whenever it was dumped: the rank that found the fault may have been slower to write
        events.sort(key=lambda e: (e[2] == "error" and _relayed(self.records[e[1]].error),
                                   e[0]))
        t, r, kind = events[0]
        if kind == "error":
            err = self.records[r].error
            head = (f"rank {r} raised {err['type']}{self._at(t)}: "
                    f"{_short(err.get('message', ''))}")
        else:
            p = self.positions.get(r)
            head = f"rank {r} {self.note(r)}" + (f", {p.where()}" if p is not None else "")
        rest: dict[str, list[int]] = {}
        for _, other, k in events[1:]:
            if k == "error":
                err = self.records[other].error
                peer = err.get("peer")
                rest.setdefault(f"{err['type']}" + (f" naming rank {peer}" if peer is not None
                                                    else ""), []).append(other)
            else:
                rest.setdefault(self.note(other), []).append(other)
        then = "; ".join(f"{ranks_text(sorted(rs))} "
                         f"{what if what.startswith(('died', 'exited')) else 'raised ' + what}"
                         for what, rs in rest.items())
        return head, then

    def _at(self, t: float) -> str:
        if not t:
            return ""
        secs = t / 1e6
        clock = time.strftime("%H:%M:%S", time.localtime(secs))
        return f" at {clock}.{int(secs * 1000) % 1000:03d}"

    def sources(self) -> str:
        by: dict[str, list[int]] = {}
        for r, rec in sorted(self.records.items()):
            kind = "dump file" if rec.source.endswith(".jsonl") else rec.source
            by.setdefault(kind, []).append(r)
        parts = [f"{ranks_text(rs)} ({kind})" for kind, rs in by.items()]
        none = [r for r in range(self.g.size) if r not in self.records]
        if none:
            parts.append(f"{ranks_text(none)}: none")
        return "; ".join(parts)


_NONE = RankRecord("", 0, 0, 0, "", Position(0, -1, 0, 0), None, [], False, "", None, "", 0.0, {})


_RELAYED = re.compile(r": rank \d+ (failed|reported a failure caused by rank \d+): ")


def _relayed(error: dict[str, Any]) -> bool:
    """An error that passes on another rank's failure (as the ring's peers tell it)."""
    return bool(_RELAYED.search(error.get("message", "")))


def _plural(note: str, count: int) -> str:
    """A note about one rank, said of ``count`` of them."""
    if count == 1:
        return note
    return note.replace(" its communicator", " their communicators").replace(
        "is stopped", "are stopped").replace(" its connection", " their connections")


def _failed_exit(fact: dict[str, Any]) -> bool:
    """A launcher saw this rank end other than with exit code 0, and not by its own doing."""
    return fact.get("state") == "exited" and fact.get("returncode", -1) != 0 \
        and not fact.get("stopped_by_launcher")


def _compatible(a: dict[str, Any], b: dict[str, Any]) -> bool:
    for field in _SIGNATURE:
        va, vb = a.get(field), b.get(field)
        if va != vb and not (field in _WILDCARDS and (va is None or vb is None)):
            return False
    return True


def describe(call: dict[str, Any]) -> str:
    """``all_reduce(float32, 4 elements, op=sum)``: a recorded call as its caller wrote it."""
    args = []
    if call.get("dtype") is not None:
        args.append(call["dtype"])
    if call.get("count") is not None:
        args.append(f"{call['count']} element{'s' if call['count'] != 1 else ''}")
    for field in ("op", "root", "peer"):
        if call.get(field) is not None:
            args.append(f"{field}={call[field]}")
    return f"{call['call']}({', '.join(args)})"


def _short(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + " [...]"


# -- the timeline -----------------------------------------------------------------------------
_ARGS = ("seq", "dtype", "count", "root", "op", "peer", "stream", "state")


def chrome_trace(evidence: Evidence) -> dict[str, Any]:
    """The trace as a JSON-ready dict (``{"traceEvents": [...], ...}``)."""
    records = [rec for g in evidence.groups.values() for rec in g.ranks.values()]
    starts = [c["started"] for rec in records for c in rec.calls if c.get("started")]
    origin = min(starts) if starts else 0.0
    groups = sorted({rec.group for rec in records}, key=lambda g: (g.count("/"), g))
    events: list[dict[str, Any]] = []
    for family in sorted({rec.family for rec in records}):
        events.append({"ph": "M", "name": "process_name", "pid": family, "tid": 0,
                       "args": {"name": f"rank {family}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": family, "tid": 0,
                       "args": {"sort_index": family}})
    for rec in records:
        tid = groups.index(rec.group)
        events.append({"ph": "M", "name": "thread_name", "pid": rec.family, "tid": tid,
                       "args": {"name": f"{rec.group} (rank {rec.rank} of {rec.size})"}})
        for call in rec.calls:
            slice_ = _slice(call, rec.taken, origin)
            if slice_ is not None:
                events.append({**slice_, "pid": rec.family, "tid": tid})
        if rec.error and rec.error.get("time"):
            events.append({"ph": "i", "s": "t", "name": f"{rec.error['type']}",
                           "ts": round(rec.error["time"] - origin, 1), "pid": rec.family,
                           "tid": tid, "args": {"message": rec.error.get("message", "")}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"source": evidence.source, "origin_us_since_epoch": origin}}


def _slice(call: dict[str, Any], taken: float, origin: float) -> dict[str, Any] | None:
    start = call.get("started")
    if not start:
        return None
    end = call.get("ended") or taken or start
    seq = call.get("seq", -1)
    if seq >= 0:
        name = f"{call['call']} #{seq}"
    else:
        name = f"{call['call']} {'to' if call['call'] == 'send' else 'from'} {call.get('peer')}"
    if call.get("state") == "failed":
        name += " (failed)"
    args = {k: call[k] for k in _ARGS if call.get(k) is not None}
    if call.get("queued") and call["queued"] < start:
        args["queued_us_before_start"] = round(start - call["queued"], 1)
    return {"ph": "X", "name": name, "cat": call["call"], "ts": round(start - origin, 1),
            "dur": round(max(end - start, 0.0), 1), "args": args}
