"""Many calls as one: batched point to point, and the fused all_reduce of many arrays.

Non-blocking and batched point to point: ``isend``/``irecv``, ``with comm.batch():`` and
torch's ``batch_isend_irecv`` with ``P2POp``.

Every send and receive of a batch is checked when it is made and posted together when the batch
ends (one NCCL group on GPUs; on the host ring they all progress side by side), so a ring of
exchanges written with them cannot deadlock however large the messages. Each returns a ``Work``
whose ``wait()`` gives what ``send``/``recv`` would return (None, or the receiving array).

Fused all_reduce of many arrays (gradient buckets, tensor fusion): ``all_reduce_many``.

Many small all_reduce calls cost one round trip each; packed end to end they cost one. NumPy
arrays are packed per dtype into buffers of at most ``FUSE_BYTES`` with one C-level concatenate,
reduced with one all_reduce per buffer, and copied back. A ``Bucket`` skips both copies: its
arrays are views of one flat buffer from the start (as torch DDP's gradient_as_bucket_view), so
``all_reduce_many(bucket)`` reduces that buffer in place. Other arrays (CuPy, torch, ...) go to
the backend's ``all_reduce_coalesced`` (one NCCL group on GPUs).
"""

from __future__ import annotations

import itertools
import math
import operator
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from gpucoll.arrays import as_ref, check_dtype, new_array, write_back
from gpucoll.errors import UsageError
from gpucoll.validation import Call, entry
from gpucoll.work import Work

# -- non-blocking and batched point to point -------------------------------------------------------
_KINDS = ("isend", "irecv")


class P2POp:
    """One send or receive for ``batch_isend_irecv``, as in torch.distributed: ``op`` is
    ``isend`` or ``irecv`` (gpucoll's functions, a communicator's methods, or their names),
    ``array`` the buffer, ``peer`` the other rank and ``tag`` the message's tag."""

    __slots__ = ("op", "array", "peer", "tag")

    def __init__(self, op: Any, array: Any, peer: int, *, tag: int = 0):
        name = op if isinstance(op, str) else getattr(op, "__name__", None)
        if name not in _KINDS:
            raise TypeError(f"P2POp: op must be isend or irecv (gpucoll.isend, comm.irecv, or "
                            f"'isend'/'irecv'), got {op!r}")
        self.op, self.array, self.peer, self.tag = name, array, peer, tag

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
        self.tags: list[int] = []
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
    def isend(self, x: Any, dst: int, *, tag: int = 0, timeout: float | None = None,
              stream: Any = None) -> Work:
        """Start sending ``x`` to ``dst`` and return its Work (``send(..., async_op=True)``);
        inside ``with comm.batch():`` it is posted when the batch ends."""
        return self._p2p("isend", x, dst, True, timeout, stream, tag)

    @entry
    def irecv(self, x: Any, src: int, *, tag: int = 0, timeout: float | None = None,
              stream: Any = None) -> Work:
        """Start receiving into ``x`` (C-contiguous) from ``src``; ``wait()`` returns ``x``.
        Inside ``with comm.batch():`` it is posted when the batch ends."""
        return self._p2p("irecv", x, src, False, timeout, stream, tag)

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
                self._p2p(op.op, op.array, op.peer, op.op == "isend", timeout, stream, op.tag)
        except BaseException:
            self._close_batch(batch, post=False)
            raise
        self._close_batch(batch, post=True, guarded=False)
        return list(batch.works)

    # -- plumbing ------------------------------------------------------------------------------

    def _p2p(self, name: str, x: Any, peer: int, sending: bool, timeout: float | None,
             stream: Any, tag: Any = 0) -> Work:
        c = self._call(name)
        batch = self._batch
        if batch is not None and batch.thread != threading.get_ident():
            raise c.fail(UsageError, "another thread has a batch open on this communicator; "
                                     "a communicator serves one thread at a time")
        ref = c.array(x, "x", writable=not sending, copy=sending)
        peer = c.peer(peer, "dst" if sending else "src")
        tag = c.tag(tag)
        t = c.timeout(timeout, self.timeout if batch is None or batch._timeout is None
                      else batch._timeout)
        check = self._pair_signature(c, ref, peer, sending, tag)
        if batch is None:
            batch = Batch(self, timeout, stream)
            batch.ops.append((sending, ref, peer, check))
            batch.tags.append(tag)
            batch.works.append(BatchedWork(c.where))
            self._post_batch(batch, t, stream)
            return batch.works[0]
        batch.ops.append((sending, ref, peer, check))
        batch.tags.append(tag)
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
                                         timeout=timeout, stream=stream,
                                         **({"tags": batch.tags} if any(batch.tags) else {}))
        for (sending, ref, _, _), work, handle in zip(batch.ops, batch.works, posted,
                                                      strict=True):
            handle.bind(None if sending else ref.array, work._label)
            work._posted = handle


# -- fused all_reduce of many arrays ---------------------------------------------------------------
FUSE_BYTES = 64 << 20  # the largest buffer one fused transfer packs (bounds the extra memory)


class Bucket(Sequence):
    """Arrays of the given ``shapes`` and one ``dtype`` that are views of one zeroed flat buffer
    (``flat``), in order: fill them in place (``np.copyto(bucket[i], g)`` or ``out=``), then
    ``all_reduce_many(bucket)`` reduces the buffer without copying. ``kind="device"`` puts the
    buffer in device memory (a CuPy array)."""

    def __init__(self, shapes: Iterable[Any], dtype: Any = np.float32, *, kind: str = "host"):
        shapes = [_shape(s, i) for i, s in enumerate(shapes)]
        dtype = np.dtype(dtype)
        check_dtype(dtype, "dtype")
        if kind not in ("host", "device"):
            raise ValueError(f"Bucket: kind must be 'host' or 'device', got {kind!r}")
        sizes = [math.prod(s) for s in shapes]
        flat = new_array(kind, (sum(sizes),), dtype)
        flat[...] = 0
        self.flat = flat
        self._ref = as_ref(flat, "bucket")
        views, start = [], 0
        for shape, n in zip(shapes, sizes, strict=True):
            views.append(flat[start:start + n].reshape(shape))
            start += n
        self.arrays: tuple = tuple(views)

    def __len__(self) -> int:
        return len(self.arrays)

    def __getitem__(self, i: Any) -> Any:
        return self.arrays[i]

    def __iter__(self) -> Iterator:
        return iter(self.arrays)

    def __repr__(self) -> str:
        return (f"<Bucket of {len(self.arrays)} arrays, {self.flat.dtype.name}, "
                f"{self.flat.size} elements>")


class FusedCalls:
    """``all_reduce_many`` for ``Communicator`` (a mixin: it uses the communicator's argument
    checks, sequence numbers and backend)."""

    @entry
    def all_reduce_many(self, arrays: Sequence[Any] | Bucket, op: Any = "sum", *,
                        async_op: bool = False, timeout: float | None = None,
                        stream: Any = None) -> Any:
        """Reduce every array of ``arrays`` (mixed shapes and dtypes) over all ranks, in place,
        in one fused transfer per dtype; returns ``arrays``. Every rank passes arrays of the
        same shapes and dtypes in the same order. A ``Bucket`` is reduced without copies."""
        c = self._call("all_reduce_many")
        t = c.timeout(timeout, self.timeout)
        b = self._backend
        if isinstance(arrays, Bucket):
            ref = arrays._ref
            rop = c.op(op, ref.dtype)
            seq = self._signature(c, t, ref, op=rop)
            return self._issue(c, seq, lambda: b.all_reduce(ref, rop, timeout=t, stream=stream),
                               arrays, async_op, stream)
        if isinstance(arrays, (str, bytes)) or not isinstance(arrays, Sequence):
            raise c.fail(TypeError, f"arrays must be a list of arrays or a gpucoll.Bucket, got "
                                    f"{type(arrays).__name__}")
        if _all_numpy(arrays):
            groups, rop = _numpy_groups(c, arrays, op)
            run = lambda: _reduce_numpy(b, groups, rop, t, stream)  # noqa: E731
        else:
            refs = [c.array(a, f"arrays[{i}]", writable=True) for i, a in enumerate(arrays)]
            kinds = {r.kind for r in refs}
            if len(kinds) > 1:
                raise c.fail(TypeError, "arrays mixes host and device arrays; pass one kind")
            rop = {r.dtype: c.op(op, r.dtype) for r in refs}
            run = lambda: _reduce_refs(b, refs, arrays, rop, t, stream)  # noqa: E731
        seq = self._signature(c, t, None, op=_op_name(rop), **(
            {"shapes": [list(np.shape(a)) for a in arrays]} if self._check is not None else {}))
        return self._issue(c, seq, run, arrays, async_op, stream)


def _all_numpy(arrays: Sequence[Any]) -> bool:
    return set(map(type, arrays)) <= {np.ndarray}


_DTYPE, _WRITEABLE, _NBYTES, _SHAPE = (operator.attrgetter(a) for a in (
    "dtype", "flags.writeable", "nbytes", "shape"))


def _numpy_groups(c: Call, arrays: Sequence[np.ndarray], op: Any) -> tuple[list, dict]:
    """The arrays in fusion groups (one dtype, at most FUSE_BYTES each, in order) and the op
    per dtype; every argument error is raised here, before anything is sent. The per-array
    work runs in C (``map``): a thousand small arrays cost microseconds, not milliseconds."""
    if not all(map(_WRITEABLE, arrays)):
        i = next(i for i, a in enumerate(arrays) if not a.flags.writeable)
        raise c.fail(ValueError, f"arrays[{i}] is read-only; all_reduce_many writes the result "
                                 f"into it")
    # first-appearance order, the same on every rank: a set's order follows the hash seed,
    # which differs between processes
    dtypes = list(dict.fromkeys(map(_DTYPE, arrays)))
    rop = {}
    for dtype in dtypes:
        try:
            check_dtype(dtype, "arrays")
        except TypeError as exc:
            raise c.fail(TypeError, str(exc)) from None
        rop[dtype] = c.op(op, dtype)
    if len(dtypes) == 1 and sum(map(_NBYTES, arrays)) <= FUSE_BYTES:
        return [list(arrays)], rop
    groups = []
    for dtype in dtypes:
        part: list[np.ndarray] = []
        nbytes = 0
        for a in arrays:
            if a.dtype != dtype:
                continue
            if part and nbytes + a.nbytes > FUSE_BYTES:
                groups.append(part)
                part, nbytes = [], 0
            part.append(a)
            nbytes += a.nbytes
        groups.append(part)
    return groups, rop


def _reduce_numpy(b: Any, groups: list, rop: dict, t: float, stream: Any) -> None:
    """Pack each group with one concatenate, reduce it, copy the results back."""
    setitem = operator.setitem
    for part in groups:
        flat = np.concatenate(part, axis=None)
        b.all_reduce(as_ref(flat, "fused"), rop[flat.dtype], timeout=t, stream=stream)
        shapes = set(map(_SHAPE, part))
        if len(shapes) == 1:  # the common case: the rows of one reshape are the results
            rows = flat.reshape(len(part), *shapes.pop())
            for _ in map(setitem, part, itertools.repeat(Ellipsis), rows):
                pass
            continue
        start = 0
        for a in part:
            a[...] = flat[start:start + a.size].reshape(a.shape)
            start += a.size


def _reduce_refs(b: Any, refs: list, arrays: Sequence[Any], rop: dict, t: float,
                 stream: Any) -> None:
    by_dtype: dict[Any, list] = {}
    for ref in refs:
        by_dtype.setdefault(ref.dtype, []).append(ref)
    for dtype, group in by_dtype.items():
        b.all_reduce_coalesced(group, rop[dtype], timeout=t, stream=stream)
    for ref, a in zip(refs, arrays, strict=True):
        if ref.array is not a:  # a strided array reduced through a contiguous copy
            write_back(ref, a)


def _op_name(rop: dict) -> Any:
    ops = {o.value for o in rop.values()}
    return ops.pop() if len(ops) == 1 else sorted(ops)


def _shape(s: Any, i: int) -> tuple[int, ...]:
    if isinstance(s, (int, np.integer)) and not isinstance(s, bool):
        s = (int(s),)
    try:
        shape = tuple(operator.index(d) for d in s)
    except TypeError:
        raise TypeError(f"Bucket: shapes[{i}] must be a shape (a tuple of ints), got "
                        f"{s!r}") from None
    if any(d < 0 for d in shape):
        raise ValueError(f"Bucket: shapes[{i}] = {shape} has a negative extent")
    return shape
