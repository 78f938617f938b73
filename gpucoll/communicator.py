"""``Communicator``: the public face of a group of ranks.

Every method checks its arguments once (``gpucoll.validation``), optionally checks under
GPUCOLL_DEBUG=1 that all ranks make the same call (``gpucoll.signature``), and hands the backend
flat contiguous buffers. Sync calls run on the caller's thread with no store traffic; calls with
``async_op=True`` return a ``Work`` and complete in issue order.

Strided (non-contiguous) inputs are copied to a contiguous buffer first; for ops that write into
their input (all_reduce, broadcast, reduce, recv) the result is copied back into it afterwards.
``out=`` buffers must be C-contiguous.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from gpucoll.arrays import ArrayRef, dtype_from_name, new_array, write_back
from gpucoll.backends.base import Backend
from gpucoll.errors import CollectiveTimeout, GpucollError, StoreTimeout
from gpucoll.signature import SignatureCheck
from gpucoll.store.gather import leave_group
from gpucoll.validation import Call, check_timeout
from gpucoll.work import Work


def debug_enabled() -> bool:
    """GPUCOLL_DEBUG=1 (any value but empty or 0) turns on the cross-rank signature check."""
    return os.environ.get("GPUCOLL_DEBUG", "") not in ("", "0")


class Communicator:
    """A group of ``size`` ranks; this process is ``rank``; ``backend`` names the engine.

    Every method is collective (all ranks of the group call it, in the same order) except
    ``send``/``recv`` (the two ranks named) and ``close``. ``timeout=`` bounds one call (default:
    the communicator's); ``stream=`` orders device work on a CUDA stream (default: current).
    A strided ``x`` is copied to a contiguous buffer, and for the ops that write into ``x``
    (all_reduce, reduce, broadcast, recv) the result is copied back into it.
    """

    def __init__(self, backend: Backend, store: Any, *, timeout: float,
                 debug: bool | None = None, owned_store: Any = None):
        self._backend = backend
        self.rank: int = backend.rank
        self.size: int = backend.size
        self.backend: str = backend.name
        self._backend_reason: str = getattr(backend, "backend_reason", None) or (
            f"the {backend.name} backend was given to the Communicator directly")
        self.timeout = check_timeout(timeout, "timeout", "Communicator")
        self._store = store
        self._owned_store = owned_store
        self._closed = False
        self._seq = 0  # collective calls that passed validation, the same count on every rank
        self._scatters = 0
        self._splits = 0
        self._children: list[Communicator] = []
        self._calls: dict[str, Call] = {}
        self._headers: dict[tuple, str] = {}  # scatter headers by (dtype, shape, kind)
        self._check = SignatureCheck(store, self.rank, self.size) if (
            debug_enabled() if debug is None else debug) else None

    # -- reductions, in place ---------------------------------------------------------------

    def all_reduce(self, x: Any, op: Any = "sum", *, async_op: bool = False,
                   timeout: float | None = None, stream: Any = None) -> Any:
        """Combine ``x`` over all ranks with ``op``, in place; returns ``x``.

        Every rank gets a bit-identical result (a fixed reduction order).
        """
        c = self._call("all_reduce")
        ref = c.array(x, "x", writable=True)
        rop = c.op(op, ref.dtype)
        t = c.timeout(timeout, self.timeout)
        self._signature(c, t, ref, op=rop)
        b = self._backend
        return self._issue(c, lambda: b.all_reduce(ref, rop, timeout=t, stream=stream),
                           x, async_op, stream, ref, x)

    def reduce(self, x: Any, root: int = 0, op: Any = "sum", *, async_op: bool = False,
               timeout: float | None = None, stream: Any = None) -> Any:
        """Combine ``x`` over all ranks into root's ``x``; returns ``x`` (unchanged off root)."""
        c = self._call("reduce")
        root = c.rank_arg(root, "root")
        ref = c.array(x, "x", writable=self.rank == root)
        rop = c.op(op, ref.dtype)
        t = c.timeout(timeout, self.timeout)
        self._signature(c, t, ref, op=rop, root=root)
        b = self._backend
        return self._issue(c, lambda: b.reduce(ref, root, rop, timeout=t, stream=stream),
                           x, async_op, stream, ref, x)

    def broadcast(self, x: Any, root: int = 0, *, async_op: bool = False,
                  timeout: float | None = None, stream: Any = None) -> Any:
        """Copy root's ``x`` into every rank's ``x`` (same shape and dtype); returns ``x``."""
        c = self._call("broadcast")
        root = c.rank_arg(root, "root")
        ref = c.array(x, "x", writable=self.rank != root)
        t = c.timeout(timeout, self.timeout)
        self._signature(c, t, ref, root=root)
        b = self._backend
        return self._issue(c, lambda: b.broadcast(ref, root, timeout=t, stream=stream),
                           x, async_op, stream, ref, x)

    # -- ops that make a new array (or fill out=) -----------------------------------------

    def all_gather(self, x: Any, *, tiled: bool = False, out: Any = None, async_op: bool = False,
                   timeout: float | None = None, stream: Any = None) -> Any:
        """Every rank's ``x`` on every rank: shape ``(size, *x.shape)``, slot i from rank i.

        ``tiled=True`` concatenates along axis 0 instead: ``(size * x.shape[0], ...)``.
        """
        c = self._call("all_gather")
        ref = c.array(x, "x")
        t = c.timeout(timeout, self.timeout)
        res = c.output(out, ref, c.stacked(tuple(ref.shape), tiled), (ref,))
        self._signature(c, t, ref, tiled=tiled)
        b = self._backend
        return self._issue(c, lambda: b.all_gather(ref, res, timeout=t, stream=stream),
                           res.array, async_op, stream)

    def gather(self, x: Any, root: int = 0, *, tiled: bool = False, out: Any = None,
               async_op: bool = False, timeout: float | None = None, stream: Any = None) -> Any:
        """Every rank's ``x`` on root, as ``all_gather`` lays it out; None on other ranks.

        ``out`` is used on root only.
        """
        c = self._call("gather")
        ref = c.array(x, "x")
        root = c.rank_arg(root, "root")
        t = c.timeout(timeout, self.timeout)
        res = None
        if self.rank == root:
            res = c.output(out, ref, c.stacked(tuple(ref.shape), tiled), (ref,))
        self._signature(c, t, ref, root=root, tiled=tiled)
        b = self._backend
        return self._issue(c, lambda: b.gather(ref, res, root, timeout=t, stream=stream),
                           None if res is None else res.array, async_op, stream)

    def scatter(self, x: Any = None, root: int = 0, *, tiled: bool = False, out: Any = None,
                async_op: bool = False, timeout: float | None = None, stream: Any = None) -> Any:
        """Root's ``x`` of shape ``(size, *s)`` split by slot: rank i gets ``x[i]``, shape ``s``.

        ``tiled=True``: root's ``x`` is ``(size * k, ...)`` and each rank gets ``k`` rows.
        Other ranks pass ``x=None`` (dtype and shape come from root, through the store) or an
        ``out=`` buffer; ``x`` is ignored off root.
        """
        c = self._call("scatter")
        root = c.rank_arg(root, "root")
        t = c.timeout(timeout, self.timeout)
        if self.rank == root:
            if x is None:
                raise c.fail(TypeError, f"x is None on the root; root {root} passes the "
                                        f"({self.size}, ...) array to scatter")
            src = c.array(x, "x")
            res = c.output(out, src, c.slots(src, "x", tiled), (src,))
        else:
            src = None
            res = None if out is None else c.array(out, "out", writable=True, copy=False)
        self._signature(c, t, res, root=root, tiled=tiled)
        res = self._scatter_header(c, root, src, res, t)
        b = self._backend
        return self._issue(c, lambda: b.scatter(src, res, root, timeout=t, stream=stream),
                           res.array, async_op, stream)

    def reduce_scatter(self, x: Any, op: Any = "sum", *, tiled: bool = False, out: Any = None,
                       async_op: bool = False, timeout: float | None = None,
                       stream: Any = None) -> Any:
        """``x`` of shape ``(size, *s)`` reduced over ranks; rank i gets reduced slot i.

        ``tiled=True``: ``x`` is ``(size * k, ...)`` and each rank gets ``k`` reduced rows.
        """
        c = self._call("reduce_scatter")
        ref = c.array(x, "x")
        rop = c.op(op, ref.dtype)
        t = c.timeout(timeout, self.timeout)
        res = c.output(out, ref, c.slots(ref, "x", tiled), (ref,))
        self._signature(c, t, ref, op=rop, tiled=tiled)
        b = self._backend
        return self._issue(c, lambda: b.reduce_scatter(ref, res, rop, timeout=t, stream=stream),
                           res.array, async_op, stream)

    def all_to_all(self, x: Any, *, tiled: bool = False, out: Any = None, async_op: bool = False,
                   timeout: float | None = None, stream: Any = None) -> Any:
        """Exchange slots: ``x`` and the result have shape ``(size, *s)``, and result slot j is
        slot ``rank`` of rank j's ``x``. ``tiled=True`` splits axis 0 into ``size`` blocks."""
        c = self._call("all_to_all")
        ref = c.array(x, "x")
        t = c.timeout(timeout, self.timeout)
        c.slots(ref, "x", tiled)
        res = c.output(out, ref, tuple(ref.shape), (ref,))
        self._signature(c, t, ref, tiled=tiled)
        b = self._backend
        return self._issue(c, lambda: b.all_to_all(ref, res, timeout=t, stream=stream),
                           res.array, async_op, stream)

    # -- point to point and barrier ---------------------------------------------------------

    def send(self, x: Any, dst: int, *, async_op: bool = False, timeout: float | None = None,
             stream: Any = None) -> Work | None:
        """Send ``x`` to rank ``dst``, which calls ``recv`` with the same dtype and size."""
        c = self._call("send")
        ref = c.array(x, "x")
        dst = c.peer(dst, "dst")
        t = c.timeout(timeout, self.timeout)
        check = self._pair_signature(c, ref, dst, sending=True)
        b = self._backend
        return self._issue(c, lambda: b.send(ref, dst, timeout=t, stream=stream),
                           None, async_op, stream, check=check, timeout=t)

    def recv(self, x: Any, src: int, *, async_op: bool = False, timeout: float | None = None,
             stream: Any = None) -> Any:
        """Receive into ``x`` what rank ``src`` sends; returns ``x``."""
        c = self._call("recv")
        ref = c.array(x, "x", writable=True)
        src = c.peer(src, "src")
        t = c.timeout(timeout, self.timeout)
        check = self._pair_signature(c, ref, src, sending=False)
        b = self._backend
        return self._issue(c, lambda: b.recv(ref, src, timeout=t, stream=stream),
                           x, async_op, stream, ref, x, check=check, timeout=t)

    def barrier(self, *, async_op: bool = False, timeout: float | None = None) -> Work | None:
        """Return once every rank has called barrier (and, in issue order, all earlier work)."""
        c = self._call("barrier")
        t = c.timeout(timeout, self.timeout)
        self._signature(c, t, None)
        b = self._backend
        return self._issue(c, lambda: b.barrier(timeout=t), None, async_op, None)

    # -- groups and lifecycle ---------------------------------------------------------------

    def split(self, color: int | None, key: int = 0, *,
              timeout: float | None = None) -> Communicator | None:
        """A communicator of the ranks that pass the same ``color`` (MPI_Comm_split).

        Ranks are numbered by ``key``, then by rank here. A rank passing ``color=None`` takes
        part and gets None. Collective over this communicator.
        """
        c = self._call("split")
        if color is not None and (not isinstance(color, int) or isinstance(color, bool)):
            raise c.fail(TypeError, f"color must be an int or None, got {type(color).__name__}")
        if not isinstance(key, int) or isinstance(key, bool):
            raise c.fail(TypeError, f"key must be an int, got {type(key).__name__}")
        t = c.timeout(timeout, self.timeout)
        self._signature(c, t, None)
        n = self._splits
        self._splits += 1
        entries = self._share(f"split/{n}", [color, key], t, c)
        sub_store, sub_rank, sub_size = None, None, 0
        if color is not None:
            members = sorted((k, r) for r, (col, k) in enumerate(entries) if col == color)
            sub_rank, sub_size = members.index((key, self.rank)), len(members)
            sub_store = _prefix(f"split/{n}/{color}", self._store)
        made: list[Backend | None] = []
        self._backend.run_sync(lambda: made.append(self._backend.split(
            sub_store, sub_rank, sub_size, color, key, timeout=t)))
        if made[0] is None:
            return None
        sub = Communicator(made[0], sub_store, timeout=self.timeout,
                           debug=self._check is not None)
        sub._backend_reason = f"split from a {self.backend} communicator: {self.backend_reason}"
        self._children = [child for child in self._children if not child.closed] + [sub]
        return sub

    @property
    def ring_order(self) -> list[int] | None:
        """The ranks in the order the host ring visits them (None on other backends)."""
        return getattr(self._backend, "ring_order", None)

    @property
    def backend_reason(self) -> str:
        """Why this communicator runs on ``backend``: requested by name, or what
        ``backend="auto"`` found on the ranks (e.g. which rank cannot use NCCL)."""
        return self._backend_reason

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Finish issued work, release the backend (and the store, if this communicator made
        it) and communicators split from this one. Idempotent; not collective."""
        if self._closed:
            return
        self._closed = True
        try:
            for child in self._children:
                child.close()
            try:
                self._backend.run_sync(lambda: None)
            except GpucollError:
                pass  # the failed call already reported it; closing must still succeed
            self._backend.close()
        finally:
            if self._store is not None:  # never raises; the last rank out deletes the keys
                leave_group(self._store, self.rank, self.size)
            if self._owned_store is not None:
                self._owned_store.close()

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<Communicator rank {self.rank} of {self.size}, {self.backend}, {state}>"

    # -- plumbing -----------------------------------------------------------------------------

    def _call(self, name: str) -> Call:
        if self._closed:
            raise ValueError(f"{name} on rank {self.rank} of {self.size}: the communicator is "
                             f"closed")
        call = self._calls.get(name)
        if call is None:
            call = self._calls[name] = Call(name, self.rank, self.size)
        return call

    def _issue(self, c: Call, call: Callable[[], None], result: Any, async_op: bool,
               stream: Any, staged: ArrayRef | None = None, target: Any = None,
               check: Callable[[float], None] | None = None, timeout: float = 0.0) -> Any:
        """Run ``call`` now (sync) or in issue order (async); copy a contiguous stand-in of a
        strided ``target`` back into it afterwards; run a debug ``check`` first."""
        if check is not None or (staged is not None and staged.array is not target):
            call = _wrapped(call, check, timeout, staged, target)
        if async_op:
            return self._backend.run_async(call, stream=stream).bind(result, c.where)
        self._backend.run_sync(call)
        return result

    def _signature(self, c: Call, t: float, ref: ArrayRef | None, **fields: Any) -> None:
        seq = self._seq
        self._seq += 1
        if self._check is None:
            return
        sig = {"call": c.name, "dtype": None, "shape": None, **fields}
        if ref is not None:
            sig["dtype"], sig["shape"] = ref.dtype.name, list(ref.shape)
        self._check.collective(seq, sig, t, c.where)

    def _pair_signature(self, c: Call, ref: ArrayRef, peer: int,
                        sending: bool) -> Callable[[float], None] | None:
        if self._check is None:
            return None
        sig = {"call": c.name, "dtype": ref.dtype.name, "shape": list(ref.shape),
               "count": ref.count, "peer": peer}
        return self._check.point_to_point(peer, sending, sig, c.where)

    def _scatter_header(self, c: Call, root: int, src: ArrayRef | None, res: ArrayRef | None,
                        t: float) -> ArrayRef:
        """Root tells the other ranks the slot's dtype, shape and array kind through the
        store; they check their ``out`` against it or allocate one."""
        n = self._scatters
        self._scatters += 1
        if self.size == 1:
            return res
        key = f"scatter/{n}"
        if self.rank == root:
            self._store.set(key, self._header(res, src.kind))
            return res
        try:
            head = json.loads(self._store.get(key, timeout=t))
        except StoreTimeout:
            raise CollectiveTimeout(f"{c.where}: root {root} did not start scatter #{n} "
                                    f"within {t:g} s") from None
        if self._store.add(f"{key}/read", 1) == self.size - 1:
            self._store.delete_key(key)
            self._store.delete_key(f"{key}/read")
        dtype, shape = dtype_from_name(head["dtype"]), tuple(head["shape"])
        if res is None:
            return c.array(new_array(head["kind"], shape, dtype), "out")
        if res.dtype != dtype or tuple(res.shape) != shape:
            raise c.fail(ValueError, f"out is {res.dtype.name}{list(res.shape)} but root {root} "
                                     f"scatters slots of {dtype.name}{list(shape)}")
        return res

    def _header(self, res: ArrayRef, kind: str) -> str:
        """scatter's slot description as JSON, encoded once per (dtype, shape, kind)."""
        facts = (res.dtype, res.shape, kind)
        head = self._headers.get(facts)
        if head is None:
            if len(self._headers) >= 64:  # a program scattering many shapes: keep it bounded
                self._headers.clear()
            head = self._headers[facts] = json.dumps(
                {"dtype": res.dtype.name, "shape": list(res.shape), "kind": kind})
        return head

    def _share(self, key: str, value: Any, t: float, c: Call) -> list[Any]:
        """Every rank's ``value`` (JSON) in rank order, through the store; collective."""
        keys = [f"{key}/{r}" for r in range(self.size)]
        self._store.set(keys[self.rank], json.dumps(value))
        try:
            self._store.wait(keys, timeout=t)
        except StoreTimeout:
            missing = [r for r, k in enumerate(keys) if not self._store.check([k])]
            raise CollectiveTimeout(f"{c.where}: ranks {missing} did not call it within "
                                    f"{t:g} s") from None
        values = [json.loads(v) for v in self._store.multi_get(keys)]
        if self._store.add(f"{key}/read", 1) == self.size:
            for k in keys + [f"{key}/read"]:
                self._store.delete_key(k)
        return values


def _wrapped(call: Callable[[], None], check: Callable[[float], None] | None, timeout: float,
             staged: ArrayRef | None, target: Any) -> Callable[[], None]:
    """``call`` preceded by a debug check and followed by a write-back into ``target``."""
    def run() -> None:
        if check is not None:
            check(timeout)
        call()
        if staged is not None and staged.array is not target:
            write_back(staged, target)

    return run


def _prefix(prefix: str, store: Any) -> Any:
    from gpucoll.store import PrefixStore

    return PrefixStore(prefix, store)
