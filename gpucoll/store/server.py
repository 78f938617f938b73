"""The store server: one event loop (epoll) in a daemon thread, serving every client at once.

No thread per client: a blocking ``get``/``wait`` parks its request server-side until the keys
are set or its deadline passes, so thousands of waiting ranks cost one small record each.
A client that sends garbage gets an error reply or loses its connection; nobody else notices.
What one client can make the server hold is bounded (``StoreLimits``): a small first message
before its token is checked, so many unsent replies before the server stops reading its requests
(TCP then holds the client's further sends back), so many parked requests; and a frame's header
alone never makes the server allocate memory its bytes have not arrived for.

``gpucoll store`` (``main`` here) runs one standalone, for multi-node jobs that some other
launcher starts: ranks connect to it through ``GPUCOLL_STORE=tcp://HOST:PORT``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import errno
import heapq
import hmac
import ipaddress
import itertools
import logging
import os
import resource
import select
import signal
import socket
import struct
import sys
import threading
import time
import warnings
from typing import Any

from gpucoll.errors import FrameError, StoreError
from gpucoll.store.forks import drop_when_forked
from gpucoll.store.protocol import (
    DEFAULT_MAX_VALUE_BYTES,
    FRAME_SLACK,
    HEADER,
    MAX_IOV,
    MAX_PAYLOAD,
    NO_REPLY,
    VERSION,
    Frame,
    FrameReader,
    Op,
    Reserve,
    Status,
    decode_args,
    encode,
    encode_payload,
    keep_alive,
    unsent,
)

log = logging.getLogger("gpucoll.store")
# bytes of frames still arriving that the server zeroes ahead of their data (all connections
# together); past it, buffers are mapped lazily and take memory only as the bytes arrive
ZEROED_RESERVE = 64 << 20
# a paused client is read again once its unsent replies fall to this fraction of the limit
_RESUME_AT = 0.5
_warned_open = False  # a store without a token reachable from other hosts: said once


@dataclasses.dataclass(frozen=True)
class StoreLimits:
    """What one client can make the server hold (each limit is per connection).

    ``hello_bytes``: the largest first message, read before the token is checked (a hello is
    the protocol name and the token). ``buffered_bytes``: replies the client has not read yet;
    past it the server reads no more of its requests until it catches up, so a client that
    never reads costs about this much and its own sends block. ``waiting``: requests parked at
    once (``get``/``wait`` of keys not set yet); more are refused with an error reply.
    ``hello_timeout``: seconds a new connection has to say hello before it is dropped.
    """

    hello_bytes: int = 4096
    buffered_bytes: int = 64 << 20
    waiting: int = 4096
    hello_timeout: float = 60.0

    def __post_init__(self):
        for name, low in (("hello_bytes", 64), ("buffered_bytes", 1 << 16), ("waiting", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"StoreLimits: {name} must be an int >= {low}, got {value!r}")
        if isinstance(self.hello_timeout, bool) or not isinstance(
                self.hello_timeout, (int, float)) or not 0 < self.hello_timeout < 1e9:
            raise ValueError(f"StoreLimits: hello_timeout must be a positive number of "
                             f"seconds, got {self.hello_timeout!r}")


# ----------------------------------------------------------------- sockets
def raise_fd_limit() -> int:
    """Lift the soft open-files limit to the hard one (a store may hold thousands of sockets)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            return want
        except (ValueError, OSError):
            pass
    return soft


class Poller:
    """epoll where there is one (Linux), else poll(2): one small seam for the loop."""

    def __init__(self):
        if hasattr(select, "epoll"):
            self._p, self._ms = select.epoll(), False
            self.IN, self.OUT = select.EPOLLIN, select.EPOLLOUT
            self.ERR = select.EPOLLERR | select.EPOLLHUP
        else:
            self._p, self._ms = select.poll(), True
            self.IN, self.OUT = select.POLLIN, select.POLLOUT
            self.ERR = select.POLLERR | select.POLLHUP
        self.register, self.modify = self._p.register, self._p.modify
        self.unregister = self._p.unregister

    def poll(self, timeout: float | None) -> list[tuple[int, int]]:
        if timeout is None:
            return self._p.poll(None if self._ms else -1)
        return self._p.poll(timeout * 1000 if self._ms else timeout)

    def close(self) -> None:
        close = getattr(self._p, "close", None)
        if close is not None:
            close()


def _warn_if_open(address: str, port: int) -> None:
    """Say once per process that a store without a token listens where other hosts reach it."""
    global _warned_open
    try:
        if _warned_open or ipaddress.ip_address(address.partition("%")[0]).is_loopback:
            return
    except ValueError:
        pass
    _warned_open = True
    shown = f"[{address}]" if ":" in address else address
    warnings.warn(f"gpucoll store on {shown}:{port} has no token: anyone who can reach this "
                  f"port can read and change its keys. Set GPUCOLL_STORE_TOKEN (or token=) on "
                  f"the server and on every rank, or listen on a loopback address.",
                  UserWarning, stacklevel=4)


def listen(host: str, port: int) -> socket.socket:
    """A non-blocking listening socket; IPv6 literals and names resolve through getaddrinfo."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                               flags=socket.AI_PASSIVE)
    last: OSError | None = None
    for family, kind, proto, _, addr in infos:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            sock.listen(4096)
            sock.setblocking(False)
            return sock
        except OSError as exc:
            sock.close()
            last = exc
    raise StoreError(f"cannot serve a store on {host}:{port}: {last}")


# ----------------------------------------------------------------- parked requests
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


class _Conn:
    __slots__ = ("sock", "fd", "peer", "reader", "out", "queued", "paused", "backlog",
                 "authed", "closing", "closed", "waiters", "wills")

    def __init__(self, sock: socket.socket, peer: str, reader: FrameReader):
        self.sock = sock
        self.fd = sock.fileno()
        self.peer = peer
        self.reader = reader
        self.out: collections.deque[memoryview] = collections.deque()
        self.queued = 0  # bytes in ``out``
        self.paused = False  # too many unsent replies: its requests are not read meanwhile
        self.backlog: collections.deque[Frame] = collections.deque()  # read before a pause
        self.authed = False
        self.closing = False
        self.closed = False
        self.waiters: set[Waiter] = set()
        self.wills: dict[bytes, bytes] = {}  # key -> value to set when the connection ends

    @property
    def done(self) -> bool:
        """Nothing left for the hello deadline to do (a timer entry, like a Waiter)."""
        return self.authed or self.closed


class StoreServer:
    """Serves the store on ``host:port`` (0 picks a free port) from a background thread."""

    def __init__(self, host: str, port: int, *, token: str | None = None,
                 max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
                 limits: StoreLimits | None = None):
        self.max_value_bytes = int(max_value_bytes)
        self.limits = limits if limits is not None else StoreLimits()
        self._token = (token or "").encode()
        if len(VERSION) + len(self._token) + 8 > self.limits.hello_bytes:
            raise ValueError(f"StoreServer: a token of {len(self._token)} bytes does not fit "
                             f"in a hello of limits.hello_bytes={self.limits.hello_bytes}")
        self._reserve = Reserve(ZEROED_RESERVE)
        # values: bytes, or memoryviews of the buffer a large value was received into
        self._data: dict[bytes, bytes | memoryview] = {}
        self._parked: dict[bytes, list[Watch]] = {}  # missing key -> watches stopped at it
        self._watches: dict[bytes, Watch] = {}
        self._timers: list[tuple[float, int, Waiter | _Conn]] = []
        self._seq = itertools.count()
        self._compact_at = 4096
        self._conns: dict[int, _Conn] = {}  # by file descriptor
        self._stop = False
        self._accepting = True
        raise_fd_limit()
        self._listener = listen(host, port)
        self.host = host
        self.port = self._listener.getsockname()[1]
        if not self._token:
            _warn_if_open(self._listener.getsockname()[0], self.port)
        self._wake_r, self._wake_w = socket.socketpair()
        self._poller = Poller()
        self._poller.register(self._listener.fileno(), self._poller.IN)
        self._poller.register(self._wake_r.fileno(), self._poller.IN)
        self._handlers = {
            Op.SET: self._op_set, Op.MULTI_SET: self._op_multi_set, Op.ADD: self._op_add,
            Op.COMPARE_SET: self._op_compare_set, Op.CHECK: self._op_check,
            Op.DELETE: self._op_delete, Op.NUM_KEYS: self._op_num_keys,
            Op.SET_WILL: self._op_set_will, Op.CLEAR_WILL: self._op_clear_will,
            Op.PEEK: self._op_peek, Op.DELETE_PREFIX: self._op_delete_prefix,
        }
        self._thread = threading.Thread(target=self._run, name=f"gpucoll-store:{self.port}",
                                        daemon=True)
        drop_when_forked(self)
        self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the loop, drop every connection and join the thread."""
        if self._stop:
            return
        self._stop = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout)
        self._wake_w.close()

    def clients(self) -> list[str]:
        """The addresses (``host:port``) of the clients connected now; read from another
        thread, so a connection made or dropped meanwhile may or may not be in it."""
        return [conn.peer for conn in list(self._conns.values())
                if conn.authed and not conn.closed]

    def drop_inherited(self) -> None:
        """In a forked child (where the loop's thread does not exist): close this process's
        copies of the listener and every connection, telling nobody."""
        self._stop = True
        socks = [self._listener, self._wake_r, self._wake_w]
        socks += [conn.sock for conn in self._conns.values()]
        for sock in socks:
            try:
                sock.close()
            except OSError:
                pass
        self._poller.close()

    def serve_forever(self) -> None:
        """Block the calling thread until the server stops (the standalone command)."""
        self._thread.join()

    # ----------------------------------------------------------------- loop
    def _run(self) -> None:
        try:
            while not self._stop:
                for fd, events in self._poller.poll(self._next_timeout()):
                    self._dispatch(fd, events)
                self._expire(time.monotonic())
        except Exception:  # noqa: BLE001 - the loop must report, then stop cleanly
            log.exception("store server on port %d stopped by an internal error", self.port)
        finally:
            self._shutdown()

    def _dispatch(self, fd: int, events: int) -> None:
        conn = self._conns.get(fd)
        if conn is None:
            if fd == self._listener.fileno():
                self._accept()
            elif fd == self._wake_r.fileno():
                self._wake_r.recv(64)
            return
        try:
            if events & self._poller.OUT:
                self._flush(conn)
            if conn.paused and events & self._poller.ERR:
                self._drop(conn)  # gone while its replies waited: nobody to send them to
            elif events & (self._poller.IN | self._poller.ERR) and not conn.closed:
                self._on_readable(conn)
        except Exception as exc:  # noqa: BLE001 - one client's failure stays its own
            log.debug("dropping store client %s: %r", conn.peer, exc)
            self._drop(conn)

    def _next_timeout(self) -> float | None:
        while self._timers and self._timers[0][2].done:
            heapq.heappop(self._timers)
        if not self._timers:
            return None
        return max(0.0, self._timers[0][0] - time.monotonic())

    def _shutdown(self) -> None:
        for conn in list(self._conns.values()):
            try:
                self._drop(conn)
            finally:
                conn.sock.close()  # whatever happened, no client may wait on this server
        self._poller.close()
        self._listener.close()
        self._wake_r.close()

    # ----------------------------------------------------------------- connections
    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    # out of file descriptors: stop accepting (the listener would stay ready
                    # and spin the loop) until a connection closes; the rest wait in the
                    # kernel's backlog
                    log.warning("store server on port %d out of file descriptors at %d "
                                "connections; accepting again when one closes",
                                self.port, len(self._conns))
                    self._poller.unregister(self._listener.fileno())
                    self._accepting = False
                else:
                    log.warning("store server could not accept a connection: %s", exc)
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            keep_alive(sock)
            reader = FrameReader(self.limits.hello_bytes, self._reserve)
            conn = _Conn(sock, f"{addr[0]}:{addr[1]}", reader)
            self._conns[conn.fd] = conn
            self._poller.register(conn.fd, self._poller.IN)
            self._add_timer(time.monotonic() + self.limits.hello_timeout, conn)

    def _drop(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        conn.reader.close()  # gives back what its unfinished frame held of the reserve
        conn.out.clear()
        conn.backlog.clear()
        for w in list(conn.waiters):
            self._retire(w)
        self._conns.pop(conn.fd, None)
        if conn.wills and not self._stop:  # its last wills: whoever waits on them wakes
            for key, value in conn.wills.items():
                self._put(key, value)
        try:
            self._poller.unregister(conn.fd)
        except (KeyError, ValueError, OSError):
            pass
        conn.sock.close()
        if not self._accepting and not self._stop:
            self._accepting = True
            self._poller.register(self._listener.fileno(), self._poller.IN)

    def _on_readable(self, conn: _Conn) -> None:
        try:
            frames = conn.reader.read_from(conn.sock)
        except (BlockingIOError, InterruptedError):
            return
        except FrameError as exc:
            self._fail(conn, exc.rid, str(exc), close=True)
            return
        if frames is None:
            self._drop(conn)
            return
        for i, frame in enumerate(frames):
            if conn.closing or conn.closed:
                return
            if conn.paused:  # the rest waits until the client has read its replies
                conn.backlog.extend(frames[i:])
                return
            self._handle(conn, frame)

    def _handle(self, conn: _Conn, frame: Frame) -> None:
        try:
            if frame.code in PARKED and conn.authed:
                self._op_park(conn, frame)  # decodes only a key list it has not seen
                return
            # values to store stay in the buffer they were received into (no copy)
            args = decode_args(frame, views=frame.code in _STORING)
            if not conn.authed:
                self._hello(conn, frame, args)
                return
            handler = self._handlers.get(frame.code)
            if handler is None:
                raise FrameError(f"unknown operation code {frame.code}", frame.rid, fatal=False)
            handler(conn, frame, args)
        except FrameError as exc:
            # a request without a reply slot cannot be told it failed: close instead
            close = exc.fatal or frame.rid == NO_REPLY or not conn.authed
            self._fail(conn, frame.rid, str(exc), close=close)

    def _hello(self, conn: _Conn, frame: Frame, args: list[bytes]) -> None:
        if frame.code != Op.HELLO or len(args) != 2:
            raise FrameError("the first request must be a hello", frame.rid)
        if args[0] != VERSION:
            raise FrameError(f"protocol {args[0][:40]!r} is not {VERSION!r}", frame.rid)
        if self._token and not hmac.compare_digest(args[1], self._token):
            raise FrameError("wrong or missing store token", frame.rid)
        conn.authed = True
        conn.reader.limit = 2 * self.max_value_bytes + FRAME_SLACK  # compare_set: two values
        self._reply(conn, Status.OK, frame.rid, [str(self.max_value_bytes).encode()])

    # ----------------------------------------------------------------- replies
    def _fail(self, conn: _Conn, rid: int, message: str, close: bool) -> None:
        log.debug("store client %s: %s", conn.peer, message)
        self._reply(conn, Status.ERROR, rid, [message.encode()], force=True)
        if close:
            conn.closing = True
            if not conn.out:
                self._drop(conn)

    def _reply(self, conn: _Conn, status: int, rid: int, args: list[bytes],
               force: bool = False) -> None:
        if conn.closed or (rid == NO_REPLY and not force):
            return
        self._write(conn, encode(status, rid, args))

    def _write(self, conn: _Conn, bufs: list[bytes]) -> None:
        """Send now what the socket takes; queue the rest for when it is writable, and stop
        reading the client's requests while too much of it waits (backpressure)."""
        if conn.closed:
            return
        was_empty = not conn.out
        if not was_empty:
            conn.out.extend(memoryview(b) for b in bufs)
            conn.queued += sum(map(len, bufs))
        else:
            try:
                if len(bufs) == 1:
                    sent = conn.sock.send(bufs[0])
                else:  # scatter-gather: large values go out of the objects that hold them
                    sent = conn.sock.sendmsg(bufs if len(bufs) <= MAX_IOV else bufs[:MAX_IOV])
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self._drop(conn)
                return
            if sent == (len(bufs[0]) if len(bufs) == 1 else sum(map(len, bufs))):
                return
            rest = unsent(bufs, sent)
            conn.out.extend(rest)
            conn.queued += sum(map(len, rest))
        pause = conn.queued > self.limits.buffered_bytes and not conn.paused
        if pause:
            conn.paused = True
            log.debug("store client %s has %d bytes of replies unread: not reading its "
                      "requests until it catches up", conn.peer, conn.queued)
        if was_empty or pause:
            self._poller.modify(conn.fd, self._poller.OUT if conn.paused else
                                self._poller.IN | self._poller.OUT)

    def _flush(self, conn: _Conn) -> None:
        while conn.out:
            try:
                sent = conn.sock.sendmsg(list(itertools.islice(conn.out, MAX_IOV)))
            except (BlockingIOError, InterruptedError):
                break
            conn.queued -= sent
            while sent and conn.out:
                head = conn.out[0]
                if sent >= len(head):
                    sent -= len(head)
                    conn.out.popleft()
                else:
                    conn.out[0] = head[sent:]
                    sent = 0
        if conn.closing and not conn.out:
            self._drop(conn)
        elif conn.paused and conn.queued <= self.limits.buffered_bytes * _RESUME_AT:
            self._resume(conn)
        elif not conn.out:
            self._poller.modify(conn.fd, self._poller.IN)

    def _resume(self, conn: _Conn) -> None:
        """The client caught up: handle what was read before the pause, then read again."""
        conn.paused = False
        while conn.backlog and not (conn.paused or conn.closing or conn.closed):
            self._handle(conn, conn.backlog.popleft())
        if not conn.closed:
            events = self._poller.IN if not conn.paused else 0
            self._poller.modify(conn.fd, events | (self._poller.OUT if conn.out else 0))

    # ----------------------------------------------------------------- operations
    def _check_value(self, value: bytes, rid: int) -> None:
        if len(value) > self.max_value_bytes:
            raise FrameError(f"value of {len(value)} bytes exceeds the store's limit of "
                             f"{self.max_value_bytes} bytes", rid, fatal=False)

    def _put(self, key: bytes | memoryview, value: bytes | memoryview) -> None:
        if type(key) is not bytes:  # a key of a frame's large arguments: keys must hash
            key = bytes(key)
        self._data[key] = value
        watches = self._parked.pop(key, None)
        if watches:
            for watch in watches:
                if watch.live:
                    self._advance(watch)

    def _op_set(self, conn: _Conn, frame: Frame, args: list[bytes]) -> None:
        _expect_args(frame, args, 2)
        self._check_value(args[1], frame.rid)
        self._put(args[0], args[1])
        self._reply(conn, Status.OK, frame.rid, [])

    def _op_multi_set(self, conn: _Conn, frame: Frame, args: list[bytes]) -> None:
        if len(args) % 2:
            raise FrameError("multi_set needs as many values as keys", frame.rid, fatal=False)
        half = len(args) // 2
        for value in args[half:]:
            self._check_value(value, frame.rid)
        for key, value in zip(args[:half], args[half:], strict=True):
            self._put(key, value)
        self._reply(conn, Status.OK, frame.rid, [])

    def _op_add(self, conn: _Conn, frame: Frame, args: list[bytes]) -> None:
        _expect_args(frame, args, 2)
        try:
            total = int(bytes(self._data.get(args[0], b"0"))) + int(args[1])
        except ValueError:
            raise FrameError(f"add: key {_show(args[0])} does not hold an integer",
                             frame.rid, fatal=False) from None
        value = str(total).encode()
        self._put(args[0], value)
        self._reply(conn, Status.OK, frame.rid, [value])

    def _op_compare_set(self, conn: _Conn, frame: Frame, args: list[bytes]) -> None:
        _expect_args(frame, args, 3)
        key, expected, desired = args
        self._check_value(desired, frame.rid)
        key = bytes(key)
        current = self._data.get(key)
        if current is None and expected:
            result = expected
        elif current is None or current == expected:
            self._put(key, desired)
            result = desired
        else:
            result = current
        self._reply(conn, Status.OK, frame.rid, [result])

    def _op_check(self, conn: _Conn, frame: Frame, args: list[bytes]) -> None:
        present = all(k in self._data for k in args)
        self._reply(conn, Status.OK, frame.rid, [b"1" if present else b"0"])

    def _op_delete(self, conn: _Conn, frame: Frame, args: list[bytes]) -> None:
        _expect_args(frame, args, 1)
        found = self._data.pop(args[0], None) is not None
        self._reply(conn, Status.OK, frame.rid, [b"1" if found else b"0"])

    def _op_num_keys(self, conn: _Conn, frame: Frame, args: list[bytes]) -> None:
        self._reply(conn, Status.OK, frame.rid, [str(len(self._data)).encode()])

    def _op_set_will(self, conn: _Conn, frame: Frame, args: list[bytes]) -> None:
        _expect_args(frame, args, 2)
        self._check_value(args[1], frame.rid)
        conn.wills[bytes(args[0])] = bytes(args[1])
        self._reply(conn, Status.OK, frame.rid, [])

    def _op_clear_will(self, conn: _Conn, frame: Frame, args: list[bytes]) -> None:
        _expect_args(frame, args, 1)
        found = conn.wills.pop(args[0], None) is not None
        self._reply(conn, Status.OK, frame.rid, [b"1" if found else b"0"])

    def _op_peek(self, conn: _Conn, frame: Frame, args: list[bytes]) -> None:
        values = [self._data.get(k) for k in args]
        present = [v for v in values if v is not None]
        if sum(map(len, present)) + 4 * len(args) + len(args) + 4 > MAX_PAYLOAD:
            raise FrameError("peek: the values do not fit in one reply; ask for fewer keys",
                             frame.rid, fatal=False)
        mask = bytes(0x30 + (v is not None) for v in values)  # b"1" present, b"0" missing
        self._reply(conn, Status.OK, frame.rid, [mask, *present])

    def _op_delete_prefix(self, conn: _Conn, frame: Frame, args: list[bytes]) -> None:
        _expect_args(frame, args, 1)
        prefix = args[0]
        doomed = [k for k in self._data if k.startswith(prefix)]
        for k in doomed:
            del self._data[k]
        self._reply(conn, Status.OK, frame.rid, [str(len(doomed)).encode()])

    # ----------------------------------------------------------------- parked requests
    def _op_park(self, conn: _Conn, frame: Frame) -> None:
        if frame.argc == 2:  # get (or wait for one key) of a key already there: no parking
            args = decode_args(frame)
            value = self._data.get(args[1])
            if value is not None and len(args[0]) == 8:
                self._reply(conn, Status.OK, frame.rid, [] if frame.code == Op.WAIT else [value])
                return
        ident, timeout = park_request(frame)
        if len(conn.waiters) >= self.limits.waiting:
            raise FrameError(f"{len(conn.waiters)} requests of this connection already wait "
                             f"for keys (the store's limit per connection)", frame.rid,
                             fatal=False)
        watch = self._watches.get(ident)
        fresh = watch is None
        if fresh:
            watch = Watch(ident, decode_args(frame)[1:])
        w = Waiter(conn, frame.rid, frame.code, watch, time.monotonic() + timeout)
        watch.members.append(w)
        watch.live += 1
        conn.waiters.add(w)
        if fresh and self._advance(watch):
            return
        self._watches[ident] = watch
        self._add_timer(w.deadline, w)

    def _advance(self, watch: Watch) -> bool:
        """Move past the keys now present; answer every member if none is missing (True),
        else park the watch at the first missing key."""
        data, keys = self._data, watch.keys
        i, n = watch.pos, len(keys)
        while True:
            while i < n and keys[i] in data:
                i += 1
            if i < n:
                watch.pos = i
                self._parked.setdefault(keys[i], []).append(watch)
                return False
            if all(w.op == Op.WAIT or w.done for w in watch.members):
                values = []
                break
            values = [data.get(k) for k in keys]
            if None not in values:  # else a key was deleted since it was passed: look again
                break
            i = values.index(None)
        self._watches.pop(watch.ident, None)
        members, watch.members, watch.live = watch.members, [], 0
        # one payload for all: many ranks waiting on the same keys is the common case; its
        # large values are sent out of the stored objects, never joined into a copy
        status, empty, full = Status.OK, encode_payload([]), None
        if values:
            full = encode_payload(values)
            if full[1] > MAX_PAYLOAD:
                status, full = Status.ERROR, encode_payload(
                    [f"reply of {full[1]} bytes does not fit in one frame: ask for "
                     f"fewer keys at a time".encode()])
        for w in members:
            if not w.done:
                w.done = True
                w.conn.waiters.discard(w)
                argc, size, (first, *rest) = empty if w.op == Op.WAIT else full
                head = HEADER.pack(size, status if w.op != Op.WAIT else Status.OK, w.rid, argc)
                # a large first buffer is shared by every member's reply, not copied into each
                self._write(w.conn, [head + first, *rest] if len(first) < _SHARE_FROM else
                            [head, first, *rest])
        return True

    def _retire(self, w: Waiter) -> None:
        """``w`` no longer waits (answered, expired or disconnected)."""
        w.done = True
        w.conn.waiters.discard(w)
        watch = w.watch
        watch.live -= 1
        if watch.live == 0 and self._watches.get(watch.ident) is watch:
            # nobody waits: forget the watch, the next request starts afresh
            del self._watches[watch.ident]
            key = watch.keys[watch.pos]
            parked = self._parked.get(key)
            if parked is not None and watch in parked:
                parked.remove(watch)
                if not parked:
                    del self._parked[key]

    def _add_timer(self, deadline: float, item: Waiter | _Conn) -> None:
        timers = self._timers
        if len(timers) >= self._compact_at:
            # Answered requests leave their entries behind until their deadline comes up;
            # drop them now and then, or frequent barriers would grow the heap without bound.
            timers[:] = [t for t in timers if not t[2].done]
            heapq.heapify(timers)
            self._compact_at = max(4096, 2 * len(timers))
        heapq.heappush(timers, (deadline, next(self._seq), item))

    def _expire(self, now: float) -> None:
        timers = self._timers
        while timers and (timers[0][2].done or timers[0][0] <= now):
            w = heapq.heappop(timers)[2]
            if type(w) is _Conn:
                if not w.done:
                    log.debug("store client %s sent no hello in %g s", w.peer,
                              self.limits.hello_timeout)
                    self._drop(w)
            elif not w.done:
                self._retire(w)
                watch = w.watch
                missing = [k for k in watch.keys[watch.pos:] if k not in self._data]
                self._reply(w.conn, Status.TIMEOUT, w.rid, missing)


_STORING = frozenset((Op.SET, Op.MULTI_SET, Op.COMPARE_SET))
_SHARE_FROM = 4096  # reply payloads from this size are sent as a buffer of their own


def _expect_args(frame: Frame, args: list[bytes], n: int) -> None:
    if len(args) != n:
        raise FrameError(f"operation {frame.code} takes {n} arguments, got {len(args)}",
                         frame.rid, fatal=False)


def _show(key: bytes) -> str:
    return repr(key.decode("utf-8", "replace"))


# ---- gpucoll store -------------------------------------------------------------------------------

def env_token() -> str | None:
    """The shared token from GPUCOLL_STORE_TOKEN, or None when unset or empty."""
    return os.environ.get("GPUCOLL_STORE_TOKEN") or None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpucoll store",
        description="Serve a gpucoll key-value store until interrupted. Point ranks at it with "
                    "GPUCOLL_STORE=tcp://HOST:PORT (and the same GPUCOLL_STORE_TOKEN).")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=29500,
                   help="port to listen on; 0 picks a free one (default 29500)")
    p.add_argument("--token", default=None,
                   help="shared secret clients must present (default: $GPUCOLL_STORE_TOKEN)")
    p.add_argument("--max-value-bytes", type=int, default=DEFAULT_MAX_VALUE_BYTES,
                   help=f"largest value accepted (default {DEFAULT_MAX_VALUE_BYTES})")
    d = StoreLimits()
    p.add_argument("--max-hello-bytes", type=int, default=d.hello_bytes,
                   help=f"largest first message, read before the token is checked "
                        f"(default {d.hello_bytes})")
    p.add_argument("--max-buffered-bytes", type=int, default=d.buffered_bytes,
                   help=f"unread replies per client before the server stops reading its "
                        f"requests until it catches up (default {d.buffered_bytes})")
    p.add_argument("--max-waiting", type=int, default=d.waiting,
                   help=f"requests one client may have waiting for keys (default {d.waiting})")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    token = args.token if args.token is not None else env_token()
    try:
        limits = StoreLimits(hello_bytes=args.max_hello_bytes,
                             buffered_bytes=args.max_buffered_bytes, waiting=args.max_waiting)
        server = StoreServer(args.host, args.port, token=token,
                             max_value_bytes=args.max_value_bytes, limits=limits)
    except ValueError as exc:
        parser.error(str(exc))
    signal.signal(signal.SIGTERM, lambda *_: server.close())
    host = args.host if ":" not in args.host else f"[{args.host}]"
    print(f"gpucoll store: serving tcp://{host}:{server.port}"
          f"{' (token required)' if token else ''}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
