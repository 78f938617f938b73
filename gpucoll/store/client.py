"""``TCPStore``: the key-value store every rank meets at (torch's TCPStore API, plus deadlines).

The rank that hosts the store (``is_server=True``) runs the server in a background thread and
is also an ordinary client of it. ``set`` and ``multi_set`` are fire-and-forget: they return
once the request is written, and the server applies a connection's requests in order, so any
later call through the same store object sees them. Every other call waits for its reply, and
every wait has a deadline: the call's ``timeout=`` or else the store's.

``PrefixStore`` (here too) is a namespace inside a store, so subgroups and repeated runs never
collide: every key becomes ``prefix + "/" + key``.

Ranks meeting in the store are here too: one key per rank and a wait for all of them that names
the ranks missing (``share``, ``gather``, ``fetch``, ``wait_for_ranks``), what became of the
ranks that left (``Liveness``), and the survivors' agreement on who is left after a rank was
lost (``agree_survivors``).
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from gpucoll.errors import CollectiveTimeout, GpucollError, PeerFailure, StoreError, StoreTimeout
from gpucoll.progress import Waiting, ranks_text
from gpucoll.store.forks import drop_when_forked
from gpucoll.store.protocol import (
    DEFAULT_MAX_VALUE_BYTES,
    FRAME_SLACK,
    MAX_IOV,
    NO_REPLY,
    VERSION,
    Op,
    ReplyReader,
    Status,
    encode,
    keep_alive,
    pack_timeout,
    unsent,
)
from gpucoll.store.server import StoreLimits, StoreServer, env_token

_WILDCARDS = {"", "0.0.0.0", "::", "*"}
# how long past a blocking call's own timeout to wait for the server's timeout reply
_REPLY_GRACE = 5.0
# longest single blocking recv; the deadline is re-checked after each
_MAX_SLICE = 1.0
_CLIENT_POLL = 0.02  # how often other_clients looks at the server's connections


class TCPStore:
    """A client of the store at ``host:port``; with ``is_server=True`` also its server.

    ``port=0`` (server only) picks a free port, reported as ``.port``. ``token`` (default:
    GPUCOLL_STORE_TOKEN) must match the server's. ``timeout`` bounds connecting and is the
    default deadline of every call. ``max_value_bytes`` (server only) caps each value; clients
    learn the server's cap when they connect. ``limits`` (server only, a ``StoreLimits``)
    bounds what one client can make the server hold. Safe to use from several threads at once.
    """

    def __init__(self, host: str, port: int, *, is_server: bool = False,
                 timeout: float = 300.0, token: str | None = None,
                 max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
                 limits: StoreLimits | None = None):
        _check_timeout(timeout, "timeout")
        if not isinstance(port, int) or not 0 <= port < 65536:
            raise ValueError(f"TCPStore: port must be an int in [0, 65535], got {port!r}")
        if port == 0 and not is_server:
            raise ValueError("TCPStore: a client needs the server's port, got port=0")
        if not isinstance(max_value_bytes, int) or max_value_bytes < 1 or \
                max_value_bytes > (1 << 32) - (1 << 21):
            raise ValueError(f"TCPStore: max_value_bytes must be in [1, 4 GiB - 2 MiB], "
                             f"got {max_value_bytes!r}")
        if limits is not None and not is_server:
            raise ValueError("TCPStore: limits are the server's; pass them with is_server=True")
        token = token if token is not None else env_token()
        self.host, self.port, self.timeout = host, port, float(timeout)
        self._server: StoreServer | None = None
        self._closed = False
        if is_server:
            self._server = StoreServer(host, port, token=token, max_value_bytes=max_value_bytes,
                                       limits=limits)
            self.port = self._server.port
        target = "127.0.0.1" if is_server and host in _WILDCARDS else host
        self._target, self._token = target, token
        try:
            self._conn = _hello(target, self.port, token, self.timeout)
        except BaseException:
            if self._server is not None:
                self._server.close()
            raise

    def new_client(self, *, timeout: float | None = None) -> TCPStore:
        """Another connection to the same store (same address and token), e.g. for a thread
        that waits there without making this connection's callers wait behind it."""
        return TCPStore(self._target, self.port, timeout=self.timeout if timeout is None
                        else timeout, token=self._token)

    @property
    def is_server(self) -> bool:
        return self._server is not None

    @property
    def stalled(self) -> bool:
        """True when a call got no reply by its deadline and nothing has come from the store
        since (it is unreachable, stopped or overwhelmed): leaving a group then waits no more."""
        return self._conn.stalled

    @property
    def max_value_bytes(self) -> int:
        """The server's value-size limit, learnt when connecting."""
        return self._conn.max_value_bytes

    def __repr__(self) -> str:
        role = "server" if self._server else "client"
        return f"TCPStore({self.host!r}, {self.port}, {role}{', closed' if self._closed else ''})"

    def __enter__(self) -> TCPStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ----------------------------------------------------------------- writes
    def set(self, key: str, value: bytes | str) -> None:
        """Store ``value`` under ``key`` (fire-and-forget; see the module docstring)."""
        if type(value) is not bytes or len(value) > self._conn.max_value_bytes:
            value = self._value(value, "set")
        if type(key) is not str:
            _key(key)
        self._conn.post(encode(Op.SET, NO_REPLY, [key.encode(), value]), "set")

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes | str]) -> None:
        """Set several keys in one request (fire-and-forget, applied in order)."""
        ks = _keys(keys, "multi_set")
        if isinstance(values, (str, bytes)) or len(values) != len(ks):
            raise ValueError(f"multi_set: {len(ks)} keys need as many values, got "
                             f"{len(values) if not isinstance(values, (str, bytes)) else 1}")
        vs = [self._value(v, "multi_set") for v in values]
        size = sum(map(len, ks)) + sum(map(len, vs)) + 8 * len(ks)
        if size > self._conn.max_value_bytes + FRAME_SLACK // 2:
            raise ValueError(f"multi_set: {size} bytes in one request exceed the store's "
                             f"limit of about {self._conn.max_value_bytes} bytes; split it")
        if ks:
            self._conn.post(encode(Op.MULTI_SET, NO_REPLY, ks + vs), "multi_set")

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer at ``key`` (0 if unset); the new value."""
        if not isinstance(amount, int) or isinstance(amount, bool):
            raise TypeError(f"add({key!r}): amount must be an int, got "
                            f"{type(amount).__name__}")
        args = [_key(key), b"%d" % amount]
        return int(self._call(Op.ADD, args, None, f"add({key!r})")[0])

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str, *,
                    timeout: float | None = None) -> bytes:
        """Atomically set ``desired`` if ``key`` holds ``expected`` (or is unset and
        ``expected`` is empty); returns the value ``key`` holds afterwards. ``timeout`` bounds
        the round trip."""
        what = f"compare_set({key!r})"
        args = [_key(key), self._value(expected, what), self._value(desired, what)]
        return self._call(Op.COMPARE_SET, args, timeout, what)[0]

    def delete_key(self, key: str) -> bool:
        """Remove ``key``; True if it was there."""
        return self._call(Op.DELETE, [_key(key)], None, f"delete_key({key!r})")[0] == b"1"

    def delete_prefix(self, prefix: str, *, timeout: float | None = None) -> int:
        """Remove every key that starts with ``prefix`` (one request); how many there were."""
        if not isinstance(prefix, str):
            raise TypeError(f"delete_prefix: prefix must be a str, got {type(prefix).__name__}")
        if not prefix:
            raise ValueError("delete_prefix: an empty prefix would delete every key in the "
                             "store, of every job using it")
        what = f"delete_prefix({prefix!r})"
        return int(self._call(Op.DELETE_PREFIX, [prefix.encode()], timeout, what)[0])

    # ----------------------------------------------------------------- last wills
    def set_will(self, key: str, value: bytes | str, *, timeout: float | None = None) -> None:
        """Leave ``key := value`` to be set by the server when this store's connection ends,
        for any reason (``close()``, the process dying, a broken network), waking whoever
        waits for ``key``, unless ``clear_will(key)`` comes first. A round trip: the will is
        registered when this returns. One will per key; another ``set_will`` replaces it."""
        what = f"set_will({key!r})"
        self._call(Op.SET_WILL, [_key(key), self._value(value, what)], timeout, what)

    def clear_will(self, key: str, *, timeout: float | None = None) -> bool:
        """Withdraw this connection's will for ``key``; True if there was one."""
        what = f"clear_will({key!r})"
        return self._call(Op.CLEAR_WILL, [_key(key)], timeout, what)[0] == b"1"

    # ----------------------------------------------------------------- reads
    def get(self, key: str, timeout: float | None = None) -> bytes:
        """The value of ``key``, waiting (server-side) until it is set or the deadline."""
        return self._blocking(Op.GET, [_key(key)], timeout, f"get({key!r})")[0]

    def multi_get(self, keys: Sequence[str], timeout: float | None = None) -> list[bytes]:
        """The values of ``keys`` in order, waiting until all are set or the deadline."""
        ks = _keys(keys, "multi_get")
        return self._blocking(Op.MULTI_GET, ks, timeout, "multi_get") if ks else []

    def wait(self, keys: Sequence[str], timeout: float | None = None) -> None:
        """Block until every key in ``keys`` is set; StoreTimeout names those still missing."""
        ks = _keys(keys, "wait")
        if ks:
            self._blocking(Op.WAIT, ks, timeout, "wait")

    def check(self, keys: Sequence[str]) -> bool:
        """True if every key in ``keys`` is set (never waits for them)."""
        return self._call(Op.CHECK, _keys(keys, "check"), None, "check")[0] == b"1"

    def peek(self, keys: Sequence[str], *, timeout: float | None = None) -> list[bytes | None]:
        """The value of each of ``keys`` now, None for those not set (never waits for them;
        ``timeout`` bounds the round trip)."""
        ks = _keys(keys, "peek")
        if not ks:
            return []
        mask, *values = self._call(Op.PEEK, ks, timeout, "peek")
        found = iter(values)
        return [next(found) if bit == 0x31 else None for bit in mask]

    def num_keys(self) -> int:
        """How many keys the store holds (all namespaces)."""
        return int(self._call(Op.NUM_KEYS, [], None, "num_keys")[0])

    def other_clients(self, timeout: float, *, what: str = "") -> list[str]:
        """On the hosting process: wait until no other process is connected (each has closed
        its connections, or ended), at most ``timeout`` seconds; return the addresses of those
        still connected then. A process that hosts a job's store calls it before it ends, so
        that ranks still at work do not lose the store. ``what`` names the wait in its
        long-wait lines (``gpucoll.progress``)."""
        if self._server is None:
            raise ValueError("TCPStore.other_clients: only the process hosting the store "
                             "knows its clients (is_server=True)")
        _check_timeout(timeout, "timeout")
        deadline = time.monotonic() + timeout
        notice = Waiting(what or f"the store at port {self.port}", timeout)
        while True:
            mine = {conn.local for conn in list(_CONNECTIONS) if not conn.inherited}
            others = [peer for peer in self._server.clients() if peer not in mine]
            if not others or time.monotonic() >= deadline:
                return others
            notice.tick(functools.partial(_others_text, len(others)))
            time.sleep(min(_CLIENT_POLL, max(deadline - time.monotonic(), 0.0)))

    def close(self) -> None:
        """Close the connection once the server has applied this store's sets and, on the
        hosting rank, stop the server. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._conn.inherited:
            return  # a forked child's copy: the connection and server are the parent's
        if self._conn.unconfirmed and not self._conn.stalled:
            # a round trip, so the sets just sent are applied before the connection goes
            try:
                self._call(Op.NUM_KEYS, [], min(self.timeout, 5.0), "close")
            except StoreError:
                pass
        self._conn.close()
        if self._server is not None:
            self._server.close()

    # ----------------------------------------------------------------- internals
    def _value(self, value: bytes | str, what: str) -> bytes:
        data = _bytes(value, what)
        if len(data) > self._conn.max_value_bytes:
            raise ValueError(f"{what}: value of {len(data)} bytes exceeds the store's limit "
                             f"of {self._conn.max_value_bytes} bytes")
        return data

    def _call(self, op: int, args: list[bytes], timeout: float | None,
              what: str) -> list[bytes]:
        if timeout is not None:
            _check_timeout(timeout, "timeout")
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        status, reply = self._conn.request(op, args, deadline, what)
        if status:
            raise StoreError(f"{what}: store at {self._conn.address} refused: "
                             f"{reply[0].decode('utf-8', 'replace') if reply else '?'}")
        return reply

    def _blocking(self, op: int, keys: list[bytes], timeout: float | None,
                  what: str) -> list[bytes]:
        """A request the server parks until ``keys`` exist; the server times it out."""
        if timeout is not None:
            _check_timeout(timeout, "timeout")
        limit = self.timeout if timeout is None else float(timeout)
        start = time.monotonic()
        args = [pack_timeout(limit), *keys]
        deadline = start + limit + _REPLY_GRACE
        status, reply = self._conn.request(op, args, deadline, what)
        if status == Status.TIMEOUT:
            missing = [k.decode("utf-8", "replace") for k in reply]
            shown = missing if len(missing) <= 8 else missing[:8] + [f"... {len(missing) - 8} more"]
            raise StoreTimeout(f"{what}: key(s) {shown} not set in store at "
                               f"{self._conn.address} after {time.monotonic() - start:.2f} s "
                               f"(timeout {limit:g} s)")
        if status != Status.OK:
            raise StoreError(f"{what}: store at {self._conn.address} refused: "
                             f"{reply[0].decode('utf-8', 'replace') if reply else '?'}")
        return reply


def _others_text(count: int) -> str:
    return f"for {count} other process{'es' if count > 1 else ''} to leave the store it hosts"


def _check_timeout(timeout: float, name: str) -> None:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
        raise ValueError(f"TCPStore: {name} must be a number of seconds >= 0, got {timeout!r}")


def _key(key: str) -> bytes:
    if type(key) is not str and not isinstance(key, str):
        raise TypeError(f"store keys are str, got {type(key).__name__} {key!r}")
    return key.encode()


def _keys(keys: Sequence[str], what: str) -> list[bytes]:
    if isinstance(keys, (str, bytes)):
        raise TypeError(f"{what}: keys must be a list of str, not a single {type(keys).__name__}")
    try:
        return [k.encode() for k in keys]
    except AttributeError:
        bad = next(k for k in keys if not isinstance(k, str))
        raise TypeError(f"{what}: store keys are str, got {type(bad).__name__} {bad!r}") from None


def _bytes(value: bytes | str, what: str) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"{what}: values are bytes or str, got {type(value).__name__}")


_HOST = re.compile(r"[A-Za-z0-9_.-]+|\[[0-9A-Fa-f:.%A-Za-z]+\]")


def parse_address(address: str) -> tuple[str, int]:
    """``"tcp://host:port"`` (or ``host:port``; IPv6 as ``[::1]:port``) -> (host, port); a
    ValueError, before anything connects, for any other scheme or a malformed host or port."""
    if not isinstance(address, str):
        raise ValueError(f"store address must be a string tcp://HOST:PORT, got "
                         f"{type(address).__name__}")
    scheme, sep, rest = address.partition("://")
    if not sep:
        rest = address
    elif scheme != "tcp":
        raise ValueError(f"store address must look like tcp://HOST:PORT, got {address!r} "
                         f"(a {scheme}:// address: the store speaks its own protocol over TCP)")
    host, sep, port = rest.rpartition(":")
    if (not sep or not _HOST.fullmatch(host) or not port.isdigit()
            or not 0 < int(port) < 65536):
        raise ValueError(f"store address must look like tcp://HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


# ----------------------------------------------------------------- the connection
class _Slot:
    __slots__ = ("reply",)

    def __init__(self):
        self.reply: tuple[int, list[bytes]] | None = None  # status, arguments


_CONNECTIONS: weakref.WeakSet = weakref.WeakSet()  # this process's, for other_clients


class Connection:
    """Connects (retrying until ``timeout`` while the server is not up yet) and says hello."""

    def __init__(self, host: str, port: int, token: str | None, timeout: float):
        self.address = f"{host}:{port}"
        deadline = time.monotonic() + timeout
        # A blocking socket with kernel-side timeouts: no poll() before every send and recv.
        self._sock = _connect(host, port, timeout, deadline)
        local = self._sock.getsockname()
        self.local = f"{local[0]}:{local[1]}"  # as the server names this client
        _set_timeo(self._sock, socket.SO_SNDTIMEO, min(max(timeout, 1.0), 60.0))
        self._rcv_timeo = 0.0
        # replies come from the server we chose: any size a frame can carry
        self._reader = ReplyReader(self._sock)
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # guards the fields below; C-level on the fast path
        self._cond = threading.Condition(self._lock)
        self._pending: dict[int, _Slot] = {}
        self._next_rid = 1
        self._reading = False
        self._closing = False  # close() was called while a thread read: it closes the socket
        self._error: str | None = None
        self._pid = os.getpid()
        drop_when_forked(self)
        _CONNECTIONS.add(self)
        self.unconfirmed = False  # a fire-and-forget request was sent since the last reply
        # a request got no reply by its deadline, and nothing came since: the store is
        # unreachable or stopped, so leaving a group sends what it must and waits for nothing
        self.stalled = False
        hello = [VERSION, (token or "").encode()]
        try:
            status, args = self.request(Op.HELLO, hello, deadline, "connect")
        except StoreTimeout:
            self.close()
            raise
        except StoreError as exc:
            dropped = self._error is not None  # the server closed it before answering
            self.close()
            if dropped:
                raise _Dropped(str(exc)) from None
            raise
        except BaseException:
            self.close()
            raise
        if status != Status.OK:
            self.close()
            raise StoreError(f"store at {self.address} refused the connection: "
                             f"{_text(args)}")
        self.max_value_bytes = int(args[0])

    @property
    def inherited(self) -> bool:
        """True in a process forked from the one that made this connection."""
        return self._pid != os.getpid()

    def post(self, bufs: list[bytes], what: str) -> None:
        """Send an encoded request that gets no reply on success (a failure breaks the
        connection, reported by the next call)."""
        if self._error is not None:
            self._raise_if_broken(what)
        self.unconfirmed = True
        self._send(bufs, what)

    def request(self, op: int, args: list[bytes], deadline: float,
                what: str) -> tuple[int, list[bytes]]:
        """Send a request and wait for its reply until ``deadline`` (monotonic seconds)."""
        if self._error is not None:  # before any lock: in a forked child (where the fork
            self._raise_if_broken(what)  # hook set the error) a parent's thread may hold it
        slot = _Slot()
        with self._lock:
            if self._error is not None:
                self._raise_if_broken(what)
            rid = self._next_rid
            self._next_rid = rid % 0xFFFFFFFF + 1
            self._pending[rid] = slot
            reader = not self._reading  # the common case: nobody else is reading
            self._reading = True
        try:
            self._send(encode(op, rid, args), what)
            if reader:
                self._read_until(slot, deadline, what)
            else:
                self._await(slot, deadline, what)
            self.unconfirmed = False  # the server answers a connection's requests in order
        finally:
            with self._lock:
                del self._pending[rid]
                if reader:
                    self._reading = False
                    if self._pending:
                        self._cond.notify_all()
                last = reader and self._closing
            if last:
                self._close_socket()
        return slot.reply

    def close(self) -> None:
        """Break the connection; threads still waiting on it get a StoreError at once."""
        if self.inherited:
            return  # the parent's: drop_inherited closed this process's copy
        with self._cond:
            if self._error is None:
                self._error = f"connection to store at {self.address} is closed"
            self._cond.notify_all()
            self._closing = True
            reading = self._reading
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv or send
        except OSError:
            pass
        if not reading:  # else the reading thread closes it once out of its recv: the
            self._close_socket()  # descriptor's number must not be reused under that recv

    def drop_inherited(self) -> None:
        """In a forked child: close this process's copy of the socket without a word to the
        server (the parent's connection stays up, and still ends when the parent ends), and
        touch no lock (a thread of the parent may have held one at the fork)."""
        self._error = (f"this connection to the store at {self.address} was inherited across "
                       f"fork() from process {self._pid}: a forked child must make a TCPStore "
                       f"of its own")
        try:
            self._sock.close()
        except OSError:
            pass

    # ----------------------------------------------------------------- internals
    def _raise_if_broken(self, what: str) -> None:
        if self._error is not None:
            raise StoreError(f"{what}: {self._error}")

    def _close_socket(self) -> None:
        with self._send_lock:  # a sender woken by the shutdown lets go of it at once
            self._sock.close()

    def _broken(self, message: str) -> None:
        with self._cond:
            if self._error is None:
                self._error = message
            self._cond.notify_all()

    def _send(self, bufs: list[bytes], what: str) -> None:
        with self._send_lock:
            try:
                _send_all(self._sock, bufs)
            except OSError as exc:
                # a partly written frame leaves the stream unusable
                self._broken(f"lost the connection to the store at {self.address} ({exc!r})")
                self._raise_if_broken(what)

    def _await(self, slot: _Slot, deadline: float, what: str) -> None:
        """Wait for another thread to read our reply, or take over reading when it stops."""
        while True:
            with self._cond:
                while slot.reply is None and self._reading and self._error is None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        self.stalled = True
                        raise StoreTimeout(f"{what}: no reply from store at {self.address} "
                                           f"by the deadline")
                    self._cond.wait(remaining)
                if slot.reply is not None:
                    return
                self._raise_if_broken(what)
                self._reading = True
            try:
                self._read_until(slot, deadline, what)
                return
            finally:
                with self._cond:
                    self._reading = False
                    self._cond.notify_all()
                    last = self._closing
                if last:
                    self._close_socket()

    def _read_until(self, slot: _Slot, deadline: float, what: str) -> None:
        def tick() -> None:
            """Before each receive: the deadline check and the receive's kernel timeout."""
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.stalled = True
                raise StoreTimeout(f"{what}: no reply from store at {self.address} "
                                   f"by the deadline")
            want = min(remaining, _MAX_SLICE)
            if want != self._rcv_timeo:
                _set_timeo(self._sock, socket.SO_RCVTIMEO, want)
                self._rcv_timeo = want

        while slot.reply is None:
            tick()
            try:
                frame = self._reader.read_frame(tick)
            except StoreTimeout:
                if self._reader.torn:  # the rest of a reply is still on its way: unusable
                    self._broken(f"lost the connection to the store at {self.address} (a reply "
                                 f"stalled halfway past the deadline)")
                raise
            except (OSError, ValueError) as exc:  # ValueError: FrameError, or closed
                self._broken(f"lost the connection to the store at {self.address} ({exc!r})")
                self._raise_if_broken(what)
            if frame is None:
                self._broken(f"lost the connection to the store at {self.address}: the server "
                             f"closed it (the process hosting the store ended or closed it)")
                self._raise_if_broken(what)
            self._deliver(frame, slot, what)

    def _deliver(self, frame: tuple[int, int, list[bytes]], mine: _Slot, what: str) -> None:
        code, rid, args = frame
        self.stalled = False
        if self._pending.get(rid) is mine:
            mine.reply = (code, args)  # our own reply: nobody else to wake
            return
        with self._cond:
            if rid == NO_REPLY:  # an earlier fire-and-forget request failed
                self._error = (f"store at {self.address} rejected an earlier request: "
                               f"{_text(args)}")
                self._cond.notify_all()
                self._raise_if_broken(what)
            target = self._pending.get(rid)
            if target is not None:  # else: a reply to a request given up on
                target.reply = (code, args)
            self._cond.notify_all()


def _send_all(sock: socket.socket, bufs: list[bytes]) -> None:
    """Send a frame's buffers in order: ``sendmsg`` of up to MAX_IOV at a time (no joining
    of large values), then whatever a partial send left over."""
    if len(bufs) == 1:
        sock.sendall(bufs[0])
        return
    for i in range(0, len(bufs), MAX_IOV):
        batch = bufs[i:i + MAX_IOV]
        for rest in unsent(batch, sock.sendmsg(batch)):
            sock.sendall(rest)


def _set_timeo(sock: socket.socket, option: int, seconds: float) -> None:
    """Kernel-side send/receive timeout of a blocking socket (0 would mean forever)."""
    seconds = max(seconds, 1e-3)
    sec = int(seconds)
    sock.setsockopt(socket.SOL_SOCKET, option, struct.pack("ll", sec,
                                                             int((seconds - sec) * 1e6)))


class _Dropped(StoreError):
    """The server closed a new connection before answering its hello."""


def _hello(host: str, port: int, token: str | None, timeout: float) -> Connection:
    """A Connection, tried again until ``timeout`` while the server drops it before answering:
    a server that is closing as this client comes (the store of a job that just ended, whose
    host is about to serve the next one at the same address)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return Connection(host, port, token, max(deadline - time.monotonic(), 0.01))
        except _Dropped:
            if time.monotonic() >= deadline:
                raise
        time.sleep(0.05)  # a retry, bounded by the deadline above


def _connect(host: str, port: int, timeout: float, deadline: float) -> socket.socket:
    """Connect, retrying with backoff while nothing listens yet (the start-up race)."""
    delay, last = 0.01, None
    notice = Waiting(f"connecting to the store at {host}:{port}", timeout)
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise StoreTimeout(f"could not connect to store at {host}:{port} within "
                               f"{timeout:g} s (last error: {last})")
        try:
            return _connect_once(host, port, min(remaining, 30.0))
        except OSError as exc:
            last = exc
        notice.tick(lambda err=last: f"for a store to accept connections (last error: {err})")
        time.sleep(max(0.0, min(delay, deadline - time.monotonic())))
        delay = min(delay * 2, 0.5)


def _connect_once(host: str, port: int, timeout: float) -> socket.socket:
    """A blocking, connected TCP socket whose connect and sends time out in the kernel
    (SO_SNDTIMEO), so neither needs a poll() per call."""
    last: OSError = OSError(f"{host} resolves to no address")
    for family, kind, proto, _, addr in _resolve(host, port):
        sock = socket.socket(family, kind, proto)
        try:
            _set_timeo(sock, socket.SO_SNDTIMEO, timeout)
            sock.connect(addr)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            keep_alive(sock)
            return sock
        except OSError as exc:
            sock.close()
            last = exc
    raise last


def _resolve(host: str, port: int) -> list[tuple]:
    """getaddrinfo, skipped for IP literals (thousands of ranks connect at once)."""
    for family, addr in ((socket.AF_INET, (host, port)), (socket.AF_INET6, (host, port, 0, 0))):
        try:
            socket.inet_pton(family, host)
        except OSError:
            continue
        return [(family, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", addr)]
    return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)


def _text(args: list[bytes]) -> str:
    return args[0].decode("utf-8", "replace") if args else "(no message)"


__all__ = ["TCPStore", "StoreTimeout", "parse_address"]


# ---- PrefixStore ---------------------------------------------------------------------------------

class PrefixStore:
    """Every key becomes ``prefix + "/" + key`` in ``store`` (a TCPStore or another PrefixStore).

    It borrows the store: ``close()`` leaves the underlying connection to whoever opened it.
    """

    def __init__(self, prefix: str, store: Any):
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"PrefixStore: prefix must be a non-empty str, got {prefix!r}")
        self.prefix = prefix
        self.store = store

    def __repr__(self) -> str:
        return f"PrefixStore({self.prefix!r}, {self.store!r})"

    def __enter__(self) -> PrefixStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def timeout(self) -> float:
        return self.store.timeout

    def _k(self, key: str) -> str:
        if not isinstance(key, str):
            raise TypeError(f"store keys are str, got {type(key).__name__} {key!r}")
        return f"{self.prefix}/{key}"

    def _ks(self, keys: Sequence[str], what: str) -> list[str]:
        if isinstance(keys, (str, bytes)):
            raise TypeError(f"{what}: keys must be a list of str, not a single "
                            f"{type(keys).__name__}")
        return [self._k(k) for k in keys]

    def set(self, key: str, value: bytes | str) -> None:
        self.store.set(self._k(key), value)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        return self.store.get(self._k(key), timeout=timeout)

    def add(self, key: str, amount: int) -> int:
        return self.store.add(self._k(key), amount)

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str, *,
                    timeout: float | None = None) -> bytes:
        return self.store.compare_set(self._k(key), expected, desired, timeout=timeout)

    def wait(self, keys: Sequence[str], timeout: float | None = None) -> None:
        self.store.wait(self._ks(keys, "wait"), timeout=timeout)

    def check(self, keys: Sequence[str]) -> bool:
        return self.store.check(self._ks(keys, "check"))

    def delete_key(self, key: str) -> bool:
        return self.store.delete_key(self._k(key))

    def delete_prefix(self, prefix: str, *, timeout: float | None = None) -> int:
        """Delete every key of this namespace that starts with ``prefix`` ("": all of them)."""
        if not isinstance(prefix, str):
            raise TypeError(f"delete_prefix: prefix must be a str, got {type(prefix).__name__}")
        return self.store.delete_prefix(f"{self.prefix}/{prefix}", timeout=timeout)

    def set_will(self, key: str, value: bytes | str, *, timeout: float | None = None) -> None:
        self.store.set_will(self._k(key), value, timeout=timeout)

    def clear_will(self, key: str, *, timeout: float | None = None) -> bool:
        return self.store.clear_will(self._k(key), timeout=timeout)

    def peek(self, keys: Sequence[str], *, timeout: float | None = None) -> list[bytes | None]:
        return self.store.peek(self._ks(keys, "peek"), timeout=timeout)

    def num_keys(self) -> int:
        """Keys in the whole underlying store (as torch's PrefixStore reports)."""
        return self.store.num_keys()

    def multi_get(self, keys: Sequence[str], timeout: float | None = None) -> list[bytes]:
        return self.store.multi_get(self._ks(keys, "multi_get"), timeout=timeout)

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes | str]) -> None:
        self.store.multi_set(self._ks(keys, "multi_set"), values)

    def close(self) -> None:
        """Nothing to release: the underlying store stays open for its owner."""


# ---- ranks meeting in the store: one key per rank, Liveness, the survivors' agreement ------------
# Start-up steps (the ring's address exchange, NCCL's arrival, backend="auto"'s verdicts) and
# store-side collectives (a split's colours, a debug signature check) each publish one key per
# rank and need every other rank's: share does both, gather and wait_for_ranks the wait. A rank
# that never shows up becomes a CollectiveTimeout naming it at the deadline; with a Liveness, a
# rank that died becomes a PeerFailure naming it within about a second, through the will every
# rank leaves in the group's namespace.

POLL = 0.5  # longest wait in the store between two looks at which ranks are gone
LEAVE_TIMEOUT = 5.0  # what leaving a group may take at most: the store may be unresponsive
LEAVE_PROBE = 0.5  # the first reply leaving waits for; a store slower than that is stalled
_GONE = "gone/{}"
_FAILED = "failed/{}"  # a rank whose communicator failed, alive and still a member: why


class Liveness:
    """This rank's presence in a group's store namespace, and what became of the others.

    Creating it leaves a will ``gone/{rank} = b"died"`` on the store's connection: when this
    process dies, or its connection to the store breaks, the server sets that key, and peers
    that wait with a ``Liveness`` learn which rank died. ``leave()`` is the clean exit.
    """

    def __init__(self, store: Any, rank: int, size: int,
                 earlier: tuple[Any, Sequence[int]] | None = None):
        self.store, self.rank, self.size = store, rank, size
        self.host = store_host_rank(store)
        self._keys = [_GONE.format(r) for r in range(size)]
        self._left = False
        # a group shrunk from another: rank i was rank earlier[1][i] there, and its will there
        # tells of a death before its will here was made
        self._earlier = None if earlier is None else (
            earlier[0], [_GONE.format(r) for r in earlier[1]])
        store.set_will(self._keys[rank], b"died")

    @classmethod
    def of(cls, store: Any, rank: int, size: int) -> Liveness | None:
        """This rank's liveness in namespace ``store``, or None for a store that keeps no
        wills (a user's own store class): waits there fall back to the deadline alone."""
        if not (hasattr(store, "set_will") and hasattr(store, "peek")):
            return None
        return cls(store, rank, size)

    def leave(self, aborted: str | None = None, culprit: int | None = None) -> None:
        """Clean exit: withdraw the will and set ``gone/{rank} = b"closed"`` (or, with
        ``aborted``, ``b"aborted: <aborted>"``: peers waiting in the store learn why; with
        ``culprit`` too, the rank whose failure made this one give up, whom they then name).
        Idempotent; never raises (the store may be gone already)."""
        if not self._left:
            self._left = True
            _mark_gone(self.store, self.rank, _gone_value(aborted, culprit))

    def failed(self, why: str) -> None:
        """Say in the store that this rank's communicator failed and why (it is alive and
        stays a member: a shrink still counts it), so that peers whose calls wait for it learn
        it at once (``failures``) instead of at their own deadline. Never raises."""
        try:
            self.store.set(_FAILED.format(self.rank), why.encode("utf-8", "replace")[:1000])
        except (GpucollError, OSError):
            pass

    def failures(self) -> dict[int, str]:
        """``{rank: why}`` for the other ranks that said their communicator failed (one
        peek)."""
        keys = [_FAILED.format(r) for r in range(self.size)]
        return {r: v.decode("utf-8", "replace") for r, v in enumerate(self.store.peek(keys))
                if v is not None and r != self.rank}

    def check(self, what: str, ranks: Sequence[int] | None = None) -> None:
        """Raise PeerFailure naming the ranks (of ``ranks``; by default all others) found gone,
        for operation ``what`` on this rank."""
        others = {r: how for r, how in self.gone().items()
                  if r != self.rank and (ranks is None or r in ranks)}
        if others:
            raise gone_failure(others, what, self.rank, self.size)

    def gone(self) -> dict[int, str]:
        """``{rank: "died" | "closed" | "aborted: <why>"}`` for the ranks whose ``gone/`` key
        exists (one peek)."""
        values = self.store.peek(self._keys)
        found = {r: v.decode("utf-8", "replace") for r, v in enumerate(values) if v is not None}
        if self._earlier is not None:
            store, keys = self._earlier
            for r, v in enumerate(store.peek(keys)):
                if v == b"died" and r not in found:
                    found[r] = "died"
        return found


def wait_for_ranks(store: Any, keys: Sequence[str], timeout: float, *, what: str, rank: int,
                   absent: str = "never arrived", liveness: Liveness | None = None,
                   poll: float = POLL, ranks: Sequence[int] | None = None,
                   stopped: Callable[[], GpucollError | None] | None = None) -> None:
    """Block until ``keys[i]`` (rank ``ranks[i]``'s key; by default rank i's) is in ``store``
    for every i.

    Every ``GPUCOLL_WAIT_LOG`` seconds (default 10) of waiting, one line on stderr names the ranks
    still missing (``gpucoll.progress``). At the deadline: a CollectiveTimeout saying, for operation
    ``what`` on ``rank``, which ranks are ``absent`` and after how long. With ``liveness`` the wait
    goes in slices of ``poll`` seconds, and between them one of those ranks found gone raises
    PeerFailure naming it: "rank 2 died during split on rank 0 of 3", or that it closed its
    communicator; losing the store that a rank of the group hosts is a PeerFailure naming that rank.
    ``stopped()``, asked between the slices too, returns the error that ends the wait early (the
    launcher stopping the job for a rank that failed before it came, a rank refusing the group).
    """
    keys = list(keys)
    ranks = list(range(len(keys)) if ranks is None else ranks)
    size = liveness.size if liveness is not None else len(keys)
    start = time.monotonic()
    deadline = start + timeout
    notice = Waiting(f"{what} on rank {rank} of {size}", timeout, start)
    while True:
        now = time.monotonic()
        remaining = max(deadline - now, 0.0)
        step = min(remaining, notice.until_due(now), poll if liveness is not None else math.inf)
        try:
            store.wait(keys, timeout=step)
            return
        except StoreTimeout:
            pass
        except StoreError as exc:
            if liveness is None or liveness.host in (None, rank):
                raise
            raise PeerFailure(
                f"{what} on rank {rank} of {size}: lost the store, which rank {liveness.host} "
                f"hosts (rank {liveness.host} died or closed it): {exc}",
                peer=liveness.host) from None
        failure = stopped() if stopped is not None else None
        if failure is not None:
            raise failure
        if liveness is not None:
            try:
                liveness.check(what, ranks)
            except PeerFailure:
                # a rank that set its key, then died while this wait's slice ran out: the wait
                # has what it waited for (the same as if the death came just after it)
                if None not in store.peek(keys):
                    return
                raise
        notice.tick(lambda: f"for {ranks_text(_missing(store, keys, ranks))}")
        if time.monotonic() >= deadline:
            missing = _missing(store, keys, ranks)
            raise CollectiveTimeout(
                f"{what} on rank {rank} of {size}: {ranks_text(missing)} {absent} within "
                f"{time.monotonic() - start:.1f} s (timeout={timeout:g} s)")


def _missing(store: Any, keys: list[str], ranks: list[int]) -> list[int]:
    """The ranks whose key is not in ``store`` yet."""
    return [r for r, v in zip(ranks, store.peek(keys), strict=True) if v is None]


def gather(store: Any, keys: Sequence[str], timeout: float, *, what: str, rank: int,
           absent: str = "never arrived", liveness: Liveness | None = None,
           poll: float = POLL, ranks: Sequence[int] | None = None) -> list[bytes]:
    """Every rank's value (rank order) once all are in ``store``; errors as ``wait_for_ranks``."""
    wait_for_ranks(store, keys, timeout, what=what, rank=rank, absent=absent,
                   liveness=liveness, poll=poll, ranks=ranks)
    return store.multi_get(list(keys))


def share(store: Any, keys: Sequence[str], value: bytes | str, timeout: float, *, what: str,
          rank: int, absent: str = "never arrived",
          liveness: Liveness | None = None) -> list[bytes]:
    """A store-side all_gather: set this rank's ``value`` under ``keys[rank]``, then return every
    rank's (rank order) once all are there; errors as ``wait_for_ranks``."""
    store.set(keys[rank], value)
    return gather(store, keys, timeout, what=what, rank=rank, absent=absent, liveness=liveness)


def fetch(store: Any, key: str, owner: int, timeout: float, *, what: str, rank: int,
          absent: str, liveness: Liveness | None = None) -> bytes:
    """The value of ``key``, which rank ``owner`` publishes; errors as ``wait_for_ranks``."""
    wait_for_ranks(store, [key], timeout, what=what, rank=rank, absent=absent,
                   liveness=liveness, ranks=[owner])
    return store.get(key)


def agree_survivors(store: Any, rank: int, size: int, liveness: Liveness, timeout: float, *,
                    attempt: str, what: str = "shrink") -> list[int]:
    """The ranks of a group that are still alive, the same list on every one of them, made
    under the name ``attempt`` (one per try: a retry needs a new one). Collective over the
    survivors, and none of them is special.

    Each survivor says it is here; it waits until every rank has said so or is gone (its will:
    died, or closed), or until ``timeout``; then it proposes the ranks that said so and are not
    gone. The store's compare-and-set makes the first proposal the answer every survivor reads,
    so they agree even when a rank dies meanwhile (a proposal made before the death names it;
    building the group then fails on every member alike, and they try again without it). A
    rank that is not in the answer (it came after the deadline) raises PeerFailure.
    """
    deadline = time.monotonic() + timeout
    here = [f"{attempt}/here/{r}" for r in range(size)]
    decided_key = f"{attempt}/members"
    store.set(here[rank], b"1")
    decided = store.peek([decided_key])[0]
    while decided is None:
        present = store.peek(here)
        gone = liveness.gone()
        pending = [r for r in range(size) if present[r] is None and r not in gone]
        if not pending or time.monotonic() >= deadline:
            proposal = [r for r in range(size) if present[r] is not None and r not in gone]
            decided = store.compare_set(decided_key, "", json.dumps(proposal))
            break
        try:
            store.wait([here[pending[0]]], timeout=max(min(POLL, deadline - time.monotonic()),
                                                       0.001))
        except StoreTimeout:
            pass
        decided = store.peek([decided_key])[0]
    members = json.loads(decided)
    if rank not in members:
        raise PeerFailure(f"{what} on rank {rank} of {size}: the surviving ranks {members} "
                          f"agreed on their group before this rank arrived (it came after "
                          f"their deadline)", peer=None)
    return members


def leave_group(store: Any, rank: int, size: int, aborted: str | None = None,
                culprit: int | None = None) -> None:
    """This rank is done with a group's namespace ``store``: it withdraws its will, marks itself
    closed (or keeps saying it aborted, with ``aborted``, the reason, and ``culprit``, the rank
    whose failure it gave up for, as ``Liveness.leave``), and the rank that finds
    every rank gone that way deletes the whole namespace, so a group that closes leaves no keys
    behind. A group with a dead rank keeps its keys (the next start-up in the store skips and
    removes them). Never raises; takes at most ``LEAVE_TIMEOUT``, and nothing on a store found
    stalled (every communicator's leave after the first on an unreachable store)."""
    if not _mark_gone(store, rank, _gone_value(aborted, culprit)) or _stalled(store):
        return
    deadline = time.monotonic() + LEAVE_TIMEOUT
    try:
        states = store.peek([_GONE.format(r) for r in range(size)], timeout=LEAVE_PROBE)
        if all(s is not None and (s == b"closed" or aborted_reason(s.decode("utf-8", "replace"))
                                  is not None) for s in states):
            store.delete_prefix("", timeout=_left(deadline))
    except (GpucollError, OSError):
        pass


def _mark_gone(store: Any, rank: int, how: bytes = b"closed") -> bool:
    """Withdraw ``rank``'s will and set its ``gone/`` key to ``how`` (closed, or aborted and
    why), without waiting for the store (on a TCPStore: the server applies both in order);
    False if the store failed."""
    key = _GONE.format(rank)
    try:
        base, prefixed = _unwrap(store, key)
        if isinstance(base, TCPStore):
            base._conn.post(encode(Op.CLEAR_WILL, NO_REPLY, [_key(prefixed)]), "clear_will")
        else:  # a user's store class: its own round trip
            store.clear_will(key, timeout=LEAVE_TIMEOUT)
        store.set(key, how)
        return True
    except (GpucollError, OSError):
        return False


def _unwrap(store: Any, key: str) -> tuple[Any, str]:
    """The store under ``store``'s PrefixStore wrappers, and ``key`` as it is named there."""
    for _ in range(16):
        if not isinstance(store, PrefixStore):
            break
        key = store._k(key)
        store = store.store
    return store, key


def _stalled(store: Any) -> bool:
    """Whether the TCPStore under ``store`` got no reply lately (``TCPStore.stalled``)."""
    return bool(getattr(_unwrap(store, "")[0], "stalled", False))


_ABORTED = "aborted: "  # the start of the ``gone/`` value of a rank that aborted, then why


# the start of the reason of a rank that closed (not aborted) after a peer's failure
CLOSED_AFTER = "closed after "
_RELAYED = re.compile(r"because of rank (\d+): ")  # an abort for another rank's failure


def _gone_value(aborted: str | None, culprit: int | None = None) -> bytes:
    """The ``gone/`` value of a rank that leaves: closed, or aborted for ``aborted`` (because
    of rank ``culprit``'s failure, when given)."""
    if aborted is None:
        return b"closed"
    if culprit is not None:
        aborted = f"because of rank {culprit}: {aborted}"
    return (_ABORTED + aborted).encode("utf-8", "replace")[:1000]


def relayed_failure(why: str) -> tuple[int, str] | None:
    """(the rank to blame, what happened) from an abort's reason that relays another rank's
    failure (``Liveness.leave`` with a culprit); None for a rank's own abort."""
    m = _RELAYED.match(why)
    return (int(m.group(1)), why[m.end():]) if m else None


def aborted_reason(how: str | None) -> str | None:
    """Why a rank aborted, read from its ``gone/`` value; None when it did not abort."""
    return how[len(_ABORTED):] if how is not None and how.startswith(_ABORTED) else None


def store_host_rank(store: Any) -> int | None:
    """The rank of the group whose process hosts ``store`` (``hosted_by`` on the client, set
    where a launcher's rank 0 serves it), looked up through PrefixStore wrappers."""
    for _ in range(16):
        if store is None or hasattr(store, "hosted_by"):
            break
        store = getattr(store, "store", None)
    return getattr(store, "hosted_by", None)


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.001)


def gone_failure(others: dict[int, str], what: str, rank: int, size: int) -> PeerFailure:
    """The PeerFailure, for operation ``what`` on ``rank`` of ``size``, for the ranks found
    gone (``{rank: gone value}``, as ``Liveness.gone``): those that aborted first (they say
    why), then those that died, then those that closed."""
    why = {r: aborted_reason(how) for r, how in others.items()}
    relays = {r: relayed_failure(w) for r, w in why.items() if w is not None}
    relays = {r: got for r, got in relays.items() if got is not None}
    aborted = sorted(r for r in others if why[r] is not None and r not in relays)
    closed = sorted(r for r, how in others.items() if how == "closed")
    died = sorted(set(others) - set(aborted) - set(closed) - set(relays))
    where = f"during {what} on rank {rank} of {size}"
    parts = [f"rank {r} aborted its communicator {where}: {why[r]}" for r in aborted]
    if died:
        parts.append(f"{ranks_text(died)} died {where} (the process ended or lost its connection "
                     f"to the store)")
    # a rank that gave up because of another's failure names that one: the first cause
    relayed = []
    for r, (culprit, told) in sorted(relays.items()):
        if culprit not in aborted and culprit not in died and culprit not in relayed:
            relayed.append(culprit)
            parts.append(f"rank {culprit} failed, as rank {r} relays {where}: {told}")
    if closed:
        parts.append(f"{ranks_text(closed)} closed {'its' if len(closed) == 1 else 'their'} "
                     f"communicator {where}")
    return PeerFailure("; ".join(parts), peer=(aborted or died or relayed or closed)[0])
