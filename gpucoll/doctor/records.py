"""The evidence the doctor reads: every rank's flight-recorder record, grouped by communicator.

From a directory: the ``rank-R.trace.jsonl`` files ranks write (``gpucoll.dumps``), and the
``launcher.json`` a launcher leaves beside them (what it knows of its ranks' processes). From a
live job's store: the doctor asks every rank (each process answers from a thread of its own,
so a rank blocked in a call still answers; a stopped one cannot), then reads what the store
knows of the others: which ranks died or closed (their wills), and the summaries that failing
ranks left in their group's slot.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import time
from typing import Any

from gpucoll.dumps import ask_keys
from gpucoll.errors import GpucollError
from gpucoll.progress import Position

FACTS_FILE = "launcher.json"
_SCAN = 64  # slots looked at per round trip when looking for a job's groups in the store


class EvidenceError(ValueError):
    """There is nothing to read: no records in the directory, or no store there."""


@dataclasses.dataclass
class RankRecord:
    """What one rank said about itself in one communicator (one ``group`` line and its calls)."""

    group: str
    rank: int
    size: int
    family: int  # the rank whose dump holds this group (its rank in the job's first group)
    backend: str
    position: Position
    error: dict[str, Any] | None
    calls: list[dict[str, Any]]
    closed: bool
    host: str
    pid: int | None
    source: str  # where it came from: a file name, "answer" or "store summary"
    taken: float  # when it was taken, microseconds since the epoch
    peers: dict[int, Position]  # same-host peers' positions, read from their memory

    @classmethod
    def from_lines(cls, process: dict[str, Any], head: dict[str, Any],
                   calls: list[dict[str, Any]], source: str) -> RankRecord:
        return cls(
            group=head["group"], rank=int(head["rank"]), size=int(head["size"]),
            family=int(head.get("family", head["rank"])), backend=head.get("backend", "?"),
            position=position(int(head["rank"]), head["position"]), error=head.get("error"),
            calls=calls, closed=bool(head.get("closed")), host=process.get("host", "?"),
            pid=process.get("pid"), source=source, taken=float(process.get("time", 0.0)),
            peers={int(j): position(int(j), p) for j, p in (head.get("peers") or {}).items()})

    def running_since(self) -> float | None:
        """When the call this rank is in started (microseconds), if the recorder holds it."""
        for call in reversed(self.calls):
            if call.get("state") == "running" and call.get("seq", -1) >= 0:
                return call.get("started")
        return None


def _rank_of(record: RankRecord) -> tuple[bool, float]:
    return record.source != "store summary", record.taken


def position(rank: int, d: dict[str, Any]) -> Position:
    return Position(rank, int(d["seq"]), int(d["state"]), int(d["kind"]),
                    int(d.get("peer", -1)), int(d.get("p2p", 0)), bool(d.get("responsive", 1)))


@dataclasses.dataclass
class Group:
    """One communicator: its ranks' records and what the store says of the others."""

    name: str
    size: int
    backend: str = "?"
    ranks: dict[int, RankRecord] = dataclasses.field(default_factory=dict)
    gone: dict[int, str] = dataclasses.field(default_factory=dict)  # rank -> died | closed

    def add(self, record: RankRecord) -> None:
        """Keep the best record of each rank: the latest, and a full one over a summary."""
        old = self.ranks.get(record.rank)
        if old is None or _rank_of(record) > _rank_of(old):
            self.ranks[record.rank] = record
        self.backend = record.backend


@dataclasses.dataclass
class Evidence:
    """Everything read: groups by name, the launcher's facts by rank, and where from."""

    groups: dict[str, Group] = dataclasses.field(default_factory=dict)
    facts: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    source: str = ""
    asked_at: float = 0.0  # microseconds since the epoch (live: when the doctor asked)
    unreadable: int = 0  # answers or summaries in the store that were not records

    def add(self, record: RankRecord) -> None:
        group = self.groups.get(record.group)
        if group is None:
            group = self.groups[record.group] = Group(record.group, record.size)
        group.add(record)

    def add_lines(self, lines: list[dict[str, Any]], source: str,
                  process: dict[str, Any] | None = None) -> None:
        """Records from dump lines: a ``process`` line, then ``group`` lines each followed by
        the ``call`` lines of that group."""
        head, calls = None, []
        for line in lines:
            kind = line.get("type")
            if kind == "process":
                process = line
            elif kind == "group":
                if head is not None:
                    self.add(RankRecord.from_lines(process or {}, head, calls, source))
                head, calls = line, []
            elif kind == "call" and head is not None:
                calls.append(line)
        if head is not None:
            self.add(RankRecord.from_lines(process or {}, head, calls, source))


# -- a directory of dump files ----------------------------------------------------------------
def read_dir(directory: str) -> Evidence:
    """The records in ``directory``'s ``rank-*.trace.jsonl`` files and its launcher facts."""
    if not os.path.isdir(directory):
        raise EvidenceError(f"{directory}: no such directory")
    paths = sorted(glob.glob(os.path.join(directory, "rank-*.trace.jsonl")))
    evidence = Evidence(source=directory)
    for path in paths:
        try:
            with open(path) as f:
                lines = [json.loads(line) for line in f if line.strip()]
            evidence.add_lines(lines, os.path.basename(path))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise EvidenceError(f"{path}: not a flight-recorder dump ({exc})") from None
    facts = os.path.join(directory, FACTS_FILE)
    if os.path.exists(facts):
        evidence.facts = read_facts(facts)
    if not evidence.groups:
        raise EvidenceError(f"{directory}: no flight-recorder dumps (rank-*.trace.jsonl) there")
    return evidence


def read_facts(path: str) -> dict[int, dict[str, Any]]:
    """A launcher's facts file: ``{"ranks": {"2": {"state": "stopped", ...}}}``."""
    try:
        with open(path) as f:
            data = json.load(f)
        return {int(r): dict(v) for r, v in data.get("ranks", {}).items()}
    except (OSError, ValueError, AttributeError, TypeError) as exc:
        raise EvidenceError(f"{path}: not a launcher facts file ({exc})") from None


# -- a live job, through its store ------------------------------------------------------------
def ask_store(store: Any, job: str, wait: float) -> Evidence:
    """Ask every rank of ``job`` in ``store`` (a TCPStore) for its record, wait up to ``wait``
    seconds for the answers (less when every rank has answered or is known gone), and add what
    the store knows of the rest."""
    root = f"gpucoll/jobs/{job}"
    counter, prefix = ask_keys(root)
    n = store.add(counter, 1)
    ask = f"{prefix}/{n}"
    evidence = Evidence(source=f"store, job {job!r}", asked_at=time.time() * 1e6)
    store.set(ask, str(time.time()))
    try:
        bodies = _collect_answers(store, ask, time.monotonic() + wait)
    finally:
        store.delete_prefix(f"{ask}/")
        store.delete_key(ask)
    for body in bodies:
        _add_body(evidence, body.get("lines", []), "answer", body)
    _read_slots(store, root, evidence)
    return evidence


def _body(value: bytes) -> dict[str, Any]:
    """An answer or summary from the store; {"unreadable": True} for bytes that are not one
    (anyone who can write to the store could have put them there)."""
    try:
        body = json.loads(value)
    except ValueError:
        body = None
    return body if isinstance(body, dict) else {"unreadable": True}


def _add_body(evidence: Evidence, lines: Any, source: str, body: dict[str, Any]) -> None:
    if body.get("unreadable"):
        evidence.unreadable += 1
        return
    try:
        evidence.add_lines(lines, source, body)
    except (KeyError, TypeError, ValueError, AttributeError):
        evidence.unreadable += 1


def _collect_answers(store: Any, ask: str, deadline: float) -> list[dict[str, Any]]:
    """The answers to ``ask`` once every rank of the groups they name has answered or is gone,
    or at ``deadline``."""
    bodies: dict[int, dict[str, Any]] = {}
    while True:
        raw = store.peek([f"{ask}/answers"])[0] or b"0"
        count = int(raw) if raw.isdigit() else 0
        missing = [i for i in range(1, count + 1) if i not in bodies]
        for i, value in zip(missing, store.peek([f"{ask}/answer/{i}" for i in missing]),
                            strict=True):
            if value is not None:
                bodies[i] = _body(value)
        if time.monotonic() >= deadline or (bodies and _all_accounted(store, bodies.values())):
            return list(bodies.values())
        try:
            store.wait([f"{ask}/answer/{count + 1}"],
                       timeout=max(min(0.2, deadline - time.monotonic()), 0.01))
        except GpucollError:
            pass


def _all_accounted(store: Any, bodies: Any) -> bool:
    """Every rank of every group named in the answers has answered or is gone."""
    answered: dict[str, set[int]] = {}
    sizes: dict[str, int] = {}
    for body in bodies:
        for line in body.get("lines", []):
            if line.get("type") == "group":
                answered.setdefault(line["group"], set()).add(int(line["rank"]))
                sizes[line["group"]] = int(line["size"])
    for group, size in sizes.items():
        rest = [r for r in range(size) if r not in answered[group]]
        if rest and any(v is None for v in store.peek([f"{group}/gone/{r}" for r in rest])):
            return False
    return True


def _read_slots(store: Any, root: str, evidence: Evidence) -> None:
    """The wills of every group seen, and the slots of the job with what failing ranks left:
    the slots found by looking from 0 until a run of empty ones."""
    slots = {g.name: g.size for g in evidence.groups.values()}
    start = 0
    while start < 1 << 12:
        sizes = store.peek([f"{root}/{n}/size" for n in range(start, start + _SCAN)])
        for n, size in enumerate(sizes, start):
            if size is not None and size.isdigit():
                slots.setdefault(f"{root}/{n}", int(size))
        if all(s is None for s in sizes):
            break
        start += _SCAN
    for name, size in slots.items():
        if name.count("/") == 3:  # a job's slot: summaries that failing ranks left there
            for value in store.peek([f"{name}/trace/{r}" for r in range(size)]):
                if value is not None:
                    body = _body(value)
                    for lines in body.get("groups", [None]):
                        _add_body(evidence, lines, "store summary", body)
        group = evidence.groups.get(name)
        if group is None and any(v is not None for v in store.peek([f"{name}/member/0"])):
            group = evidence.groups[name] = Group(name, size)
        if group is not None:
            gone = store.peek([f"{name}/gone/{r}" for r in range(size)])
            group.gone = {r: v.decode() for r, v in enumerate(gone) if v is not None}
    for group in evidence.groups.values():  # groups inside slots (splits), seen in records
        if not group.gone:
            gone = store.peek([f"{group.name}/gone/{r}" for r in range(group.size)])
            group.gone = {r: v.decode() for r, v in enumerate(gone) if v is not None}
