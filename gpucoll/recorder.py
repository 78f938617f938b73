"""The flight recorder: a communicator's last N calls, always on, at a fixed small cost per call.

Each call leaves a record in a ring of about ``capacity`` calls (``GPUCOLL_TRACE_SIZE``, default
2000; 0 keeps none): its sequence number, call, dtype, element count, root, reduce op, peer and
stream, and the times it was queued, started and ended, read from the monotonic clock once per
event. Recording converts, formats and looks up nothing: it keeps the objects the call already
holds (its dtype, its signature's fields) in a tuple, and ``records()`` turns them into numbers
and names only when someone asks (a dump). An item never holds an array, so the recorder keeps
no memory of the caller's alive.

A call's head, made after its checks and kept in ``current`` until the call is issued::

  (seq, kind, dtype, count, fields, peer, stream)

``seq`` is -1 for sends and receives; ``kind`` is the call's ``progress.KIND``; ``dtype`` the
array's NumPy dtype (None: no array); ``fields`` the signature's dict (its ``root`` and ``op``
are read from it), None for a send or receive; ``peer`` -1 for a collective; ``stream`` 0 for the
default stream. The ring is a deque of these items, appended by the thread that makes or runs
the call:

  (head, started)                                    a call that runs now
      int                                            ... its end (negative: it failed)
  (seq, kind, dtype, count, root, op, started)      a lean call (NumPy all_reduce or
      int                                            broadcast), and its end
  ("Q", id, head, queued)                            an async call, issued
      ("S", id, started), ("E", id, ended)           ... when it runs
  ("P", head, posted)                                a non-blocking send or receive

A call that runs now holds the communicator until its end, so nothing is appended between its
two items. Reading the ring (a dump) copies the deque in one C call, which no other thread can
interleave with. (Packing each record into int64s as it is made, so that the garbage collector
never watches it, cost three times as much per call as these tuples cost the collector.)
"""

from __future__ import annotations

import collections
import os
import time
from typing import Any

from gpucoll.arrays import SUPPORTED_DTYPES, dtype_from_name
from gpucoll.ops import ReduceOp
from gpucoll.progress import kind_name

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
