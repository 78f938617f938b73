"""One client connection to a store server, shared safely by any number of threads.

Every request carries an id and every reply names it, so a thread parked in a long ``get`` does
not stop another thread's ``set``. No reader thread: whichever waiting thread finds the socket
free reads replies for everyone and hands each to its owner (the single-threaded case thus costs
one send and one receive, nothing more).
"""

from __future__ import annotations

import socket
import threading
import time

from gpucoll.errors import StoreError, StoreTimeout
from gpucoll.store.protocol import (
    DEFAULT_MAX_VALUE_BYTES,
    FRAME_SLACK,
    NO_REPLY,
    VERSION,
    Frame,
    FrameError,
    FrameReader,
    Op,
    Status,
    decode_args,
    encode,
)


class _Slot:
    __slots__ = ("frame",)

    def __init__(self):
        self.frame: Frame | None = None


class Connection:
    """Connects (retrying until ``timeout`` while the server is not up yet) and says hello."""

    def __init__(self, host: str, port: int, token: str | None, timeout: float):
        self.address = f"{host}:{port}"
        deadline = time.monotonic() + timeout
        self._sock = _connect(host, port, timeout, deadline)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._reader = FrameReader(DEFAULT_MAX_VALUE_BYTES + FRAME_SLACK)
        self._send_lock = threading.Lock()
        self._cond = threading.Condition()
        self._pending: dict[int, _Slot] = {}
        self._next_rid = 1
        self._reading = False
        self._error: str | None = None
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
        self._reader.limit = self.max_value_bytes + FRAME_SLACK

    def post(self, op: int, args: list[bytes], deadline: float, what: str) -> None:
        """Send a request that gets no reply on success (errors break the connection)."""
        with self._cond:
            self._raise_if_broken(what)
        self._send(encode(op, NO_REPLY, args), deadline, what)

    def request(self, op: int, args: list[bytes], deadline: float,
                what: str) -> tuple[int, list[bytes]]:
        """Send a request and wait for its reply until ``deadline`` (monotonic seconds)."""
        slot = _Slot()
        with self._cond:
            self._raise_if_broken(what)
            rid = self._next_rid
            self._next_rid = rid % 0xFFFFFFFF + 1
            self._pending[rid] = slot
        try:
            self._send(encode(op, rid, args), deadline, what)
            frame = self._await(slot, deadline, what)
        finally:
            with self._cond:
                self._pending.pop(rid, None)
        try:
            return frame.code, decode_args(frame)
        except FrameError as exc:
            raise StoreError(f"store at {self.address} sent a malformed reply to {what}: "
                             f"{exc}") from None

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

    # ----------------------------------------------------------------- internals
    def _raise_if_broken(self, what: str) -> None:
        if self._error is not None:
            raise StoreError(f"{what}: {self._error}")

    def _broken(self, message: str) -> None:
        with self._cond:
            if self._error is None:
                self._error = message
            self._cond.notify_all()

    def _send(self, bufs: list[bytes], deadline: float, what: str) -> None:
        with self._send_lock:
            try:
                for buf in bufs:
                    self._sock.settimeout(max(deadline - time.monotonic(), 1e-3))
                    self._sock.sendall(buf)
            except OSError as exc:
                # a partly written frame leaves the stream unusable
                self._broken(f"lost connection to store at {self.address} ({exc})")
                self._raise_if_broken(what)

    def _await(self, slot: _Slot, deadline: float, what: str) -> Frame:
        while True:
            with self._cond:
                while slot.frame is None and self._reading and self._error is None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise StoreTimeout(f"{what}: no reply from store at {self.address} "
                                           f"by the deadline")
                    self._cond.wait(remaining)
                if slot.frame is not None:
                    return slot.frame
                self._raise_if_broken(what)
                self._reading = True
            try:
                self._read_until(slot, deadline, what)
            finally:
                with self._cond:
                    self._reading = False
                    self._cond.notify_all()

    def _read_until(self, slot: _Slot, deadline: float, what: str) -> None:
        while slot.frame is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StoreTimeout(f"{what}: no reply from store at {self.address} "
                                   f"by the deadline")
            self._sock.settimeout(remaining)
            try:
                frames = self._reader.read_from(self._sock)
            except TimeoutError:
                continue
            except (OSError, FrameError) as exc:
                self._broken(f"lost connection to store at {self.address} ({exc})")
                self._raise_if_broken(what)
            if frames is None:
                self._broken(f"lost connection to store at {self.address} "
                             f"(the server closed it)")
                self._raise_if_broken(what)
            self._deliver(frames, what)

    def _deliver(self, frames: list[Frame], what: str) -> None:
        with self._cond:
            for frame in frames:
                if frame.rid == NO_REPLY:  # an earlier fire-and-forget request failed
                    self._error = (f"store at {self.address} rejected an earlier request: "
                                   f"{_text(decode_args(frame))}")
                    self._cond.notify_all()
                    self._raise_if_broken(what)
                target = self._pending.get(frame.rid)
                if target is not None:  # else: a reply to a request given up on
                    target.frame = frame
            self._cond.notify_all()


def _connect(host: str, port: int, timeout: float, deadline: float) -> socket.socket:
    """Connect, retrying with backoff while nothing listens yet (the start-up race)."""
    delay, last = 0.01, None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise StoreTimeout(f"could not connect to store at {host}:{port} within "
                               f"{timeout:g} s (last error: {last})")
        try:
            return socket.create_connection((host, port), timeout=min(remaining, 30.0))
        except OSError as exc:
            last = exc
        time.sleep(max(0.0, min(delay, deadline - time.monotonic())))
        delay = min(delay * 2, 0.5)


def _text(args: list[bytes]) -> str:
    return args[0].decode("utf-8", "replace") if args else "(no message)"
