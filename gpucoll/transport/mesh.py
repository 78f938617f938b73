"""Connect every rank of a group to every other, meeting through the store.

Each rank publishes where it listens (a TCP port and an abstract Unix socket name, which leaves no
file behind), which host it runs on (hostname + boot id), and its process id with the descriptor
of its progress record, so that a peer on the same host can read that record even while the rank
is stopped (``progress_of``). Every pair then gets a control connection, watched for liveness by
the monitor (``Monitor``, below), and a data link: shared-memory rings when both ranks share a
host with a CPU whose stores are seen in order (``shm.ordered_cpu``), a Unix-domain socket when
they share a host with a weakly ordered CPU, a TCP connection otherwise or when TCP is forced. The
higher rank of a pair connects; the lower accepts, so set-up never waits in a cycle.

The monitor's one thread watches the control connection to every peer: a peer that dies reads
EOF at once (a vanished host is caught by TCP keepalive and TCP_USER_TIMEOUT within
``GPUCOLL_LINK_TIMEOUT`` seconds, ``link_timeout``), one that fails sends an
abort message first (the kind of failure and the rank to blame, so that every rank raises the
same kind of error), and one that closes cleanly says how many of our bytes it had consumed; the
first failure is recorded in the shared ``State`` and the rank's doorbell is rung, so a call
blocked in ``Engine.run`` wakes and raises. It also answers a peer's "where are you?" with this
rank's ``Progress`` record, even while the rank's main thread is busy elsewhere.

The TCP side lives here too: socket set-up helpers and ``TcpLink``, a non-blocking byte link
(over TCP, or over a Unix-domain socket). Links never block: ``send_some``/``recv_*`` move what
the kernel accepts now and return, so one thread can drive a send and a receive at the same time
(a ring step never deadlocks on full socket buffers). Waiting happens in
``gpucoll.transport.engine``.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import select
import socket
import struct
import termios
import threading
import time
import uuid
from collections.abc import Callable

import numpy as np

from gpucoll.errors import (
    BackendUnavailable,
    CollectiveMismatch,
    CollectiveTimeout,
    GpucollError,
    PeerFailure,
)
from gpucoll.progress import SLOTS, Progress
from gpucoll.store import POLL, Liveness, gather
from gpucoll.store.forks import drop_when_forked
from gpucoll.transport import shm
from gpucoll.transport.engine import State

TRANSPORTS = ("auto", "shm", "tcp")
# how long a rank whose set-up connection broke waits for the store to say which peer went
BLAME_WAIT = 2.0
CONTROL, DATA = b"c", b"d"
HELLO_WAIT = 5.0  # seconds a connection to a rank's listener has to present its hello
BACKLOG = 128  # room in a listener's queue beyond our ranks' connections, for strays
MAX_PENDING = 256  # connections waiting for their hello at once; beyond, the oldest is dropped
log = logging.getLogger("gpucoll.transport")


def host_identity() -> str:
    """Same string on two ranks = same kernel, so shared memory can join them.

    GPUCOLL_HOST_ID replaces it (e.g. to keep containers that share a kernel apart)."""
    override = os.environ.get("GPUCOLL_HOST_ID")
    if override:
        return override
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{boot}"


def check_environment() -> None:
    """ValueError for a malformed transport variable (GPUCOLL_TRANSPORT, GPUCOLL_LINK_TIMEOUT,
    GPUCOLL_NATIVE, GPUCOLL_SHM_RING_BYTES), before a rank waits for anyone."""
    resolve_transport("auto")
    link_timeout()
    shm.native()
    shm.ring_bytes_from_env()


def resolve_transport(transport: str) -> str:
    """``transport="auto"`` defers to GPUCOLL_TRANSPORT; ValueError on anything unknown."""
    if transport == "auto":
        transport = os.environ.get("GPUCOLL_TRANSPORT", "auto").strip() or "auto"
        source = "GPUCOLL_TRANSPORT"
    else:
        source = "transport"
    if transport.lower() not in TRANSPORTS:
        raise ValueError(f"{source}={transport!r} is not one of {', '.join(TRANSPORTS)}")
    return transport.lower()


def _store_host(store) -> str | None:
    """The store's host, looked up through PrefixStore-like wrappers."""
    seen = 0
    while store is not None and seen < 8:
        host = getattr(store, "host", None)
        if isinstance(host, str):
            return host
        store = getattr(store, "store", None) or getattr(store, "_store", None)
        seen += 1
    return None


def advertised_host(store) -> str:
    """The address other hosts reach this rank at: GPUCOLL_HOST_ADDR, else the local address
    of the route to the store, else the hostname's address."""
    env = os.environ.get("GPUCOLL_HOST_ADDR")
    if env:
        return env
    target = _store_host(store)
    if target:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((target, 9))  # no packet is sent: this only picks a route
                return probe.getsockname()[0]
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _listen_unix(name: str, backlog: int) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind("\0" + name)
    sock.listen(backlog)
    return sock


class Mesh:
    """Every connection of one rank: ``control[peer]``, ``links[peer]``, own doorbell."""

    def __init__(self, store, rank: int, size: int, *, timeout: float, transport: str = "auto",
                 progress_fd: int = -1, liveness=None):
        self.rank, self.size = rank, size
        self.transport = resolve_transport(transport)
        self.control: dict[int, socket.socket] = {}
        self.links: list = [None] * size
        self.outboxes: shm.Outboxes | None = None  # set when every peer shares this host
        self.bell = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.local_ranks = 1
        self.peers: list[dict] = []  # every rank's published facts (host, pid, progress fd)
        self._progress_fd = progress_fd
        self._liveness = liveness
        self._listeners: list[socket.socket] = []
        self._unwrapped: dict[int, socket.socket] = {}
        self.strays = 0  # connections to our listeners dropped for want of a valid hello
        drop_when_forked(self)
        try:
            self._build(store, timeout)
        except BaseException:
            self.close()
            raise
        finally:
            for sock in self._listeners:
                sock.close()
            self._listeners = []

    # -- set-up ----------------------------------------------------------------------------
    def _build(self, store, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        rank, size = self.rank, self.size
        nonce = uuid.uuid4().bytes
        prefix = os.environ.get("GPUCOLL_SHM_PREFIX", "gpucoll")
        tcp_listener = listen_tcp(2 * size + BACKLOG)
        self._listeners.append(tcp_listener)
        unix_name = f"{prefix[:40]}-{nonce.hex()}-{rank}"  # abstract names hold 107 bytes
        self._listeners.append(_listen_unix(unix_name, 2 * size + BACKLOG))
        if self._liveness is None:  # a rank that dies during set-up is named at once
            self._liveness = Liveness.of(store, rank, size)
        me = {"host": advertised_host(store), "port": tcp_listener.getsockname()[1],
              "unix": unix_name, "id": host_identity(), "nonce": nonce.hex(),
              "pid": os.getpid(), "progress": self._progress_fd}
        store.set(f"ring/addr/{rank}", json.dumps(me))
        peers = self.peers = self._gather_addresses(store, deadline)
        kinds = [self._pair_kind(me, peers[j], j) for j in range(size)]
        self.local_ranks = sum(1 for p in peers if p["id"] == me["id"])
        data = self._unwrapped  # data sockets until they become links (closed on failure)
        try:
            for j in range(rank):
                self._connect(j, peers[j], kinds[j], data, deadline)
            self._accept(kinds, nonce, data, deadline)
            for j in list(data):
                self.links[j] = TcpLink(j, data.pop(j), kind=kinds[j])
            shm_peers = [j for j in range(size) if kinds[j] == "shm"]
            if shm_peers:
                self._share_rings(shm_peers, prefix, deadline)
        except (OSError, PeerFailure) as exc:
            raise self._blame(exc) from None

    def _blame(self, exc: BaseException) -> PeerFailure:
        """The PeerFailure for a set-up connection that broke (``exc``): it names the rank whose
        will the store sets (a killed peer's comes within moments of its death), else the
        connection's own error."""
        if self._liveness is not None:
            until = time.monotonic() + BLAME_WAIT
            while True:
                try:
                    self._liveness.check("ring set-up")
                except PeerFailure as failure:
                    return failure
                except (GpucollError, OSError):
                    break  # a store that cannot answer: the connection's error is all we know
                if time.monotonic() >= until:
                    break
                time.sleep(0.05)  # the will of a peer whose connection just broke is on its way
        if isinstance(exc, PeerFailure):
            return exc
        return PeerFailure(f"ring set-up on rank {self.rank} of {self.size}: a connection to a "
                           f"peer broke ({exc})")

    def _gather_addresses(self, store, deadline: float) -> list[dict]:
        keys = [f"ring/addr/{j}" for j in range(self.size)]
        values = gather(store, keys, max(deadline - time.monotonic(), 0.001), what="ring set-up",
                        rank=self.rank, absent="did not publish an address",
                        liveness=self._liveness)
        return [json.loads(v) for v in values]

    def _pair_kind(self, me: dict, peer: dict, j: int) -> str | None:
        if j == self.rank:
            return None
        same = me["id"] == peer["id"]
        if self.transport == "shm" and not same:
            raise BackendUnavailable(
                f"transport='shm' needs every rank on one host, but rank {j} runs on "
                f"{peer['id'].split('/')[0]} and rank {self.rank} on {me['id'].split('/')[0]}")
        if not same or self.transport == "tcp":
            return "tcp"
        if shm.ordered_cpu():
            return "shm"
        if self.transport == "shm":
            raise BackendUnavailable(
                "transport='shm' is not safe on this CPU: its memory model does not keep stores "
                "in order, which the shared-memory rings rely on (gpucoll.transport.shm); leave "
                "GPUCOLL_TRANSPORT unset to join ranks on one host with Unix-domain sockets")
        return "unix"

    def same_host(self, j: int) -> bool:
        """True when rank ``j`` runs on this rank's host (its memory can be read from here)."""
        return self.peers[j]["id"] == self.peers[self.rank]["id"]

    def _connect(self, j: int, peer: dict, kind: str, data: dict, deadline: float) -> None:
        what = f"rank {j}"
        hello = bytes.fromhex(peer["nonce"])
        channels = (CONTROL,) if kind == "shm" else (CONTROL, DATA)
        for channel in channels:
            if kind == "tcp":
                sock = connect_tcp(peer["host"], peer["port"], deadline, what,
                                   check=lambda: self._check_alive([j]))
            else:
                sock = self._connect_unix(j, peer, deadline)
            (self.control if channel == CONTROL else data)[j] = sock
            send_all(sock, HELLO.pack(hello, self.rank, channel), deadline, what)

    def _connect_unix(self, j: int, peer: dict, deadline: float) -> socket.socket:
        """Connect to rank ``j``'s abstract Unix socket; a full backlog (other connections not
        yet accepted) is retried until ``deadline``."""
        delay = 0.01
        while True:
            try:
                return self._try_unix(j, peer, deadline)
            except BlockingIOError:
                if time.monotonic() + delay >= deadline:
                    raise CollectiveTimeout(
                        f"ring set-up on rank {self.rank}: rank {j}'s Unix socket accepted no "
                        f"connection in time") from None
                self._check_alive([j])
                time.sleep(delay)
                delay = min(delay * 2, 0.2)

    def _try_unix(self, j: int, peer: dict, deadline: float) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            sock.connect("\0" + peer["unix"])
            sock.settimeout(None)
        except BlockingIOError:
            sock.close()
            raise
        except OSError as exc:
            sock.close()
            raise PeerFailure(
                f"ring set-up on rank {self.rank}: cannot reach rank {j} over its Unix socket "
                f"({exc}): it has exited, or it shares this host's name and kernel but not its "
                f"network namespace (then set GPUCOLL_HOST_ID per container, or "
                f"GPUCOLL_TRANSPORT=tcp)", peer=j) from None
        except BaseException:
            sock.close()
            raise
        return sock

    def _accept(self, kinds: list, nonce: bytes, data: dict, deadline: float) -> None:
        """Accept the connections of the higher ranks. Each must present its hello (our nonce,
        its rank, the channel) within ``HELLO_WAIT`` seconds; one that closes, sends something
        else or stays silent (a port scanner, a health check) is dropped and counted in
        ``strays`` while set-up goes on."""
        expected = set()
        for j in range(self.rank + 1, self.size):
            expected.add((j, CONTROL))
            if kinds[j] != "shm":
                expected.add((j, DATA))
        pending: dict[socket.socket, tuple[bytearray, float]] = {}  # sock -> (hello, until)
        for listener in self._listeners:
            listener.setblocking(False)
        try:
            while expected:
                now = time.monotonic()
                remaining = deadline - now
                if remaining <= 0:
                    missing = sorted({j for j, _ in expected})
                    raise CollectiveTimeout(
                        f"ring set-up on rank {self.rank}: ranks {missing} did not connect in "
                        f"time")
                for sock, (_, until) in list(pending.items()):
                    if now >= until:
                        self._stray(pending, sock, f"sent no hello in {HELLO_WAIT:g} s")
                wait = min([remaining, POLL, *(until - now for _, until in pending.values())])
                ready, _, _ = select.select([*self._listeners, *pending], [], [], max(wait, 0))
                if not ready:
                    self._check_alive(sorted({j for j, _ in expected}))
                for sock in ready:
                    if sock in pending:
                        self._read_hello(sock, pending, nonce, expected, data)
                        continue
                    try:
                        conn, _ = sock.accept()
                    except OSError:  # gone again before we took it (or nothing there)
                        continue
                    conn.setblocking(False)
                    if len(pending) >= MAX_PENDING:  # a flood: the oldest silent one goes
                        self._stray(pending, next(iter(pending)), "was crowded out")
                    pending[conn] = (bytearray(), now + HELLO_WAIT)
        finally:
            for sock in pending:
                sock.close()

    def _read_hello(self, sock: socket.socket, pending: dict, nonce: bytes, expected: set,
                    data: dict) -> None:
        """Read what a pending connection sent; keep it once its hello is whole and ours."""
        buf, _ = pending[sock]
        try:
            chunk = sock.recv(HELLO.size - len(buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._stray(pending, sock, "closed before its hello")
            return
        buf += chunk
        if len(buf) < HELLO.size:
            return
        got, j, channel = HELLO.unpack(buf)
        if got != nonce or (j, channel) not in expected:
            self._stray(pending, sock, "sent no valid hello")  # a stray, or a repeat
            return
        del pending[sock]
        sock.setblocking(True)
        if sock.family == socket.AF_INET:
            tune(sock)
        expected.discard((j, channel))
        (self.control if channel == CONTROL else data)[j] = sock

    def _stray(self, pending: dict, sock: socket.socket, why: str) -> None:
        """Drop a connection that is not one of our ranks', and say so at debug level."""
        del pending[sock]
        try:
            peer = sock.getpeername()
        except OSError:
            peer = "?"
        sock.close()
        self.strays += 1
        log.debug("ring set-up on rank %d: dropped a connection from %s that %s (%d so far)",
                  self.rank, peer or "a local process", why, self.strays)

    def _check_alive(self, ranks: list[int]) -> None:
        """PeerFailure if one of ``ranks`` died or left since set-up began (its store will)."""
        if self._liveness is not None:
            self._liveness.check("ring set-up", ranks)

    def _share_rings(self, shm_peers: list[int], prefix: str, deadline: float) -> None:
        """Create each inbound ring, pass it, our doorbell and (when every peer is on this
        host) our outbox to the peer, map theirs."""
        cap = shm.ring_bytes(len(shm_peers))
        inbound: dict[int, shm.Ring] = {}
        boxes: dict[int, shm.Ring] = {}
        whole = len(shm_peers) == self.size - 1
        box_fd = shm.create_segment(f"{prefix}-outbox-{self.rank}", shm.OUTBOX) if whole else -1
        try:
            if whole:
                boxes[self.rank] = shm.Ring(box_fd)
            for j in shm_peers:
                fd = shm.create_segment(f"{prefix}-ring-{j}to{self.rank}", cap)
                try:
                    inbound[j] = shm.Ring(fd)
                    socket.send_fds(self.control[j], [b"R"], [fd, self.bell, box_fd][:2 + whole])
                finally:
                    os.close(fd)
            for j in shm_peers:
                self._map_peer(j, inbound, boxes, 2 + whole, deadline)
        except BaseException:
            for ring in [*inbound.values(), *boxes.values()]:
                ring.close()
            raise
        finally:
            if box_fd >= 0:
                os.close(box_fd)
        if whole:
            self.outboxes = shm.Outboxes(self.rank, boxes, self.links)

    def _map_peer(self, j: int, inbound: dict, boxes: dict, nfds: int, deadline: float) -> None:
        """Receive rank ``j``'s ring (its doorbell, its outbox) and make the link."""
        sock = self.control[j]
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 1, nfds)
        except TimeoutError:
            raise CollectiveTimeout(
                f"ring set-up on rank {self.rank}: rank {j} did not share its memory in time"
            ) from None
        finally:
            sock.settimeout(None)
        if msg != b"R" or len(fds) != nfds:
            for fd in fds:
                os.close(fd)
            raise PeerFailure(f"rank {j} left during ring set-up", peer=j)
        ring_fd, peer_bell, *box = fds
        try:
            outbound = shm.Ring(ring_fd)
            if box:
                boxes[j] = shm.Ring(box[0])
        except BaseException:
            os.close(peer_bell)
            raise
        finally:
            os.close(ring_fd)
            if box:
                os.close(box[0])
        self.links[j] = shm.ShmLink(j, outbound, inbound.pop(j), peer_bell)

    def progress_of(self, j: int) -> bytes | None:
        """Rank ``j``'s progress record read from its memory (same host only; works while it is
        stopped), or None when it cannot be read."""
        peer = self.peers[j] if self.peers else None
        if peer is None or peer.get("progress", -1) < 0 or not self.same_host(j):
            return None
        try:
            fd = os.open(f"/proc/{peer['pid']}/fd/{peer['progress']}", os.O_RDONLY)
        except OSError:
            return None
        try:
            return os.pread(fd, 64, 0)
        except OSError:
            return None
        finally:
            os.close(fd)

    # -- tear-down -------------------------------------------------------------------------
    def drop_inherited(self) -> None:
        """Close this process's copies of every socket and the doorbell, telling nobody."""
        socks = [*self.control.values(), *self._unwrapped.values(), *self._listeners]
        socks += [link.sock for link in self.links if link is not None and link.kind == "tcp"]
        for sock in socks:
            try:
                sock.close()
            except OSError:
                pass
        for link in self.links:
            if link is not None and link.kind == "shm" and link.bell >= 0:
                os.close(link.bell)
                link.bell = -1  # the number may be reused by the child's own files
        if self.bell >= 0:
            os.close(self.bell)
            self.bell = -1

    def close(self) -> None:
        """Close every link, control connection and the doorbell; idempotent."""
        if self.outboxes is not None:
            self.outboxes.close()
            self.outboxes = None
        for i, link in enumerate(self.links):
            if link is not None:
                link.close()
                self.links[i] = None
        for sock in self.control.values():
            try:
                sock.close()
            except OSError:
                pass
        self.control = {}
        for sock in self._unwrapped.values():
            sock.close()
        self._unwrapped = {}
        if self.bell >= 0:
            os.close(self.bell)
            self.bell = -1


# -- TCP: socket set-up helpers and a non-blocking byte link -----------------------------------
SOCKET_BUFFER = 4 << 20  # the kernel clamps this to net.core.[rw]mem_max
PIECE = 1 << 20  # bytes handed to one send()/recv() call
STAGING = 1 << 20  # receive buffer for reductions over TCP


LINK_TIMEOUT = 15.0  # default of GPUCOLL_LINK_TIMEOUT
KEEPIDLE = 2  # seconds of silence before the first keepalive probe, then one a second


def link_timeout() -> float:
    """GPUCOLL_LINK_TIMEOUT: seconds a TCP connection between ranks may go unanswered (no reply
    to a keepalive probe, data unacknowledged) before its peer is taken for lost (default 15).
    ValueError unless it is a number of seconds from 3 to 86400."""
    raw = os.environ.get("GPUCOLL_LINK_TIMEOUT", "").strip()
    if not raw:
        return LINK_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not 3 <= value <= 86400:  # also refuses NaN
        raise ValueError(f"GPUCOLL_LINK_TIMEOUT={raw!r}: expected the seconds a connection "
                         f"between hosts may go unanswered before its peer is taken for lost, "
                         f"a number from 3 to 86400")
    return value


def broken(exc: BaseException) -> str:
    """Why a connection broke, in words: a timeout says whose silence it was."""
    if isinstance(exc, OSError) and exc.errno == errno.ETIMEDOUT:
        return (f"no answer from its host for {link_timeout():g} s, GPUCOLL_LINK_TIMEOUT: the "
                f"host is down or unreachable")
    return str(exc)


def tune(sock: socket.socket) -> None:
    """Low latency and large buffers on a data or control connection; a peer whose host stops
    answering is taken for lost after ``link_timeout()`` seconds, whether the connection is idle
    (keepalive probes go unanswered) or busy (data stays unacknowledged). Lost packets alone do
    not end it: TCP retransmits them, and one answer in that time is enough."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
    timeout = link_timeout()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    # with TCP_USER_TIMEOUT set, Linux ends a probed connection once nothing has been received
    # for that long, whatever the probe count; the count is for systems without it. A probe
    # goes out every second, so the end comes within a second of the timeout: aim a second short
    user_ms = int((timeout - 1) * 1000)
    options = (("TCP_KEEPIDLE", KEEPIDLE), ("TCP_KEEPINTVL", 1),
               ("TCP_KEEPCNT", min(max(int(timeout) - 1 - KEEPIDLE, 1), 127)),
               ("TCP_USER_TIMEOUT", user_ms))
    for name, value in options:
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
        if isinstance(exc, OSError) and exc.errno == errno.ETIMEDOUT:
            return PeerFailure(f"rank {self.peer}'s connection broke ({broken(exc)})",
                               peer=self.peer)
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


# -- peer liveness: the monitor on the control connections -----------------------------------------
# Messages (one byte of type, then a fixed layout):
#   C  u64 bytes consumed from the receiver of this message,
#      i64 the latest collective entered (-1: none, or failed)  clean close
#   A  u8 kind, i32 culprit, u64 bytes consumed (as C),
#      u16 length, reason (UTF-8)                              abort
#   Q                                                          where are you?
#   P  the asker's Progress record                             answer to Q
CLOSE, ABORT, QUERY, POSITION = b"C", b"A", b"Q", b"P"
_CLOSE = struct.Struct("!Qq")
_ABORT = struct.Struct("!BiQH")  # failure kind, rank to blame, bytes consumed, reason length
_POSITION_BYTES = 8 * SLOTS
# abort kinds: the class a peer's failure is re-raised as on every rank (a timeout and a
# mismatch keep their kind; anything else, an interrupt included, is a failed peer)
_KINDS = (PeerFailure, CollectiveTimeout, CollectiveMismatch)


def encode_abort(error: BaseException, culprit: int, consumed: int = 0) -> bytes:
    """An abort message for ``error``; ``culprit`` is the rank to blame (a dead or stuck peer,
    or the sender itself); ``consumed``: bytes of the receiver's data this rank consumed."""
    kind = next((i for i, cls in enumerate(_KINDS) if isinstance(error, cls)), 0)
    data = f"{type(error).__name__}: {error}".encode("utf-8", "replace")[:4000]
    return ABORT + _ABORT.pack(kind, culprit, consumed, len(data)) + data


def encode_close(consumed: int, last_call: int = -1) -> bytes:
    """A clean close: ``consumed`` as in an abort; ``last_call``: the latest collective this
    rank entered, all of whose calls it finished (-1 to claim none)."""
    return CLOSE + _CLOSE.pack(consumed, last_call)


class Monitor:
    """Watches ``control`` sockets from a daemon thread until ``stop()``.

    ``unconsumed(peer, consumed)`` says how many bytes this rank sent to ``peer`` beyond the
    ``consumed`` the peer reported at its close; ``progress`` is this rank's record.
    """

    def __init__(self, rank: int, control: dict[int, socket.socket], bell: int, state: State,
                 progress: Progress | None = None, unconsumed=lambda peer, consumed: 0):
        self.rank = rank
        self.control = control
        self.bell = bell
        self.state = state
        self.progress = progress or Progress()
        self.unconsumed = unconsumed
        self.answers: dict[int, bytes] = {}  # peer -> its Progress record, after ask()
        self._buffers = {peer: b"" for peer in control}
        self._send_locks = {peer: threading.Lock() for peer in control}
        self._stop_r, self._stop_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name=f"gpucoll-monitor-{rank}",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as exc:  # noqa: BLE001 - without the monitor, failures would go unseen
            if self.state.failure is None:
                self.state.failure = GpucollError(f"rank {self.rank}'s peer monitor stopped: "
                                                  f"{type(exc).__name__}: {exc}")
            self._wake()

    def _loop(self) -> None:
        poller = select.poll()
        by_fd = {}
        for peer, sock in self.control.items():
            poller.register(sock.fileno(), select.POLLIN)
            by_fd[sock.fileno()] = peer
        poller.register(self._stop_r, select.POLLIN)
        while True:
            for fd, _ in poller.poll():
                if fd == self._stop_r:
                    return
                peer = by_fd[fd]
                if not self._read(peer):
                    poller.unregister(fd)

    def _read(self, peer: int) -> bool:
        """Handle what ``peer`` sent; False once its connection is finished."""
        try:
            chunk = self.control[peer].recv(65536)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError as exc:
            self._fail(peer, f"rank {peer}'s connection broke ({broken(exc)})")
            self.state.ended.add(peer)
            return False
        if not chunk:
            if peer not in self.state.closed_peers:
                self._fail(peer, f"rank {peer} died or lost its connection")
            self.state.ended.add(peer)
            self._wake()
            return False
        buf = self._buffers[peer] + chunk
        while buf:
            used = self._message(peer, buf)
            if used is None:
                return False
            if used == 0:
                break
            buf = buf[used:]
        self._buffers[peer] = buf
        return True

    def _message(self, peer: int, buf: bytes) -> int | None:
        """Handle the message at the start of ``buf``: bytes used, 0 if incomplete, None if the
        peer speaks nonsense (it is then failed)."""
        kind = buf[:1]
        if kind == CLOSE:
            if len(buf) < 1 + _CLOSE.size:
                return 0
            self._closed(peer, *_CLOSE.unpack_from(buf, 1))
            return 1 + _CLOSE.size
        if kind == ABORT:
            head = 1 + _ABORT.size
            if len(buf) < head:
                return 0
            code, culprit, consumed, n = _ABORT.unpack_from(buf, 1)
            if len(buf) < head + n:
                return 0
            self.state.consumed[peer] = consumed
            self._aborted(peer, code, culprit, buf[head:head + n].decode("utf-8", "replace"))
            return head + n
        if kind == QUERY:
            self.send(peer, POSITION + self.progress.encode())
            return 1
        if kind == POSITION:
            if len(buf) < 1 + _POSITION_BYTES:
                return 0
            self.answers[peer] = buf[1:1 + _POSITION_BYTES]
            self._wake()
            return 1 + _POSITION_BYTES
        self._fail(peer, f"rank {peer} sent an unexpected control message {buf[:8]!r}")
        return None

    def _closed(self, peer: int, consumed: int, last_call: int) -> None:
        self.state.closed_after[peer] = last_call  # (before closed_peers, which the engine reads)
        self.state.closed_peers[peer] = consumed
        self.state.consumed[peer] = consumed
        lost = self.unconsumed(peer, consumed)
        if lost > 0 and self.state.failure is None:
            self.state.failure = self.state.close_failure = PeerFailure(
                f"rank {peer} closed its communicator without receiving {lost} bytes this rank "
                f"sent it", peer=peer)
        self._wake()

    def _aborted(self, peer: int, code: int, culprit: int, reason: str) -> None:
        cls = _KINDS[code] if code < len(_KINDS) else PeerFailure
        if culprit == peer:
            message = f"rank {peer} failed: {reason}"
        else:  # the peer gave up because of another rank: name both
            message = f"rank {peer} reported a failure caused by rank {culprit}: {reason}"
        if self.state.failure is None:
            error = PeerFailure(message, culprit) if cls is PeerFailure else cls(message)
            error.peer = culprit
            self.state.failure = error
        self._wake()

    def _fail(self, peer: int, message: str) -> None:
        if self.state.failure is None:
            self.state.failure = PeerFailure(message, peer=peer)
        self._wake()

    def _wake(self) -> None:
        try:
            os.eventfd_write(self.bell, 1)
        except OSError:
            pass

    # -- sending ---------------------------------------------------------------------------
    def send(self, peer: int, message: bytes) -> bool:
        """Best-effort send of a control message to ``peer``; never blocks for long."""
        sock = self.control.get(peer)
        if sock is None:
            return False
        with self._send_locks[peer]:
            try:
                sock.settimeout(0.2)
                sock.sendall(message)
                return True
            except OSError:
                return False

    def broadcast(self, message: bytes) -> None:
        """Best-effort send of a control message to every peer."""
        for peer in self.control:
            self.send(peer, message)

    def ask(self, peers: list[int]) -> list[int]:
        """Ask ``peers`` where they are (answers land in ``answers``); the peers asked."""
        for peer in peers:
            self.answers.pop(peer, None)
        return [peer for peer in peers if self.send(peer, QUERY)]

    def stop(self) -> None:
        """End the thread and wait for it; idempotent."""
        if self._stop_w >= 0:
            os.write(self._stop_w, b"x")
            self._thread.join(timeout=5)
            os.close(self._stop_w)
            os.close(self._stop_r)
            self._stop_w = self._stop_r = -1
