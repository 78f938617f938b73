"""What a communicator asks of a backend.

The communicator validates every argument once, then hands a backend flat, contiguous buffers
(``ArrayRef``) of one supported dtype, roots in range and sizes that agree, so a backend only
moves and combines bytes. Backends never import the communicator.

Buffer layout, ``n`` = elements of one slot:
  all_reduce/broadcast/reduce   x: n elements, in place (reduce: result meaningful on root)
  all_gather                    x: n, out: size*n (slot i = rank i's x)
  gather                        x: n, out: size*n on root, None elsewhere
  scatter                       x: size*n on root, None elsewhere; out: n
  reduce_scatter                x: size*n, out: n (slot `rank` reduced over ranks)
  all_to_all                    x: size*n, out: size*n (out slot j = rank j's x slot `rank`)
  send/recv                     x: n
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from gpucoll.arrays import ArrayRef
    from gpucoll.ops import ReduceOp
    from gpucoll.work import Work


class Backend(abc.ABC):
    """A communicator's engine for one group of ranks; constructing one is collective."""

    name: ClassVar[str]

    rank: int
    size: int

    @abc.abstractmethod
    def all_reduce(self, x: ArrayRef, op: ReduceOp, *, timeout: float, stream: Any = None) -> None:
        ...

    @abc.abstractmethod
    def broadcast(self, x: ArrayRef, root: int, *, timeout: float, stream: Any = None) -> None:
        ...

    @abc.abstractmethod
    def reduce(
        self, x: ArrayRef, root: int, op: ReduceOp, *, timeout: float, stream: Any = None
    ) -> None:
        ...

    @abc.abstractmethod
    def all_gather(self, x: ArrayRef, out: ArrayRef, *, timeout: float, stream: Any = None) -> None:
        ...

    @abc.abstractmethod
    def gather(
        self, x: ArrayRef, out: ArrayRef | None, root: int, *, timeout: float, stream: Any = None
    ) -> None:
        ...

    @abc.abstractmethod
    def scatter(
        self, x: ArrayRef | None, out: ArrayRef, root: int, *, timeout: float, stream: Any = None
    ) -> None:
        ...

    @abc.abstractmethod
    def reduce_scatter(
        self, x: ArrayRef, out: ArrayRef, op: ReduceOp, *, timeout: float, stream: Any = None
    ) -> None:
        ...

    @abc.abstractmethod
    def all_to_all(self, x: ArrayRef, out: ArrayRef, *, timeout: float, stream: Any = None) -> None:
        ...

    @abc.abstractmethod
    def send(self, x: ArrayRef, dst: int, *, timeout: float, stream: Any = None) -> None:
        ...

    @abc.abstractmethod
    def recv(self, x: ArrayRef, src: int, *, timeout: float, stream: Any = None) -> None:
        ...

    @abc.abstractmethod
    def barrier(self, *, timeout: float) -> None:
        ...

    @abc.abstractmethod
    def run_async(self, call: Callable[[], None], *, stream: Any = None) -> Work:
        """Start ``call`` (one of the methods above, bound) and return its Work handle.

        Work on one backend completes in issue order.
        """

    @abc.abstractmethod
    def run_sync(self, call: Callable[[], None]) -> None:
        """Run ``call`` after every earlier ``run_async`` call of this backend."""

    @abc.abstractmethod
    def split(self, store: Any, rank: int | None, size: int, color: int | None, key: int,
              *, timeout: float) -> Backend | None:
        """Collective over this backend's ranks: the backend of the new group, or None for a
        rank whose ``color`` is None. ``store`` is the new group's namespace."""

    @abc.abstractmethod
    def abort(self, reason: str) -> None:
        """Fail every pending and future call fast with ``reason``; safe from any thread."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release every socket, segment and thread; idempotent; returns even after abort."""
