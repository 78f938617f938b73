"""Flight-recorder dumps: every rank's record written where a person, or ``gpucoll doctor``,
can read it, when a group fails or someone asks.

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

Nothing here waits for a peer: a file is local, and store writes happen on a background
thread. The SIGUSR1 handler only puts a token on a queue, since it may run while the main
thread holds any lock (a store connection's, the ring's, stdout's).
"""

from __future__ import annotations

import atexit
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
from gpucoll.progress import Position, Progress
from gpucoll.recorder import Recorder

DIR_VARIABLE = "GPUCOLL_TRACE_DIR"
DUMPED = (CollectiveTimeout, PeerFailure, CollectiveMismatch)  # failures that end a group
SUMMARY_CALLS = 32  # calls of each group in a store summary
ANSWER_CALLS = 400  # ... and in an answer to the doctor
FLUSH_S = 1.0  # how long closing a communicator waits for its summary to reach the store
_ASK_SLICE = 30.0  # longest single wait of a listener in the store (server-side, costs nothing)
_CONNECT_S = 2.0  # how long a listener tries to open its connection to the store
_JOIN_S = 3.0  # how long the last communicator's close waits for the threads to end

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
                listener = _LISTENERS[key] = _Listener(flight.base, key[-1])
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

    def __init__(self, base: Any, root: str):
        self.base, self.root = base, root
        self.flights: weakref.WeakSet = weakref.WeakSet()
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
