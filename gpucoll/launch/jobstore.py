"""The job's key-value store: node 0's launcher hosts it; the ranks (and other nodes) connect.

The launcher, not rank 0, hosts the store, so it is up before any rank starts and outlives a
rank that fails. A fresh random token keeps other jobs' ranks out of it. In a job of several
nodes the launchers also meet there: a node whose rank fails posts an abort that stops the
ranks of every other node, and node 0 keeps the store up until every node has finished.
"""

from __future__ import annotations

import dataclasses
import queue
import secrets
import socket
import threading

from gpucoll.errors import StoreError
from gpucoll.launch.config import LaunchConfig

JOIN_TIMEOUT = 300.0  # how long another node's launcher waits for node 0's store
PREFIX = "gpucoll-launch/"
ABORT = PREFIX + "abort"


def new_token() -> str:
    return secrets.token_hex(16)


@dataclasses.dataclass(frozen=True)
class RemoteAbort:
    """Another node's launcher stopped the job: its exit status and why."""

    status: int
    reason: str


class JobStore:
    """The store as the launchers use it; ``address`` is what the ranks connect to."""

    def __init__(self, cfg: LaunchConfig, token: str):
        from gpucoll.store import TCPStore

        self.cfg = cfg
        if cfg.node_rank == 0:
            bind = cfg.master_addr if cfg.nnodes == 1 else "0.0.0.0"
            self.store = TCPStore(bind, cfg.master_port, is_server=True, token=token)
        else:
            self.store = TCPStore(cfg.master_addr, cfg.master_port, token=token,
                                  timeout=JOIN_TIMEOUT)
        self.address = (cfg.master_addr, self.store.port)
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    def watch(self, events: queue.SimpleQueue) -> None:
        """Post a :class:`RemoteAbort` on ``events`` if another node aborts the job."""
        if self.cfg.nnodes > 1:
            self._watcher = threading.Thread(target=self._watch, args=(events,), daemon=True,
                                             name="gpucoll-abort-watch")
            self._watcher.start()

    def _watch(self, events: queue.SimpleQueue) -> None:
        while not self._stop.is_set():
            try:
                self.store.wait([ABORT], timeout=0.5)
            except TimeoutError:
                continue
            except StoreError:
                return  # the store went away: node 0 finished; nothing more to hear
            status, _, reason = self.store.get(ABORT).decode().partition(":")
            events.put(RemoteAbort(int(status), reason))
            return

    def abort(self, status: int, reason: str) -> None:
        """Tell every other node to stop its ranks (the first abort wins)."""
        if self.cfg.nnodes > 1:
            self.store.compare_set(ABORT, b"", f"{status}:{reason}".encode())

    def finish(self, status: int) -> int:
        """Record this node's exit status; node 0 waits for the others (the store is theirs
        too) and returns the first non-zero status among the nodes."""
        self._stop.set()
        if self.cfg.nnodes == 1:
            return status
        self.store.set(f"{PREFIX}done/{self.cfg.node_rank}", str(status))
        if self.cfg.node_rank != 0:
            return status
        keys = [f"{PREFIX}done/{k}" for k in range(self.cfg.nnodes)]
        self.store.wait(keys, timeout=JOIN_TIMEOUT)
        statuses = [int(v) for v in self.store.multi_get(keys)]
        return next((s for s in statuses if s), 0)

    def close(self) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=5)
        self.store.close()


def torch_port(cfg: LaunchConfig, store_port: int) -> int:
    """``MASTER_PORT`` for torch.distributed scripts: next to the store's port, or a free one.

    Every node must compute the same value, so a job of several nodes uses store port + 1.
    """
    if cfg.nnodes > 1 or cfg.master_port:
        return store_port + 1
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((cfg.master_addr, 0))
        return s.getsockname()[1]
