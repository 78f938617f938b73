"""Peer liveness: one thread watches the control connection to every peer.

A peer's process dying closes its sockets, so the connection reads EOF at once (a host that
vanishes is caught by TCP keepalive within seconds). A peer that fails on its own sends an abort
message first, saying what kind of failure (so that every rank raises the same kind of error) and
which rank is to blame; a peer that closes cleanly says so, with how many bytes of ours it had
consumed (anything more that we sent is lost, and we say so). The first failure is recorded in
the shared ``State`` and the rank's doorbell is rung, so a call blocked in ``Engine.run`` wakes
and raises. The monitor also answers a peer's question "where are you?" with this rank's
``Progress`` record, even while the rank's main thread is busy elsewhere.

Messages (one byte of type, then a fixed layout):
  C  u64 bytes consumed from the receiver of this message    clean close
  A  u8 kind, i32 culprit, u64 bytes consumed (as C),
     u16 length, reason (UTF-8)                              abort
  Q                                                          where are you?
  P  the asker's Progress record                             answer to Q
"""

from __future__ import annotations

import os
import select
import socket
import struct
import threading

from gpucoll.errors import CollectiveMismatch, CollectiveTimeout, GpucollError, PeerFailure
from gpucoll.progress import SLOTS, Progress
from gpucoll.transport.engine import State

CLOSE, ABORT, QUERY, POSITION = b"C", b"A", b"Q", b"P"
_CLOSE = struct.Struct("!Q")
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


def encode_close(consumed: int) -> bytes:
    return CLOSE + _CLOSE.pack(consumed)


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
            self._fail(peer, f"rank {peer}'s connection broke ({exc})")
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
            self._closed(peer, _CLOSE.unpack_from(buf, 1)[0])
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

    def _closed(self, peer: int, consumed: int) -> None:
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
