"""The store's wire format: length-prefixed frames, and the readers that cut them from a socket
(``FrameReader`` on the server's non-blocking sockets, ``ReplyReader`` on a client's blocking one).

A frame is a 13-byte header ``<IBII`` (payload bytes, op or status code, request id, argument
count) followed by the payload: ``argc`` little-endian u32 lengths, then the arguments' bytes
back to back. Requests and replies use the same framing, so one reader serves both ends.
Request id 0 asks for no reply on success (``set`` is fire-and-forget, as in torch's store);
replies carry the id of their request, so several threads can share one connection.
"""

from __future__ import annotations

import enum
import itertools
import mmap
import socket
import struct
from collections.abc import Callable, Sequence
from typing import NamedTuple

from gpucoll.errors import FrameError

VERSION = b"gpucoll-store/1"
HEADER = struct.Struct("<IBII")
HEADER_SIZE = HEADER.size
_HEADER2 = struct.Struct("<IBIIII")  # header and the lengths of two arguments
_HEADER1 = struct.Struct("<IBIII")  # header and the length of one argument
_U32 = struct.Struct("<I")
_U32X2 = struct.Struct("<II")
NO_REPLY = 0
MAX_PAYLOAD = 0xFFFFFFFF  # the header's length field is 32 bits
DEFAULT_MAX_VALUE_BYTES = 256 << 20
# room for keys and lengths beside the largest value in one frame
FRAME_SLACK = 1 << 20
RECV_CHUNK = 64 << 10  # recv(n) allocates n bytes first: larger costs more than it saves
# payloads larger than one receive go straight into a buffer of their own: no regrowing
_BIG_PAYLOAD = RECV_CHUNK
# arguments joined into one buffer below this total; above it they are sent as a list
_JOIN_BELOW = 256 << 10
# arguments at least this large are not copied out of a large frame's buffer (server side)
BIG_ARG = 64 << 10
# at most this many buffers per sendmsg (Linux refuses more than IOV_MAX = 1024)
MAX_IOV = 512
# one readable event reads at most this much of a large frame: other clients get their turn
_FILL_PER_EVENT = 16 << 20
# a silent peer (host gone, network cut) is found within about idle + interval * count seconds
KEEPALIVE = (10, 5, 3)
_USER_TIMEOUT_MS = 30_000  # data unacknowledged this long breaks the connection
# frames this large are received into anonymous memory of their own rather than a bytearray:
# malloc maps such sizes fresh anyway, and a bytearray would also zero every page first
_MAP_FROM = 32 << 20


class Op(enum.IntEnum):
    HELLO = 1
    SET = 2
    GET = 3
    ADD = 4
    COMPARE_SET = 5
    WAIT = 6
    CHECK = 7
    DELETE = 8
    NUM_KEYS = 9
    MULTI_GET = 10
    MULTI_SET = 11
    SET_WILL = 12  # key, value: set key := value when this connection ends, unless cleared
    CLEAR_WILL = 13
    PEEK = 14  # keys -> a presence byte per key (b"1"/b"0"), then the present keys' values
    DELETE_PREFIX = 15


class Status(enum.IntEnum):
    OK = 0
    ERROR = 1
    TIMEOUT = 2


class Frame(NamedTuple):
    code: int
    rid: int
    argc: int
    payload: bytes | bytearray | mmap.mmap


def encode(code: int, rid: int, args: Sequence[bytes]) -> list[bytes]:
    """Frame ``args``; small frames come back as one buffer, large ones as a list to send."""
    if len(args) == 1:  # most replies
        (a,) = args
        head = _HEADER1.pack(4 + len(a), code, rid, 1, len(a))
        return [head + a] if len(a) < _JOIN_BELOW else [head, a]
    if len(args) == 2:  # most requests: set(key, value), get(timeout, key), add(key, amount)
        a, b = args
        size = len(a) + len(b)
        head = _HEADER2.pack(8 + size, code, rid, 2, len(a), len(b))
        return [head + a + b] if size < _JOIN_BELOW else [head, a, b]
    argc, size, (first, *rest) = encode_payload(args)
    return [HEADER.pack(size, code, rid, argc) + first, *rest]


def encode_payload(args: Sequence[bytes]) -> tuple[int, int, list[bytes]]:
    """A frame's payload, to put behind several headers: (argument count, payload bytes,
    buffers). Large arguments stay buffers of their own (sent with scatter-gather, never
    copied); runs of small ones are joined so a reply is a few buffers, not thousands."""
    lengths = [len(a) for a in args]
    size = 4 * len(args) + sum(lengths)
    table = struct.pack(f"<{len(args)}I", *lengths)
    if size < _JOIN_BELOW:
        return len(args), size, [table + b"".join(args)]
    bufs: list[bytes] = []
    run: list[bytes] = [table]
    for a in args:
        if len(a) < BIG_ARG:
            run.append(a)
            continue
        if run:
            bufs.append(b"".join(run) if len(run) > 1 else run[0])
        bufs.append(a)
        run = []
    if run:
        bufs.append(b"".join(run))
    return len(args), size, bufs


def unsent(bufs: Sequence[bytes | memoryview], sent: int) -> list[memoryview]:
    """What of a frame's buffers a send that took ``sent`` bytes left over, in order (the
    tail of the partly sent one, then the untouched ones; empty buffers dropped)."""
    rest: list[memoryview] = []
    for buf in bufs:
        if sent >= len(buf):
            sent -= len(buf)
            continue
        rest.append(memoryview(buf)[sent:])
        sent = 0
    return rest


def decode_args(frame: Frame, views: bool = False) -> list[bytes]:
    """Split a frame's payload into its arguments; FrameError when lengths do not add up.
    With ``views``, large arguments of a frame read into a buffer of its own come back as views
    of it rather than copies (the server stores values that way: no copy of a big value)."""
    payload, argc = frame.payload, frame.argc
    if argc == 1 and type(payload) is bytes and len(payload) >= 4 \
            and _U32.unpack_from(payload)[0] == len(payload) - 4:
        return [payload[4:]]  # most replies: one value
    if argc == 2 and type(payload) is bytes and len(payload) >= 8:
        n1, n2 = _U32X2.unpack_from(payload)
        if n1 + n2 + 8 == len(payload):  # most requests: two arguments
            return [payload[8:8 + n1], payload[8 + n1:]]
    table = 4 * argc
    if table > len(payload):
        raise FrameError(f"frame claims {argc} arguments in {len(payload)} bytes",
                         frame.rid, fatal=False)
    lengths = struct.unpack_from(f"<{argc}I", payload, 0)
    if table + sum(lengths) != len(payload):
        raise FrameError(f"argument lengths add up to {sum(lengths)} bytes, frame holds "
                         f"{len(payload) - table}", frame.rid, fatal=False)
    offsets = list(itertools.accumulate(lengths, initial=table))
    if type(payload) is bytes:  # slicing bytes gives bytes: one copy, no per-item overhead
        return [payload[a:b] for a, b in itertools.pairwise(offsets)]
    view = memoryview(payload)  # a large frame read into a buffer of its own
    if views:
        return [view[a:b] if b - a >= BIG_ARG else bytes(view[a:b])
                for a, b in itertools.pairwise(offsets)]
    return [bytes(view[a:b]) for a, b in itertools.pairwise(offsets)]


def keep_alive(sock: socket.socket) -> None:
    """TCP keepalive and a send timeout on a store connection, so that a peer whose host or
    network vanished is noticed (its wills fire, its server's clients fail) in half a minute
    rather than the kernel's two hours."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_KEEPIDLE"):  # Linux; elsewhere the system's defaults apply
        idle, interval, count = KEEPALIVE
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, count)
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, _USER_TIMEOUT_MS)


def pack_timeout(seconds: float) -> bytes:
    return struct.pack("<d", seconds)


class Reserve:
    """Bytes that buffers of frames still arriving may hold before their data is in, shared by
    every connection of a server. A buffer is zeroed when allocated, so without this bound a
    header alone would make the server hold memory; past it, buffers are mapped lazily and take
    memory only as their bytes arrive (fresh pages cost a fault each, so only past it)."""

    def __init__(self, budget: int):
        self.left = budget


class FrameReader:
    """Accumulates bytes from a non-blocking socket (the server's side) and cuts them into
    frames no larger than ``limit``."""

    def __init__(self, limit: int, reserve: Reserve | None = None):
        self.limit = limit
        self._reserve = reserve if reserve is not None else Reserve(_MAP_FROM)
        self._held = 0  # what the unfinished large frame holds of the reserve
        self._buf: bytes | bytearray = b""  # an unfinished frame's first bytes
        self._big: bytearray | mmap.mmap | None = None
        self._fill = 0
        self._head: tuple[int, int, int] = (0, 0, 0)

    def close(self) -> None:
        """Give back the reserve held by an unfinished frame (its connection is gone)."""
        self._reserve.left += self._held
        self._held = 0
        self._big, self._buf = None, b""

    def read_from(self, sock: socket.socket) -> list[Frame] | None:
        """One ``recv``; the frames it completed, or None when the peer closed the stream."""
        if self._big is not None:
            return self._fill_big(sock)
        data = sock.recv(RECV_CHUNK)
        if not data:
            return None
        if self._buf:
            self._buf += data
            data = self._buf
        elif len(data) >= HEADER_SIZE:  # the common case: exactly one whole frame
            plen, code, rid, argc = HEADER.unpack_from(data)
            if len(data) == HEADER_SIZE + plen and plen <= self.limit:
                return [Frame(code, rid, argc, data[HEADER_SIZE:])]
        frames, pos = self._parse(data)
        self._buf = bytearray(data[pos:]) if pos < len(data) else b""
        if self._big is not None:  # a large frame began: take what else has arrived
            frames += self._fill_big(sock) or []  # a close shows on the next read
        return frames

    def _parse(self, data: bytes | bytearray) -> tuple[list[Frame], int]:
        frames: list[Frame] = []
        pos, n = 0, len(data)
        while n - pos >= HEADER_SIZE:
            plen, code, rid, argc = HEADER.unpack_from(data, pos)
            if plen > self.limit:
                raise FrameError(f"frame of {plen} bytes exceeds the limit of {self.limit}", rid)
            end = pos + HEADER_SIZE + plen
            if end > n:
                if plen >= _BIG_PAYLOAD:
                    self._start_big(plen, code, rid, argc, data, pos + HEADER_SIZE)
                    pos = n
                break
            frames.append(Frame(code, rid, argc, bytes(data[pos + HEADER_SIZE:end])))
            pos = end
        return frames, pos

    def _start_big(self, plen: int, code: int, rid: int, argc: int, data, start: int) -> None:
        if plen < _MAP_FROM and plen <= self._reserve.left:
            self._reserve.left -= plen
            self._held = plen
            self._big = bytearray(plen)
        else:
            self._big = mmap.mmap(-1, plen)
        self._fill = len(data) - start
        with memoryview(self._big) as view:
            view[:self._fill] = data[start:]
        self._head = (code, rid, argc)

    def _fill_big(self, sock: socket.socket) -> list[Frame] | None:
        """Receive straight into the frame's buffer while the socket has data (one poll
        round trip per receive would cost more than the copy), up to a fair share."""
        budget = _FILL_PER_EVENT
        with memoryview(self._big) as view:
            while True:
                try:
                    n = sock.recv_into(view[self._fill:])
                except (BlockingIOError, InterruptedError):
                    return []
                if n == 0:
                    return None
                self._fill += n
                budget -= n
                if self._fill == len(self._big):
                    break
                if budget <= 0:
                    return []
        payload, self._big = self._big, None
        self._reserve.left += self._held
        self._held = 0
        return [Frame(*self._head, payload)]


class ReplyReader:
    """Reads reply frames from ``sock`` (blocking, with a kernel receive timeout: SO_RCVTIMEO).

    Each receive takes exactly the bytes the frame needs next (its header, then its payload, or
    a large frame's argument table and then each argument), so a value is received straight
    into the ``bytes`` object handed to the caller: no read-ahead buffer to copy out of, and no
    lock (a buffered reader's lock, held by a thread blocked in a read when the process forks,
    would stay held for good in the child).

    Whenever a receive times out, ``tick()`` is called; it raises once the caller's deadline
    has passed and may shorten the next receive's timeout. ``torn`` is True while a frame has
    been started but not finished: a deadline then leaves the stream unusable.
    """

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self.torn = False

    def read_frame(self, tick: Callable[[], None]) -> tuple[int, int, list[bytes]] | None:
        """The next frame as (code, request id, arguments); None when the peer closed the
        stream. FrameError for a frame that breaks the format."""
        head = self._exact(HEADER_SIZE, tick)
        if head is None:
            return None
        self.torn = True
        plen, code, rid, argc = HEADER.unpack(head)
        table = 4 * argc
        if plen < BIG_ARG or table > plen:  # small: one read, then slices of it
            payload = self._exact(plen, tick)
            if payload is None:
                return None
            self.torn = False
            return code, rid, decode_args(Frame(code, rid, argc, payload))
        raw = self._exact(table, tick)
        if raw is None:
            return None
        lengths = struct.unpack(f"<{argc}I", raw)
        if table + sum(lengths) != plen:
            raise FrameError(f"argument lengths add up to {sum(lengths)} bytes, frame holds "
                             f"{plen - table}", rid)
        args = []
        for n in lengths:
            arg = self._exact(n, tick)
            if arg is None:
                return None
            args.append(arg)
        self.torn = False
        return code, rid, args

    def _exact(self, n: int, tick: Callable[[], None]) -> bytes | None:
        """Exactly ``n`` bytes, or None at end of stream."""
        if n == 0:
            return b""
        parts: list[bytes] = []
        got = 0
        while True:
            try:
                data = self._sock.recv(n - got, socket.MSG_WAITALL)
            except (BlockingIOError, InterruptedError):  # the kernel's receive timeout
                data = None
            if data is not None:
                if not data:
                    return None
                if len(data) == n:
                    return data  # the common case: one call
                parts.append(data)
                got += len(data)
                if got == n:
                    return b"".join(parts)
                self.torn = True
            tick()  # the receive timed out (or came up short): is there time left?
