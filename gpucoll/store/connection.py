"""One client connection to a store server, shared safely by any number of threads.

Every request carries an id and every reply names it, so a thread parked in a long ``get`` does
not stop another thread's ``set``. No reader thread: whichever waiting thread finds the socket
free reads replies for everyone and hands each to its owner (the single-threaded case thus costs
one send and one receive, nothing more).
"""

from __future__ import annotations

import socket
import struct
import threading
import time

from gpucoll.errors import StoreError, StoreTimeout
from gpucoll.store.protocol import MAX_IOV, NO_REPLY, VERSION, Op, Status, encode, unsent
from gpucoll.store.stream import ReplyReader

# longest single blocking recv; the deadline is re-checked after each
_MAX_SLICE = 1.0


class _Slot:
    __slots__ = ("reply",)

    def __init__(self):
        self.reply: tuple[int, list[bytes]] | None = None  # status, arguments


class Connection:
    """Connects (retrying until ``timeout`` while the server is not up yet) and says hello."""

    def __init__(self, host: str, port: int, token: str | None, timeout: float):
        self.address = f"{host}:{port}"
        deadline = time.monotonic() + timeout
        # A blocking socket with kernel-side timeouts: no poll() before every send and recv.
        self._sock = _connect(host, port, timeout, deadline)
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
        self._error: str | None = None
        self.unconfirmed = False  # a fire-and-forget request was sent since the last reply
        hello = [VERSION, (token or "").encode()]
        try:
            status, args = self.request(Op.HELLO, hello, deadline, "connect")
        except BaseException:
            self.close()
            raise
        if status != Status.OK:
            self.close()
            raise StoreError(f"store at {self.address} refused the connection: "
                             f"{_text(args)}")
        self.max_value_bytes = int(args[0])

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
        return slot.reply

    def close(self) -> None:
        """Break the connection; threads still waiting on it get a StoreError at once."""
        with self._cond:
            if self._error is None:
                self._error = f"connection to store at {self.address} is closed"
            self._cond.notify_all()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv
        except OSError:
            pass
        self._sock.close()
        self._reader.close()  # the socket's descriptor goes with its last file object

    # ----------------------------------------------------------------- internals
    def _raise_if_broken(self, what: str) -> None:
        if self._error is not None:
            raise StoreError(f"{what}: {self._error}")

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
                self._broken(f"lost connection to store at {self.address} ({exc!r})")
                self._raise_if_broken(what)

    def _await(self, slot: _Slot, deadline: float, what: str) -> None:
        """Wait for another thread to read our reply, or take over reading when it stops."""
        while True:
            with self._cond:
                while slot.reply is None and self._reading and self._error is None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
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

    def _read_until(self, slot: _Slot, deadline: float, what: str) -> None:
        def tick() -> None:
            """Before each receive: the deadline check and the receive's kernel timeout."""
            remaining = deadline - time.monotonic()
            if remaining <= 0:
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
                    self._broken(f"lost connection to store at {self.address} (a reply "
                                 f"stalled halfway past the deadline)")
                raise
            except (OSError, ValueError) as exc:  # ValueError: FrameError, or closed
                self._broken(f"lost connection to store at {self.address} ({exc!r})")
                self._raise_if_broken(what)
            if frame is None:
                self._broken(f"lost connection to store at {self.address} "
                             f"(the server closed it)")
                self._raise_if_broken(what)
            self._deliver(frame, slot, what)

    def _deliver(self, frame: tuple[int, int, list[bytes]], mine: _Slot, what: str) -> None:
        code, rid, args = frame
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


def _connect(host: str, port: int, timeout: float, deadline: float) -> socket.socket:
    """Connect, retrying with backoff while nothing listens yet (the start-up race)."""
    delay, last = 0.01, None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise StoreTimeout(f"could not connect to store at {host}:{port} within "
                               f"{timeout:g} s (last error: {last})")
        try:
            return _connect_once(host, port, min(remaining, 30.0))
        except OSError as exc:
            last = exc
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
