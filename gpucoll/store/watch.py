"""Parked requests: a get/multi_get/wait waits in the server until its keys exist.

Requests naming the same key list share one ``Watch`` (every rank waiting for every rank's
address is the common case), so the server passes over those keys once, not once per rank.
"""

from __future__ import annotations

import struct
from typing import Any

from gpucoll.store.protocol import Frame, FrameError, Op


class Watch:
    """One list of keys that parked requests wait for, shared by every request naming the
    same list (ranks of a job all wait for the same keys: one scan serves them all)."""

    __slots__ = ("ident", "keys", "pos", "members", "live")

    def __init__(self, ident: bytes, keys: list[bytes]):
        self.ident, self.keys = ident, keys
        self.pos = 0  # keys[:pos] were all present when last looked at
        self.members: list[Waiter] = []
        self.live = 0  # members still waiting; 0 makes the watch stale


class Waiter:
    """A parked get/multi_get/wait request, answered when its watch completes or expires."""

    __slots__ = ("conn", "rid", "op", "watch", "deadline", "done")

    def __init__(self, conn: Any, rid: int, op: int, watch: Watch, deadline: float):
        self.conn, self.rid, self.op, self.watch = conn, rid, op, watch
        self.deadline = deadline
        self.done = False


PARKED = frozenset((Op.GET, Op.MULTI_GET, Op.WAIT))


def park_request(frame: Frame) -> tuple[bytes, float]:
    """The identity of a parked request's key list (its bytes, without the timeout) and its
    timeout; FrameError if the frame is not ``timeout, key...``."""
    payload, argc = frame.payload, frame.argc
    table = 4 * argc
    if argc < 2 or (frame.code == Op.GET and argc != 2) or table > len(payload):
        raise FrameError("a blocking request needs a timeout and its keys", frame.rid,
                         fatal=False)
    lengths = struct.unpack_from(f"<{argc}I", payload)
    if lengths[0] != 8 or table + sum(lengths) != len(payload):
        raise FrameError("malformed blocking request", frame.rid, fatal=False)
    timeout = struct.unpack_from("<d", payload, table)[0]
    if not 0.0 <= timeout <= 1e9:  # also refuses NaN
        raise FrameError(f"timeout {timeout!r} is not a number of seconds", frame.rid,
                         fatal=False)
    # get, multi_get and wait of the same keys share one watch; only the replies differ
    return bytes(payload[4:table]) + bytes(payload[table + 8:]), timeout
