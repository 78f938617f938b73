"""A backend that only records what reaches it: shows that validation stops bad calls first.

It lets one process play any rank of any world size, so argument checks that depend on the rank
(root ranges, send-to-self, scatter's root-only input) run without spawning a group.
"""

from __future__ import annotations

from gpucoll.backends import Backend
from gpucoll.communicator import Communicator
from gpucoll.work import CompletedWork


class RecordingBackend(Backend):
    name = "recording"
    host_control = True  # the communicator's in-band agreements reach all_gather below

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size
        self.calls: list[tuple] = []
        self.closed = False

    def _record(self, *call) -> None:
        self.calls.append(call)

    def all_reduce(self, x, op, *, timeout, stream=None):
        self._record("all_reduce", x, op)

    def broadcast(self, x, root, *, timeout, stream=None):
        self._record("broadcast", x, root)

    def reduce(self, x, root, op, *, timeout, stream=None):
        self._record("reduce", x, root, op)

    def all_gather(self, x, out, *, timeout, stream=None):
        """Records the call; host buffers come back as if every rank had passed ``x``."""
        self._record("all_gather", x, out)
        if x.host is not None and out.host is not None:
            out.host.reshape(self.size, -1)[:] = x.host

    def gather(self, x, out, root, *, timeout, stream=None):
        self._record("gather", x, out, root)

    def reduce_scatter(self, x, out, op, *, timeout, stream=None):
        self._record("reduce_scatter", x, out, op)

    def send(self, x, dst, *, timeout, stream=None):
        self._record("send", x, dst)

    def recv(self, x, src, *, timeout, stream=None):
        self._record("recv", x, src)

    def barrier(self, *, timeout):
        self._record("barrier")

    def all_reduce_out(self, x, out, op, *, timeout, stream=None):
        self._record("all_reduce_out", x, out, op)

    def reduce_out(self, x, out, root, op, *, timeout, stream=None):
        self._record("reduce_out", x, out, root, op)

    def broadcast_out(self, x, out, root, *, timeout, stream=None):
        self._record("broadcast_out", x, out, root)

    def exchange(self, sends, recvs, layout, *, timeout, stream=None):
        self._record("exchange", sends, recvs, layout)

    def all_gather_v(self, x, out, counts, layout, *, timeout, stream=None):
        self._record("all_gather_v", x, out, counts, layout)

    def reduce_scatter_v(self, x, out, counts, op, layout, *, timeout, stream=None):
        self._record("reduce_scatter_v", x, out, counts, op, layout)

    def all_to_all(self, x, out, *, timeout, stream=None):
        """Records the call; host buffers come back as if every rank had sent ``x``."""
        self._record("all_to_all", x, out)
        if x.host is not None and out.host is not None:
            out.host[:] = x.host

    def scatter(self, x, out, root, *, timeout, stream=None):
        """Records the call; a host ``out`` gets slot 0 of root's ``x`` when this is root."""
        self._record("scatter", x, out, root)
        if x is not None and x.host is not None and out.host is not None:
            out.host[:] = x.host[:out.count]

    def run_async(self, call, *, stream=None):
        call()
        return CompletedWork()

    def run_sync(self, call):
        call()

    def split(self, store, rank, size, color, key, *, timeout):
        return None if color is None else RecordingBackend(rank, size)

    def abort(self, reason):
        self._record("abort", reason)

    def close(self):
        self.closed = True


def recording_comm(rank: int = 0, size: int = 4, timeout: float = 5.0,
                   store=None) -> Communicator:
    """A communicator over a RecordingBackend (without ``store``: not for split, scatter's
    header or debug checks)."""
    return Communicator(RecordingBackend(rank, size), store, timeout=timeout, debug=False)
