"""The NCCL forms of the out-of-place, uneven, coalesced and batched calls.

``GroupedNccl`` is a mixin of ``NcclBackend``: it uses only the backend's plumbing (``_begin``
to check buffers and pick the stream, ``_end`` to hand the call's event to the watchdog,
``_call`` and ``_group`` to run NCCL calls with errors translated, ``_copy``, ``_comm``,
``_rt``) and the dtype and op tables of ``nccl_types``, so that it moves with the backend.

The uneven all-gather takes one of three forms, by the size of the gathered buffer, after
published measurements of the three (UCC's TL/NCCL all-gather-v, openucx/ucc#347: one node, 8
GPUs, sizes as that table gives them): a group of broadcasts, one per rank (what PyTorch and
vLLM use), was fastest up to 512 KiB; a group of sends and receives from 1 to 4 MiB; one
all-gather padded to the largest rank's size, then compacted, from 8 MiB on (1.9x the sends and
receives at 128 MiB). The padded form is skipped when padding would move much more than the
data (very uneven sizes). None of the three has been timed on a GPU here. The uneven
reduce-scatter is a group of reduces, one per rank, each to the rank that owns the slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpucoll.backends.nccl_types import reduce_plan, wire
from gpucoll.backends.nccl_watch import EventWork
from gpucoll.ops import ReduceOp

BROADCAST_MAX_BYTES = 512 << 10  # up to here: a group of broadcasts
PADDED_MIN_BYTES = 8 << 20  # from here: one padded all-gather ...
PADDED_MAX_WASTE = 1.25  # ... unless padding moves more than this times the data


class GroupedNccl:
    """Out-of-place, uneven, coalesced and batched calls for ``NcclBackend``."""

    # -- out of place: NCCL reads x and writes out ------------------------------------------
    def all_reduce_out(self, x: Any, out: Any, op: ReduceOp, *, timeout: float,
                       stream: Any = None) -> None:
        s = self._begin("all_reduce", stream, (x, out))
        plan = reduce_plan(op, x.dtype, "all_reduce")
        keep = None
        if plan.native:
            self._call("all_reduce", self._comm.allReduce, x.ptr, out.ptr,
                       x.count * plan.factor, plan.code, plan.op, s)
        else:  # all-gather every rank's x, then reduce the slots locally into out
            keep = self._rt.alloc_device(self.size * x.nbytes, s)
            self._call("all_reduce", self._comm.allGather, x.ptr, keep.ptr,
                       x.count * plan.factor, plan.code, s)
            self._rt.reduce_slots(op.value, keep.ptr, out.ptr, self.size, x.count, x.dtype, s)
        self._end("all_reduce", s, timeout, keep)

    def reduce_out(self, x: Any, out: Any | None, root: int, op: ReduceOp, *, timeout: float,
                   stream: Any = None) -> None:
        s = self._begin("reduce", stream, (x, out))
        plan = reduce_plan(op, x.dtype, "reduce")
        keep = None
        if plan.native:  # recvbuff may be NULL off root (nccl.h)
            self._call("reduce", self._comm.reduce, x.ptr, out.ptr if out is not None else 0,
                       x.count * plan.factor, plan.code, plan.op, root, s)
        else:
            keep = self._rt.alloc_device(self.size * x.nbytes, s) if self.rank == root else None
            self._gather_to(x, keep.ptr if keep is not None else 0, root, s, "reduce")
            if keep is not None:
                self._rt.reduce_slots(op.value, keep.ptr, out.ptr, self.size, x.count, x.dtype,
                                      s)
        self._end("reduce", s, timeout, keep)

    def broadcast_out(self, x: Any | None, out: Any, root: int, *, timeout: float,
                      stream: Any = None) -> None:
        s = self._begin("broadcast", stream, (x, out))
        w = wire(out.dtype)
        send = x.ptr if self.rank == root else out.ptr  # sendbuff is read on root only
        self._call("broadcast", self._comm.broadcast, send, out.ptr, out.count * w.factor,
                   w.code, root, s)
        self._end("broadcast", s, timeout)

    # -- uneven sizes ------------------------------------------------------------------------
    def exchange(self, sends: Sequence[tuple[int, Any]], recvs: Sequence[tuple[int, Any]],
                 layout: int, *, timeout: float, stream: Any = None) -> None:
        """One NCCL group of sends and receives; what a rank sends itself is a device copy."""
        s = self._begin("exchange", stream, tuple(r for _, r in (*sends, *recvs)))
        comm, me = self._comm, self.rank
        own = [r for p, r in recvs if p == me]
        for i, src in enumerate(r for p, r in sends if p == me):
            self._copy(own[i].ptr, src.ptr, src.nbytes, s)
        calls = []
        for peer, ref in sends:
            if peer != me:
                w = wire(ref.dtype)
                calls.append((comm.send, (ref.ptr, ref.count * w.factor, w.code, peer, s)))
        for peer, ref in recvs:
            if peer != me:
                w = wire(ref.dtype)
                calls.append((comm.recv, (ref.ptr, ref.count * w.factor, w.code, peer, s)))
        if calls:
            self._group("exchange", calls)
        self._end("exchange", s, timeout)

    def all_gather_v(self, x: Any, out: Any, counts: Sequence[int], layout: int, *,
                     timeout: float, stream: Any = None) -> None:
        s = self._begin("all_gather_v", stream, (x, out))
        item, n, total = x.dtype.itemsize, self.size, sum(counts)
        biggest = max(counts)
        keep = None
        if total * item >= PADDED_MIN_BYTES and n * biggest <= PADDED_MAX_WASTE * total:
            keep = self._padded_all_gather(x, out, counts, biggest, s)
        elif total * item <= BROADCAST_MAX_BYTES:
            self._group("all_gather_v", self._broadcasts(x, out, counts, s))
        else:  # a group of sends and receives, straight into the slots of out
            self._group("all_gather_v", self._sends_and_receives(x, out, counts, s))
        self._end("all_gather_v", s, timeout, keep)

    def _padded_all_gather(self, x: Any, out: Any, counts: Sequence[int], biggest: int,
                           s: int) -> Any:
        """One all-gather of slots padded to the largest, then each slot copied into place;
        returns the scratch buffer (kept alive until the call completes)."""
        w, item, n = wire(x.dtype), x.dtype.itemsize, self.size
        keep = self._rt.alloc_device((n + 1) * biggest * item, s)
        padded = keep.ptr + n * biggest * item  # this rank's padded slot, after the others
        self._copy(padded, x.ptr, x.nbytes, s)
        self._call("all_gather_v", self._comm.allGather, padded, keep.ptr, biggest * w.factor,
                   w.code, s)
        start = 0
        for r, k in enumerate(counts):
            self._copy(out.ptr + start * item, keep.ptr + r * biggest * item, k * item, s)
            start += k
        return keep

    def _broadcasts(self, x: Any, out: Any, counts: Sequence[int], s: int) -> list:
        """One broadcast per rank, from its x into its slot of out."""
        w, item, calls, start = wire(x.dtype), x.dtype.itemsize, [], 0
        for r, k in enumerate(counts):
            send = x.ptr if r == self.rank else out.ptr + start * item
            calls.append((self._comm.broadcast, (send, out.ptr + start * item, k * w.factor,
                                                 w.code, r, s)))
            start += k
        return calls

    def _sends_and_receives(self, x: Any, out: Any, counts: Sequence[int], s: int) -> list:
        """x to every other rank, and every other rank's x into its slot of out (this rank's
        own slot: a device copy)."""
        w, item, me, calls, start = wire(x.dtype), x.dtype.itemsize, self.rank, [], 0
        for r, k in enumerate(counts):
            if r == me:
                self._copy(out.ptr + start * item, x.ptr, x.nbytes, s)
            else:
                calls.append((self._comm.send, (x.ptr, x.count * w.factor, w.code, r, s)))
                calls.append((self._comm.recv, (out.ptr + start * item, k * w.factor, w.code,
                                                r, s)))
            start += k
        return calls

    def reduce_scatter_v(self, x: Any, out: Any, counts: Sequence[int], op: ReduceOp,
                         layout: int, *, timeout: float, stream: Any = None) -> None:
        s = self._begin("reduce_scatter_v", stream, (x, out))
        plan = reduce_plan(op, x.dtype, "reduce_scatter_v")
        item, me = x.dtype.itemsize, self.rank
        keep = None
        if plan.native:  # one reduce per slot, to the rank that owns it, as one group
            calls, start = [], 0
            for r, k in enumerate(counts):
                calls.append((self._comm.reduce, (x.ptr + start * item,
                                                  out.ptr if r == me else 0, k * plan.factor,
                                                  plan.code, plan.op, r, s)))
                start += k
            self._group("reduce_scatter_v", calls)
        else:  # every rank's slot `me` comes here (grouped send/recv), then a local reduction
            keep = self._rt.alloc_device(self.size * out.nbytes, s)
            w, calls, start = wire(x.dtype), [], 0
            for r, k in enumerate(counts):
                if r != me:
                    calls.append((self._comm.send, (x.ptr + start * item, k * w.factor, w.code,
                                                    r, s)))
                    calls.append((self._comm.recv, (keep.ptr + r * out.nbytes,
                                                    out.count * w.factor, w.code, r, s)))
                else:
                    self._copy(keep.ptr + me * out.nbytes, x.ptr + start * item, out.nbytes, s)
                start += k
            if calls:
                self._group("reduce_scatter_v", calls)
            self._rt.reduce_slots(op.value, keep.ptr, out.ptr, self.size, out.count, out.dtype,
                                  s)
        self._end("reduce_scatter_v", s, timeout, keep)

    # -- many arrays, and point to point in one go -----------------------------------------
    def all_reduce_coalesced(self, xs: Sequence[Any], op: ReduceOp, *, timeout: float,
                             stream: Any = None) -> None:
        """The arrays NCCL reduces natively as one group (one launch); the others one by one."""
        s = self._begin("all_reduce_many", stream, tuple(xs))
        calls, rest = [], []
        for x in xs:
            plan = reduce_plan(op, x.dtype, "all_reduce_many")
            if plan.native:
                calls.append((self._comm.allReduce, (x.ptr, x.ptr, x.count * plan.factor,
                                                     plan.code, plan.op, s)))
            else:
                rest.append(x)
        if calls:
            self._group("all_reduce_many", calls)
        self._end("all_reduce_many", s, timeout)
        for x in rest:
            self.all_reduce(x, op, timeout=timeout, stream=stream)

    def batch_p2p(self, ops: Sequence[tuple[bool, Any, int]], *, timeout: float,
                  stream: Any = None) -> list:
        """Every send and receive as one NCCL group; they share its completion event."""
        s = self._begin("batch_isend_irecv", stream, tuple(ref for _, ref, _ in ops))
        calls = []
        for sending, ref, peer in ops:
            w = wire(ref.dtype)
            fn = self._comm.send if sending else self._comm.recv
            calls.append((fn, (ref.ptr, ref.count * w.factor, w.code, peer, s)))
        if calls:
            self._group("batch_isend_irecv", calls)
        self._end("batch_isend_irecv", s, timeout)
        return [EventWork(self, self._last) for _ in ops]
