"""The host collectives as steps of sends and receives between ranks.

Every function takes a ``Step`` (this rank, the group size, and ``run(ops)`` that completes a set
of ops by the call's deadline) and flat 1-D NumPy arrays. Large messages use bandwidth-optimal
schedules (the ring: reduce-scatter then all-gather; a pipelined chain for broadcast and reduce);
small ones a single round of direct exchange. Reductions follow a fixed order, so every rank of
an all_reduce ends with bit-identical values.

The ring visits ranks in ``Step.order`` (a permutation; the topology may choose it so neighbours
share the fastest links). Ring schedules work on positions in that order and translate a position
to a rank only to name a peer or a rank's slot, so every result keeps its meaning.

The grouped rounds and uneven collectives come last, with ``GroupedRing``, which adds them and the
out-of-place forms to ``RingBackend`` (a mixin: it uses the backend's call machinery). A grouped
round (``exchange``) is the ring's ncclGroupStart/End: sends and receives to and from named ranks
that progress together as one step of the current collective. The uneven collectives
(``all_gather_v``, ``reduce_scatter_v``) choose, like their even twins, one round of direct
messages while that stays cheap and the ring otherwise. Every message carries the call's frame
header with its own element count and the call's layout (a digest of the counts and trailing
shape every rank must agree on), so two ranks that disagree about the sizes are caught by the
first message between them, on both sides, instead of waiting for bytes that never come.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from gpucoll.arrays import SUPPORTED_DTYPES, ArrayRef, as_ref
from gpucoll.ops import ReduceOp, host_ufunc
from gpucoll.progress import IN_CALL, KIND, kind_name
from gpucoll.transport.engine import FRAME_BYTES, Peek, Put, Recv, RecvReduce, Send
from gpucoll.transport.shm import FOLDED, FRAME_MAGIC, STAGED, TAKEN, WHOLE

# below this many bytes per rank, one round of direct messages beats the ring's 2(n-1) steps
DIRECT_BYTES = 64 << 10
DIRECT_TOTAL = 1 << 20  # ... and at most this many bytes sent by one rank in that round
# on shared memory the round reads the peers' messages in place, and one round instead of the
# ring's 2(n-1) pays for more bytes sent when ranks share cores (at 4 ranks on 2 cores a 512 KiB
# all_reduce takes about half the ring's time): a rank puts up to this many
IN_PLACE_TOTAL = 2 << 20
CHAIN_CHUNK = 4 << 20  # bytes per round of the reduce chain (its scratch size)


# -- frame headers ---------------------------------------------------------------------------
# Every message starts with one: magic, call kind, reduce op, dtype, flags (unused), root, layout
# (0, or for the uneven collectives a digest of the counts and trailing shape every rank must
# agree on: ``GroupedRing``), sequence number, element count. The receiver compares it with the
# header of its own call.
FRAME = struct.Struct("<4sBBBBiIQQ")
MAGIC = FRAME_MAGIC
_DTYPE_CODES: dict[np.dtype, int] = {}
_OP_CODES = {op: i + 1 for i, op in enumerate(ReduceOp)}
_OPS = {code: op for op, code in _OP_CODES.items()}
assert FRAME.size == FRAME_BYTES


def dtype_code(dtype: np.dtype) -> int:
    code = _DTYPE_CODES.get(dtype)
    if code is None:
        code = _DTYPE_CODES[dtype] = SUPPORTED_DTYPES.index(dtype.name) + 1
    return code


def op_code(op: ReduceOp | None) -> int:
    """A reduce op's code in frame headers (0: none)."""
    return 0 if op is None else _OP_CODES[op]


def frame(kind: int, seq: int, dtype: np.dtype, count: int, root: int = -1,
          op: ReduceOp | None = None) -> bytes:
    """The frame header of every message of one call (or one point-to-point message)."""
    return FRAME.pack(MAGIC, kind, 0 if op is None else _OP_CODES[op],
                      _DTYPE_CODES.get(dtype) or dtype_code(dtype), 0, root, 0, seq, count)


def describe_frame(data: bytes) -> str:
    """``all_reduce #17 (float32, 4 elements, op=sum)``: a frame header in words."""
    magic, kind, op, dtype, _, root, layout, seq, count = FRAME.unpack(data)
    if magic != MAGIC:
        return f"unknown bytes {data[:16].hex()} (not a gpucoll frame: the streams are out of step)"
    name = SUPPORTED_DTYPES[dtype - 1] if 0 < dtype <= len(SUPPORTED_DTYPES) else f"dtype {dtype}"
    what = kind_name(kind)
    parts = [name, f"{count} elements"]
    if op:
        parts.append(f"op={_OPS[op].value}" if op in _OPS else f"op {op}")
    if root >= 0:  # a point-to-point message's tag travels where a collective's root does
        parts.append(f"{'tag' if what in ('send', 'recv') else 'root'}={root}")
    if layout:
        parts.append(f"counts/shape digest {layout:08x}")
    number = f"message #{seq}" if what in ("send", "recv") else f"#{seq}"
    return f"{what} {number} ({', '.join(parts)})"


def later_call(head: bytes, latest: int) -> bool:
    """True when the frame header ``head`` belongs to a collective after call ``latest``."""
    magic, kind, _, _, _, _, _, seq, _ = FRAME.unpack(head)
    return magic == MAGIC and kind not in _P2P_KINDS and seq > latest


_P2P_KINDS = frozenset({KIND["send"], KIND["recv"]})


class Step:
    """What an algorithm needs of the backend for one call; ``hdr`` heads its messages."""

    def __init__(self, engine, rank: int, size: int, deadline: float, opname: str,
                 order=None, pos: int | None = None, hdr: bytes = b""):
        self.engine = engine
        self.rank = rank
        self.size = size
        self.deadline = deadline
        self.opname = opname
        self.order = range(size) if order is None else order  # ring position -> rank
        self.hosts = None  # ranks grouped by host, for hierarchical schedules (see all_reduce)
        self.pos = rank if pos is None else pos  # this rank's position: order[pos] == rank
        self.hdr = hdr

    def sub(self, members) -> Step:
        """The same call over a subset of the ranks (``members``, this rank among them), which
        form a ring in the order given: the steps of a hierarchical schedule."""
        return Step(self.engine, self.rank, len(members), self.deadline, self.opname,
                    tuple(members), members.index(self.rank), self.hdr)

    def at(self, pos: int) -> int:
        """The rank at ring position ``pos`` (taken modulo the group size)."""
        return self.order[pos % self.size]

    def send(self, peer: int, arr: np.ndarray, gate=None) -> Send:
        return Send(self.engine.links[peer], arr, self.hdr, gate)

    def recv(self, peer: int, arr: np.ndarray) -> Recv:
        return Recv(self.engine.links[peer], arr, self.hdr)

    def reduce_from(self, peer: int, acc: np.ndarray, ufunc, src=None) -> RecvReduce:
        return RecvReduce(self.engine.links[peer], acc, ufunc, self.hdr, src)

    def run(self, *ops) -> None:
        self.engine.run(ops, self.deadline, self.opname)

    def in_place(self, peers, nbytes: int) -> bool:
        """True when messages of ``nbytes`` to and from ``peers`` can be read in the rings."""
        links = self.engine.links
        size = nbytes + FRAME_BYTES
        return size <= WHOLE and all(
            links[j].kind == "shm" and size <= links[j].whole for j in peers)

    def exchange_in_place(self, x: np.ndarray, send_to, recv_from) -> dict[int, np.ndarray]:
        """Send ``x`` to ``send_to``; return the messages of ``recv_from`` as views of the rings
        (typed like ``x``, writable) that stay valid until ``release``."""
        links = self.engine.links
        peeks = {j: Peek(links[j], x.nbytes, self.hdr) for j in recv_from}
        self.run(*(Put(links[j], x, self.hdr) for j in send_to), *peeks.values())
        return {j: p.view.view(x.dtype) for j, p in peeks.items()}

    def release(self, peers, nbytes: int) -> None:
        for j in peers:
            self.engine.links[j].release(nbytes + FRAME_BYTES)


def blocks(x: np.ndarray, k: int, n: int) -> list[np.ndarray]:
    """The ``n`` consecutive blocks of ``k`` elements of the flat array ``x`` (views)."""
    return [x[i * k:(i + 1) * k] for i in range(n)]


def bounds(count: int, parts: int) -> list[tuple[int, int]]:
    """Split ``count`` elements into ``parts`` nearly equal [start, stop) ranges."""
    base, extra = divmod(count, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def use_direct(nbytes: int, size: int) -> bool:
    """One round of messages to every peer while that stays cheap in bytes; the ring's
    2(n-1) rounds otherwise."""
    return nbytes <= DIRECT_BYTES and nbytes * (size - 1) <= DIRECT_TOTAL


def in_place_bytes(links: Sequence, size: int) -> int:
    """The largest all_reduce, in bytes, that still goes in one round when every peer's ring
    holds it whole (half a ring at most) and a rank puts at most IN_PLACE_TOTAL in the round
    (the peers' values are read where they lie). -1 when a link is not shared memory."""
    if not links or any(link.kind != "shm" for link in links):
        return -1
    return min(min(link.whole for link in links) - FRAME.size,
               IN_PLACE_TOTAL // max(size - 1, 1))


def _direct_in_place(s: Step, nbytes: int) -> bool:
    return nbytes <= _in_place_limit(s)


def _in_place_limit(s: Step) -> int:
    links = s.engine.links
    return in_place_bytes([links[j] for j in s.order if j != s.rank], s.size)


# -- all_reduce -----------------------------------------------------------------------------
def all_reduce(s: Step, x: np.ndarray, ufunc, finish: Callable | None,
               src: np.ndarray | None = None) -> None:
    """Reduce ``x`` over all ranks, in place; ``finish(view)`` post-processes (avg). With
    ``src`` out of place: ``x`` := the reduction of every rank's ``src``. The large paths read
    ``src`` where they would read ``x``, so that costs no copy; the small ones copy it first.
    The messages are the same either way: ranks in place and out of place work together."""
    limit = _in_place_limit(s)  # -1 alone
    if s.size == 1 or x.size == 0 or use_direct(x.nbytes, s.size) or x.nbytes <= limit:
        if src is not None:
            np.copyto(x, src)
        if s.size > 1 and x.size:
            _all_reduce_direct(s, x, ufunc)
        if finish is not None:
            finish(x)
    elif s.hosts is not None:
        _all_reduce_hierarchical(s, x, ufunc, finish, src)
    elif use_outboxes(s.engine.outboxes, x.nbytes, s.size, limit):
        all_reduce_outboxes(s, x if src is None else src, x, ufunc, finish)
    else:
        _all_reduce_ring(s, x, ufunc, finish, src)


def use_outboxes(boxes, nbytes: int, size: int, limit: int) -> bool:
    """When every rank is on this host (``boxes``: the engine's outboxes), an all_reduce too
    large for one round of messages (``limit``: ``in_place_bytes``, -1 alone) goes through
    the outboxes."""
    return boxes is not None and len(boxes.ranks) == size and nbytes > limit > 0


def all_reduce_outboxes(s: Step, x: np.ndarray, out: np.ndarray, ufunc,
                        finish: Callable | None) -> None:
    """``out`` := the reduction of every rank's ``x`` (``out`` may be ``x``), all ranks on
    one host: each rank copies the other ranks' shares of its data into its outbox once, a
    slot at a time; folds its own share of the slot, in rank order, from every outbox and its
    own data into ``out`` and back into its outbox; and copies the other shares of the slot
    out of their owners' outboxes. At 4 ranks a rank reads and writes about 5 times the
    buffer's bytes (the ring: 7), in three hand-overs per slot (the ring: 2(n-1) per segment),
    and one slot fills while the other drains. Every share's value is made once, by its owner,
    so every rank ends bit-identical."""
    engine, boxes, rank = s.engine, s.engine.outboxes, s.rank
    peers = [j for j in boxes.ranks if j != rank]
    links = [engine.links[j] for j in peers]
    # the frame headers first: every peer is in this very call (or the ranks disagree)
    if engine.active or engine.inbox:  # non-blocking messages in flight go first
        s.exchange_in_place(x[:0], peers, peers)
    else:
        engine.swap_small(links, links, memoryview(b""), s.hdr, s.deadline, s.opname)
    s.release(peers, 0)
    per = boxes.slot_bytes // x.itemsize
    nslots, base, depth = -(-x.size // per), boxes.used, boxes.slots
    staged = folded = taken = 0

    def slot(i: int) -> tuple[int, int, list[tuple[int, int]]]:
        lo, hi = i * per, min((i + 1) * per, x.size)
        return lo, hi, bounds(hi - lo, s.size)

    def can_stage() -> bool:
        return staged < nslots and boxes.least(TAKEN) > base + staged - depth

    def can_fold() -> bool:
        return folded < staged and boxes.least(STAGED) > base + folded

    def can_take() -> bool:
        return taken < folded and boxes.least(FOLDED) > base + taken

    def waiting_for() -> str:
        done = f"({min(taken * per, x.size) * x.itemsize} of {x.nbytes} bytes done)"
        for counter, value, wanted in ((FOLDED, taken + 1, taken < folded),
                                       (STAGED, folded + 1, folded < staged),
                                       (TAKEN, staged - depth + 1, True)):
            j = boxes.behind(counter, base + value)
            if wanted and j >= 0:
                return f"to receive from rank {j} {done}"
        return f"for the peers {done}"

    idle = 0.0
    while taken < nslots:
        moved = False
        if can_stage():
            lo, hi, cuts = slot(staged)
            box = boxes.slot(rank, base + staged, x.dtype, hi - lo)
            a, b = cuts[rank]
            box[:a] = x[lo:lo + a]  # (this rank's own share stays where it is)
            box[b:] = x[lo + b:hi]
            staged += 1
            boxes.publish(STAGED, base + staged)
            moved = True
        if can_fold():
            lo, hi, cuts = slot(folded)
            a, b = cuts[rank]
            share = boxes.slot(rank, base + folded, x.dtype, hi - lo)[a:b]
            _fold_share(boxes, rank, base + folded, x[lo + a:lo + b], out[lo + a:lo + b], share,
                        (a, b, hi - lo), ufunc)
            if finish is not None:
                finish(out[lo + a:lo + b])
            share[...] = out[lo + a:lo + b]
            folded += 1
            boxes.publish(FOLDED, base + folded)
            moved = True
        if can_take():
            lo, hi, cuts = slot(taken)
            for j in peers:
                a, b = cuts[j]
                out[lo + a:lo + b] = boxes.slot(j, base + taken, x.dtype, hi - lo)[a:b]
            taken += 1
            boxes.publish(TAKEN, base + taken)
            moved = True
        if (engine.active or engine.inbox) and engine.poke():  # non-blocking ones move too
            moved = True
        if moved:
            idle = 0.0
        else:
            idle = engine.idle_shared(idle, s.deadline, s.opname, waiting_for,
                                      lambda: can_stage() or can_fold() or can_take())
    boxes.used = base + nslots


def _fold_share(boxes, rank: int, index: int, mine: np.ndarray, dst: np.ndarray,
                share: np.ndarray, cut, ufunc) -> None:
    """``dst`` := every rank's share ``cut`` = (a, b, count) of slot ``index`` folded in rank
    order, this rank's own value being ``mine`` (which ``dst`` may be). Until ``mine`` is
    folded in, the sum so far waits in ``share``, this rank's own share of its outbox, which
    is free until the result goes there."""
    a, b, count = cut
    first, *rest = boxes.ranks
    acc = mine if first == rank else boxes.slot(first, index, mine.dtype, count)[a:b]
    for j in rest:
        value = mine if j == rank else boxes.slot(j, index, mine.dtype, count)[a:b]
        target = dst if j >= rank else share
        ufunc(acc, value, out=target)
        acc = target


def _all_reduce_direct(s: Step, x: np.ndarray, ufunc) -> None:
    """Everyone sends x to everyone, then folds all ranks' values in rank order."""
    peers = [j for j in s.order if j != s.rank]
    if s.in_place(peers, x.nbytes):
        views = s.exchange_in_place(x, peers, peers)
        fold_in_rank_order(s.rank, x, views, ufunc)
        s.release(peers, x.nbytes)
        return
    bufs = {j: np.empty_like(x) for j in peers}
    s.run(*(s.send(j, x) for j in peers), *(s.recv(j, bufs[j]) for j in peers))
    fold_in_rank_order(s.rank, x, bufs, ufunc)


def _native_fold_codes() -> dict:
    """(op, dtype) -> the code of the same left fold in the compiled exchange
    (gpucoll/transport/_shmfast.c: op * 16 + type). Integers take every op; floats only sum
    and product, whose IEEE results cannot differ from NumPy's (min and max keep NumPy's NaN
    rules); float16, bfloat16 and bool stay with NumPy."""
    ops = [ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.BAND,
           ReduceOp.BOR, ReduceOp.BXOR]
    types = ["i1", "u1", "i2", "u2", "i4", "u4", "i8", "u8", "f4", "f8"]
    codes = {}
    for t, name in enumerate(types):
        for o, op in enumerate(ops):
            if name[0] != "f" or op in (ReduceOp.SUM, ReduceOp.PROD):
                codes[(op, np.dtype(name))] = o * 16 + t
                if op is ReduceOp.SUM:
                    codes[(ReduceOp.AVG, np.dtype(name))] = o * 16 + t  # a sum, then divided
    return codes


NATIVE_FOLD = _native_fold_codes()


def fold_in_rank_order(rank: int, x: np.ndarray, bufs: dict, ufunc) -> None:
    """x := v0 op v1 op ... op v(n-1), left to right, where v(rank) is x itself (``bufs`` may be
    overwritten)."""
    if len(bufs) == 1:  # two ranks: one step, the lower rank's value on the left
        (j, other), = bufs.items()
        if j < rank:
            ufunc(other, x, out=x)
        else:
            ufunc(x, other, out=x)
        return
    order = sorted([*bufs, rank])
    if order[0] == rank:
        acc = x
    else:
        acc = bufs[order[0]]
    for j in order[1:]:
        if j == rank:
            ufunc(acc, x, out=x)
            acc = x
        else:
            ufunc(acc, bufs[j], out=acc)
    if acc is not x:
        np.copyto(x, acc)


def _all_reduce_ring(s: Step, x: np.ndarray, ufunc, finish, src=None) -> None:
    """Reduce-scatter then all-gather around the ring, as one pipeline: each segment is
    forwarded piece by piece as soon as its reduction (or arrival) completes. With ``src``,
    ``src``'s values reduced into ``x``."""
    cuts = bounds(x.size, s.size)
    seg = [x[a:b] for a, b in cuts]  # indexed by ring position
    ops, arrived = _reduce_scatter_steps(s, seg, ufunc, _cut(src, cuts))
    if finish is not None:  # avg: the sum must be whole before it is divided and sent on
        s.run(*ops)
        finish(seg[(s.pos + 1) % s.size])
        ops, arrived = [], None
    s.run(*ops, *_all_gather_steps(s, seg, arrived))


def _reduce_scatter_steps(s: Step, seg: list, ufunc, src: list | None = None
                          ) -> tuple[list, object]:
    """The ring's reduce-scatter: after it, this rank holds the full reduction of segment
    ``pos + 1``. With ``src`` (segments like ``seg``) this rank's values are read from there:
    the first send and every fold take them from ``src``, later sends the partial sums in
    ``seg``. Returns the ops and the last one (later sends wait for it)."""
    n, p = s.size, s.pos
    nxt, prv = s.at(p + 1), s.at(p - 1)
    mine = seg if src is None else src
    ops, arrived = [], None
    for step in range(n - 1):
        out_i, in_i = (p - step) % n, (p - step - 1) % n
        ops.append(s.send(nxt, (seg if step else mine)[out_i], gate=arrived))
        arrived = s.reduce_from(prv, seg[in_i], ufunc, src=mine[in_i])
        ops.append(arrived)
    return ops, arrived


def _cut(src: np.ndarray | None, cuts: list[tuple[int, int]]) -> list | None:
    return None if src is None else [src[a:b] for a, b in cuts]


def _all_gather_steps(s: Step, seg: list, arrived) -> list:
    """The ring's all-gather of finished segments, this rank starting with ``pos + 1``."""
    n, p = s.size, s.pos
    nxt, prv = s.at(p + 1), s.at(p - 1)
    ops = []
    for step in range(n - 1):
        out_i, in_i = (p + 1 - step) % n, (p - step) % n
        ops.append(s.send(nxt, seg[out_i], gate=arrived))
        arrived = s.recv(prv, seg[in_i])
        ops.append(arrived)
    return ops


def _all_reduce_hierarchical(s: Step, x: np.ndarray, ufunc, finish, src=None) -> None:
    """Ranks on several hosts, the same number (two or more) on each: a reduce-scatter among
    the ranks of a host (shared memory), an all_reduce of each shard among the ranks that hold
    it on every host (the network), then an all-gather on each host. The network carries 1/L
    of what a flat ring sends across it, L ranks' shards at once. Each shard's value is made
    once, by the network step, and copied from there, so every rank ends bit-identical. With
    ``src``, ``src``'s values reduced into ``x`` (read by the reduce-scatter, no copy)."""
    local = next(h for h in s.hosts if s.rank in h)
    node = s.sub(local)
    cuts = bounds(x.size, node.size)
    seg = [x[a:b] for a, b in cuts]
    ops, _ = _reduce_scatter_steps(node, seg, ufunc, _cut(src, cuts))
    node.run(*ops)
    shard = (node.pos + 1) % node.size
    across = s.sub([h[node.pos] for h in s.hosts])
    if across.size > 1 and use_direct(seg[shard].nbytes, across.size):
        _all_reduce_direct(across, seg[shard], ufunc)
    elif across.size > 1:
        _all_reduce_ring(across, seg[shard], ufunc, None)
    if finish is not None:
        finish(seg[shard])
    node.run(*_all_gather_steps(node, seg, None))


# -- broadcast / reduce ---------------------------------------------------------------------
def broadcast(s: Step, x: np.ndarray, root: int) -> None:
    if s.size == 1 or x.size == 0:
        return
    if use_direct(x.nbytes, s.size):
        if s.rank == root:
            peers = [j for j in range(s.size) if j != root]
            if s.in_place(peers, x.nbytes):
                s.exchange_in_place(x, peers, [])
            else:
                s.run(*(s.send(j, x) for j in peers))
        elif s.in_place([root], x.nbytes):
            np.copyto(x, s.exchange_in_place(x, [], [root])[root])
            s.release([root], x.nbytes)
        else:
            s.run(s.recv(root, x))
        return
    # pipelined chain along the ring from root: each rank forwards bytes as they arrive
    n = s.size
    pos = (s.pos - s.order.index(root)) % n
    nxt, prv = s.at(s.pos + 1), s.at(s.pos - 1)
    if pos == 0:
        s.run(s.send(nxt, x))
    elif pos == n - 1:
        s.run(s.recv(prv, x))
    else:
        incoming = s.recv(prv, x)
        s.run(incoming, s.send(nxt, x, gate=incoming))


def reduce(s: Step, x: np.ndarray, root: int, ufunc, finish: Callable | None) -> None:
    """The reduction lands in ``x`` on root; other ranks' ``x`` stays unchanged."""
    if s.size == 1 or x.size == 0:
        if finish is not None and s.rank == root:
            finish(x)
        return
    n, rank = s.size, s.rank
    if use_direct(x.nbytes, n):
        if rank == root:
            peers = [j for j in range(n) if j != root]
            bufs = {j: np.empty_like(x) for j in peers}
            s.run(*(s.recv(j, bufs[j]) for j in peers))
            fold_in_rank_order(rank, x, bufs, ufunc)
        else:
            s.run(s.send(root, x))
    else:
        _reduce_chain(s, x, root, ufunc)
    if finish is not None and rank == root:
        finish(x)


def _reduce_chain(s: Step, x: np.ndarray, root: int, ufunc) -> None:
    """Pipelined chain along the ring from the rank after root back to root: partial results are
    forwarded as they form, chunk by chunk, so a middle rank needs one chunk of scratch, not a
    copy of ``x``."""
    n = s.size
    pos = (s.pos - s.order.index(root)) % n
    nxt, prv = s.at(s.pos + 1), s.at(s.pos - 1)
    step = max(CHAIN_CHUNK // x.itemsize, 1)
    scratch = np.empty(min(step, x.size), x.dtype) if 1 < pos else None
    for start in range(0, x.size, step):
        part = x[start:start + step]
        if pos == 1:
            s.run(s.send(nxt, part))
        elif pos == 0:
            s.run(s.reduce_from(prv, part, ufunc))
        else:
            acc = scratch[:part.size]
            incoming = s.reduce_from(prv, acc, ufunc, src=part)
            s.run(incoming, s.send(nxt, acc, gate=incoming))


# -- gathering and scattering ---------------------------------------------------------------
def all_gather(s: Step, x: np.ndarray, out: np.ndarray) -> None:
    n, rank, k = s.size, s.rank, x.size
    slots = blocks(out, k, n)
    np.copyto(slots[rank], x)
    if n == 1 or k == 0:
        return
    if use_direct(x.nbytes, n) or _direct_in_place(s, x.nbytes):
        peers = [j for j in range(n) if j != rank]
        s.run(*(s.send(j, x) for j in peers), *(s.recv(j, slots[j]) for j in peers))
        return
    # ring, pipelined: each slot is forwarded piece by piece as it arrives
    p = s.pos
    nxt, prv = s.at(p + 1), s.at(p - 1)
    ops, arrived = [], None
    for step in range(n - 1):
        ops.append(s.send(nxt, slots[s.at(p - step)], gate=arrived))
        arrived = s.recv(prv, slots[s.at(p - step - 1)])
        ops.append(arrived)
    s.run(*ops)


def gather(s: Step, x: np.ndarray, out: np.ndarray | None, root: int) -> None:
    n, rank, k = s.size, s.rank, x.size
    if rank != root:
        s.run(s.send(root, x))
        return
    slots = blocks(out, k, n)
    np.copyto(slots[rank], x)
    s.run(*(s.recv(j, slots[j]) for j in range(n) if j != root))


def scatter(s: Step, x: np.ndarray | None, out: np.ndarray, root: int) -> None:
    n, rank, k = s.size, s.rank, out.size
    if rank != root:
        s.run(s.recv(root, out))
        return
    slots = blocks(x, k, n)
    np.copyto(out, slots[rank])
    s.run(*(s.send(j, slots[j]) for j in range(n) if j != root))


def all_to_all(s: Step, x: np.ndarray, out: np.ndarray) -> None:
    n, rank = s.size, s.rank
    k = x.size // n
    xs = blocks(x, k, n)
    outs = blocks(out, k, n)
    np.copyto(outs[rank], xs[rank])
    peers = [j for j in range(n) if j != rank]
    s.run(*(s.send(j, xs[j]) for j in peers), *(s.recv(j, outs[j]) for j in peers))


def reduce_scatter(s: Step, x: np.ndarray, out: np.ndarray, ufunc, finish) -> None:
    """``out`` := slot ``rank`` of ``x`` reduced over ranks; ``x`` stays unchanged."""
    n, rank, k = s.size, s.rank, out.size
    xs = blocks(x, k, n)
    if n == 1 or k == 0:
        np.copyto(out, xs[rank])
    elif use_direct(out.nbytes, n) or _direct_in_place(s, out.nbytes):
        peers = [j for j in range(n) if j != rank]
        bufs = {j: np.empty_like(out) for j in peers}
        s.run(*(s.send(j, xs[j]) for j in peers), *(s.recv(j, bufs[j]) for j in peers))
        np.copyto(out, xs[rank])
        fold_in_rank_order(rank, out, bufs, ufunc)
    else:
        _reduce_scatter_ring(s, xs, out, ufunc)
    if finish is not None:
        finish(out)


def _reduce_scatter_ring(s: Step, xs: list, out: np.ndarray, ufunc) -> None:
    """Partial sums travel the ring; the slot of the rank at position q gathers the ranks at
    q+1, q+2, ... and ends on that rank."""
    n, p = s.size, s.pos
    nxt, prv = s.at(p + 1), s.at(p - 1)
    bufs = [np.empty_like(out), np.empty_like(out)] if n > 2 else [None]
    outgoing = xs[s.at(p - 1)]
    for step in range(n - 1):
        slot = s.at(p - step - 2)
        acc = out if step == n - 2 else bufs[step % 2]
        s.run(s.send(nxt, outgoing), s.reduce_from(prv, acc, ufunc, src=xs[slot]))
        outgoing = acc


# -- point to point and barrier -------------------------------------------------------------
def barrier(s: Step) -> None:
    """Dissemination barrier: ceil(log2 n) rounds of one-byte messages."""
    token, got = np.zeros(1, np.uint8), np.zeros(1, np.uint8)
    dist = 1
    while dist < s.size:
        to, frm = (s.rank + dist) % s.size, (s.rank - dist) % s.size
        if s.in_place((to, frm), 1):
            s.exchange_in_place(token, [to], [frm])
            s.release([frm], 1)
        else:
            s.run(s.send(to, token), s.recv(frm, got))
        dist *= 2


# -- grouped rounds, uneven collectives, out-of-place forms ------------------------------------
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
        seq, opcode = max(p.seq, 0), op_code(op)
        pack, magic = FRAME.pack, MAGIC

        def header(count: int, dtype: np.dtype) -> bytes:
            return pack(magic, code, opcode, dtype_code(dtype), 0, root, layout & 0xFFFFFFFF,
                        seq, count)

        return header

    # -- out of place: copy, then the in-place algorithm on out (large all_reduces: no copy) --
    def all_reduce_out(self, x: ArrayRef, out: ArrayRef, op: ReduceOp, *, timeout: float,
                       stream: Any = None) -> None:
        if self._all_reduce_from(x.host, out.host, op, self._frame("all_reduce", x.host, op=op),
                                 timeout):
            return
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


def exchange(s: Step, sends: list, recvs: list, header: Header) -> None:
    """One grouped round: messages to and from each peer in order; to itself, copies."""
    local = [a for p, a in recvs if p == s.rank]
    for i, src in enumerate(a for p, a in sends if p == s.rank):
        np.copyto(local[i], src)
    links = s.engine.links
    ops = [Send(links[p], a, header(a.size, a.dtype)) for p, a in sends if p != s.rank]
    ops += [Recv(links[p], a, header(a.size, a.dtype)) for p, a in recvs if p != s.rank]
    if ops:
        s.run(*ops)


def all_gather_v(s: Step, x: np.ndarray, slots: list[np.ndarray], header: Header) -> None:
    """Rank r's ``x`` into ``slots[r]`` on every rank. Every pair of ranks exchanges a message
    (empty ones too) in the direct round, so a disagreement on the sizes fails everywhere."""
    n, rank = s.size, s.rank
    np.copyto(slots[rank], x)
    if n == 1:
        return
    links = s.engine.links
    if use_direct(max(v.nbytes for v in slots), n):
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


def reduce_scatter_v(s: Step, xs: list[np.ndarray], out: np.ndarray, ufunc,
                     finish: Callable | None, header: Header) -> None:
    """``out`` := slot ``rank`` of ``xs`` reduced over ranks (the slots differ in size)."""
    n, rank = s.size, s.rank
    links = s.engine.links
    if n == 1:
        np.copyto(out, xs[rank])
    elif use_direct(max(v.nbytes for v in xs), n):
        peers = [j for j in range(n) if j != rank]
        bufs = {j: np.empty_like(out) for j in peers}
        s.run(*(Send(links[j], xs[j], header(xs[j].size, out.dtype)) for j in peers),
              *(Recv(links[j], bufs[j], header(out.size, out.dtype)) for j in peers))
        np.copyto(out, xs[rank])
        fold_in_rank_order(rank, out, bufs, ufunc)
    else:
        _reduce_scatter_v_ring(s, xs, out, ufunc, header)
    if finish is not None:
        finish(out)


def _reduce_scatter_v_ring(s: Step, xs: list[np.ndarray], out: np.ndarray, ufunc,
                           header: Header) -> None:
    """As ``_reduce_scatter_ring``, with partial sums the size of their slot."""
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
