"""Peer liveness: one thread watches the control connection to every peer.

A peer's process dying closes its sockets, so the connection reads EOF at once (a host that
vanishes is caught by TCP keepalive within seconds). A peer that fails on its own sends an abort
message first; a peer that closes cleanly says so, and its EOF is then expected. The first
failure is recorded in the shared ``State`` and the rank's doorbell is rung, so a collective
blocked in ``Engine.run`` wakes and raises ``PeerFailure`` naming the peer.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import threading

from gpucoll.errors import GpucollError, PeerFailure
from gpucoll.transport.engine import State

CLOSE, ABORT = b"C", b"A"
_ABORT_HEADER = struct.Struct("!Hi")  # reason length, rank the failure started at


def encode_abort(reason: str, culprit: int) -> bytes:
    """An abort message; ``culprit`` is the rank to blame (a dead peer, or the sender)."""
    data = reason.encode("utf-8", "replace")[:4000]
    return ABORT + _ABORT_HEADER.pack(len(data), culprit) + data


class Monitor:
    """Watches ``control`` sockets from a daemon thread until ``stop()``."""

    def __init__(self, rank: int, control: dict[int, socket.socket], bell: int, state: State):
        self.rank = rank
        self.control = control
        self.bell = bell
        self.state = state
        self._buffers = {peer: b"" for peer in control}
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
            if buf[:1] == CLOSE:
                self.state.closed_peers.add(peer)
                self._wake()
                buf = buf[1:]
            elif buf[:1] == ABORT:
                head = 1 + _ABORT_HEADER.size
                if len(buf) < head:
                    break
                n, culprit = _ABORT_HEADER.unpack(buf[1:head])
                if len(buf) < head + n:
                    break
                reason = buf[head:head + n].decode("utf-8", "replace")
                if culprit == peer:
                    self._fail(peer, f"rank {peer} aborted: {reason}")
                else:  # the peer gave up because of another rank: blame that one
                    self._fail(culprit, f"rank {culprit} failed (reported by rank {peer})")
                buf = buf[head + n:]
            else:
                self._fail(peer, f"rank {peer} sent an unexpected control message {buf[:8]!r}")
                return False
        self._buffers[peer] = buf
        return True

    def _fail(self, peer: int, message: str) -> None:
        if self.state.failure is None:
            self.state.failure = PeerFailure(message, peer=peer)
        self._wake()

    def _wake(self) -> None:
        try:
            os.eventfd_write(self.bell, 1)
        except OSError:
            pass

    def broadcast(self, message: bytes) -> None:
        """Best-effort send of a control message to every peer; never blocks for long."""
        for sock in self.control.values():
            try:
                sock.settimeout(0.2)
                sock.sendall(message)
            except OSError:
                pass

    def stop(self) -> None:
        """End the thread and wait for it; idempotent."""
        if self._stop_w >= 0:
            os.write(self._stop_w, b"x")
            self._thread.join(timeout=5)
            os.close(self._stop_w)
            os.close(self._stop_r)
            self._stop_w = self._stop_r = -1
