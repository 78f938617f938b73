"""Collectives of picklable Python objects: broadcast_object, all_gather_object, gather_object,
scatter_object, all_reduce_object and reduce_object; the same packing carries the point-to-point
messages of ``gpucoll.messages``.

An object travels as pickle protocol 5: the pickle stream, plus every buffer of 256 KiB or more
that supports out-of-band pickling (NumPy arrays, and CuPy arrays through the host arrays CuPy
pickles them as) sent straight from its own memory and received into memory the unpickled
object then uses, so large arrays inside objects are never copied into or out of the stream
(mpi4py.util.pkl5 works the same way). First a fixed header says how many buffers follow and
their sizes, so receivers allocate exactly; every message is at most ``MESSAGE_BYTES`` (larger
buffers go in pieces), so no count anywhere comes near a 2 GiB limit, whatever the object's size.

Unpickling runs code that the pickle names: objects must come only from the job's own ranks.
An object that does not pickle fails on every rank (its own error on the rank that had it, a
``pickle.PicklingError`` naming that rank elsewhere), and the communicator stays usable.
"""

from __future__ import annotations

import operator
import pickle
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from gpucoll import cuda
from gpucoll.arrays import as_ref
from gpucoll.errors import CollectiveMismatch, CollectiveTimeout
from gpucoll.ops import ReduceOp, parse_op
from gpucoll.validation import Call, entry

OUT_OF_BAND_BYTES = 256 << 10  # smaller buffers are copied into the pickle stream: cheaper
MESSAGE_BYTES = 1 << 30  # the largest message; bigger buffers travel in pieces
MAGIC = 0x314A424F  # "OBJ1"
HEAD = 8  # int64: magic, segments (-1: pickling failed), tag, then up to 5 segment lengths
_INLINE = HEAD - 3


class Packed:
    """One object as segments of bytes (uint8 arrays): the pickle stream, then its out-of-band
    buffers; or, when pickling failed, the error's text alone (``failed``)."""

    def __init__(self, segments: list[np.ndarray], failed: BaseException | None = None):
        self.segments, self.failed = segments, failed

    @classmethod
    def of(cls, obj: Any) -> Packed:
        buffers: list[memoryview] = []

        def out_of_band(buf: pickle.PickleBuffer) -> bool:
            try:
                raw = buf.raw()
            except BufferError:  # not contiguous: in the stream
                return True
            if raw.nbytes < OUT_OF_BAND_BYTES:
                return True
            buffers.append(raw)
            return False

        try:
            data = pickle.dumps(obj, protocol=5, buffer_callback=out_of_band)
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it, then it is raised
            text = f"{type(exc).__name__}: {exc}".encode("utf-8", "replace")
            return cls([np.frombuffer(text, np.uint8)], exc)
        return cls([np.frombuffer(data, np.uint8)] +
                   [np.frombuffer(b, np.uint8) for b in buffers])

    def head(self, tag: int = 0) -> np.ndarray:
        return make_head(-1 if self.failed else len(self.segments),
                         [s.size for s in self.segments], tag)

    def rest(self) -> np.ndarray:
        """The segment lengths that do not fit in the head."""
        return np.array([s.size for s in self.segments[_INLINE:]], np.int64)

    def copy(self) -> Packed:
        """The same segments in memory of their own (so that an unpickled copy shares none
        with the original object)."""
        return Packed([self.segments[0]] + [s.copy() for s in self.segments[1:]], self.failed)


def make_head(count: int, lengths: Sequence[int], tag: int = 0) -> np.ndarray:
    """A head of ``count`` segments (-1: a pickling failure) of these lengths; point-to-point
    messages carry their ``tag`` (0 in collectives)."""
    head = np.zeros(HEAD, np.int64)
    head[0], head[1], head[2] = MAGIC, count, tag
    inline = list(lengths[:_INLINE])
    head[3:3 + len(inline)] = inline
    return head


def segments_of(head: np.ndarray) -> int:
    """How many segments a head announces (1 for a failure: the error's text)."""
    return 1 if head[1] < 0 else int(head[1])


def needs_rest(head: np.ndarray) -> int:
    """How many segment lengths do not fit in the head and follow it."""
    return max(segments_of(head) - _INLINE, 0)


def lengths(head: np.ndarray, rest: np.ndarray | None) -> list[int]:
    count = segments_of(head)
    inline = [int(v) for v in head[3:3 + min(count, _INLINE)]]
    return inline + ([] if rest is None else [int(v) for v in rest])


def pieces(segment: np.ndarray) -> list[np.ndarray]:
    """``segment`` cut into messages of at most ``MESSAGE_BYTES`` (at least one, maybe empty)."""
    step = max(int(MESSAGE_BYTES), 1)
    return [segment[i:i + step] for i in range(0, segment.size, step)] or [segment]


def unpack(c: Call, segments: list[np.ndarray], rank: int) -> Any:
    try:
        return pickle.loads(segments[0], buffers=segments[1:])
    except Exception as exc:
        note = f"while unpickling the object from rank {rank} ({c.where})"
        if hasattr(exc, "add_note"):
            exc.add_note(note)
        raise


def check_head(c: Call, head: np.ndarray, rank: int) -> None:
    if head[0] != MAGIC or head[1] < -1:
        raise CollectiveMismatch(f"{c.where}: what rank {rank} sent is not an object header "
                                 f"(a send_object/recv_object paired with another call?)")


class Wire:
    """Host byte arrays through a backend that takes host arrays, each step bounded by what is
    left of the call's deadline."""

    def __init__(self, backend: Any, timeout: float, where: str):
        self.b, self.deadline, self.where = backend, time.monotonic() + timeout, where

    def left(self) -> float:
        """Seconds left for the next step. Past the deadline the call is over on this rank,
        and the backend is aborted so that the peers waiting for the next step know it."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            err = CollectiveTimeout(f"{self.where}: timed out between the steps of the call")
            self.b.abort(err)
            raise err
        return left

    def broadcast(self, arr: np.ndarray, root: int) -> None:
        self.b.broadcast(as_ref(arr, "object"), root, timeout=self.left())

    def all_gather(self, row: np.ndarray, out: np.ndarray) -> None:
        self.b.all_gather(as_ref(row, "object"), as_ref(out, "object"), timeout=self.left())

    def scatter(self, rows: np.ndarray | None, out: np.ndarray, root: int) -> None:
        self.b.scatter(None if rows is None else as_ref(rows, "object"), as_ref(out, "object"),
                       root, timeout=self.left())

    def exchange(self, sends: list, recvs: list) -> None:
        self.b.exchange([(p, as_ref(a, "object")) for p, a in sends],
                        [(p, as_ref(a, "object")) for p, a in recvs], 0, timeout=self.left())

    def send(self, arr: np.ndarray, peer: int) -> None:
        self.b.send(as_ref(arr, "object"), peer, timeout=self.left())

    def recv(self, arr: np.ndarray, peer: int) -> None:
        self.b.recv(as_ref(arr, "object"), peer, timeout=self.left())


class DeviceWire(Wire):
    """Host byte arrays through a backend that moves device memory only (NCCL): each step
    copies them to device buffers through pinned memory, runs there, and copies back."""

    def broadcast(self, arr: np.ndarray, root: int) -> None:
        mine = self.b.rank == root
        self._staged([arr] if mine else [], [] if mine else [arr], lambda d, u, s: self.b.broadcast(
            (d or u)[0], root, timeout=self.left(), stream=s))

    def all_gather(self, row: np.ndarray, out: np.ndarray) -> None:
        self._staged([row], [out], lambda d, u, s: self.b.all_gather(
            d[0], u[0], timeout=self.left(), stream=s))

    def scatter(self, rows: np.ndarray | None, out: np.ndarray, root: int) -> None:
        self._staged([] if rows is None else [rows], [out], lambda d, u, s: self.b.scatter(
            d[0] if d else None, u[0], root, timeout=self.left(), stream=s))

    def exchange(self, sends: list, recvs: list) -> None:
        self._staged([a for _, a in sends], [a for _, a in recvs], lambda d, u, s: self.b.exchange(
            list(zip([p for p, _ in sends], d, strict=True)),
            list(zip([p for p, _ in recvs], u, strict=True)), 0, timeout=self.left(), stream=s))

    def send(self, arr: np.ndarray, peer: int) -> None:
        self._staged([arr], [], lambda d, u, s: self.b.send(d[0], peer, timeout=self.left(),
                                                           stream=s))

    def recv(self, arr: np.ndarray, peer: int) -> None:
        self._staged([], [arr], lambda d, u, s: self.b.recv(u[0], peer, timeout=self.left(),
                                                           stream=s))

    def _staged(self, down: list[np.ndarray], up: list[np.ndarray], call: Any) -> None:
        rt = cuda.runtime()
        with rt.using_device(getattr(self.b, "device", None)):  # the communicator's device
            s, device = rt.current_stream(), rt.current_device()
            staged = {}
            for a in (*down, *up):
                if id(a) not in staged:
                    buf = rt.empty((a.nbytes,), np.dtype(np.uint8), device)
                    staged[id(a)] = (as_ref(buf, "object"), rt.alloc_pinned(a.nbytes), a)
            for a in down:
                ref, pin, _ = staged[id(a)]
                if a.nbytes:
                    pin[:] = a.view(np.uint8).reshape(-1)
                    rt.memcpy_async(ref.ptr, pin.__array_interface__["data"][0], a.nbytes, s)
            call([staged[id(a)][0] for a in down], [staged[id(a)][0] for a in up], s)
            for a in up:
                ref, pin, _ = staged[id(a)]
                if a.nbytes:
                    rt.memcpy_async(pin.__array_interface__["data"][0], ref.ptr, a.nbytes, s)
            event = rt.record_event(s)
        while not cuda.event_done(event):  # the pinned and device buffers live until then
            self.left()
            time.sleep(0.0002)
        for a in up:
            if a.nbytes:
                a.view(np.uint8).reshape(-1)[:] = staged[id(a)][1]


class ObjectCalls:
    """The object collectives of ``Communicator`` (a mixin: it uses the communicator's
    argument checks, sequence numbers and backend)."""

    @entry
    def broadcast_object(self, obj: Any = None, root: int = 0, *,
                         timeout: float | None = None) -> Any:
        """Root's ``obj`` on every rank (root gets ``obj`` itself back; the others a copy)."""
        c = self._call("broadcast_object")
        root = c.rank_arg(root, "root")
        t = c.timeout(timeout, self.timeout)
        seq = self._signature(c, t, None, root=root)
        me = self.rank

        def run(box: list) -> None:
            w = self._wire(t, c)
            packed = Packed.of(obj) if me == root else None
            head = packed.head() if packed else np.zeros(HEAD, np.int64)
            w.broadcast(head, root)
            check_head(c, head, root)
            rest = None
            if needs_rest(head):
                rest = packed.rest() if packed else np.zeros(needs_rest(head), np.int64)
                w.broadcast(rest, root)
            segs = packed.segments if packed else [np.empty(n, np.uint8)
                                                   for n in lengths(head, rest)]
            for seg in segs:
                for piece in pieces(seg):
                    w.broadcast(piece, root)
            if head[1] < 0:
                _raise_failed(c, packed, {root: segs[0]})
            box.append(obj if me == root else unpack(c, segs, root))

        return self._deferred(c, seq, run, False, None)

    @entry
    def all_gather_object(self, obj: Any, *, timeout: float | None = None) -> list:
        """Every rank's ``obj``, in rank order, on every rank (copies, this rank's too)."""
        c = self._call("all_gather_object")
        t = c.timeout(timeout, self.timeout)
        seq = self._signature(c, t, None)

        def run(box: list) -> None:
            box.append(self._gather_objects(c, obj, None, t))

        return self._deferred(c, seq, run, False, None)

    @entry
    def gather_object(self, obj: Any, root: int = 0, *, timeout: float | None = None) -> Any:
        """Every rank's ``obj``, in rank order, on root (copies); None on the other ranks."""
        c = self._call("gather_object")
        root = c.rank_arg(root, "root")
        t = c.timeout(timeout, self.timeout)
        seq = self._signature(c, t, None, root=root)

        def run(box: list) -> None:
            box.append(self._gather_objects(c, obj, root, t))

        return self._deferred(c, seq, run, False, None)

    @entry
    def scatter_object(self, objs: Sequence[Any] | None = None, root: int = 0, *,
                       timeout: float | None = None) -> Any:
        """Root's ``objs[r]`` to rank r (a copy); ``objs`` is ignored off root."""
        c = self._call("scatter_object")
        root = c.rank_arg(root, "root")
        t = c.timeout(timeout, self.timeout)
        me, n = self.rank, self.size
        if me == root and (isinstance(objs, (str, bytes)) or not isinstance(objs, Sequence)
                           or len(objs) != n):
            raise c.fail(ValueError if isinstance(objs, Sequence) else TypeError,
                         f"objs must be a list of {n} objects on the root (one per rank), got "
                         f"{_what(objs)}")
        seq = self._signature(c, t, None, root=root)

        def run(box: list) -> None:
            w = self._wire(t, c)
            packs = [Packed.of(o) for o in objs] if me == root else None
            failed = next((p for p in packs if p.failed), None) if packs else None
            if failed is not None:
                packs = [failed] * n
            head = np.zeros(HEAD, np.int64)
            w.scatter(np.stack([p.head() for p in packs]) if packs else None, head, root)
            check_head(c, head, root)
            rest = np.zeros(needs_rest(head), np.int64)
            sends = []
            if packs:
                sends = [(r, p.rest()) for r, p in enumerate(packs) if needs_rest(p.head())]
            if sends or rest.size:
                w.exchange(sends, [(root, rest)] if rest.size else [])
            segs = [np.empty(k, np.uint8) for k in lengths(head, rest if rest.size else None)]
            if packs:
                sends = [(r, piece) for r, p in enumerate(packs) for seg in p.segments
                         for piece in pieces(seg)]
            w.exchange(sends, [(root, piece) for seg in segs for piece in pieces(seg)])
            if head[1] < 0:
                _raise_failed(c, failed, {root: segs[0]})
            box.append(unpack(c, segs, root))

        return self._deferred(c, seq, run, False, None)

    @entry
    def all_reduce_object(self, obj: Any, op: Any = "sum", *,
                          timeout: float | None = None) -> Any:
        """Every rank's ``obj`` combined with ``op``, the same result on every rank (mpi4py's
        ``comm.allreduce(obj, op)``). ``op``: "sum" (``+``), "prod" (``*``), "min", "max" (the
        builtins), a ``gpucoll.ReduceOp`` of those, or a function of two objects. The objects
        are folded in rank order, ``op(op(obj0, obj1), obj2)...``, on every rank alike (so a
        non-commutative op such as list ``+`` gives rank order); each rank receives every
        object to do so."""
        c = self._call("all_reduce_object")
        fold = object_op(c, op)
        t = c.timeout(timeout, self.timeout)
        seq = self._signature(c, t, None)

        def run(box: list) -> None:
            box.append(_fold(c, fold, self._gather_objects(c, obj, None, t)))

        return self._deferred(c, seq, run, False, None)

    @entry
    def reduce_object(self, obj: Any, root: int = 0, op: Any = "sum", *,
                      timeout: float | None = None) -> Any:
        """Every rank's ``obj`` combined with ``op`` on root, as ``all_reduce_object`` folds
        them; None on the other ranks (mpi4py's ``comm.reduce(obj, op, root)``)."""
        c = self._call("reduce_object")
        root = c.rank_arg(root, "root")
        fold = object_op(c, op)
        t = c.timeout(timeout, self.timeout)
        seq = self._signature(c, t, None, root=root)

        def run(box: list) -> None:
            objs = self._gather_objects(c, obj, root, t)
            box.append(None if objs is None else _fold(c, fold, objs))

        return self._deferred(c, seq, run, False, None)

    # -- plumbing ------------------------------------------------------------------------------

    def _wire(self, t: float, c: Call) -> Wire:
        kind = Wire if self._backend.host_control else DeviceWire
        return kind(self._backend, t, c.where)

    def _gather_objects(self, c: Call, obj: Any, root: int | None, t: float) -> list | None:
        """all_gather_object (``root`` None) and gather_object: every rank learns every head
        (so that all of them see a failure alike), then the segments go where they are due."""
        w, me, n = self._wire(t, c), self.rank, self.size
        packed = Packed.of(obj)
        heads = np.empty((n, HEAD), np.int64)
        w.all_gather(packed.head(), heads)
        for r in range(n):
            check_head(c, heads[r], r)
        failed = [r for r in range(n) if heads[r][1] < 0]
        if failed:  # the failed ranks' error texts go to every rank
            texts = {r: np.empty(lengths(heads[r], None)[0], np.uint8) for r in failed}
            sends = [(p, packed.segments[0]) for p in range(n) if me in failed and p != me]
            w.exchange(sends, [(r, a) for r, a in texts.items() if r != me])
            _raise_failed(c, packed if packed.failed else None, texts)
        wanted = range(n) if root is None or root == me else ()
        targets = [p for p in range(n) if p != me and (root is None or p == root)]
        rest = {r: np.empty(needs_rest(heads[r]), np.int64) for r in wanted
                if r != me and needs_rest(heads[r])}
        if needs_rest(heads[me]) and targets or rest:
            mine = packed.rest()
            w.exchange([(p, mine) for p in targets if needs_rest(heads[me])], list(rest.items()))
        segs = {r: [np.empty(k, np.uint8) for k in lengths(heads[r], rest.get(r))]
                for r in wanted if r != me}
        w.exchange([(p, piece) for p in targets for seg in packed.segments
                    for piece in pieces(seg)],
                   [(r, piece) for r, ss in segs.items() for seg in ss for piece in pieces(seg)])
        if root is not None and root != me:
            return None
        segs[me] = packed.copy().segments
        return [unpack(c, segs[r], r) for r in range(n)]


def _raise_failed(c: Call, own: Packed | None, texts: dict[int, np.ndarray]) -> None:
    """A rank could not pickle its object: raise its own error there, PicklingError elsewhere."""
    if own is not None and own.failed is not None:
        raise own.failed
    detail = "; ".join(f"rank {r}: {bytes(t).decode('utf-8', 'replace')}"
                       for r, t in sorted(texts.items()))
    raise pickle.PicklingError(f"{c.where}: an object could not be pickled, so nothing was "
                               f"sent ({detail})")


_OBJECT_OPS: dict[ReduceOp, Callable[[Any, Any], Any]] = {
    ReduceOp.SUM: operator.add, ReduceOp.PROD: operator.mul, ReduceOp.MIN: min,
    ReduceOp.MAX: max}


def object_op(c: Call, op: Any) -> Callable[[Any, Any], Any]:
    """The function of two objects that ``op`` names (or is), checked before anything is sent."""
    if callable(op) and not isinstance(op, (str, ReduceOp)):
        return op
    if not isinstance(op, (str, ReduceOp)):
        raise c.fail(TypeError, f"op must be 'sum', 'prod', 'min', 'max', a gpucoll.ReduceOp or a "
                                f"function of two objects, got {type(op).__name__}")
    try:
        parsed = parse_op(op)
    except ValueError:
        parsed = None
    if parsed not in _OBJECT_OPS:
        raise c.fail(ValueError, f"op={op!r} does not combine Python objects; expected 'sum', "
                                 f"'prod', 'min', 'max' (or gpucoll.ReduceOp of them) or a "
                                 f"function of two objects")
    return _OBJECT_OPS[parsed]


def _fold(c: Call, fold: Callable[[Any, Any], Any], objs: list) -> Any:
    """``objs`` folded left in rank order."""
    acc = objs[0]
    for r in range(1, len(objs)):
        try:
            acc = fold(acc, objs[r])
        except Exception as exc:
            exc.add_note(f"{c.where}: while combining rank {r}'s object with those of ranks "
                         f"0..{r - 1}")
            raise
    return acc


def _what(objs: Any) -> str:
    if isinstance(objs, Sequence) and not isinstance(objs, (str, bytes)):
        return f"{len(objs)}"
    return type(objs).__name__
