"""The NCCL forms of the out-of-place, uneven, coalesced and batched calls.

``GroupedNccl`` is a mixin of ``NcclBackend``: it uses only the backend's plumbing (``_begin`` to
check buffers and order the stream, ``_end`` to hand the call's event and buffers to the
watchdog, ``_run`` and ``_nc.group`` to run NCCL calls within the deadline, ``_buf``, ``_copy``,
``_rt``) under the backend's device guard, and the dtype and op tables of ``driver``.

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

import time
from collections.abc import Sequence
from typing import Any

from gpucoll.backends.nccl.driver import reduce_plan, wire
from gpucoll.backends.nccl.watch import EventWork
from gpucoll.ops import ReduceOp

BROADCAST_MAX_BYTES = 512 << 10  # up to here: a group of broadcasts
PADDED_MIN_BYTES = 8 << 20  # from here: one padded all-gather ...
PADDED_MAX_WASTE = 1.25  # ... unless padding moves more than this times the data


class GroupedNccl:
    """Out-of-place, uneven, coalesced and batched calls for ``NcclBackend``."""

    def _group_of(self, opname: str, calls: list, deadline: float, timeout: float) -> None:
        if calls:
            self._nc.group(opname, calls, deadline=deadline, timeout=timeout)

    # -- out of place: NCCL reads x and writes out ------------------------------------------
    def all_reduce_out(self, x: Any, out: Any, op: ReduceOp, *, timeout: float,
                       stream: Any = None) -> None:
        plan = reduce_plan(op, x.dtype, "all_reduce")
        deadline = time.monotonic() + timeout
        with self._rt.using_device(self.device):
            s = self._begin("all_reduce", stream, timeout, (x, out))
            keep, n = None, x.count * plan.factor
            if x.count and plan.native:
                self._run("all_reduce", self._nc.comm.allreduce, self._buf(x.ptr, n, plan.dtype),
                          self._buf(out.ptr, n, plan.dtype), plan.op, stream=s,
                          deadline=deadline, timeout=timeout)
            elif x.count:  # all-gather every rank's x, then reduce the slots locally into out
                keep = self._rt.alloc_device(self.size * x.nbytes, s)
                self._run("all_reduce", self._nc.comm.allgather, self._buf(x.ptr, n, plan.dtype),
                          self._buf(keep.ptr, self.size * n, plan.dtype), stream=s,
                          deadline=deadline, timeout=timeout)
                self._rt.reduce_slots(op.value, keep.ptr, out.ptr, self.size, x.count, x.dtype,
                                      s)
            self._end("all_reduce", s, deadline, timeout, (x, out, keep))

    def reduce_out(self, x: Any, out: Any | None, root: int, op: ReduceOp, *, timeout: float,
                   stream: Any = None) -> None:
        plan = reduce_plan(op, x.dtype, "reduce")
        deadline = time.monotonic() + timeout
        with self._rt.using_device(self.device):
            s = self._begin("reduce", stream, timeout, (x, out))
            keep, n = None, x.count * plan.factor
            if x.count and plan.native:  # the receive buffer is read on root only
                recv = out if out is not None else x
                self._run("reduce", self._nc.comm.reduce, self._buf(x.ptr, n, plan.dtype),
                          self._buf(recv.ptr, n, plan.dtype), plan.op, root, stream=s,
                          deadline=deadline, timeout=timeout)
            elif x.count:
                if self.rank == root:
                    keep = self._rt.alloc_device(self.size * x.nbytes, s)
                self._gather_to(x, keep.ptr if keep is not None else 0, root, s, "reduce",
                                deadline, timeout)
                if keep is not None:
                    self._rt.reduce_slots(op.value, keep.ptr, out.ptr, self.size, x.count,
                                          x.dtype, s)
            self._end("reduce", s, deadline, timeout, (x, out, keep))

    def broadcast_out(self, x: Any | None, out: Any, root: int, *, timeout: float,
                      stream: Any = None) -> None:
        deadline = time.monotonic() + timeout
        with self._rt.using_device(self.device):
            s = self._begin("broadcast", stream, timeout, (x, out))
            if out.count:
                w = wire(out.dtype)
                n = out.count * w.factor
                send = x if self.rank == root else out  # the send buffer is read on root only
                self._run("broadcast", self._nc.comm.broadcast, self._buf(send.ptr, n, w.dtype),
                          self._buf(out.ptr, n, w.dtype), root, stream=s, deadline=deadline,
                          timeout=timeout)
            self._end("broadcast", s, deadline, timeout, (x, out))

    # -- uneven sizes ------------------------------------------------------------------------
    def _group_p2p(self, fn: Any, ref: Any, peer: int, s: int, ptr: int | None = None,
             count: int | None = None) -> tuple:
        """One send or receive of a group: ``count`` elements of ``ref``'s dtype at ``ptr``."""
        w = wire(ref.dtype)
        count = ref.count if count is None else count
        buf = self._buf(ref.ptr if ptr is None else ptr, count * w.factor, w.dtype)
        return fn, (buf, peer), {"stream": s}

    def exchange(self, sends: Sequence[tuple[int, Any]], recvs: Sequence[tuple[int, Any]],
                 layout: int, *, timeout: float, stream: Any = None) -> None:
        """One NCCL group of sends and receives; what a rank sends itself is a device copy."""
        deadline = time.monotonic() + timeout
        refs = tuple(r for _, r in (*sends, *recvs))
        with self._rt.using_device(self.device):
            s = self._begin("exchange", stream, timeout, refs)
            comm, me = self._nc.comm, self.rank
            own = [r for p, r in recvs if p == me]
            for i, src in enumerate(r for p, r in sends if p == me):
                self._copy(own[i].ptr, src.ptr, src.nbytes, s)
            calls = [self._group_p2p(comm.send, ref, peer, s) for peer, ref in sends if peer != me]
            calls += [self._group_p2p(comm.recv, ref, peer, s) for peer, ref in recvs if peer != me]
            self._group_of("exchange", calls, deadline, timeout)
            self._end("exchange", s, deadline, timeout, refs)

    def all_gather_v(self, x: Any, out: Any, counts: Sequence[int], layout: int, *,
                     timeout: float, stream: Any = None) -> None:
        deadline = time.monotonic() + timeout
        item, n, total = x.dtype.itemsize, self.size, sum(counts)
        biggest = max(counts)
        with self._rt.using_device(self.device):
            s = self._begin("all_gather_v", stream, timeout, (x, out))
            keep = None
            if not total:
                pass
            elif total * item >= PADDED_MIN_BYTES and n * biggest <= PADDED_MAX_WASTE * total:
                keep = self._padded_all_gather(x, out, counts, biggest, s, deadline, timeout)
            elif total * item <= BROADCAST_MAX_BYTES:
                self._group_of("all_gather_v", self._broadcasts(x, out, counts, s), deadline,
                               timeout)
            else:  # a group of sends and receives, straight into the slots of out
                self._group_of("all_gather_v", self._sends_and_receives(x, out, counts, s),
                               deadline, timeout)
            self._end("all_gather_v", s, deadline, timeout, (x, out, keep))

    def _padded_all_gather(self, x: Any, out: Any, counts: Sequence[int], biggest: int,
                           s: int, deadline: float, timeout: float) -> Any:
        """One all-gather of slots padded to the largest, then each slot copied into place;
        returns the scratch buffer (kept alive until the call completes)."""
        w, item, n = wire(x.dtype), x.dtype.itemsize, self.size
        keep = self._rt.alloc_device((n + 1) * biggest * item, s)
        padded = keep.ptr + n * biggest * item  # this rank's padded slot, after the others
        self._copy(padded, x.ptr, x.nbytes, s)
        self._run("all_gather_v", self._nc.comm.allgather,
                  self._buf(padded, biggest * w.factor, w.dtype),
                  self._buf(keep.ptr, n * biggest * w.factor, w.dtype), stream=s,
                  deadline=deadline, timeout=timeout)
        start = 0
        for r, k in enumerate(counts):
            self._copy(out.ptr + start * item, keep.ptr + r * biggest * item, k * item, s)
            start += k
        return keep

    def _broadcasts(self, x: Any, out: Any, counts: Sequence[int], s: int) -> list:
        """One broadcast per rank, from its x into its slot of out."""
        w, item, calls, start = wire(x.dtype), x.dtype.itemsize, [], 0
        for r, k in enumerate(counts):
            slot = self._buf(out.ptr + start * item, k * w.factor, w.dtype)
            send = self._buf(x.ptr, k * w.factor, w.dtype) if r == self.rank else slot
            calls.append((self._nc.comm.broadcast, (send, slot, r), {"stream": s}))
            start += k
        return calls

    def _sends_and_receives(self, x: Any, out: Any, counts: Sequence[int], s: int) -> list:
        """x to every other rank, and every other rank's x into its slot of out (this rank's
        own slot: a device copy)."""
        item, me, comm, calls, start = x.dtype.itemsize, self.rank, self._nc.comm, [], 0
        for r, k in enumerate(counts):
            if r == me:
                self._copy(out.ptr + start * item, x.ptr, x.nbytes, s)
            else:
                calls.append(self._group_p2p(comm.send, x, r, s))
                calls.append(self._group_p2p(comm.recv, x, r, s, out.ptr + start * item, k))
            start += k
        return calls

    def reduce_scatter_v(self, x: Any, out: Any, counts: Sequence[int], op: ReduceOp,
                         layout: int, *, timeout: float, stream: Any = None) -> None:
        plan = reduce_plan(op, x.dtype, "reduce_scatter_v")
        deadline = time.monotonic() + timeout
        item, me, comm = x.dtype.itemsize, self.rank, self._nc.comm
        with self._rt.using_device(self.device):
            s = self._begin("reduce_scatter_v", stream, timeout, (x, out))
            keep = None
            if not sum(counts):
                pass
            elif plan.native:  # one reduce per slot, to the rank that owns it, as one group
                calls, start = [], 0
                for r, k in enumerate(counts):
                    send = self._buf(x.ptr + start * item, k * plan.factor, plan.dtype)
                    recv = self._buf(out.ptr, k * plan.factor, plan.dtype) if r == me else send
                    calls.append((comm.reduce, (send, recv, plan.op, r), {"stream": s}))
                    start += k
                self._group_of("reduce_scatter_v", calls, deadline, timeout)
            else:  # every rank's slot `me` comes here (grouped send/recv), then a local reduction
                keep = self._rt.alloc_device(self.size * out.nbytes, s)
                calls, start = [], 0
                for r, k in enumerate(counts):
                    if r != me:
                        calls.append(self._group_p2p(comm.send, x, r, s, x.ptr + start * item, k))
                        calls.append(self._group_p2p(comm.recv, out, r, s,
                                                     keep.ptr + r * out.nbytes))
                    else:
                        self._copy(keep.ptr + me * out.nbytes, x.ptr + start * item,
                                   out.nbytes, s)
                    start += k
                self._group_of("reduce_scatter_v", calls, deadline, timeout)
                if out.count:
                    self._rt.reduce_slots(op.value, keep.ptr, out.ptr, self.size, out.count,
                                          out.dtype, s)
            self._end("reduce_scatter_v", s, deadline, timeout, (x, out, keep))

    # -- many arrays, and point to point in one go -----------------------------------------
    def all_reduce_coalesced(self, xs: Sequence[Any], op: ReduceOp, *, timeout: float,
                             stream: Any = None) -> None:
        """The arrays NCCL reduces natively as one group (one launch); the others one by one."""
        deadline = time.monotonic() + timeout
        rest = []
        with self._rt.using_device(self.device):
            s = self._begin("all_reduce_many", stream, timeout, tuple(xs))
            calls = []
            for x in xs:
                plan = reduce_plan(op, x.dtype, "all_reduce_many")
                if not plan.native:
                    rest.append(x)
                elif x.count:
                    buf = self._buf(x.ptr, x.count * plan.factor, plan.dtype)
                    calls.append((self._nc.comm.allreduce, (buf, buf, plan.op), {"stream": s}))
            self._group_of("all_reduce_many", calls, deadline, timeout)
            self._end("all_reduce_many", s, deadline, timeout, tuple(xs))
        for x in rest:
            self.all_reduce(x, op, timeout=timeout, stream=stream)

    def batch_p2p(self, ops: Sequence[tuple[bool, Any, int]], *, timeout: float,
                  stream: Any = None) -> list:
        """Every send and receive as one NCCL group; they share its completion event."""
        deadline = time.monotonic() + timeout
        refs = tuple(ref for _, ref, _ in ops)
        with self._rt.using_device(self.device):
            s = self._begin("batch_isend_irecv", stream, timeout, refs)
            comm = self._nc.comm
            calls = [self._group_p2p(comm.send if sending else comm.recv, ref, peer, s)
                     for sending, ref, peer in ops]
            self._group_of("batch_isend_irecv", calls, deadline, timeout)
            self._end("batch_isend_irecv", s, deadline, timeout, refs)
        return [EventWork(self, self._last) for _ in ops]
