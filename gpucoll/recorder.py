"""The flight recorder: a communicator's last N calls, always on, at a fixed small cost per call.

Each call gets one entry in a ring of ``capacity`` slots (``GPUCOLL_TRACE_SIZE``, default 2000;
0 keeps none): a short list made in one step -- sequence number, call, dtype, element count,
the signature's root and op, peer, stream -- and the times it was queued, started and ended,
read from the monotonic clock once per event. Recording formats and looks up nothing: the
call's name, its dtype and its signature's fields are the call's own objects, held by
reference, and ``records()`` turns entries into words only when someone asks (a dump). An
entry's end time is negative when the call failed.

Entries are written by the thread that makes or runs the call and may be read at any moment by
another thread (a dump): every field is one list item, so a reader sees each whole or not yet.
"""

from __future__ import annotations

import collections
import os
import time
from typing import Any

DEFAULT_SIZE = 2000
SIZE_VARIABLE = "GPUCOLL_TRACE_SIZE"
MAX_SIZE = 1 << 20

# fields of an entry: the call's own objects (its name, a dtype, a ReduceOp) are kept by
# reference, which costs nothing; they become words only in ``record``
SEQ, CALL, DTYPE, COUNT, ROOT, OP, PEER, STREAM, QUEUED, STARTED, ENDED = range(11)

clock = time.monotonic_ns  # the one clock read per event


def size_from_env(environ: Any = None) -> int:
    """``GPUCOLL_TRACE_SIZE`` as a number of entries; ValueError naming the variable if bad."""
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
    """The last ``capacity`` calls of one communicator (none kept when ``capacity`` is 0)."""

    __slots__ = ("capacity", "entries", "keep", "_keep", "current", "wall_offset")

    def __init__(self, capacity: int = DEFAULT_SIZE):
        self.capacity = capacity
        # a deque drops the oldest item itself; copying it (a dump) is one C call, which no
        # other thread can interleave with. A lean call takes two items (see ``keep``).
        self.entries: collections.deque = collections.deque(maxlen=2 * capacity)
        # the lean path's record, the cheapest there is: ``keep((seq, call, dtype, count,
        # root, op, started))`` as the call starts, then ``keep(ended)`` (an int, negative
        # when it failed); nothing else is kept between the two, since the call holds the
        # communicator (entries of async calls are made before and filled in place)
        self.keep = self._keep = self.entries.append
        self.current: list = _blank()  # the latest call's entry (a scratch one when off)
        # monotonic -> wall clock, so that the ranks' records line up on one time axis
        self.wall_offset = time.time_ns() - clock()

    def collective(self, seq: int, call: str, ref: Any, fields: dict[str, Any]) -> None:
        """Collective ``seq``, a ``call`` (its name), passed its checks: make its entry.
        ``ref``: its array (or None); ``fields``: its signature's ``root`` and ``op``."""
        if ref is None:
            entry = [seq, call, None, -1, fields.get("root", -1), fields.get("op"), -1, 0, 0, 0,
                     0]
        else:
            entry = [seq, call, ref.dtype, ref.count, fields.get("root", -1), fields.get("op"),
                     -1, 0, 0, 0, 0]
        self._keep(entry)
        self.current = entry

    def point_to_point(self, call: str, ref: Any, peer: int) -> None:
        """A send or receive with ``peer`` passed its checks: make its entry."""
        entry = [-1, call, ref.dtype, ref.count, -1, None, peer, 0, 0, 0, 0]
        self._keep(entry)
        self.current = entry

    def snapshot(self) -> list[list]:
        """Copies of the last ``capacity`` entries held now, oldest first (a lean call's two
        items become one entry)."""
        items = list(self.entries)
        out = []
        for i, item in enumerate(items):
            if type(item) is tuple:  # a lean call; its end follows unless it is running
                seq, call, dtype, count, root, op, started = item
                after = items[i + 1] if i + 1 < len(items) else None
                ended = after if type(after) is int else 0
                out.append([seq, call, dtype, count, root, op, -1, 0, 0, started, ended])
            elif type(item) is list:
                out.append(list(item))
        return out[-self.capacity:] if self.capacity else []

    def records(self) -> list[dict[str, Any]]:
        """The entries as dicts of names and wall-clock microseconds (see ``record``)."""
        return [record(e, self.wall_offset) for e in self.snapshot()]


def _blank() -> list:
    return [-1, "", None, -1, -1, None, -1, 0, 0, 0, 0]


def record(entry: list, wall_offset: int) -> dict[str, Any]:
    """One entry in words: call, seq (-1 for sends and receives), dtype, count, root, op,
    peer, stream, the times queued/started/ended in microseconds since the epoch (None: not
    yet), and its state: ``issued`` (queued, not started), ``posted`` (a non-blocking send or
    receive, whose end the recorder does not see), ``running``, ``done`` or ``failed``."""
    queued, started, ended = entry[QUEUED], entry[STARTED], entry[ENDED]
    name = entry[CALL]
    if not started:
        state = "posted" if name in ("send", "recv") and queued else "issued"
    else:
        state = "running" if not ended else "done" if ended > 0 else "failed"
    out: dict[str, Any] = {"call": name, "seq": entry[SEQ]}
    dtype, root, op = entry[DTYPE], entry[ROOT], entry[OP]
    if dtype is not None:
        out["dtype"] = getattr(dtype, "name", str(dtype))
    if entry[COUNT] >= 0:
        out["count"] = entry[COUNT]
    if isinstance(root, int) and root >= 0:
        out["root"] = root
    if op is not None:
        out["op"] = getattr(op, "value", str(op))
    if entry[PEER] >= 0:
        out["peer"] = entry[PEER]
    if entry[STREAM]:
        out["stream"] = entry[STREAM]
    out["queued"] = _us(queued or started, wall_offset)
    out["started"] = _us(started, wall_offset)
    out["ended"] = _us(abs(ended), wall_offset)
    out["state"] = state
    return out


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
