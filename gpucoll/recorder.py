"""The flight recorder: a communicator's last N calls, always on, at a fixed small cost per call.

Each call leaves a record in a ring of about ``capacity`` calls (``GPUCOLL_TRACE_SIZE``, default
2000; 0 keeps none): its sequence number, call, dtype, element count, root, reduce op, peer and
stream, and the times it was queued, started and ended, read from the monotonic clock once per
event. Recording formats nothing and looks nothing up. A call that runs now is one ``bytes``
object of nine int64 (one C call packs it), which the garbage collector never looks at: a ring
of thousands of tuples, renewed call after call, made it collect more often and each
collection slower, and cost more than the recording itself.
``records()`` turns the ring into dicts only when someone asks (a dump).

The ring is a deque of these items, appended by the thread that makes or runs the call:

  pack(seq, kind, dtype, count, root, op, peer, stream, started)   a call that runs now
      int                                            ... its end (negative: it failed)
  (seq, kind, dtype, count, root, op, started)      a lean call (NumPy all_reduce or
      int                                            broadcast), and its end
  ("Q", id, seq, ..., stream, queued)                an async call, issued
      ("S", id, started), ("E", id, ended)           ... when it runs
  ("P", seq, ..., stream, posted)                    a non-blocking send or receive

``seq`` is -1 for sends and receives; ``kind`` is the call's ``progress.KIND``; ``dtype`` the
NumPy type number; ``op`` an index into ``ReduceOp`` or -1. A lean call keeps the call's own
dtype and ReduceOp objects instead: cheaper to take, and that path makes too few objects for
the collector's work to matter (measured: the same with the collector off). A call that runs
now holds the communicator until its end, so nothing is appended between its two items.
Reading the ring (a dump) copies the deque in one C call, which no other thread can
interleave with.
"""

from __future__ import annotations

import collections
import os
import struct
import time
from typing import Any

from gpucoll.arrays import SUPPORTED_DTYPES, dtype_from_name
from gpucoll.ops import ReduceOp
from gpucoll.progress import kind_name

DEFAULT_SIZE = 2000
SIZE_VARIABLE = "GPUCOLL_TRACE_SIZE"
MAX_SIZE = 1 << 20

clock = time.monotonic_ns  # the one clock read per event
# a call that runs now: seq, call kind, dtype number, count, root, op code, peer, stream, started
pack = struct.Struct("<9q").pack
_UNPACK = struct.Struct("<9q").unpack
NO_CALL = (-1, 0, -1, -1, -1, -1, -1, 0)  # a signature: all of the above but the time
_OPS = tuple(ReduceOp)
OP_CODES = {op.value: i for i, op in enumerate(_OPS)}  # by value: a str hashes fast
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
        array (or None), ``fields`` its signature's ``root`` and ``op``."""
        op = fields.get("op")
        if op is not None:  # a ReduceOp, or its name (as some calls give it)
            op = OP_CODES.get(op if type(op) is str else op._value_, -1)
        root = fields.get("root", -1)
        self.current = (seq, kind, -1 if ref is None else ref.dtype.num,
                        -1 if ref is None else ref.count, root if type(root) is int else -1,
                        -1 if op is None else op, -1, 0)

    def point_to_point(self, kind: int, ref: Any, peer: int) -> None:
        """A send or receive with ``peer`` passed its checks."""
        self.current = (-1, kind, ref.dtype.num, ref.count, -1, -1, peer, 0)

    def on_stream(self, stream: int) -> None:
        """The current call runs on ``stream`` (a number, see ``stream_id``)."""
        self.current = self.current[:7] + (stream,)

    def issued(self) -> int:
        """The current call was queued to run later; the id its start and end name."""
        n = self._ids
        self._ids = n + 1
        self.keep(("Q", n) + self.current + (clock(),))
        return n

    def posted(self) -> None:
        """The current call, a non-blocking send or receive, was posted."""
        self.keep(("P",) + self.current + (clock(),))

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
            elif type(item) is bytes:
                fields = _UNPACK(item)
                running = [*fields[:8], 0, fields[8], 0]
                calls.append(running)
            elif type(item[0]) is int:  # a lean call: its dtype and op are objects
                seq, kind, dtype, count, root, op, started = item
                running = [seq, kind, dtype.num, count, root,
                           -1 if op is None else OP_CODES[op.value], -1, 0, 0, started, 0]
                calls.append(running)
            elif item[0] == "Q":
                issued[item[1]] = entry = [*item[2:10], item[10], 0, 0]
                calls.append(entry)
            elif item[0] == "P":
                calls.append([*item[1:9], -1, item[9], 0])
            elif item[1] in issued:
                issued[item[1]][9 if item[0] == "S" else 10] = item[2]
        return calls[-self.capacity:] if self.capacity else []

    def records(self) -> list[dict[str, Any]]:
        """The calls as dicts of names and wall-clock microseconds (see ``record``)."""
        return [record(e, self.wall_offset) for e in self.snapshot()]


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
