"""Grouped rounds of messages, uneven collectives and out-of-place forms on the host ring.

A grouped round (``exchange``) is the ring's ncclGroupStart/End: sends and receives to and from
named ranks that progress together as one step of the current collective. The uneven
collectives (``all_gather_v``, ``reduce_scatter_v``) choose, like their even twins, one round of
direct messages while that stays cheap and the ring otherwise. Every message carries the call's
frame header with its own element count and the call's layout (a digest of the counts and
trailing shape every rank must agree on), so two ranks that disagree about the sizes are caught
by the first message between them, on both sides, instead of waiting for bytes that never come.

``GroupedRing`` adds these methods to ``RingBackend``; the functions below are the algorithms,
on flat NumPy arrays, in the style of ``ring_algos``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from gpucoll.arrays import ArrayRef, as_ref
from gpucoll.backends import ring_algos as algos
from gpucoll.ops import ReduceOp, host_ufunc
from gpucoll.progress import IN_CALL, KIND
from gpucoll.transport.engine import Recv, RecvReduce, Send

# header(count, dtype) -> the frame header of one message of the running call
Header = Callable[[int, np.dtype], bytes]


class GroupedRing:
    """The ring backend's grouped rounds, uneven collectives and out-of-place forms (a mixin of
    ``RingBackend``, whose call machinery it uses)."""

    def _headers(self, kind: str, layout: int, root: int = -1,
                 op: ReduceOp | None = None) -> Header:
        """The frame header of each message of this call: its own count, the call's layout."""
        p = self.progress
        code = p.kind if p.state == IN_CALL and p.kind else KIND.get(kind, 0)
        seq, opcode = max(p.seq, 0), algos.op_code(op)
        pack, magic = algos.FRAME.pack, algos.MAGIC

        def header(count: int, dtype: np.dtype) -> bytes:
            return pack(magic, code, opcode, algos.dtype_code(dtype), 0, root, layout & 0xFFFFFFFF,
                        seq, count)

        return header

    # -- out of place: copy, then the in-place algorithm on out -----------------------------
    def all_reduce_out(self, x: ArrayRef, out: ArrayRef, op: ReduceOp, *, timeout: float,
                       stream: Any = None) -> None:
        np.copyto(out.host, x.host)
        self.all_reduce(out, op, timeout=timeout)

    def reduce_out(self, x: ArrayRef, out: ArrayRef | None, root: int, op: ReduceOp, *,
                   timeout: float, stream: Any = None) -> None:
        if self.rank != root:  # the ring's reduce leaves x unchanged off root
            self.reduce(x, root, op, timeout=timeout)
            return
        np.copyto(out.host, x.host)
        self.reduce(out, root, op, timeout=timeout)

    def broadcast_out(self, x: ArrayRef | None, out: ArrayRef, root: int, *, timeout: float,
                      stream: Any = None) -> None:
        if self.rank == root:
            np.copyto(out.host, x.host)
        self.broadcast(out, root, timeout=timeout)

    # -- uneven sizes ------------------------------------------------------------------------
    def exchange(self, sends: Sequence[tuple[int, ArrayRef]],
                 recvs: Sequence[tuple[int, ArrayRef]], layout: int, *, timeout: float,
                 stream: Any = None) -> None:
        for peer, _ in (*sends, *recvs):
            if not 0 <= peer < self.size:
                raise ValueError(f"exchange on rank {self.rank}: peer {peer} is not a rank of "
                                 f"this group of {self.size}")
        self._call("exchange", timeout, b"", exchange,
                   [(p, r.host) for p, r in sends], [(p, r.host) for p, r in recvs],
                   self._headers("exchange", layout))

    def all_gather_v(self, x: ArrayRef, out: ArrayRef, counts: Sequence[int], layout: int, *,
                     timeout: float, stream: Any = None) -> None:
        self._call("all_gather_v", timeout, b"", all_gather_v, x.host, slots(out.host, counts),
                   self._headers("all_gather_v", layout))

    def reduce_scatter_v(self, x: ArrayRef, out: ArrayRef, counts: Sequence[int], op: ReduceOp,
                         layout: int, *, timeout: float, stream: Any = None) -> None:
        self._reducing("reduce_scatter_v", timeout, b"", reduce_scatter_v,
                       slots(x.host, counts), out.host, host_ufunc(op),
                       self._finish(op, self.size), self._headers("reduce_scatter_v", layout,
                                                                  op=op))

    def all_reduce_coalesced(self, xs: Sequence[ArrayRef], op: ReduceOp, *, timeout: float,
                             stream: Any = None) -> None:
        """One all_reduce of the arrays packed end to end (per dtype), then unpacked."""
        groups: dict[np.dtype, list[ArrayRef]] = {}
        for x in xs:
            groups.setdefault(x.dtype, []).append(x)
        for refs in groups.values():
            flat = np.concatenate([r.host for r in refs])
            self.all_reduce(as_ref(flat, "fused"), op, timeout=timeout)
            start = 0
            for r in refs:
                np.copyto(r.host, flat[start:start + r.count])
                start += r.count


def slots(flat: np.ndarray, counts: Sequence[int]) -> list[np.ndarray]:
    """``flat`` cut into consecutive views of ``counts`` elements (rank order)."""
    views, start = [], 0
    for n in counts:
        views.append(flat[start:start + n])
        start += n
    return views


def exchange(s: algos.Step, sends: list, recvs: list, header: Header) -> None:
    """One grouped round: messages to and from each peer in order; to itself, copies."""
    local = [a for p, a in recvs if p == s.rank]
    for i, src in enumerate(a for p, a in sends if p == s.rank):
        np.copyto(local[i], src)
    links = s.engine.links
    ops = [Send(links[p], a, header(a.size, a.dtype)) for p, a in sends if p != s.rank]
    ops += [Recv(links[p], a, header(a.size, a.dtype)) for p, a in recvs if p != s.rank]
    if ops:
        s.run(*ops)


def all_gather_v(s: algos.Step, x: np.ndarray, slots: list[np.ndarray], header: Header) -> None:
    """Rank r's ``x`` into ``slots[r]`` on every rank. Every pair of ranks exchanges a message
    (empty ones too) in the direct round, so a disagreement on the sizes fails everywhere."""
    n, rank = s.size, s.rank
    np.copyto(slots[rank], x)
    if n == 1:
        return
    links = s.engine.links
    if algos.use_direct(max(v.nbytes for v in slots), n):
        peers = [j for j in range(n) if j != rank]
        s.run(*(Send(links[j], x, header(x.size, x.dtype)) for j in peers),
              *(Recv(links[j], slots[j], header(slots[j].size, x.dtype)) for j in peers))
        return
    # ring, pipelined: each slot is forwarded piece by piece as it arrives
    p = s.pos
    nxt, prv = links[s.at(p + 1)], links[s.at(p - 1)]
    ops, arrived = [], None
    for step in range(n - 1):
        out, into = slots[s.at(p - step)], slots[s.at(p - step - 1)]
        ops.append(Send(nxt, out, header(out.size, x.dtype), arrived))
        arrived = Recv(prv, into, header(into.size, x.dtype))
        ops.append(arrived)
    s.run(*ops)


def reduce_scatter_v(s: algos.Step, xs: list[np.ndarray], out: np.ndarray, ufunc,
                     finish: Callable | None, header: Header) -> None:
    """``out`` := slot ``rank`` of ``xs`` reduced over ranks (the slots differ in size)."""
    n, rank = s.size, s.rank
    links = s.engine.links
    if n == 1:
        np.copyto(out, xs[rank])
    elif algos.use_direct(max(v.nbytes for v in xs), n):
        peers = [j for j in range(n) if j != rank]
        bufs = {j: np.empty_like(out) for j in peers}
        s.run(*(Send(links[j], xs[j], header(xs[j].size, out.dtype)) for j in peers),
              *(Recv(links[j], bufs[j], header(out.size, out.dtype)) for j in peers))
        np.copyto(out, xs[rank])
        algos.fold_in_rank_order(rank, out, bufs, ufunc)
    else:
        _reduce_scatter_v_ring(s, xs, out, ufunc, header)
    if finish is not None:
        finish(out)


def _reduce_scatter_v_ring(s: algos.Step, xs: list[np.ndarray], out: np.ndarray, ufunc,
                           header: Header) -> None:
    """As ``ring_algos._reduce_scatter_ring``, with partial sums the size of their slot."""
    n, p = s.size, s.pos
    nxt, prv = s.engine.links[s.at(p + 1)], s.engine.links[s.at(p - 1)]
    biggest = max(v.size for v in xs)
    scratch = [np.empty(biggest, out.dtype), np.empty(biggest, out.dtype)] if n > 2 else []
    outgoing = xs[s.at(p - 1)]
    for step in range(n - 1):
        slot = s.at(p - step - 2)
        acc = out if step == n - 2 else scratch[step % 2][:xs[slot].size]
        s.run(Send(nxt, outgoing, header(outgoing.size, out.dtype)),
              RecvReduce(prv, acc, ufunc, header(acc.size, out.dtype), xs[slot]))
        outgoing = acc
