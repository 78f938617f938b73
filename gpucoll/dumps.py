"""Flight-recorder dumps: every rank's record written where a person, or ``gpucoll doctor``,
can read it, when a group fails or someone asks; and read back, as the doctor's evidence.

What starts a dump:
  - a communicator's first CollectiveTimeout, PeerFailure or CollectiveMismatch: the rank's
    file in ``GPUCOLL_TRACE_DIR`` (when set) and a summary in the store, in the slot of the
    group's job (``<slot>/trace/<rank>``), which outlives the rank;
  - SIGUSR1: the rank's file in ``GPUCOLL_TRACE_DIR`` (else a directory under the system's
    temporary one), and a line on stderr saying where;
  - a doctor asking through the store (``gpucoll doctor tcp://host:port``, which ``gpucoll
    run`` does when its ``--timeout`` passes): an answer in the store, and the file.

A file holds JSON lines: one ``process`` line, then per communicator a ``group`` line (rank,
size, where its progress record says it is, its first failure) and one ``call`` line per
recorded call, oldest first. Files are written whole under a temporary name and renamed, so
a reader never sees half of one.

Nothing a rank does here waits for a peer: a file is local, and store writes happen on a
background thread. The SIGUSR1 handler only puts a token on a queue, since it may run while the
main thread holds any lock (a store connection's, the ring's, stdout's).

Reading them back, for the doctor: every rank's record (``RankRecord``), grouped by
communicator (``Group``), as ``Evidence``. From a directory (``read_dir``): the
``rank-R.trace.jsonl`` files, and the ``launcher.json`` a launcher leaves beside them (what it
knows of its ranks' processes). From a live job's store (``ask_store``): the doctor asks every
rank (each process answers from a thread of its own, so a rank blocked in a call still answers;
a stopped one cannot), then reads what the store knows of the others: which ranks died or
closed (their wills), and the summaries that failing ranks left in their group's slot.

In this order: writing the files; the registry, the worker thread and SIGUSR1; answering the
doctor; reading them back.
"""

from __future__ import annotations

import atexit
import dataclasses
import glob
import json
import os
import queue
import signal
import socket
import sys
import tempfile
import threading
import time
import weakref
from typing import Any

from gpucoll.errors import (
    CollectiveMismatch,
    CollectiveTimeout,
    GpucollError,
    PeerFailure,
    StoreTimeout,
)
from gpucoll.progress import Position, Progress, Recorder

DIR_VARIABLE = "GPUCOLL_TRACE_DIR"
DUMPED = (CollectiveTimeout, PeerFailure, CollectiveMismatch)  # failures that end a group
SUMMARY_CALLS = 32  # calls of each group in a store summary
ANSWER_CALLS = 400  # ... and in an answer to the doctor
FLUSH_S = 1.0  # how long closing a communicator waits for its summary to reach the store
_ASK_SLICE = 30.0  # longest single wait of a listener in the store (server-side, costs nothing)
_CONNECT_S = 2.0  # how long a listener tries to open its connection to the store
_JOIN_S = 3.0  # how long the last communicator's close waits for the threads to end
FACTS_FILE = "launcher.json"  # what a launcher knows of its ranks, beside their dumps
_SCAN = 64  # slots looked at per round trip when looking for a job's groups in the store

_FLIGHTS: weakref.WeakSet = weakref.WeakSet()
_LOCK = threading.Lock()  # guards the registry below and the worker's start
_LISTENERS: dict[tuple, _Listener] = {}
_JOBS: queue.SimpleQueue = queue.SimpleQueue()  # for the worker; SIGUSR1 puts _SIGNALLED
_SIGNALLED = "SIGUSR1"
_worker: threading.Thread | None = None
_PENDING: set[threading.Event] = set()  # summaries on their way to the store


def trace_dir() -> str | None:
    """Where dumps go: ``GPUCOLL_TRACE_DIR``, or None when it is not set."""
    return os.environ.get(DIR_VARIABLE) or None


def file_name(rank: int) -> str:
    return f"rank-{rank}.trace.jsonl"


class Flight:
    """One communicator's flight recorder, with what a dump says about the group."""

    def __init__(self, recorder: Recorder, store: Any, rank: int, size: int, backend: Any):
        self.recorder = recorder
        self.base, self.group = namespace_of(store)
        self.rank, self.size = rank, size
        self.backend_name: str = getattr(backend, "name", "?")
        self._backend = backend
        self.family = rank  # whose file holds this group: the rank in the group it came from
        self.error: BaseException | None = None
        self.error_time = 0.0
        self.closed = False
        self._posted: threading.Event | None = None
        _register(self)

    # -- events ----------------------------------------------------------------------------
    def failed(self, exc: BaseException) -> None:
        """The communicator raised ``exc``; the first failure that ends the group dumps."""
        if self.error is not None or not isinstance(exc, DUMPED):
            return
        self.error, self.error_time = exc, time.time()
        directory = trace_dir()
        if directory is not None:
            write_files(directory, f"{type(exc).__name__} on rank {self.rank}")
        if self.base is not None and self.slot:
            done = self._posted = threading.Event()
            _PENDING.add(done)
            _post(lambda: self._publish(done))

    def close(self) -> None:
        """The communicator closed: wait (briefly) for its summary to reach the store, and
        stop answering the doctor for it."""
        self.closed = True
        if self._posted is not None:
            self._posted.wait(FLUSH_S)
        _unregister(self)

    # -- what a dump says ------------------------------------------------------------------
    @property
    def slot(self) -> str:
        """The store slot of the job's group this one came from (``gpucoll/jobs/<job>/<n>``),
        or "" for a namespace of another shape."""
        parts = self.group.split("/")
        return "/".join(parts[:4]) if len(parts) >= 4 and parts[:2] == ["gpucoll", "jobs"] \
            else ""

    def position(self) -> Position:
        return self._backend.progress.position(self.rank)

    def header(self) -> dict[str, Any]:
        """The group line of a dump: who, where its progress record says it is, its failure,
        and where it can see its same-host peers from their memory."""
        pos = self.position()
        head: dict[str, Any] = {
            "type": "group", "group": self.group, "rank": self.rank, "size": self.size,
            "family": self.family, "backend": self.backend_name, "closed": self.closed,
            "trace_size": self.recorder.capacity,
            "position": position_dict(pos), "where": pos.where(), "error": None,
            "peers": self._peers(),
        }
        if self.error is not None:
            err = self.error
            head["error"] = {"type": type(err).__name__, "message": str(err),
                             "peer": getattr(err, "peer", None),
                             "time": round(self.error_time * 1e6, 1)}
        return head

    def _peers(self) -> dict[str, dict[str, int]]:
        read = getattr(self._backend, "peer_progress", None)
        if read is None:
            return {}
        try:
            found = read()
        except Exception:  # noqa: BLE001 - a dump must never fail on this extra
            return {}
        return {str(j): position_dict(Progress.decode(j, data, False))
                for j, data in found.items()}

    def lines(self, calls: int | None = None) -> list[dict[str, Any]]:
        """The group line and its last ``calls`` call lines (all held, by default)."""
        records = self.recorder.records()
        if calls is not None:
            records = records[-calls:] if calls else []
        tag = {"type": "call", "group": self.group, "rank": self.rank}
        return [self.header()] + [{**tag, **r} for r in records]

    def _publish(self, done: threading.Event) -> None:
        """Leave this process's summary of the slot's groups in the store (worker thread)."""
        try:
            flights = [f for f in _flights() if f.base is self.base and f.slot == self.slot
                       and f.family == self.family]
            body = {**process_line("failure"), "groups": [f.lines(SUMMARY_CALLS)
                                                          for f in flights]}
            self.base.set(f"{self.slot}/trace/{self.family}", json.dumps(body))
        except (GpucollError, OSError, ValueError):
            pass  # the store is gone: the file, where there is one, still tells
        finally:
            done.set()
            _PENDING.discard(done)


def position_dict(p: Position) -> dict[str, int]:
    return {"seq": p.seq, "state": p.state, "kind": p.kind, "peer": p.peer, "p2p": p.p2p,
            "responsive": int(p.responsive)}


def process_line(reason: str) -> dict[str, Any]:
    return {"type": "process", "pid": os.getpid(), "host": socket.gethostname(),
            "reason": reason, "time": round(time.time() * 1e6, 1)}


def namespace_of(store: Any) -> tuple[Any, str]:
    """(the store client under ``store``'s prefixes, the whole prefix), e.g. (TCPStore,
    ``gpucoll/jobs/anonymous/3``); (None, "") for a store that is not one of ours."""
    prefixes = []
    for _ in range(32):
        if not (hasattr(store, "prefix") and hasattr(store, "store")):
            break
        prefixes.append(store.prefix)
        store = store.store
    if store is None or not hasattr(store, "port"):
        return None, "/".join(reversed(prefixes))
    return store, "/".join(reversed(prefixes))


# -- files ---------------------------------------------------------------------------------
def write_files(directory: str, reason: str) -> list[str]:
    """Write this process's dump, one file per rank it runs (``rank-R.trace.jsonl``), into
    ``directory``; the paths written. Never raises for a file it cannot write."""
    families: dict[int, list[Flight]] = {}
    for flight in _flights():
        families.setdefault(flight.family, []).append(flight)
    written = []
    for rank, flights in sorted(families.items()):
        lines = [{**process_line(reason), "rank": rank}]
        for flight in flights:
            lines += flight.lines()
        path = os.path.join(directory, file_name(rank))
        try:
            os.makedirs(directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".rank-{rank}.", dir=directory)
            with os.fdopen(fd, "w") as f:
                f.writelines(json.dumps(line) + "\n" for line in lines)
            os.replace(tmp, path)
            written.append(path)
        except OSError as exc:
            _say(f"gpucoll: rank {rank}: could not write its flight recorder to {path}: {exc}")
    return written


def default_dir() -> str:
    """Where SIGUSR1 dumps go when ``GPUCOLL_TRACE_DIR`` is not set."""
    return os.path.join(tempfile.gettempdir(), f"gpucoll-trace-{os.getuid()}")


def _say(text: str) -> None:
    try:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


# -- the registry, the worker thread and SIGUSR1 ---------------------------------------------
def _flights() -> list[Flight]:
    with _LOCK:
        return sorted(_FLIGHTS, key=lambda f: (f.family, f.group))


def _register(flight: Flight) -> None:
    with _LOCK:
        _FLIGHTS.add(flight)
        _start_worker()
        if flight.base is not None and flight.slot and hasattr(flight.base, "new_client"):
            key = _listener_key(flight)
            listener = _LISTENERS.get(key)
            if listener is None:
                _LISTENERS[key] = _Listener(flight.base, key[-1], flight)
            else:
                listener.flights.add(flight)
    _install_handler()


def _unregister(flight: Flight) -> None:
    """Forget ``flight``; the threads that served only it end before this returns (no thread
    outlives the communicators that needed it)."""
    global _worker
    ending: list[Any] = []
    with _LOCK:
        _FLIGHTS.discard(flight)
        key = _listener_key(flight) if flight.base is not None and flight.slot else None
        listener = _LISTENERS.get(key) if key is not None else None
        if listener is not None:
            listener.flights.discard(flight)
            if not listener.flights:
                del _LISTENERS[key]
                listener.stop()
                ending.append(listener)
        if not _FLIGHTS and _worker is not None:
            _JOBS.put(None)  # after any job still queued
            ending.append(_worker)
            _worker = None
    for thread in ending:
        thread.join(_JOIN_S)


def _listener_key(flight: Flight) -> tuple:
    root = "/".join(flight.slot.split("/")[:3])  # gpucoll/jobs/<job>
    return (id(flight.base), root)


def _start_worker() -> None:
    global _worker
    if _worker is None:
        _worker = threading.Thread(target=_work, args=(_JOBS,), daemon=True,
                                   name="gpucoll-dumps")
        _worker.start()


def _post(job: Any) -> None:
    _JOBS.put(job)


def _work(jobs: queue.SimpleQueue) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        try:
            if job is _SIGNALLED:
                _dump_on_signal()
            else:
                job()
        except Exception as exc:  # noqa: BLE001 - the worker must outlive one bad dump
            _say(f"gpucoll: a flight-recorder dump failed: {type(exc).__name__}: {exc}")


def _dump_on_signal() -> None:
    directory = trace_dir() or default_dir()
    for path in write_files(directory, "SIGUSR1"):
        _say(f"gpucoll: pid {os.getpid()}: flight recorder written to {path}")


def _on_signal(signum: int, frame: Any) -> None:
    _JOBS.put(_SIGNALLED)  # all a handler may safely do here: the worker writes the dump


def _install_handler() -> None:
    """Dump on SIGUSR1, unless the program handles that signal itself (or this is not the
    main thread, where Python cannot install handlers)."""
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None):
            signal.signal(signal.SIGUSR1, _on_signal)
    except (ValueError, OSError):
        pass


def _forked() -> None:
    """A forked child inherits none of its parent's communicators, threads or listeners."""
    global _worker, _JOBS, _LOCK
    _LOCK = threading.Lock()
    _FLIGHTS.clear()
    _LISTENERS.clear()
    _JOBS = queue.SimpleQueue()
    _worker = None
    _PENDING.clear()


os.register_at_fork(after_in_child=_forked)


@atexit.register
def _flush() -> None:
    """A process that ends without closing its communicators (an uncaught PeerFailure) still
    gives its summaries a moment to reach the store."""
    deadline = time.monotonic() + FLUSH_S
    for done in list(_PENDING):
        done.wait(max(deadline - time.monotonic(), 0.0))


# -- answering the doctor ------------------------------------------------------------------
def ask_keys(root: str) -> tuple[str, str]:
    """(the counter of asks, the prefix of ask n's key and answers) under a job's root."""
    return f"{root}/doctor/asks", f"{root}/doctor/ask"


class _Listener:
    """Waits in the store, on a connection of its own, for ``gpucoll doctor`` to ask, and
    answers for the communicators of this process in the job under ``root``."""

    def __init__(self, base: Any, root: str, first: Flight):
        self.base, self.root = base, root
        # ``first`` is in before the thread starts: the thread ends once the set is empty
        self.flights: weakref.WeakSet = weakref.WeakSet([first])
        self._stopped = threading.Event()
        self._client: Any = None
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="gpucoll-doctor-listener")
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def stop(self) -> None:
        self._stopped.set()
        client = self._client
        if client is not None:
            client.close()  # wakes the thread's wait

    def _run(self) -> None:
        try:
            client = self.base.new_client(timeout=_CONNECT_S)
        except (GpucollError, OSError, ValueError):
            return
        self._client = client
        try:
            if not self._stopped.is_set():
                self._serve(client)
        except (GpucollError, OSError, ValueError):
            pass  # the store went away: nobody can ask any more
        finally:
            client.close()

    def _serve(self, client: Any) -> None:
        """Answer each ask made from now on, and the one a doctor still waits on (its key is
        there until it has read the answers): this thread may start after the doctor asked."""
        counter, prefix = ask_keys(self.root)
        seen = int(client.peek([counter])[0] or 0)
        if seen and client.peek([f"{prefix}/{seen}"])[0] is not None:
            seen -= 1
        while not self._stopped.is_set() and len(self.flights):
            latest = int(client.peek([counter])[0] or 0)
            if latest > seen:
                seen = latest
                self._answer(client, f"{prefix}/{seen}")
                continue
            try:
                client.wait([f"{prefix}/{seen + 1}"], timeout=_ASK_SLICE)
            except StoreTimeout:
                continue

    def _answer(self, client: Any, ask: str) -> None:
        mine = [f for f in _flights() if f in self.flights]
        directory = trace_dir()
        if directory is not None:
            write_files(directory, "gpucoll doctor")
        for flight in mine:
            body = {**process_line("gpucoll doctor"), "lines": flight.lines(ANSWER_CALLS)}
            n = client.add(f"{ask}/answers", 1)
            client.set(f"{ask}/answer/{n}", json.dumps(body))


# -- reading them: the doctor's evidence, every rank's record grouped by communicator ---------
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
    # rank -> died | closed | aborted: <why>
    gone: dict[int, str] = dataclasses.field(default_factory=dict)

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
