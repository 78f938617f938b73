"""Collectives whose ranks contribute different numbers of rows: the ``*_v`` calls.

Arrays are cut along axis 0 (rows); every rank's rows share one dtype and one trailing shape.
Without ``counts=`` the ranks first exchange a small description of their arrays (dtype, array
kind, shape), in-band on the host ring and through the store elsewhere, so a dtype or
trailing-shape disagreement is a ``CollectiveMismatch`` on every rank, naming the ranks, before
any data moves. ``counts=`` (rows per rank, the same list on every rank) skips that exchange; the
ranks' counts then travel as a digest in every message (``layout``), so a rank given other
counts than its peer fails the first message between them on both sides, never a hang.
"""

from __future__ import annotations

import operator
import struct
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from gpucoll.arrays import (
    SUPPORTED_DTYPES,
    ArrayRef,
    as_ref,
    dtype_from_name,
    empty_ref,
    flat_view,
    new_array,
)
from gpucoll.errors import CollectiveMismatch
from gpucoll.progress import ranks_text
from gpucoll.validation import Call, entry, overlaps
from gpucoll.work import Deferred

MAX_DIMS = 64  # NumPy's limit; a description holds this many trailing extents
_HEAD = 4  # description: dtype code, array kind, trailing ndim, rows; then the trailing shape
WIDTH = _HEAD + MAX_DIMS
_KINDS = ("host", "device")


def layout_digest(counts: Sequence[int] | None, trailing: Sequence[int]) -> int:
    """A nonzero 32-bit checksum of the rows per rank (None: not shared by every rank) and the
    trailing shape, which every rank of one call must compute alike."""
    rows = () if counts is None else tuple(counts)
    data = struct.pack(f"<qq{len(rows)}q{len(trailing)}q", len(rows), len(trailing), *rows,
                       *trailing)
    return zlib.crc32(data) or 1


def describe(ref: ArrayRef, rows: int | None = None) -> np.ndarray:
    """The fixed-width description of ``ref`` (its dtype, kind, rows and trailing shape) that
    ranks exchange; ``rows`` overrides its leading extent."""
    row = np.zeros(WIDTH, np.int64)
    trailing = ref.shape[1:]
    row[:_HEAD] = (SUPPORTED_DTYPES.index(ref.dtype.name), _KINDS.index(ref.kind), len(trailing),
                   ref.shape[0] if rows is None else rows)
    row[_HEAD:_HEAD + len(trailing)] = trailing
    return row


def read(row: np.ndarray) -> tuple[np.dtype, str, tuple[int, ...], int]:
    """(dtype, kind, trailing shape, rows) of a description."""
    code, kind, ndim, rows = (int(v) for v in row[:_HEAD])
    return (dtype_from_name(SUPPORTED_DTYPES[code]), _KINDS[kind],
            tuple(int(v) for v in row[_HEAD:_HEAD + ndim]), rows)


def check_agree(c: Call, rows: np.ndarray, what: str, senders: Sequence[int] | None = None) -> None:
    """CollectiveMismatch on every rank when the descriptions (one per rank, rank order, or per
    ``senders``) differ in dtype or trailing shape."""
    ranks = list(range(len(rows))) if senders is None else list(senders)
    seen: dict[tuple, list[int]] = {}
    for r, row in zip(ranks, rows, strict=True):
        dtype, _, trailing, _ = read(row)
        seen.setdefault((dtype.name, trailing), []).append(r)
    if len(seen) > 1:
        detail = "; ".join(f"{ranks_text(rs)} {'passes' if len(rs) == 1 else 'pass'} {name} "
                           f"{_shape(trailing)}" for (name, trailing), rs in seen.items())
        raise CollectiveMismatch(f"{c.where}: the ranks disagree on the dtype or trailing shape "
                                 f"of {what}: {detail}; no data moved")


def split_rows(array: Any, counts: Sequence[int]) -> list:
    """Consecutive views of ``array`` along axis 0, ``counts[r]`` rows each."""
    views, start = [], 0
    for n in counts:
        views.append(array[start:start + n])
        start += n
    return views


class UnevenCalls:
    """The ``*_v`` collectives of ``Communicator`` (a mixin: it uses the communicator's
    argument checks, sequence numbers and backend)."""

    @entry
    def all_gather_v(self, x: Any, *, counts: Sequence[int] | None = None, tiled: bool = False,
                     out: Any = None, async_op: bool = False, timeout: float | None = None,
                     stream: Any = None) -> Any:
        """Every rank's ``x`` on every rank, where ``x`` has shape ``(k_r, *s)`` with ``k_r``
        rows on rank r: a list of ``size`` arrays (array r from rank r, views of one buffer),
        or with ``tiled=True`` that buffer, shape ``(sum(k), *s)``.

        ``counts`` (every rank's rows, the same list everywhere) skips the exchange of sizes;
        ``out`` (shape ``(sum(counts), *s)``) needs it.
        """
        c = self._call("all_gather_v")
        ref = _rows(c, x, "x")
        t = c.timeout(timeout, self.timeout)
        trailing = ref.shape[1:]
        counts, res = self._known(c, counts, ref, out, (ref,))
        seq = self._signature(c, t, None, dtype=ref.dtype.name, shape=[-1, *trailing],
                              tiled=tiled)
        b, per = self._backend, _per_row(trailing)

        def run(box: list) -> None:
            rows = counts
            if rows is None:
                every = self._meta_all_gather(c, describe(ref), t)
                check_agree(c, every, "x")
                rows = [int(row[3]) for row in every]
            buf = res if res is not None else empty_ref(ref, (sum(rows), *trailing))
            b.all_gather_v(ref, buf, [n * per for n in rows], layout_digest(rows, trailing),
                           timeout=t, stream=stream)
            box.append(buf.array if tiled else split_rows(buf.array, rows))

        return self._deferred(c, seq, run, async_op, stream)

    @entry
    def gather_v(self, x: Any, root: int = 0, *, counts: Sequence[int] | None = None,
                 tiled: bool = False, out: Any = None, async_op: bool = False,
                 timeout: float | None = None, stream: Any = None) -> Any:
        """Every rank's ``x`` (``k_r`` rows) on root, laid out as ``all_gather_v`` does; None on
        the other ranks. ``out`` is used on root only."""
        c = self._call("gather_v")
        ref = _rows(c, x, "x")
        root = c.rank_arg(root, "root")
        t = c.timeout(timeout, self.timeout)
        trailing = ref.shape[1:]
        counts, res = self._known(c, counts, ref, out if self.rank == root else None, (ref,))
        seq = self._signature(c, t, None, dtype=ref.dtype.name, shape=[-1, *trailing],
                              root=root, tiled=tiled)
        b, per, me = self._backend, _per_row(trailing), self.rank

        def run(box: list) -> None:
            rows = counts
            if rows is None:  # every rank learns the sizes, so that all of them judge alike
                every = self._meta_all_gather(c, describe(ref), t)
                check_agree(c, every, "x")
                rows = [int(row[3]) for row in every]
            layout = layout_digest(rows, trailing)
            if me != root:
                b.exchange([(root, ref)], [], layout, timeout=t, stream=stream)
                box.append(None)
                return
            buf = res if res is not None else empty_ref(ref, (sum(rows), *trailing))
            parts = _cut(buf, [n * per for n in rows])
            b.exchange([(root, ref)], list(enumerate(parts)), layout, timeout=t, stream=stream)
            box.append(buf.array if tiled else split_rows(buf.array, rows))

        return self._deferred(c, seq, run, async_op, stream)

    @entry
    def scatter_v(self, chunks: Sequence[Any] | None = None, root: int = 0, *,
                  counts: Sequence[int] | None = None, out: Any = None, async_op: bool = False,
                  timeout: float | None = None, stream: Any = None) -> Any:
        """Root's ``chunks[r]`` (``k_r`` rows each, one dtype and trailing shape) to rank r;
        returns this rank's chunk. Other ranks pass no chunks (ignored there).

        Without ``counts`` every rank learns its chunk's shape and dtype from root. With
        ``counts`` (the same list everywhere) ranks other than root pass ``out``, shape
        ``(counts[rank], *s)``, and nothing is exchanged first.
        """
        c = self._call("scatter_v")
        root = c.rank_arg(root, "root")
        t = c.timeout(timeout, self.timeout)
        if counts is not None:
            counts = _counts(c, counts, self.size)
        if self.rank == root:
            refs = _chunks(c, chunks, "chunks", self.size)
            if counts is not None:
                _match_rows(c, refs, counts, "chunks")
            res = None if out is None else _out(c, out, refs[root], refs[root].shape, refs)
            dtype, trailing = refs[0].dtype.name, refs[0].shape[1:]
        else:
            refs, res = None, _leaf_out(c, counts, out, self.rank)
            dtype, trailing = (None, None) if res is None else (res.dtype.name, res.shape[1:])
        seq = self._signature(c, t, None, dtype=dtype, root=root,
                              shape=None if trailing is None else [-1, *trailing])
        b = self._backend

        def run(box: list) -> None:
            mine, sends = res, []
            layout = None if trailing is None else layout_digest(counts, trailing)
            if refs is not None:  # root: the layouts first, unless every rank knows them
                if counts is None:
                    self._meta_scatter(c, np.stack([describe(r) for r in refs]), root, t)
                if mine is None:
                    mine = empty_ref(refs[root], refs[root].shape)
                sends = list(enumerate(refs))
            elif mine is None:  # learn this rank's chunk from root
                chunk_dtype, kind, tail, rows = read(self._meta_scatter(c, None, root, t))
                mine = c.array(new_array(kind, (rows, *tail), chunk_dtype), "out")
                layout = layout_digest(None, tail)
            b.exchange(sends, [(root, mine)], layout, timeout=t, stream=stream)
            box.append(mine.array)

        return self._deferred(c, seq, run, async_op, stream)

    @entry
    def all_to_all_v(self, chunks: Sequence[Any], *, counts: Sequence[int] | None = None,
                     tiled: bool = False, out: Any = None, async_op: bool = False,
                     timeout: float | None = None, stream: Any = None) -> Any:
        """Send ``chunks[j]`` (``k`` rows, one dtype and trailing shape for all) to rank j;
        returns the list of what each rank sent this one (array j from rank j, views of one
        buffer), or with ``tiled=True`` that buffer.

        ``counts[j]``: the rows rank j sends this rank; it skips the exchange of sizes, and
        ``out`` (shape ``(sum(counts), *s)``) needs it.
        """
        c = self._call("all_to_all_v")
        refs = _chunks(c, chunks, "chunks", self.size)
        t = c.timeout(timeout, self.timeout)
        trailing = refs[0].shape[1:]
        counts, res = self._known(c, counts, refs[0], out, refs, own=False)
        if counts is not None and counts[self.rank] != refs[self.rank].shape[0]:
            raise c.fail(ValueError, f"counts[{self.rank}] = {counts[self.rank]}, but chunks["
                                     f"{self.rank}] (what this rank sends itself) has "
                                     f"{refs[self.rank].shape[0]} rows")
        seq = self._signature(c, t, None, dtype=refs[0].dtype.name, shape=[-1, *trailing],
                              tiled=tiled)
        b, per, n = self._backend, _per_row(trailing), self.size
        layout = layout_digest(None, trailing)

        def run(box: list) -> None:
            rows = counts
            if rows is None:
                got = self._meta_all_to_all(c, np.stack([describe(r) for r in refs]), t)
                check_agree(c, got, "chunks")
                rows = [int(row[3]) for row in got]
            buf = res if res is not None else empty_ref(refs[0], (sum(rows), *trailing))
            parts = _cut(buf, [k * per for k in rows])
            b.exchange(list(enumerate(refs)), list(zip(range(n), parts, strict=True)), layout,
                       timeout=t, stream=stream)
            box.append(buf.array if tiled else split_rows(buf.array, rows))

        return self._deferred(c, seq, run, async_op, stream)

    @entry
    def reduce_scatter_v(self, x: Any, counts: Sequence[int], op: Any = "sum", *,
                         out: Any = None, async_op: bool = False, timeout: float | None = None,
                         stream: Any = None) -> Any:
        """``x`` of shape ``(sum(counts), *s)`` reduced over ranks; rank r gets rows
        ``sum(counts[:r])`` to ``sum(counts[:r+1])`` of the result, shape ``(counts[r], *s)``.
        Every rank passes the same ``counts`` and an ``x`` of the same shape."""
        c = self._call("reduce_scatter_v")
        ref = _rows(c, x, "x")
        rop = c.op(op, ref.dtype)
        t = c.timeout(timeout, self.timeout)
        counts = _counts(c, counts, self.size)
        if sum(counts) != ref.shape[0]:
            raise c.fail(ValueError, f"x has {ref.shape[0]} rows, but counts add up to "
                                     f"{sum(counts)}")
        trailing = ref.shape[1:]
        shape = (counts[self.rank], *trailing)
        res = c.output(out, ref, shape, (ref,))
        seq = self._signature(c, t, ref, op=rop)
        b, per = self._backend, _per_row(trailing)
        layout = layout_digest(counts, trailing)
        return self._issue(c, seq, lambda: b.reduce_scatter_v(
            ref, res, [k * per for k in counts], rop, layout, timeout=t, stream=stream),
            res.array, async_op, stream)

    # -- plumbing ------------------------------------------------------------------------------

    def _known(self, c: Call, counts: Any, ref: ArrayRef, out: Any, inputs: Sequence[ArrayRef],
               own: bool = True) -> tuple[list[int] | None, ArrayRef | None]:
        """Checked ``counts`` (None: to be exchanged) and ``out`` (needs counts). ``own``: the
        list includes this rank's rows, which ``ref`` must have."""
        if counts is None:
            if out is not None:
                raise c.fail(ValueError, "out= needs counts= (without them the result's size "
                                         "is known only after the exchange)")
            return None, None
        counts = _counts(c, counts, self.size)
        if own and counts[self.rank] != ref.shape[0]:
            raise c.fail(ValueError, f"counts[{self.rank}] = {counts[self.rank]}, but x has "
                                     f"{ref.shape[0]} rows on this rank")
        if out is None:
            return counts, None
        return counts, _out(c, out, ref, (sum(counts), *ref.shape[1:]), inputs)

    def _deferred(self, c: Call, seq: int, run: Callable[[list], None], async_op: bool,
                  stream: Any) -> Any:
        """Issue ``run(box)``, which puts the call's result in ``box``; return it (or a Work
        that does)."""
        box: list = []
        work = self._issue(c, seq, lambda: run(box), None, async_op, stream)
        return Deferred(work, box) if async_op else box[0]

    def _meta_all_gather(self, c: Call, row: np.ndarray, t: float) -> np.ndarray:
        """Every rank's int64 ``row``, stacked in rank order (in-band on host backends)."""
        if self._backend.host_control:
            every = np.empty((self.size, row.size), np.int64)
            self._backend.all_gather(as_ref(row, "sizes"), as_ref(every, "sizes"), timeout=t)
            return every
        values = self._in_store(lambda: self._share(row.tobytes(), t, c))
        return np.stack([np.frombuffer(v, np.int64) for v in values])

    def _meta_all_to_all(self, c: Call, rows: np.ndarray, t: float) -> np.ndarray:
        """Row ``rank`` of every rank's ``rows`` (one row per destination), in rank order."""
        if self._backend.host_control:
            got = np.empty_like(rows)
            self._backend.all_to_all(as_ref(rows, "sizes"), as_ref(got, "sizes"), timeout=t)
            return got
        values = self._in_store(lambda: self._share(rows.tobytes(), t, c))
        return np.stack([np.frombuffer(v, np.int64).reshape(rows.shape)[self.rank]
                         for v in values])

    def _meta_scatter(self, c: Call, rows: np.ndarray | None, root: int, t: float) -> np.ndarray:
        """Row ``rank`` of root's ``rows``."""
        if self._backend.host_control:
            mine = np.empty(WIDTH, np.int64)
            self._backend.scatter(None if rows is None else as_ref(rows, "sizes"),
                                  as_ref(mine, "sizes"), root, timeout=t)
            return mine
        values = self._in_store(lambda: self._share(b"" if rows is None else rows.tobytes(),
                                                    t, c))
        return np.frombuffer(values[root], np.int64).reshape(self.size, WIDTH)[self.rank]


def _rows(c: Call, x: Any, name: str) -> ArrayRef:
    ref = c.array(x, name)
    if not ref.shape:
        raise c.fail(ValueError, f"{name} is 0-d; the uneven collectives cut arrays along a "
                                 f"leading axis of rows")
    if len(ref.shape) - 1 > MAX_DIMS - 1:
        raise c.fail(ValueError, f"{name} has {len(ref.shape)} dimensions, more than {MAX_DIMS}")
    return ref


def _chunks(c: Call, chunks: Any, name: str, size: int) -> list[ArrayRef]:
    """One array per rank, all of one dtype, trailing shape and kind."""
    if isinstance(chunks, (str, bytes)) or not isinstance(chunks, Sequence):
        raise c.fail(TypeError, f"{name} must be a list of {size} arrays (one per rank), got "
                                f"{type(chunks).__name__}")
    if len(chunks) != size:
        raise c.fail(ValueError, f"{name} has {len(chunks)} arrays; expected one per rank "
                                 f"({size})")
    refs = [_rows(c, a, f"{name}[{i}]") for i, a in enumerate(chunks)]
    first = refs[0]
    for i, r in enumerate(refs[1:], 1):
        if r.dtype != first.dtype or r.shape[1:] != first.shape[1:] or r.kind != first.kind:
            raise c.fail(TypeError if r.dtype != first.dtype else ValueError,
                         f"{name}[{i}] is {r.kind} {r.dtype.name} {_shape(r.shape[1:])}, but "
                         f"{name}[0] is {first.kind} {first.dtype.name} {_shape(first.shape[1:])};"
                         f" every chunk needs one dtype, trailing shape and array kind")
    return refs


def _counts(c: Call, counts: Any, size: int) -> list[int]:
    if isinstance(counts, (str, bytes)) or not hasattr(counts, "__len__"):
        raise c.fail(TypeError, f"counts must be a list of {size} ints (rows per rank), got "
                                f"{type(counts).__name__}")
    if len(counts) != size:
        raise c.fail(ValueError, f"counts has {len(counts)} entries; expected one per rank "
                                 f"({size})")
    out = []
    for i, v in enumerate(counts):
        if isinstance(v, bool) or not hasattr(type(v), "__index__"):
            raise c.fail(TypeError, f"counts[{i}] must be an int, got {type(v).__name__}")
        v = operator.index(v)
        if v < 0:
            raise c.fail(ValueError, f"counts[{i}] = {v} is negative")
        out.append(v)
    return out


def _leaf_out(c: Call, counts: list[int] | None, out: Any, rank: int) -> ArrayRef | None:
    """scatter_v's ``out`` off root: needed with ``counts`` (it gives the dtype and trailing
    shape), refused without (the size comes from root)."""
    if counts is None:
        if out is not None:
            raise c.fail(ValueError, "out= needs counts= (without them the chunk's size is "
                                     "known only once root sends it)")
        return None
    if out is None:
        raise c.fail(ValueError, "with counts= a rank other than root passes out= (its chunk's "
                                 "dtype and shape); or pass neither and learn them from root")
    res = c.array(out, "out", writable=True, copy=False)
    if not res.shape or res.shape[0] != counts[rank]:
        raise c.fail(ValueError, f"out has shape {tuple(res.shape)}, but counts[{rank}] = "
                                 f"{counts[rank]} rows")
    return res


def _match_rows(c: Call, refs: Sequence[ArrayRef], counts: Sequence[int], name: str) -> None:
    for i, (r, k) in enumerate(zip(refs, counts, strict=True)):
        if r.shape[0] != k:
            raise c.fail(ValueError, f"{name}[{i}] has {r.shape[0]} rows, but counts[{i}] = {k}")


def _out(c: Call, out: Any, like: ArrayRef, shape: tuple[int, ...],
         inputs: Sequence[ArrayRef]) -> ArrayRef:
    res = c.output(out, like, tuple(shape), ())
    if any(overlaps(res, r) for r in inputs):
        raise c.fail(ValueError, "out shares memory with an input; pass a separate buffer")
    return res


def _cut(buf: ArrayRef, elements: Sequence[int]) -> list[ArrayRef]:
    parts, start = [], 0
    for n in elements:
        parts.append(flat_view(buf, start, n))
        start += n
    return parts


def _per_row(trailing: Sequence[int]) -> int:
    per = 1
    for d in trailing:
        per *= d
    return per


def _shape(trailing: Sequence[int]) -> str:
    return f"(k, {', '.join(map(str, trailing))})" if trailing else "(k,)"
