"""Server-side socket plumbing: the listening socket, the poller, the open-files limit."""

from __future__ import annotations

import resource
import select
import socket

from gpucoll.errors import StoreError


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
