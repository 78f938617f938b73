"""Where a rank is in its communicator's sequence of calls, kept where its peers can read it.

Every collective has a sequence number, the same on every rank: the n-th collective a
communicator makes. A rank records the call it enters and when it leaves it in a handful of
int64 slots. The ring backend puts those slots in shared memory that the ranks on its host map,
so a peer can read them even while the rank is stopped; peers on other hosts ask for them over
the control connection. When a call times out, every rank can then say which rank is behind
and where ("rank 2 is stuck before all_reduce #17; ranks 0, 1, 3 reached #18").

Call kinds are small integers (``KINDS``), also used in the ring's frame headers.

Two neighbours of that record live here too. The flight recorder keeps a communicator's last N
calls, always on, at a fixed small cost per call, for the dumps that ``gpucoll doctor`` reads.
``Waiting`` makes every long wait say what it waits for, in one format everywhere.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from gpucoll.arrays import SUPPORTED_DTYPES, dtype_from_name
from gpucoll.ops import ReduceOp

# kind code -> call name; the index is what frames and progress slots carry
KINDS = (
    "", "all_reduce", "broadcast", "reduce", "all_gather", "gather", "scatter",
    "reduce_scatter", "all_to_all", "barrier", "send", "recv", "split", "scatter header",
    "all_gather_v", "gather_v", "scatter_v", "all_to_all_v", "reduce_scatter_v",
    "all_reduce_many", "broadcast_object", "all_gather_object", "gather_object",
    "scatter_object", "new_group", "monitored_barrier", "all_reduce_object", "reduce_object",
)
KIND = {name: code for code, name in enumerate(KINDS)}

SEQ, STATE, KIND_SLOT, PEER, P2P = range(5)
SLOTS = 8  # int64 slots of one record (room to grow)
IDLE, IN_CALL, DONE, FAILED = 0, 1, 2, 3  # STATE values


def kind_name(code: int) -> str:
    return KINDS[code] if 0 <= code < len(KINDS) else f"call kind {code}"


@dataclasses.dataclass(frozen=True)
class Position:
    """A snapshot of one rank's progress: its latest collective and what it does now."""

    rank: int
    seq: int  # latest collective entered (-1: none yet)
    state: int  # IN_CALL, DONE or FAILED for ``seq``; IDLE before the first call
    kind: int
    peer: int = -1  # a point-to-point call in progress: its peer, else -1
    p2p: int = 0  # ... and its kind (send/recv), else 0
    responsive: bool = True  # False: read from memory while the rank did not answer

    @property
    def order(self) -> int:
        """Sorts positions: inside call n < after call n < inside call n + 1."""
        return 2 * self.seq + (1 if self.state == IN_CALL else 2)

    def where(self) -> str:
        """``in all_reduce #17``, ``before call #18 (after all_reduce #17)``, ``in
        all_reduce #17 (failed)``, or ``before its first collective``."""
        if self.seq < 0:
            text = "before its first collective"
        elif self.state == IN_CALL:
            text = f"in {kind_name(self.kind)} #{self.seq}"
        elif self.state == FAILED:
            text = f"in {kind_name(self.kind)} #{self.seq} (failed)"
        else:
            text = f"before call #{self.seq + 1} (after {kind_name(self.kind)} #{self.seq})"
        if self.p2p:
            text += f", in {kind_name(self.p2p)} {'to' if KINDS[self.p2p] == 'send' else 'from'}"
            text += f" rank {self.peer}"
        return text


class Progress:
    """One rank's progress slots; ``buf`` (a writable buffer of SLOTS int64) may be shared."""

    def __init__(self, buf=None):
        if buf is None:
            buf = bytearray(8 * SLOTS)
        self._slots = memoryview(buf).cast("B")[:8 * SLOTS].cast("q")
        self._slots[SEQ] = -1

    def detach(self) -> None:
        """Keep the record in private memory from now on, releasing the shared buffer."""
        private = memoryview(bytearray(self._slots.tobytes())).cast("q")
        self._slots.release()
        self._slots = private

    @property
    def seq(self) -> int:
        return self._slots[SEQ]

    @property
    def kind(self) -> int:
        return self._slots[KIND_SLOT]

    @property
    def state(self) -> int:
        return self._slots[STATE]

    def enter(self, seq: int, kind: int) -> None:
        """This rank starts collective ``seq`` of kind ``kind``."""
        s = self._slots
        s[STATE] = IN_CALL
        s[KIND_SLOT] = kind
        s[SEQ] = seq

    def leave(self, ok: bool = True) -> None:
        """The current collective finished (or failed)."""
        self._slots[STATE] = DONE if ok else FAILED

    def p2p(self, kind: int, peer: int) -> None:
        """A point-to-point call with ``peer`` starts (kind > 0) or ends (kind 0)."""
        s = self._slots
        s[PEER] = peer
        s[P2P] = kind

    def position(self, rank: int, responsive: bool = True) -> Position:
        s = self._slots.tolist()
        return Position(rank, s[SEQ], s[STATE], s[KIND_SLOT], s[PEER], s[P2P], responsive)

    def encode(self) -> bytes:
        return self._slots.tobytes()

    @staticmethod
    def decode(rank: int, data: bytes, responsive: bool = True) -> Position:
        s = memoryview(data).cast("q").tolist()
        return Position(rank, s[SEQ], s[STATE], s[KIND_SLOT], s[PEER], s[P2P], responsive)


def diagnose(positions: dict[int, Position], silent: list[int]) -> str:
    """One line naming the ranks that are behind and where, from every rank's ``Position``.

    ``silent`` ranks neither answered nor could be read: they are named as unreachable.
    """
    groups: dict[tuple[int, str], list[int]] = {}
    for r, p in sorted(positions.items()):
        note = "" if p.responsive else " and does not respond (stopped?)"
        groups.setdefault((p.order, p.where() + note), []).append(r)
    ordered = sorted(groups.items())
    parts = []
    for i, ((_, where), ranks) in enumerate(ordered):
        verb = "is" if len(ranks) == 1 else "are"
        if i == 0 and ordered[0][0][0] < ordered[-1][0][0]:
            verb += " behind,"
        parts.append(f"{ranks_text(ranks)} {verb} {where}")
    if silent:
        parts.append(f"{ranks_text(silent)} did not answer and could not be read")
    return "; ".join(parts) or "no rank's progress could be read"


def ranks_text(ranks: list[int]) -> str:
    """"rank 2" or "ranks 0, 1, 3": how every message names a set of ranks."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


# -- the flight recorder ---------------------------------------------------------------------------
# A communicator's last N calls, always on, at a fixed small cost per call.
#
# Each call leaves a record in a ring of about ``capacity`` calls (``GPUCOLL_TRACE_SIZE``, default
# 2000; 0 keeps none): its sequence number, call, dtype, element count, root, reduce op, peer and
# stream, and the times it was queued, started and ended, read from the monotonic clock once per
# event. Recording converts, formats and looks up nothing: it keeps the objects the call already
# holds (its dtype, its signature's fields) in a tuple, and ``records()`` turns them into numbers
# and names only when someone asks (a dump). An item never holds an array, so the recorder keeps
# no memory of the caller's alive.
#
# A call's head, made after its checks and kept in ``current`` until the call is issued::
#
#   (seq, kind, dtype, count, fields, peer, stream)
#
# ``seq`` is -1 for sends and receives; ``kind`` is the call's ``KIND``; ``dtype`` the
# array's NumPy dtype (None: no array); ``fields`` the signature's dict (its ``root`` and ``op``
# are read from it), None for a send or receive; ``peer`` -1 for a collective; ``stream`` 0 for the
# default stream. The ring is a deque of these items, appended by the thread that makes or runs
# the call:
#
#   (head, started)                                    a call that runs now
#       int                                            ... its end (negative: it failed)
#   (seq, kind, dtype, count, root, op, started)      a lean call (NumPy all_reduce or
#       int                                            broadcast), and its end
#   ("Q", id, head, queued)                            an async call, issued
#       ("S", id, started), ("E", id, ended)           ... when it runs
#   ("P", head, posted)                                a non-blocking send or receive
#
# A call that runs now holds the communicator until its end, so nothing is appended between its
# two items. Reading the ring (a dump) copies the deque in one C call, which no other thread can
# interleave with. (Packing each record into int64s as it is made, so that the garbage collector
# never watches it, cost three times as much per call as these tuples cost the collector.)

DEFAULT_SIZE = 2000
SIZE_VARIABLE = "GPUCOLL_TRACE_SIZE"
MAX_SIZE = 1 << 20

clock = time.monotonic_ns  # the one clock read per event
NO_CALL = (-1, 0, None, -1, None, -1, 0)  # a head: seq, kind, dtype, count, fields, peer, stream
_OPS = tuple(ReduceOp)
OP_CODES = {op.value: i for i, op in enumerate(_OPS)}
_DTYPE_NAMES: dict[int, str] = {}


def size_from_env(environ: Any = None) -> int:
    """``GPUCOLL_TRACE_SIZE`` as a number of calls; ValueError naming the variable if bad."""
    raw = (os.environ if environ is None else environ).get(SIZE_VARIABLE, "")
    if raw.strip() == "":
        return DEFAULT_SIZE
    try:
        size = int(raw)
    except ValueError:
        size = -1
    if not 0 <= size <= MAX_SIZE:
        raise ValueError(f"{SIZE_VARIABLE}={raw!r}: expected a number of calls from 0 (off) to "
                         f"{MAX_SIZE}")
    return size


class Recorder:
    """The last ``capacity`` calls of one communicator (none kept when ``capacity`` is 0).

    The communicator appends a call's items with ``keep`` itself (a bound ``deque.append``,
    the cheapest way there is), from the signature that ``signature``/``point_to_point`` left
    in ``current``."""

    __slots__ = ("capacity", "entries", "keep", "current", "wall_offset", "_ids")

    def __init__(self, capacity: int = DEFAULT_SIZE):
        self.capacity = capacity
        self.entries: collections.deque = collections.deque(maxlen=2 * capacity)
        self.keep = self.entries.append
        self.current: tuple = NO_CALL  # the signature of the call being made
        self._ids = 0
        # monotonic -> wall clock, so that the ranks' records line up on one time axis
        self.wall_offset = time.time_ns() - clock()

    def signature(self, seq: int, kind: int, ref: Any, fields: dict[str, Any]) -> None:
        """Collective ``seq`` of ``kind`` (``progress.KIND``) passed its checks: ``ref`` is its
        array (or None), ``fields`` its signature's fields (``root``, ``op``, ...)."""
        self.current = (seq, kind, None, -1, fields, -1, 0) if ref is None else \
            (seq, kind, ref.dtype, ref.count, fields, -1, 0)

    def point_to_point(self, kind: int, ref: Any, peer: int) -> None:
        """A send or receive with ``peer`` passed its checks."""
        self.current = (-1, kind, ref.dtype, ref.count, None, peer, 0)

    def on_stream(self, stream: int) -> None:
        """The current call runs on ``stream`` (a number, see ``stream_id``)."""
        self.current = self.current[:6] + (stream,)

    def issued(self) -> int:
        """The current call was queued to run later; the id its start and end name."""
        n = self._ids
        self._ids = n + 1
        self.keep(("Q", n, self.current, clock()))
        return n

    def posted(self) -> None:
        """The current call, a non-blocking send or receive, was posted."""
        self.keep(("P", self.current, clock()))

    def snapshot(self) -> list[list]:
        """The last ``capacity`` calls held now, oldest first, each as ``[seq, call, dtype,
        count, root, op, peer, stream, queued, started, ended]`` (times 0 when not yet; ended
        negative when the call failed; queued -1 for a posted send or receive)."""
        calls: list[list] = []
        issued: dict[int, list] = {}
        running: list | None = None  # a call that runs now, until its end comes
        for item in list(self.entries):
            if type(item) is int:
                if running is not None:
                    running[10], running = item, None
            elif type(item[0]) is tuple:
                running = [*_numbers(item[0]), 0, item[1], 0]
                calls.append(running)
            elif type(item[0]) is int:  # a lean call
                seq, kind, dtype, count, root, op, started = item
                running = [seq, kind, dtype.num, count, root, _op_code(op), -1, 0, 0, started, 0]
                calls.append(running)
            elif item[0] == "Q":
                issued[item[1]] = entry = [*_numbers(item[2]), item[3], 0, 0]
                calls.append(entry)
            elif item[0] == "P":
                calls.append([*_numbers(item[1]), -1, item[2], 0])
            elif item[1] in issued:
                issued[item[1]][9 if item[0] == "S" else 10] = item[2]
        return calls[-self.capacity:] if self.capacity else []

    def records(self) -> list[dict[str, Any]]:
        """The calls as dicts of names and wall-clock microseconds (see ``record``)."""
        return [record(e, self.wall_offset) for e in self.snapshot()]


def _numbers(head: tuple) -> list[int]:
    """A head as numbers: seq, kind, dtype number, count, root, op code, peer, stream (-1 for
    what the call has not)."""
    seq, kind, dtype, count, fields, peer, stream = head
    root, op = -1, -1
    if fields:
        root = fields.get("root", -1)
        root = root if type(root) is int else -1
        op = _op_code(fields.get("op"))
    return [seq, kind, -1 if dtype is None else dtype.num, count, root, op, peer, stream]


def _op_code(op: Any) -> int:
    """The index in ``ReduceOp`` of ``op`` (a ReduceOp or its name); -1 for None or for
    anything else (the ops of a fused call that differ by dtype)."""
    if isinstance(op, ReduceOp):
        op = op.value  # an Enum hashes by its name, not its value
    return OP_CODES.get(op, -1) if isinstance(op, str) else -1


def record(entry: list, wall_offset: int) -> dict[str, Any]:
    """One call in words: call, seq (-1 for sends and receives), dtype, count, root, op, peer,
    stream, the times queued/started/ended in microseconds since the epoch (None: not yet), and
    its state: ``issued`` (queued, not started), ``posted`` (a non-blocking send or receive,
    whose end the recorder does not see), ``running``, ``done`` or ``failed``."""
    seq, kind, dtype, count, root, op, peer, stream, queued, started, ended = entry
    call = kind_name(kind)
    if queued == -1:
        state, queued, started = "posted", started, 0
    elif not started:
        state = "issued"
    else:
        state = "running" if not ended else "done" if ended > 0 else "failed"
    out: dict[str, Any] = {"call": call, "seq": seq}
    if dtype >= 0:
        out["dtype"] = dtype_name(dtype)
    if count >= 0:
        out["count"] = count
    if root >= 0:
        out["root"] = root
    if op >= 0:
        out["op"] = _OPS[op].value
    if peer >= 0:
        out["peer"] = peer
    if stream:
        out["stream"] = stream
    out["queued"] = _us(queued or started, wall_offset)
    out["started"] = _us(started, wall_offset)
    out["ended"] = _us(abs(ended), wall_offset)
    out["state"] = state
    return out


def dtype_name(num: int) -> str:
    """The name of the supported dtype whose NumPy type number is ``num``."""
    if not _DTYPE_NAMES:
        for name in SUPPORTED_DTYPES:
            try:
                _DTYPE_NAMES[dtype_from_name(name).num] = name
            except (TypeError, ValueError, ImportError):
                pass
    return _DTYPE_NAMES.get(num, f"dtype #{num}")


def _us(t: int, wall_offset: int) -> float | None:
    return round((t + wall_offset) / 1000, 1) if t else None


def stream_id(stream: Any) -> int:
    """A number for a stream argument (CuPy's ``ptr``, an int handle), 0 for the default."""
    if stream is None:
        return 0
    if isinstance(stream, int):
        return stream
    ptr = getattr(stream, "ptr", None)
    return ptr if isinstance(ptr, int) else -1


# -- long waits say what they wait for -------------------------------------------------------------
# No wait is silent. A wait that lasts longer than ``GPUCOLL_WAIT_LOG`` seconds (default 10) --
# start-up, a store wait, a collective on the host ring or on NCCL -- prints one line on stderr,
# and another every interval while it lasts, naming the call, this rank, how long it has waited
# and whom for::
#
#     gpucoll: start-up on rank 0 of 2: still waiting after 10 s for rank 1 (gives up at 300 s)
#
# ``GPUCOLL_WAIT_LOG=0`` silences the lines; a smaller number shortens the interval. Every wait
# goes through one ``Waiting`` (``tick`` when it has not ended yet), so the rule and the format are
# the same everywhere.

WAIT_ENV = "GPUCOLL_WAIT_LOG"
DEFAULT_INTERVAL = 10.0


def interval(environ: dict[str, str] | None = None) -> float | None:
    """Seconds between lines about a long wait, from ``GPUCOLL_WAIT_LOG``; None: silenced.
    ValueError for a value that is not a number of seconds >= 0."""
    raw = (os.environ if environ is None else environ).get(WAIT_ENV, "").strip()
    if not raw:
        return DEFAULT_INTERVAL
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not seconds >= 0 or math.isinf(seconds):
        raise ValueError(f"{WAIT_ENV}={raw!r}: expected the seconds between lines about a long "
                         f"wait (a number >= 0; 0 silences them)")
    return seconds or None


def _interval_or_default() -> float | None:
    try:
        return interval()
    except ValueError:  # gpucoll.init reports a bad value; a wait never fails over it
        return DEFAULT_INTERVAL


class Waiting:
    """The lines about one wait: ``what`` (e.g. ``all_reduce on rank 0 of 4``) waited since
    ``start`` (time.monotonic), giving up after ``timeout`` seconds (None: not said)."""

    __slots__ = ("what", "start", "timeout", "every", "due")

    def __init__(self, what: str, timeout: float | None = None, start: float | None = None,
                 every: float | None | bool = True):
        self.what, self.timeout = what, timeout
        self.every = _interval_or_default() if every is True else every
        self.restart(time.monotonic() if start is None else start)

    def restart(self, start: float) -> None:
        """The wait (begun again) started at ``start``: the first line comes an interval later."""
        self.start = start
        self.due = start + self.every if self.every else math.inf

    def until_due(self, now: float) -> float:
        """Seconds until the next line is due (inf when silenced): the longest slice a waiter
        may block for before it should ``tick`` again."""
        return max(self.due - now, 0.0)

    def tick(self, detail: Callable[[], str], now: float | None = None) -> bool:
        """Print the line if one is due; ``detail()`` says whom the wait is for (called only
        then). True if a line was printed."""
        now = time.monotonic() if now is None else now
        if now < self.due:
            return False
        self.due = now + self.every
        limit = "" if self.timeout is None else f" (gives up at {_seconds(self.timeout)} s)"
        try:
            text = detail()
        except Exception as exc:  # noqa: BLE001 - the line must not break the wait
            text = f"(could not tell whom: {exc})"
        try:
            sys.stderr.write(f"gpucoll: {self.what}: still waiting after "
                             f"{_seconds(now - self.start)} s {text}{limit}\n")
            sys.stderr.flush()
        except (OSError, ValueError, AttributeError):  # stderr closed or gone
            pass
        return True


def _seconds(s: float) -> str:
    """``12`` for long spans, ``0.4`` for the short intervals tests use."""
    return f"{s:.0f}" if s >= 10 else f"{s:.1f}".removesuffix(".0")
