"""TCP between any two ranks: socket set-up helpers and a non-blocking byte link.

Links never block: ``send_some``/``recv_*`` move what the kernel accepts now and return, so one
thread can drive a send and a receive at the same time (a ring step never deadlocks on full
socket buffers). Waiting happens in ``gpucoll.transport.engine``.
"""

from __future__ import annotations

import fcntl
import select
import socket
import struct
import termios
import time
from collections.abc import Callable

import numpy as np

from gpucoll.errors import CollectiveTimeout, PeerFailure

SOCKET_BUFFER = 4 << 20  # the kernel clamps this to net.core.[rw]mem_max
PIECE = 1 << 20  # bytes handed to one send()/recv() call
STAGING = 1 << 20  # receive buffer for reductions over TCP


def tune(sock: socket.socket) -> None:
    """Low latency and large buffers on a data or control connection; probes for dead hosts."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
    # a host that vanishes without a FIN is noticed after ~4 s of silence
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 2), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 2)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def listen_tcp(backlog: int) -> socket.socket:
    """A listening socket on every interface, port chosen by the OS."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("0.0.0.0", 0))
    sock.listen(backlog)
    return sock


def connect_tcp(host: str, port: int, deadline: float, what: str,
                check: Callable[[], None] | None = None) -> socket.socket:
    """Connect, retrying refused attempts until ``deadline``; CollectiveTimeout naming ``what``.
    ``check`` runs before each retry: it raises to give up early (the peer is known gone)."""
    delay = 0.01
    while True:
        if check is not None and delay > 0.01:
            check()
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise CollectiveTimeout(f"could not connect to {what} at {host}:{port} in time")
        try:
            sock = socket.create_connection((host, port), timeout=remaining)
            sock.settimeout(None)
            tune(sock)
            return sock
        except (TimeoutError, ConnectionRefusedError, ConnectionResetError):
            time.sleep(min(delay, max(remaining, 0)))
            delay = min(delay * 2, 0.2)


def send_all(sock: socket.socket, data: bytes, deadline: float, what: str) -> None:
    """Blocking send of a small set-up message, bounded by ``deadline``."""
    sock.settimeout(max(deadline - time.monotonic(), 0.001))
    try:
        sock.sendall(data)
    except TimeoutError:
        raise CollectiveTimeout(f"sending to {what} did not finish in time") from None
    finally:
        sock.settimeout(None)


def recv_exact(sock: socket.socket, n: int, deadline: float, what: str) -> bytes:
    """Blocking receive of exactly ``n`` set-up bytes; PeerFailure on EOF."""
    buf = bytearray()
    while len(buf) < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise CollectiveTimeout(f"waiting for {what} timed out")
        ready, _, _ = select.select([sock], [], [], remaining)
        if not ready:
            continue
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise PeerFailure(f"{what} closed the connection during set-up")
        buf += chunk
    return bytes(buf)


HELLO = struct.Struct("!16sIc")  # listener's nonce, connecting rank, connection kind


class TcpLink:
    """A non-blocking byte stream to one peer over a connected socket: TCP, or a Unix-domain
    socket between ranks on one host whose CPU cannot use the shared-memory rings (``kind`` is
    then "unix")."""

    def __init__(self, peer: int, sock: socket.socket, kind: str = "tcp"):
        self.kind = kind
        self.peer = peer
        self.sock = sock
        sock.setblocking(False)
        self.fd = sock.fileno()
        self._staging = np.empty(STAGING + 16, dtype=np.uint8)
        self._stage_mv = memoryview(self._staging)
        self._staged = 0  # bytes in staging not yet reduced (less than one element)
        self._sent = 0
        self._received = 0

    def _dead(self, exc: BaseException | None = None) -> PeerFailure:
        why = f" ({exc})" if exc else ""
        return PeerFailure(f"rank {self.peer} closed its connection{why}", peer=self.peer)

    def send_some(self, mv: memoryview, off: int, end: int, item: int = 1) -> int:
        """Send from ``mv[off:end]`` what the kernel takes now; bytes sent."""
        try:
            n = self.sock.send(mv[off:min(end, off + PIECE)])
        except BlockingIOError:
            return 0
        except (ConnectionError, OSError) as exc:
            raise self._dead(exc) from None
        self._sent += n
        return n

    def _recv_into(self, view: memoryview, want: int) -> int:
        """Up to ``want`` bytes the kernel holds now (0 if none); PeerFailure at end of stream."""
        try:
            n = self.sock.recv_into(view, want)
        except BlockingIOError:
            return 0
        except (ConnectionError, OSError) as exc:
            raise self._dead(exc) from None
        if n == 0:
            raise self._dead()
        self._received += n
        return n

    def recv_copy(self, mv: memoryview, off: int, end: int) -> int:
        """Receive straight into ``mv[off:end]``; bytes received."""
        return self._recv_into(mv[off:end], min(end - off, PIECE))

    def recv_reduce(self, acc: np.ndarray, src: np.ndarray, ufunc, off: int, end: int) -> int:
        """Receive bytes ``off:end`` of a message and fold them into ``acc`` (elements).

        ``acc[i] = ufunc(src[i], incoming[i])``; whole elements are folded as they arrive, a
        partial element waits in the staging buffer. Returns bytes received.
        """
        item = acc.itemsize
        staged = self._staged
        want = min(end - off, STAGING - staged)
        n = self._recv_into(self._stage_mv[staged:staged + want], want)
        if n == 0:
            return 0
        have = staged + n
        whole = have - have % item
        if whole:
            first = (off - staged) // item
            count = whole // item
            incoming = self._staging[:whole].view(acc.dtype)
            ufunc(src[first:first + count], incoming, out=acc[first:first + count])
            rest = have - whole
            if rest:
                self._staging[:rest] = self._staging[whole:have]
            have = rest
        self._staged = have
        return n

    def begin(self, sending: bool, nbytes: int) -> None:
        """A message starts (a byte stream needs no preparation)."""

    def end_send(self) -> None:
        """A message ended (TCP needs no padding)."""

    def end_recv(self) -> None:
        self._staged = 0

    def sent(self) -> int:
        return self._sent

    def received(self) -> int:
        return self._received

    def delivered(self) -> bool:
        """True once the peer's kernel has acknowledged every byte sent (the send queue is
        empty); the peer process may not have read them yet."""
        return self.undelivered() == 0

    def undelivered(self) -> int:
        """Bytes sent but not yet acknowledged by the peer's kernel (0 for Unix sockets, whose
        bytes sit in the receiver's buffer once sent)."""
        if self.kind != "tcp":
            return 0
        try:
            buf = fcntl.ioctl(self.fd, termios.TIOCOUTQ, b"\0\0\0\0")
        except OSError:
            return 0  # closed: nothing more can be learnt here
        return struct.unpack("i", buf)[0]

    def next_frame(self, size: int) -> bytes | None:
        """The first ``size`` bytes of the next unread message, if they have arrived."""
        try:
            head = self.sock.recv(size, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except (BlockingIOError, OSError):
            return None
        return head if len(head) == size else None

    def unread(self) -> int:
        """Bytes that arrived from the peer and were not consumed (at most 64 KiB looked at)."""
        try:
            return len(self.sock.recv(1 << 16, socket.MSG_PEEK | socket.MSG_DONTWAIT))
        except (BlockingIOError, OSError):
            return 0

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
