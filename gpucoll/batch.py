"""Non-blocking and batched point to point: ``isend``/``irecv``, ``with comm.batch():`` and
torch's ``batch_isend_irecv`` with ``P2POp``.

Every send and receive of a batch is checked when it is made and posted together when the batch
ends (one NCCL group on GPUs; on the host ring they all progress side by side), so a ring of
exchanges written with them cannot deadlock however large the messages. Each returns a ``Work``
whose ``wait()`` gives what ``send``/``recv`` would return (None, or the receiving array).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from gpucoll.errors import UsageError
from gpucoll.validation import entry
from gpucoll.work import Work

_KINDS = ("isend", "irecv")


class P2POp:
    """One send or receive for ``batch_isend_irecv``, as in torch.distributed: ``op`` is
    ``isend`` or ``irecv`` (gpucoll's functions, a communicator's methods, or their names),
    ``array`` the buffer and ``peer`` the other rank."""

    __slots__ = ("op", "array", "peer")

    def __init__(self, op: Any, array: Any, peer: int):
        name = op if isinstance(op, str) else getattr(op, "__name__", None)
        if name not in _KINDS:
            raise TypeError(f"P2POp: op must be isend or irecv (gpucoll.isend, comm.irecv, or "
                            f"'isend'/'irecv'), got {op!r}")
        self.op, self.array, self.peer = name, array, peer

    def __repr__(self) -> str:
        return f"P2POp({self.op}, {type(self.array).__name__}, peer={self.peer})"


class BatchedWork(Work):
    """A send or receive of a batch not posted yet; once the batch ends, the posted call's."""

    def __init__(self, label: str):
        self._label = label
        self._posted: Work | None = None
        self._error: BaseException | None = None

    def _check(self) -> Work:
        if self._error is not None:
            raise self._error
        if self._posted is None:
            raise UsageError(f"{self._label}: its batch has not been posted yet; it is posted "
                             f"when the `with comm.batch():` block ends, wait for it after that")
        return self._posted

    def is_completed(self) -> bool:
        return self._error is not None or (self._posted is not None and
                                          self._posted.is_completed())

    def _wait(self, timeout: float | None) -> bool:
        return self._check()._wait(timeout)

    def wait(self, timeout: float | None = None) -> Any:
        return self._check().wait(timeout)


class Batch:
    """The sends and receives made inside ``with comm.batch():``, posted together at its end
    (or dropped, unsent, when the block raises). ``wait()`` waits for all of them. Only
    ``isend``/``irecv`` join a batch; other calls made inside the block run at once."""

    def __init__(self, comm: Any, timeout: float | None, stream: Any):
        self._comm, self._timeout, self._stream = comm, timeout, stream
        self.thread = threading.get_ident()
        self.ops: list[tuple[bool, Any, int, Any]] = []  # (sending, ref, peer, check)
        self.works: list[BatchedWork] = []

    def __enter__(self) -> Batch:
        self._comm._open_batch(self)
        return self

    def __exit__(self, kind: type | None, *exc: object) -> None:
        self._comm._close_batch(self, post=kind is None)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for every send and receive of the batch (after the block ended)."""
        for work in self.works:
            work.wait(timeout)


class PointToPointCalls:
    """``isend``, ``irecv``, ``batch`` and ``batch_isend_irecv`` for ``Communicator`` (a mixin:
    it uses the communicator's argument checks and backend)."""

    _batch: Batch | None = None

    @entry
    def isend(self, x: Any, dst: int, *, timeout: float | None = None,
              stream: Any = None) -> Work:
        """Start sending ``x`` to ``dst`` and return its Work (``send(..., async_op=True)``);
        inside ``with comm.batch():`` it is posted when the batch ends."""
        return self._p2p("isend", x, dst, True, timeout, stream)

    @entry
    def irecv(self, x: Any, src: int, *, timeout: float | None = None,
              stream: Any = None) -> Work:
        """Start receiving into ``x`` (C-contiguous) from ``src``; ``wait()`` returns ``x``.
        Inside ``with comm.batch():`` it is posted when the batch ends."""
        return self._p2p("irecv", x, src, False, timeout, stream)

    def batch(self, *, timeout: float | None = None, stream: Any = None) -> Batch:
        """A context in which ``isend``/``irecv`` are collected, then posted together when it
        ends (one NCCL group on GPUs); ``timeout`` bounds each of them."""
        return Batch(self, timeout, stream)

    @entry
    def batch_isend_irecv(self, ops: Sequence[P2POp], *, timeout: float | None = None,
                          stream: Any = None) -> list[Work]:
        """Post every ``P2POp`` together (torch.distributed.batch_isend_irecv); returns their
        Works in order."""
        c = self._call("batch_isend_irecv")
        if isinstance(ops, (str, bytes)) or not isinstance(ops, Sequence) or not all(
                isinstance(op, P2POp) for op in ops):
            raise c.fail(TypeError, "ops must be a list of gpucoll.P2POp")
        batch = Batch(self, timeout, stream)
        self._open_batch(batch)
        try:
            for op in ops:
                self._p2p(op.op, op.array, op.peer, op.op == "isend", timeout, stream)
        except BaseException:
            self._close_batch(batch, post=False)
            raise
        self._close_batch(batch, post=True, guarded=False)
        return list(batch.works)

    # -- plumbing ------------------------------------------------------------------------------

    def _p2p(self, name: str, x: Any, peer: int, sending: bool, timeout: float | None,
             stream: Any) -> Work:
        c = self._call(name)
        batch = self._batch
        if batch is not None and batch.thread != threading.get_ident():
            raise c.fail(UsageError, "another thread has a batch open on this communicator; "
                                     "a communicator serves one thread at a time")
        ref = c.array(x, "x", writable=not sending, copy=sending)
        peer = c.peer(peer, "dst" if sending else "src")
        t = c.timeout(timeout, self.timeout if batch is None or batch._timeout is None
                      else batch._timeout)
        check = self._pair_signature(c, ref, peer, sending)
        if batch is None:
            batch = Batch(self, timeout, stream)
            batch.ops.append((sending, ref, peer, check))
            batch.works.append(BatchedWork(c.where))
            self._post_batch(batch, t, stream)
            return batch.works[0]
        batch.ops.append((sending, ref, peer, check))
        work = BatchedWork(c.where)
        batch.works.append(work)
        return work

    def _open_batch(self, batch: Batch) -> None:
        if self._batch is not None:
            raise UsageError(f"batch on rank {self.rank} of {self.size}: a batch is already "
                             f"open on this communicator; batches do not nest")
        self._batch = batch

    def _close_batch(self, batch: Batch, post: bool, guarded: bool = True) -> None:
        self._batch = None
        if not post:
            error = UsageError(f"rank {self.rank}: the batch was abandoned (its block raised), "
                               f"so this send or receive was never posted")
            for work in batch.works:
                work._error = error
            return
        t = self.timeout if batch._timeout is None else batch._timeout
        if guarded:
            self._end_batch(batch, t, batch._stream)
        else:
            self._post_batch(batch, t, batch._stream)

    @entry
    def _end_batch(self, batch: Batch, timeout: float, stream: Any) -> None:
        self._post_batch(batch, timeout, stream)

    def _post_batch(self, batch: Batch, timeout: float, stream: Any) -> None:
        """Run the debug checks of every message (all sides were published when they were
        made), then post them all at once."""
        if not batch.ops:
            return
        checks = [check for _, _, _, check in batch.ops if check is not None]
        for check in checks:
            check(timeout)
        posted = self._backend.batch_p2p([(s, ref, peer) for s, ref, peer, _ in batch.ops],
                                         timeout=timeout, stream=stream)
        for (sending, ref, _, _), work, handle in zip(batch.ops, batch.works, posted,
                                                      strict=True):
            handle.bind(None if sending else ref.array, work._label)
            work._posted = handle
