"""Point-to-point messages of Python objects, matched as MPI matches them: ``send_object``,
``recv_object``, ``isend_object`` and ``irecv_object``, with tags, ``ANY_SOURCE``/``ANY_TAG``
and a ``Status`` that says who sent what was received.

A message carries a ``tag`` (an int >= 0, default 0). A receive takes the first message from its
source with its tag, in the order they were sent (MPI's non-overtaking rule per source and tag);
a message that no receive wants yet waits on the receiving rank for its own. Posted receives are
matched in the order they were posted.

How: between two ranks object messages travel in order on the host ring's links, packed as the
object collectives pack them (``gpucoll.objects``), the tag in the head. The receiving rank reads
them off that channel in order and matches each, host-side, against its posted receives; one that
no receive wants is kept, still pickled, until one does. So that a rank can tell which peers
have a message for it without blocking on any (``ANY_SOURCE``, ``is_completed()``, ``wait`` with
a timeout), every send first marks the message in the group's store (one request that waits for
no reply; the key ``objects/{dst}/{src}/{block}/{n}``, a block's 64 keys deleted together by the
receiver), and such a receive reads a message off the channel only once it is marked: it polls
the markers, backing off from 20 us to 1 ms, and every half second asks whether its senders are
still there. A receive that blocks on one named source reads its channel directly instead.

NCCL pairs each send with a receive on a stream, in order, and cannot hold a message until its
receive comes (a rank's receive would queue behind its own unfinished send), so on NCCL object
messages wait in the store itself (``mail/{dst}/{src}/{n}/``, parts of at most 64 MiB), sent in
one request with their marker and deleted once read.

Arrays and objects between two ranks share that one ordered channel: a tag reorders objects
among objects only, so a rank receives arrays and objects from a peer in the kinds' order of
sending (an object receive that meets an array is a ``CollectiveMismatch``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from gpucoll.arrays import as_ref
from gpucoll.errors import CollectiveTimeout, PeerFailure, UsageError
from gpucoll.objects import (
    HEAD,
    Packed,
    _raise_failed,
    check_head,
    lengths,
    needs_rest,
    pieces,
    unpack,
)
from gpucoll.validation import Call, entry
from gpucoll.work import Work

ANY_SOURCE = -1  # recv_object/irecv_object: a message from any rank
ANY_TAG = -1  # recv_object/irecv_object: a message with any tag
_POLL_S = (20e-6, 1e-3)  # first and longest pause between looks at the markers
_BLOCK = 64  # markers deleted together
_CHECK_S = 0.5  # how often a waiting receive asks whether its senders are still there
STORE_PART_BYTES = 64 << 20  # the largest value a message left in the store is cut into


@dataclasses.dataclass
class Status:
    """Who sent a received object and with which tag: pass one as ``status=`` to a receive
    (mpi4py's ``MPI.Status``; its ``Get_source()``/``Get_tag()`` work too)."""

    source: int = -1
    tag: int = -1

    def Get_source(self) -> int:  # noqa: N802 - mpi4py's spelling, for ported programs
        return self.source

    def Get_tag(self) -> int:  # noqa: N802
        return self.tag


class Message:
    """One object message read off the channel, still pickled."""

    __slots__ = ("src", "tag", "head", "segs")

    def __init__(self, src: int, head: np.ndarray, segs: list[np.ndarray]):
        self.src, self.tag, self.head, self.segs = src, int(head[2]), head, segs


class Receive:
    """A posted receive: from ``src`` (None: any) with ``tag`` (None: any), by ``deadline``."""

    __slots__ = ("src", "tag", "deadline", "where", "message")

    def __init__(self, src: int | None, tag: int | None, deadline: float, where: str):
        self.src, self.tag, self.deadline, self.where = src, tag, deadline, where
        self.message: Message | None = None

    def wants(self, m: Message) -> bool:
        return (self.src is None or self.src == m.src) and (self.tag is None or self.tag == m.tag)

    def describe(self) -> str:
        src = "any rank" if self.src is None else f"rank {self.src}"
        tag = "any tag" if self.tag is None else f"tag {self.tag}"
        return f"{self.where}: no object from {src} with {tag}"


class Mailbox:
    """One communicator's object messages: how many it read from each peer, the messages kept
    for later receives, and the receives posted and not yet matched."""

    def __init__(self, comm: Any):
        self.comm = comm
        self.rank, self.size, self.store = comm.rank, comm.size, comm._store
        self.taken = [0] * self.size  # messages read off the channel from each peer
        self.sent = [0] * self.size  # messages marked in the store for each peer
        self.kept: list[Message] = []  # read, not yet received, in the order they came
        self.posted: list[Receive] = []
        self.turn = 0  # where an any-source look starts, so that no sender starves
        # a backend that cannot hold a message until its receive comes (NCCL pairs sends with
        # receives on a stream, in order): messages wait in the store instead
        self.stored = not comm._backend.host_control and self.store is not None

    def announce(self, dst: int, keys: list[str] | None = None,
                 values: list[bytes] | None = None) -> None:
        """Mark one more message from this rank to ``dst`` in the store (after ``keys`` set to
        ``values``, in the same request): one request that waits for no reply."""
        if self.store is None:
            return
        n = self.sent[dst]
        self.sent[dst] = n + 1
        self.store.multi_set([*(keys or []), _marker(dst, self.rank, n)],
                             [*(values or []), b"1"])

    def deposit(self, dst: int, arrays: list[np.ndarray]) -> None:
        """Leave a message for ``dst`` in the store (a backend without host buffering), marked
        in the same request as its last part: a marked message is there whole."""
        base = f"mail/{dst}/{self.rank}/{self.sent[dst]}/"
        keys, values, size = [], [], 0
        for j, part in enumerate(p for a in arrays for p in _cut(a)):
            if keys and size + part.nbytes > STORE_PART_BYTES:
                self.store.multi_set(keys, values)
                keys, values, size = [], [], 0
            keys.append(f"{base}{j}")
            values.append(part.tobytes())
            size += part.nbytes
        self.announce(dst, keys, values)

    def _took(self, src: int) -> None:
        """One more message read from ``src``; the markers of a block of them all read are
        deleted together (one request per ``_BLOCK`` messages)."""
        n = self.taken[src] = self.taken[src] + 1
        if self.store is not None and n % _BLOCK == 0:
            self.store.delete_prefix(f"objects/{self.rank}/{src}/{n // _BLOCK - 1}/")

    def _withdraw(self, src: int, deadline: float, where: str) -> tuple[np.ndarray, Any, list]:
        """The head, rest and segments of the next message ``src`` deposited for this rank."""
        base = f"mail/{self.rank}/{src}/{self.taken[src]}/"
        left = lambda: max(deadline - time.monotonic(), 1e-3)  # noqa: E731
        head = np.frombuffer(self.store.get(f"{base}0", timeout=left()), np.int64).copy()
        check_head(_Where(where), head, src)
        j, rest = 1, None
        if needs_rest(head):
            rest = np.frombuffer(self.store.get(f"{base}1", timeout=left()), np.int64).copy()
            j = 2
        segs = [np.empty(k, np.uint8) for k in lengths(head, rest)]
        parts = [part for seg in segs for piece in pieces(seg) for part in _cut(piece)]
        batch: list[tuple[str, np.ndarray]] = []  # fetched together, at most a part's size
        for i, part in enumerate(parts + [None]):
            if batch and (part is None or sum(p.nbytes for _, p in batch) + part.nbytes >
                          STORE_PART_BYTES):
                values = self.store.multi_get([k for k, _ in batch], timeout=left())
                for (_, dst), value in zip(batch, values, strict=True):
                    dst[:] = np.frombuffer(value, np.uint8)
                batch = []
            if part is not None:
                batch.append((f"{base}{j + i}", part))  # as the sender cut them
        self.store.delete_prefix(base)
        return head, rest, segs

    def post(self, r: Receive) -> None:
        """Match ``r`` with the earliest kept message it wants, else leave it posted."""
        for i, m in enumerate(self.kept):
            if r.wants(m):
                r.message = self.kept.pop(i)
                return
        self.posted.append(r)

    def forget(self, r: Receive) -> None:
        if r in self.posted:
            self.posted.remove(r)

    def read(self, src: int, deadline: float, where: str) -> None:
        """Read the next message from ``src`` off the channel and hand it to the first posted
        receive that wants it, or keep it."""
        if self.stored:
            head, _, segs = self._withdraw(src, deadline, where)
            self._took(src)
        else:
            w = self.comm._wire(max(deadline - time.monotonic(), 1e-3), _Where(where))
            head = np.zeros(HEAD, np.int64)
            w.recv(head, src)
            self._took(src)
            check_head(_Where(where), head, src)
            rest = None
            if needs_rest(head):
                rest = np.zeros(needs_rest(head), np.int64)
                w.recv(rest, src)
            segs = [np.empty(k, np.uint8) for k in lengths(head, rest)]
            for seg in segs:
                for piece in pieces(seg):
                    w.recv(piece, src)
        m = Message(src, head, segs)
        for i, r in enumerate(self.posted):
            if r.wants(m):
                r.message = m
                del self.posted[i]
                return
        self.kept.append(m)

    def look(self, r: Receive) -> bool:
        """Read the next marked message of each of ``r``'s sources, until ``r`` is matched;
        never waits for a message not yet sent. True if any was read."""
        if self.store is None:
            raise UsageError(f"{r.where}: this communicator has no store, where senders count "
                             f"their messages; receive from a named rank with recv_object")
        peers = [p for p in range(self.size) if p != self.rank]
        if r.src is not None:
            peers = [r.src]
        else:  # start after the last one served
            peers = peers[self.turn:] + peers[:self.turn]
        marks = self.store.peek([_marker(self.rank, p, self.taken[p]) for p in peers])
        read = False
        for i, (p, mark) in enumerate(zip(peers, marks, strict=True)):
            if mark is None:
                continue
            self.comm._backend.run_sync(lambda p=p: self.read(p, r.deadline, r.where))
            read = True
            if r.message is not None:
                if r.src is None:
                    self.turn = (self.turn + i + 1) % len(peers)
                return True
        return read

    def settle(self, r: Receive, until: float, direct: bool) -> bool:
        """Match ``r`` by ``until`` (at most its deadline); False if not matched by then.
        ``direct``: read a named source's channel directly, waiting on it (a blocking call);
        otherwise only messages the senders marked are read."""
        if r.message is not None:
            return True
        if direct and r.src is not None and not self.stored:
            while r.message is None:
                self.comm._backend.run_sync(lambda: self.read(r.src, r.deadline, r.where))
            return True
        pause, next_check = _POLL_S[0], time.monotonic() + _CHECK_S
        while r.message is None:
            gone = None
            if time.monotonic() >= next_check:  # before the look: what it misses never comes
                gone, next_check = self._gone(), time.monotonic() + _CHECK_S
            if self.look(r):
                pause = _POLL_S[0]
                continue
            if gone:
                self._raise_if_no_sender(r, gone)
            now = time.monotonic()
            if now >= until:
                return False
            time.sleep(min(pause, until - now))
            pause = min(pause * 2, _POLL_S[1])
        return True

    def _gone(self) -> dict[int, str]:
        liveness = self.comm._liveness
        return {} if liveness is None else liveness.gone()

    def _raise_if_no_sender(self, r: Receive, gone: dict[int, str]) -> None:
        """Every rank ``r`` could match is gone and left nothing unread: it can never match."""
        senders = [r.src] if r.src is not None else [p for p in range(self.size)
                                                       if p != self.rank]
        if all(p in gone for p in senders):
            what = "; ".join(f"rank {p} {gone[p]}" for p in senders)
            raise PeerFailure(f"{r.describe()} can arrive: {what}")


class ObjectReceive(Work):
    """The Work of ``irecv_object``: ``wait()``/``result()`` give the object."""

    def __init__(self, comm: Any, box: Mailbox, r: Receive, status: Status | None):
        self._comm, self._box, self._r, self._status = comm, box, r, status
        self._done = False
        self._error: BaseException | None = None
        self._label = r.where

    def is_completed(self) -> bool:
        """Never waits for a message not yet sent: reads those the senders marked."""
        if not self._done and self._error is None and self._comm._entry.acquire(blocking=False):
            try:
                self._progress(time.monotonic(), False)
            finally:
                self._comm._entry.release()
        return self._done or self._error is not None

    def _wait(self, timeout: float | None) -> bool:
        if not self._done and self._error is None:
            until = self._r.deadline if timeout is None else min(
                time.monotonic() + timeout, self._r.deadline)
            if not self._comm._entry.acquire(blocking=False):
                raise UsageError(f"{self._label}: waited for while another thread is inside a "
                                 f"call of the communicator (it serves one thread at a time)")
            try:
                self._progress(until, timeout is None)
            finally:
                self._comm._entry.release()
        if self._error is not None:
            raise self._error
        return self._done

    def _progress(self, until: float, direct: bool) -> None:
        """Settle the receive (the caller holds the communicator's entry), then unpickle."""
        try:
            matched = self._box.settle(self._r, until, direct)
        except BaseException as exc:  # noqa: BLE001 - raised by wait(), as every failure
            self._box.forget(self._r)
            self._error = exc
            return
        if matched:
            self._deliver()
        elif time.monotonic() >= self._r.deadline:
            self._box.forget(self._r)
            self._error = CollectiveTimeout(f"{self._r.describe()} arrived within its timeout")

    def _deliver(self) -> None:
        m = self._r.message
        if self._status is not None:
            self._status.source, self._status.tag = m.src, m.tag
        try:
            self._value = received(self._r.where, m)
        except BaseException as exc:
            self._error = exc
            return
        self._done = True


def received(where: str, m: Message) -> Any:
    """The object of message ``m``, or the sender's pickling failure."""
    if m.head[1] < 0:
        _raise_failed(_Where(where), None, {m.src: m.segs[0]})
    return unpack(_Where(where), m.segs, m.src)


class _Where:
    """What ``gpucoll.objects`` reads of a call in its messages: ``where``."""

    __slots__ = ("where",)

    def __init__(self, where: str):
        self.where = where


class MessageCalls:
    """``send_object``, ``recv_object``, ``isend_object`` and ``irecv_object`` for
    ``Communicator`` (a mixin: it uses the communicator's argument checks and backend)."""

    _mailbox: Mailbox | None = None

    @entry
    def send_object(self, obj: Any, dst: int, *, tag: int = 0,
                    timeout: float | None = None) -> None:
        """Send ``obj`` to rank ``dst`` with ``tag``; returns once it is sent (the receiver
        may not have it yet). An object that does not pickle raises here, and the receive
        that matches it raises a PicklingError naming this rank."""
        c = self._call("send_object")
        dst, tag, t = c.peer(dst, "dst"), c.tag(tag), c.timeout(timeout, self.timeout)
        packed, arrays = self._outgoing(c, obj, dst, tag)
        box = self._boxes()

        def run() -> None:
            if box.stored:
                box.deposit(dst, arrays)
            else:
                box.announce(dst)
                w = self._wire(t, c)
                for a in arrays:
                    w.send(a, dst)
            _raise_own(c, packed)

        self._issue(c, None, run, None, False, None)

    @entry
    def isend_object(self, obj: Any, dst: int, *, tag: int = 0,
                     timeout: float | None = None) -> Work:
        """Start sending ``obj`` to rank ``dst`` with ``tag`` and return its Work (mpi4py's
        ``isend``). ``obj`` is pickled now: changing it afterwards changes nothing sent."""
        c = self._call("isend_object")
        dst, tag, t = c.peer(dst, "dst"), c.tag(tag), c.timeout(timeout, self.timeout)
        packed, arrays = self._outgoing(c, obj, dst, tag)
        box = self._boxes()
        if box.stored:
            self._issue(c, None, lambda: box.deposit(dst, arrays), None, False, None)
            works = []
        else:
            box.announce(dst)
            works = self._backend.batch_p2p([(True, as_ref(a, "object"), dst) for a in arrays],
                                            timeout=t)
        _raise_own(c, packed)
        return AllOf(works, arrays).bind(None, c.where)

    @entry
    def recv_object(self, src: int = ANY_SOURCE, *, tag: int = ANY_TAG,
                    status: Status | None = None, timeout: float | None = None) -> Any:
        """The first object rank ``src`` sent with ``tag`` (``ANY_SOURCE``, ``ANY_TAG``: any);
        ``status``, a ``gpucoll.Status``, is set to its sender and tag."""
        c = self._call("recv_object")
        r = self._receive(c, src, tag, timeout, status)
        box = self._boxes()
        box.post(r)
        got: list = []

        def run() -> None:
            try:
                if not box.settle(r, r.deadline, True):
                    raise CollectiveTimeout(f"{r.describe()} arrived within its timeout")
            finally:
                box.forget(r)
            if status is not None:
                status.source, status.tag = r.message.src, r.message.tag
            got.append(received(c.where, r.message))

        self._issue(c, None, run, None, False, None)
        return got[0]

    @entry
    def irecv_object(self, src: int = ANY_SOURCE, *, tag: int = ANY_TAG,
                     status: Status | None = None, timeout: float | None = None) -> Work:
        """Post a receive of the first object ``src`` sends with ``tag`` and return its Work,
        whose ``wait()``/``result()`` give the object (mpi4py's ``irecv``); ``status`` is set
        when it completes. ``timeout`` bounds the receive from now."""
        c = self._call("irecv_object")
        r = self._receive(c, src, tag, timeout, status)
        box = self._boxes()
        box.post(r)
        return ObjectReceive(self, box, r, status)

    # -- plumbing ------------------------------------------------------------------------------

    def _boxes(self) -> Mailbox:
        if self._mailbox is None:
            self._mailbox = Mailbox(self)
        return self._mailbox

    def _receive(self, c: Call, src: Any, tag: Any, timeout: float | None,
                 status: Any) -> Receive:
        """A receive from ``src`` with ``tag``, checked (nothing is read yet)."""
        if status is not None and not isinstance(status, Status):
            raise c.fail(TypeError, f"status must be a gpucoll.Status or None, got "
                                    f"{type(status).__name__}")
        if isinstance(src, (int, np.integer)) and not isinstance(src, bool) and src == ANY_SOURCE:
            src = None
        else:
            src = c.peer(src, "src")
        tag = c.tag(tag, receiving=True)
        t = c.timeout(timeout, self.timeout)
        return Receive(src, None if tag == ANY_TAG else tag, time.monotonic() + t, c.where)

    def _outgoing(self, c: Call, obj: Any, dst: int, tag: int) -> tuple[Packed, list]:
        """``obj`` pickled and cut into the messages that carry it (a failure's text when it
        does not pickle)."""
        packed = Packed.of(obj)
        head = packed.head(tag)
        arrays = [head] + ([packed.rest()] if needs_rest(head) else []) + [
            piece for seg in packed.segments for piece in pieces(seg)]
        return packed, arrays


class AllOf(Work):
    """Several Works as one (the messages of one object): complete when all of them are;
    ``keep`` stays referenced until then (the memory they send from)."""

    def __init__(self, works: list[Work], keep: Any):
        self._works, self._keep = works, keep

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def _wait(self, timeout: float | None) -> bool:
        until = None if timeout is None else time.monotonic() + timeout
        for w in self._works:
            left = None if until is None else max(until - time.monotonic(), 0.0)
            if not w._wait(left):
                return False
        return True


def _marker(dst: int, src: int, n: int) -> str:
    """The store key that says message ``n`` from ``src`` to ``dst`` was sent."""
    return f"objects/{dst}/{src}/{n // _BLOCK}/{n % _BLOCK}"


def _cut(a: np.ndarray) -> list[np.ndarray]:
    """``a``'s bytes in parts the store takes (at least one, maybe empty)."""
    flat = a.view(np.uint8).reshape(-1)
    step = STORE_PART_BYTES
    return [flat[i:i + step] for i in range(0, flat.size, step)] or [flat]


def _raise_own(c: Call, packed: Packed) -> None:
    """The sender's own pickling error, noted with the call, rank and argument."""
    exc = packed.failed
    if exc is not None:
        exc.add_note(f"{c.where}: obj could not be pickled, so it was not sent; the receive "
                     f"that matches it raises a PicklingError naming this rank")
        raise exc
