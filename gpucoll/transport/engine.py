"""Drive several sends and receives to completion from one thread, with deadlines.

A collective step is a handful of ops (send these bytes to rank a, receive or reduce those from
rank b). ``Engine.run`` lets every op move whatever its link accepts now, round-robin, so sends
and receives overlap and nothing deadlocks on full buffers. With nothing to do it spins briefly
(less, and then yields the core for a moment, when processes outnumber cores), then sleeps on this
rank's doorbell (an eventfd that peers, and the failure monitor, ring) and on its TCP sockets:
waiting ranks never starve busy ones.
"""

from __future__ import annotations

import collections
import math
import os
import select
import time
from collections.abc import Sequence

import numpy as np

from gpucoll.errors import CollectiveMismatch, CollectiveTimeout, GpucollError, PeerFailure
from gpucoll.progress import Waiting
from gpucoll.transport.shm import native

SPIN_S = 50e-6  # busy polling before yielding: peers on other cores answer within this
YIELD_S = 25e-6  # then sched_yield, only when processes outnumber cores
LOAD_CHECK_S = 0.1  # how often to look at the machine's load
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
NAP_MS = 2  # longest sleep between re-checks (covers a doorbell raced past)
NATIVE_YIELD_S = 1e-3  # how long the compiled small exchange yields, when cores are short
ROOT_CAUSE_S = 2.0  # how long a broken link waits for the monitor to learn why


def runnable_tasks() -> int:
    """Processes running or ready to run on this machine now (0 if unknown)."""
    try:
        with open("/proc/loadavg", "rb") as f:
            return int(f.read().split()[3].split(b"/")[0])
    except (OSError, ValueError, IndexError):
        return 0


FRAME_BYTES = 32  # every message starts with a frame header of this size (ring_algos.frame)


class Op:
    """One message on ``link``: a frame header, then the payload. ``nbytes`` and ``off`` count
    both; ``hdr`` is the header sent, or the one a received message must carry.

    Ops that are not part of the call driving the engine (non-blocking sends and receives)
    carry their own ``deadline``, ``opname`` and the ``done`` callback that completes their
    handle; ``batch`` counts the unfinished ops of the call that posted them.
    """

    __slots__ = ("link", "nbytes", "off", "sending", "hdr", "deadline", "opname", "done",
                 "batch")

    def __init__(self, link, payload: int, sending: bool, hdr: bytes):
        self.link = link
        self.nbytes = payload + FRAME_BYTES
        self.off = 0
        self.sending = sending
        self.hdr = hdr
        self.deadline = 0.0
        self.opname = ""
        self.done = None
        self.batch = None

    def ready(self) -> bool:
        """Whether a shared-memory link could move bytes for this op now (before sleeping)."""
        return self.link.can_send() if self.sending else self.link.can_recv()

    def finish(self) -> None:
        """The message is complete: let the link close it (padding, alignment)."""
        if self.sending:
            self.link.end_send()
        else:
            self.link.end_recv()

    def blocked_on_gate(self) -> bool:
        return False


class Send(Op):
    """Send the bytes of ``arr``; with ``gate`` only those ``gate`` has received so far."""

    __slots__ = ("mv", "hmv", "item", "gate")

    def __init__(self, link, arr: np.ndarray, hdr: bytes, gate: Op | None = None):
        super().__init__(link, arr.nbytes, True, hdr)
        self.mv = memoryview(arr.view(np.uint8))
        self.hmv = memoryview(hdr)
        self.item = arr.itemsize
        self.gate = gate

    def blocked_on_gate(self) -> bool:
        gate = self.gate
        return gate is not None and gate.off < gate.nbytes and \
            gate.off - gate.off % self.item <= self.off

    def step(self) -> int:
        off = self.off
        if off < FRAME_BYTES:
            n = self.link.send_some(self.hmv, off, FRAME_BYTES, 1)
            self.off += n
            return n
        gate = self.gate
        if gate is None or gate.off >= gate.nbytes:
            end = self.nbytes
        else:  # whole elements only: a reduction holds back a partial element
            end = gate.off - gate.off % self.item
        if off >= end:
            return 0
        n = self.link.send_some(self.mv, off - FRAME_BYTES, end - FRAME_BYTES, self.item)
        self.off += n
        return n


class _Receive(Op):
    """A received message: its frame header is read into ``got`` and checked first."""

    __slots__ = ("got",)

    def __init__(self, link, payload: int, hdr: bytes):
        super().__init__(link, payload, False, hdr)
        self.got = bytearray(FRAME_BYTES)

    def header_step(self) -> int:
        n = self.link.recv_copy(memoryview(self.got), self.off, FRAME_BYTES)
        self.off += n
        if self.off == FRAME_BYTES and self.got != self.hdr:
            raise FrameMismatch(self.link.peer, bytes(self.got), self.hdr)
        return n


class Recv(_Receive):
    """Receive ``arr.nbytes`` bytes into ``arr``."""

    __slots__ = ("mv",)

    def __init__(self, link, arr: np.ndarray, hdr: bytes):
        super().__init__(link, arr.nbytes, hdr)
        self.mv = memoryview(arr.view(np.uint8))

    def step(self) -> int:
        if self.off < FRAME_BYTES:
            return self.header_step()
        n = self.link.recv_copy(self.mv, self.off - FRAME_BYTES, self.nbytes - FRAME_BYTES)
        self.off += n
        return n


class RecvReduce(_Receive):
    """Receive ``acc.size`` elements and store ``ufunc(src, incoming)`` into ``acc``."""

    __slots__ = ("acc", "src", "ufunc")

    def __init__(self, link, acc: np.ndarray, ufunc, hdr: bytes, src: np.ndarray | None = None):
        super().__init__(link, acc.nbytes, hdr)
        self.acc = acc
        self.src = acc if src is None else src
        self.ufunc = ufunc

    def step(self) -> int:
        if self.off < FRAME_BYTES:
            return self.header_step()
        n = self.link.recv_reduce(self.acc, self.src, self.ufunc, self.off - FRAME_BYTES,
                                  self.nbytes - FRAME_BYTES)
        self.off += n
        return n


class Put(Op):
    """Send a small message to a shared-memory link in one piece."""

    __slots__ = ("mv",)

    def __init__(self, link, arr: np.ndarray, hdr: bytes):
        super().__init__(link, arr.nbytes, True, hdr)
        self.mv = memoryview(arr.view(np.uint8))

    def ready(self) -> bool:
        return self.link.can_put(self.nbytes)

    def step(self) -> int:
        if self.link.put(self.hdr, self.mv):
            self.off = self.nbytes
            return self.nbytes
        return 0

    def finish(self) -> None:
        pass


class Peek(Op):
    """Wait for a small message on a shared-memory link; ``view`` then shows its payload in the
    ring (read it, then ``link.release(nbytes)``). Its header is checked as soon as it is
    there, so a peer that sent a shorter message of another call is caught, not waited for."""

    __slots__ = ("view", "checked")

    def __init__(self, link, payload: int, hdr: bytes):
        super().__init__(link, payload, False, hdr)
        self.view = None
        self.checked = False

    def ready(self) -> bool:
        return self.link.peek(self.nbytes) is not None

    def step(self) -> int:
        view = self.link.peek(self.nbytes)
        if view is None:
            if not self.checked:
                head = self.link.peek(FRAME_BYTES)
                if head is not None:
                    self._check(head)
            return 0
        if not self.checked:
            self._check(view[:FRAME_BYTES])
        self.view = view[FRAME_BYTES:]
        self.off = self.nbytes
        return self.nbytes

    def _check(self, head) -> None:
        if head.data != self.hdr:
            raise FrameMismatch(self.link.peer, head.tobytes(), self.hdr)
        self.checked = True

    def finish(self) -> None:
        pass


class FrameMismatch(Exception):
    """A message's frame header differs from the one this rank expects (ranks disagree)."""

    def __init__(self, peer: int, got: bytes, expected: bytes):
        super().__init__(peer, got, expected)
        self.peer, self.got, self.expected = peer, got, expected


class State:
    """What the failure monitor tells the engine: the first failure, who closed cleanly (how
    many bytes of ours they had consumed by then, and the latest call they had finished), and
    whose control connection ended."""

    def __init__(self):
        self.failure: GpucollError | None = None
        self.closed_peers: dict[int, int] = {}  # peer -> bytes it consumed from us, at close
        self.closed_after: dict[int, int] = {}  # peer -> the latest collective it finished then
        self.consumed: dict[int, int] = {}  # the same, said by a peer that closed or aborted
        self.ended: set[int] = set()  # peers whose control connection is finished
        # the failure "a peer closed without receiving data of ours", when it came first: the
        # rank's own unreceived data may then prove that the ranks disagreed (see close)
        self.close_failure: GpucollError | None = None


class Engine:
    """Moves the messages of one rank; ``links[peer]`` is a TcpLink or ShmLink (None for self).

    Messages on one link in one direction go in the order they were posted: each starts when
    the one before it is complete; all others progress together. ``run`` posts a call's
    messages and drives every posted message (also non-blocking ones from ``submit``) until
    that call's are done; ``drive`` moves non-blocking ones when no call is running.
    ``describe(header)`` says in words what a frame header stands for (for mismatch errors).
    """

    def __init__(self, rank: int, links: list, bell: int, state: State, oversubscribed: bool,
                 describe=bytes.hex, outboxes=None):
        self.rank = rank
        self.links = links
        self.outboxes = outboxes  # shm.Outboxes when every peer shares this host
        self.bell = bell
        self.state = state
        self.describe = describe
        self.oversubscribed = oversubscribed  # this job alone has more ranks than cores
        self._load_checked = 0.0
        self.native = native()
        self._set_policy(oversubscribed)
        self.poller = select.poll()
        self.poller.register(bell, select.POLLIN)
        self.active: list[Op] = []  # the message in progress on each busy link and direction
        self._busy: set[tuple[int, bool]] = set()
        self._queued: dict[tuple[int, bool], collections.deque] = {}
        self.inbox: collections.deque = collections.deque()  # from submit(), any thread
        self._background: list[Op] = []  # non-blocking messages not yet complete
        self._notice = Waiting(f"rank {rank}")  # says what a wait long idle waits for

    def _set_policy(self, crowded: bool) -> None:
        """Long spins when every rank has a core; when cores are short (our ranks or other
        processes), spin a little, then yield the core to whoever we wait for, then sleep.
        (Yielding longer would give whole time slices to unrelated processes, and gains
        nothing when only this job's ranks crowd the cores.)"""
        self.spin_s = 5e-6 if crowded else SPIN_S
        self.yield_s = self.spin_s + YIELD_S if crowded else 0.0
        # the compiled exchange's wait before the loop below takes over: spin, yield (ns)
        self.native_wait = (0, int(NATIVE_YIELD_S * 1e9)) if crowded else (int(SPIN_S * 1e9), 0)

    def _watch_load(self, now: float) -> None:
        """Every LOAD_CHECK_S, see whether other processes crowd the cores."""
        if now - self._load_checked < LOAD_CHECK_S:
            return
        self._load_checked = now
        self._set_policy(self.oversubscribed or runnable_tasks() > CORES)

    # -- posting ---------------------------------------------------------------------------
    def submit(self, op: Op, deadline: float, opname: str, done) -> None:
        """Post a non-blocking message from any thread; ``done(error)`` is called (by whichever
        thread drives the engine) once it completes (error None) or fails."""
        op.deadline, op.opname, op.done = deadline, opname, done
        self.inbox.append(op)
        try:
            os.eventfd_write(self.bell, 1)  # wake a driver asleep in poll
        except OSError:
            pass

    def _post(self, op: Op) -> None:
        peer = op.link.peer
        if op.sending and (peer in self.state.closed_peers or peer in self.state.ended):
            raise self._gone(op)  # (a receive still reads what the peer sent before it left)
        key = (peer, op.sending)
        if key in self._busy:
            queue = self._queued.get(key)
            if queue is None:
                queue = self._queued[key] = collections.deque()
            queue.append(op)
        else:
            self._busy.add(key)
            op.link.begin(op.sending, op.nbytes)
            self.active.append(op)

    def _take_inbox(self) -> None:
        inbox = self.inbox
        while inbox:
            op = inbox.popleft()
            self._background.append(op)
            self._post(op)

    # -- driving ---------------------------------------------------------------------------
    def run(self, ops: Sequence[Op], deadline: float, opname: str) -> None:
        """Complete every op by ``deadline`` (time.monotonic) or raise naming the peer; moves
        posted non-blocking messages meanwhile."""
        if self.inbox:
            self._take_inbox()
        if self.active or not self._alone(ops, deadline, opname):
            batch = [len(ops)]
            for op in ops:
                op.deadline, op.opname, op.batch = deadline, opname, batch
                self._post(op)
            self._drive(lambda: batch[0] > 0, deadline)

    def _alone(self, ops: Sequence[Op], deadline: float, opname: str) -> bool:
        """The common case, every op of one call on a link and direction of its own with
        nothing else posted, in a tight loop; False (nothing done) when it does not apply. A
        non-blocking message posted meanwhile from another thread hands the rest to ``_drive``."""
        state = self.state
        keys = set()
        for op in ops:
            if op.sending and (op.link.peer in state.closed_peers or op.link.peer in state.ended):
                raise self._gone(op, opname)
            keys.add((op.link.peer, op.sending))
        if len(keys) < len(ops):
            return False
        for op in ops:
            op.deadline, op.opname, op.batch = deadline, opname, None
            op.link.begin(op.sending, op.nbytes)
        active = self.active = list(ops)
        idle_since = 0.0
        while active:
            if self._step(active):
                for op in [op for op in active if op.off >= op.nbytes]:
                    active.remove(op)
                    op.finish()
                    if op.sending and op.link.peer in state.closed_peers:
                        self._check_delivered(op)
                idle_since = 0.0
            elif self.inbox:
                batch = [len(active)]
                for op in active:
                    op.batch = batch
                    self._busy.add((op.link.peer, op.sending))
                self._take_inbox()
                self._drive(lambda b=batch: b[0] > 0, deadline)
                return True
            else:
                idle_since = self._idle(idle_since, deadline)
        return True

    # -- small messages on shared memory --------------------------------------------------
    def swap_small(self, send_to: Sequence, recv_from: Sequence, mv: memoryview | list,
                   hdr: bytes, deadline: float, opname: str, fold: tuple[int, int] | None = None,
                   sent: bool = False) -> list[int] | bool:
        """Put ``hdr`` + ``mv`` whole on the shared-memory links ``send_to`` (``mv``: one payload
        for all, or a list of one per link, all the same size) and wait for a
        message of the same size and header on each of ``recv_from``; returns where each one's
        payload starts in its link's receive ring (``link.rx.typed`` reads it in place), valid
        until ``link.release``. The caller knows that nothing else is posted and that every
        message fits a ring whole: the tight loop of the latency-bound calls, without the
        general engine's bookkeeping. With ``fold`` = (rank, code) the compiled exchange may
        also fold the values into ``mv`` in rank order and release the messages: True then.
        ``sent``: the messages to ``send_to`` are out already (a compiled try put them)."""
        state = self.state
        parts = dict(zip(send_to, mv, strict=True)) if isinstance(mv, list) else None
        one = mv[0] if parts else mv  # every message's payload, or the first (its size)
        nbytes = len(one) + FRAME_BYTES
        if state.closed_peers or state.ended:
            for link in send_to:
                if link.peer in state.closed_peers or link.peer in state.ended:
                    raise self._gone_peer(link.peer, True, nbytes, opname)
        unsent, waiting = [] if sent else list(send_to), list(recv_from)
        if self.native is not None:
            fast = self.native.swap(unsent, recv_from, mv if unsent else one, hdr, fold,
                                    *self.native_wait)
            if fast is None:  # sent; wait below for what has not arrived (or reads wrong)
                unsent = []
            elif fast is not False:  # False: a ring was full, nothing was sent
                return fast
        for link in unsent:
            link.begin(True, nbytes)
        for link in recv_from:
            link.begin(False, nbytes)  # (again, if the compiled exchange began: a no-op)
        found = [-1] * len(waiting)
        polls = 16 if self.yield_s else 256  # a tight spin on shared cores starves the peer
        idle_since = 0.0
        while True:
            for link in tuple(unsent):
                if link.put(hdr, parts[link] if parts else mv):
                    unsent.remove(link)
                    idle_since = 0.0
            for i, link in enumerate(recv_from):
                if found[i] < 0:
                    at = link.arrived(nbytes)
                    if at < 0:
                        continue
                    found[i] = self._payload_at(link, at, hdr, opname)
                    waiting.remove(link)
                    idle_since = 0.0
            if not (unsent or waiting):
                return found
            for link in waiting:
                self._check_early_header(link, hdr, opname)
            # poll the first awaited counter tightly before the slower rounds of checks
            if unsent or not waiting[0].poll_arrival(nbytes, polls):
                idle_since = self._idle_small(idle_since, deadline, unsent, waiting, nbytes,
                                              opname)

    def _payload_at(self, link, at: int, hdr: bytes, opname: str) -> int:
        """Where the payload of the complete small message at ``at`` starts, once its frame
        header is this call's."""
        head = link.rx.mv[at:at + FRAME_BYTES]
        if head != hdr:
            raise self._mismatch(FrameMismatch(link.peer, head.tobytes(), hdr), opname)
        return at + FRAME_BYTES

    def _check_early_header(self, link, hdr: bytes, opname: str) -> None:
        """A peer that sent a shorter message of another call is caught, not waited for."""
        at = link.arrived(FRAME_BYTES)
        if at >= 0:
            head = link.rx.mv[at:at + FRAME_BYTES]
            if head != hdr:
                raise self._mismatch(FrameMismatch(link.peer, head.tobytes(), hdr), opname)

    def _idle_small(self, idle_since: float, deadline: float, unsent: list, waiting: list,
                    nbytes: int, opname: str) -> float:
        """``_idle`` for ``swap_small``: the same failure, deadline and back-off rules."""
        def small_detail() -> str:
            link, verb = (waiting[0], "receive from") if waiting else (unsent[0], "send to")
            if nbytes == FRAME_BYTES:  # a header alone: the outboxes' start (ring_algos)
                return f"to {verb} rank {link.peer} (the start of the call)"
            return f"to {verb} rank {link.peer} (0 of {nbytes - FRAME_BYTES} bytes done)"

        now = self._still_on(deadline, opname, small_detail)

        def sleep(deadline: float) -> None:
            for link in unsent:
                link.sleep_flags(True, False, 1)
            for link in waiting:
                link.sleep_flags(False, True, 1)
            try:
                if any(link.can_put(nbytes) for link in unsent) or any(
                        link.arrived(nbytes) >= 0 for link in waiting):
                    return
                closed = self.state.closed_peers
                for link in unsent:
                    if link.peer in closed:
                        raise self._gone_peer(link.peer, True, nbytes, opname)
                for link in waiting:
                    if link.peer in closed:
                        raise self._gone_peer(link.peer, False, nbytes, opname)
                wait_ms = min(NAP_MS, max((deadline - time.monotonic()) * 1000, 0))
                if self.poller.poll(wait_ms):
                    self._drain_bell()
            finally:
                for link in unsent:
                    link.sleep_flags(True, False, 0)
                for link in waiting:
                    link.sleep_flags(False, True, 0)

        return self._back_off(idle_since, now, sleep, deadline, opname, small_detail)

    def _still_on(self, deadline: float, opname: str, detail) -> float:
        """The time now, unless a peer's failure was reported or the deadline has passed (then
        the call's error, saying what it waited for: ``detail()``)."""
        if self.state.failure is not None:
            raise self._in_op(self.state.failure, opname)
        now = time.monotonic()
        if now >= deadline:
            raise CollectiveTimeout(f"{opname} on rank {self.rank} timed out: waiting {detail()}")
        return now

    def idle_shared(self, idle_since: float, deadline: float, opname: str, detail,
                    can_move) -> float:
        """Nothing moved in an exchange through the outboxes' counters: the failure, deadline
        and back-off rules of ``_idle_small``; asleep, this rank's ASLEEP flag asks the peers
        to ring its doorbell when they move (``can_move()`` re-checks after raising it)."""
        now = self._still_on(deadline, opname, detail)
        boxes = self.outboxes

        def sleep(deadline: float) -> None:
            boxes.asleep(1)
            try:
                if can_move():
                    return
                state = self.state
                for j in boxes.ranks:
                    if j in state.closed_peers or j in state.ended:
                        raise self._gone_peer(j, False, FRAME_BYTES, opname)
                if self.active or self.inbox:  # non-blocking messages wake it too
                    self._sleep(deadline)
                else:
                    wait_ms = min(NAP_MS, max((deadline - time.monotonic()) * 1000, 0))
                    if self.poller.poll(wait_ms):
                        self._drain_bell()
            finally:
                boxes.asleep(0)

        return self._back_off(idle_since, now, sleep, deadline, opname, detail)

    def drive(self, stop) -> None:
        """Move non-blocking messages until none is left or ``stop()`` says to yield."""
        self._take_inbox()
        self._drive(lambda: self._background and not stop(), None)

    @property
    def has_background(self) -> bool:
        return bool(self._background or self.inbox)

    def _drive(self, going, deadline: float | None) -> None:
        idle_since = 0.0
        while going():
            if self._step_active():
                idle_since = 0.0
                continue
            if self.inbox:
                self._take_inbox()
                continue
            idle_since = self._idle(idle_since, deadline)

    def _step(self, ops: list[Op]) -> bool:
        """Move each of ``ops`` as far as its link allows (a broken link or a header of another
        call raises, naming the call); True when any moved."""
        op = None
        try:
            moved = False
            for op in ops:
                if op.step():
                    moved = True
        except PeerFailure as exc:
            raise self._in_op(self._root_cause(exc, op.deadline), op.opname) from None
        except FrameMismatch as exc:
            raise self._mismatch(exc, op.opname) from None
        return moved

    def _step_active(self) -> bool:
        """Move every posted message, completing those done; True when any moved."""
        active = self.active
        if not self._step(active):
            return False
        done = [op for op in active if op.off >= op.nbytes]
        if done:
            self._complete(done)
        return True

    def poke(self) -> bool:
        """One pass over the posted non-blocking messages, for a wait that is not the engine's
        own (the outboxes'); True when any moved."""
        if self.inbox:
            self._take_inbox()
        return self._step_active()

    def _complete(self, done: list[Op]) -> None:
        for op in done:
            self.active.remove(op)
            op.finish()
            peer = op.link.peer
            if op.sending and peer in self.state.closed_peers:
                self._check_delivered(op)
            key = (peer, op.sending)
            queue = self._queued.get(key)
            if queue:
                nxt = queue.popleft()
                nxt.link.begin(nxt.sending, nxt.nbytes)
                self.active.append(nxt)
            else:
                self._busy.discard(key)
            if op.batch is not None:
                op.batch[0] -= 1
            if op.done is not None:
                self._background.remove(op)
                op.done(None)

    def fail_background(self, exc: BaseException) -> None:
        """Fail every non-blocking message still posted (the backend is poisoned)."""
        self._take_inbox_quietly()
        ops, self._background = self._background, []
        self.active, self._queued, self._busy = [], {}, set()
        for op in ops:
            op.done(exc)

    def _take_inbox_quietly(self) -> None:
        while self.inbox:
            self._background.append(self.inbox.popleft())

    # -- waiting ---------------------------------------------------------------------------
    def _idle(self, idle_since: float, deadline: float | None) -> float:
        """Nothing moved: fail, time out, spin, yield or sleep; returns when idleness began."""
        if self.state.failure is not None:
            op = self.active[0] if self.active else None
            raise self._in_op(self.state.failure, op.opname if op else "waiting")
        now = time.monotonic()
        expired = self._expired(now, deadline)
        if expired is not None:
            raise self._timeout(expired)
        return self._back_off(idle_since, now, self._sleep, deadline, None, self._waited_for)

    def _back_off(self, idle_since: float, now: float, sleep, deadline: float | None,
                  opname, detail) -> float:
        """Spin, then yield the core (when cores are short), then ``sleep(deadline)``; a wait
        long idle says what it waits for (``detail()``, ``gpucoll.progress``)."""
        if not idle_since:
            self._watch_load(now)
            self._notice.restart(now)
            return now
        idle = now - idle_since
        if idle < self.spin_s:
            pass
        elif idle < self.yield_s:
            os.sched_yield()
        else:
            if now >= self._notice.due:
                self._say_waiting(opname, detail, now)
            sleep(deadline)
        return idle_since

    def _say_waiting(self, opname, detail, now: float) -> None:
        op = self.active[0] if self.active else None
        name = opname if opname is not None else op.opname if op is not None else "waiting"
        self._notice.what = f"{name} on rank {self.rank}"
        self._notice.tick(detail, now)

    def _waited_for(self) -> str:
        """Whom the posted messages wait for: a receive first, as a timeout would name it."""
        ops = self.active or [op for q in self._queued.values() for op in q]
        if not ops:
            return "for nothing posted"
        op = next((op for op in ops if not op.sending), ops[0])
        verb = "send to" if op.sending else "receive from"
        return (f"to {verb} rank {op.link.peer} ({max(op.off - FRAME_BYTES, 0)} of "
                f"{op.nbytes - FRAME_BYTES} bytes done)")

    def _expired(self, now: float, deadline: float | None) -> Op | None:
        """The message to blame when a deadline has passed: one this rank waits to receive
        before one it cannot yet send; None while every deadline is ahead."""
        late = [op for op in self.active if op.deadline <= now]
        late += [op for q in self._queued.values() for op in q if op.deadline <= now]
        if not late:
            return None
        return next((op for op in late if not op.sending), late[0])

    def _sleep(self, deadline: float | None) -> None:
        """Block until a doorbell, a socket or a short nap says something may have changed."""
        pending = [op for op in self.active if not (op.sending and op.blocked_on_gate())]
        shm = [op for op in pending if op.link.kind == "shm"]
        for op in shm:
            op.link.sleep_flags(op.sending, not op.sending, 1)
        try:
            if any(op.ready() for op in shm):
                return
            self._check_closed(pending)
            masks: dict[int, int] = {}
            for op in pending:
                if op.link.kind != "shm":
                    mask = select.POLLOUT if op.sending else select.POLLIN
                    masks[op.link.fd] = masks.get(op.link.fd, 0) | mask
            for fd, mask in masks.items():
                self.poller.register(fd, mask)
            try:
                wait_ms = NAP_MS
                if deadline is not None:
                    wait_ms = min(NAP_MS, max((deadline - time.monotonic()) * 1000, 0))
                events = self.poller.poll(wait_ms)
            finally:
                for fd in masks:
                    self.poller.unregister(fd)
            if any(fd == self.bell for fd, _ in events):
                self._drain_bell()
        finally:
            for op in shm:
                op.link.sleep_flags(op.sending, not op.sending, 0)

    def _check_closed(self, pending) -> None:
        """A peer that closed cleanly will never read or write its side of a link again."""
        closed = self.state.closed_peers
        for op in pending:  # a TCP receive reads on to the end of stream instead
            if op.link.peer in closed and (op.sending or (op.link.kind == "shm" and
                                                          not op.ready())):
                raise self._gone(op)

    def _gone(self, op: Op, opname: str | None = None) -> GpucollError:
        return self._gone_peer(op.link.peer, op.sending, op.nbytes, opname or op.opname)

    def _gone_peer(self, peer: int, sending: bool, nbytes: int, opname: str) -> GpucollError:
        """A peer left: the failure that made it leave, when one was reported (a peer that
        fails tells the others before it goes), else PeerFailure naming it."""
        if self.state.failure is not None:
            return self._in_op(self.state.failure, opname)
        why = "closed its communicator" if peer in self.state.closed_peers else \
            "is gone (its connection ended)"
        if sending:
            what = f"this rank's message to it ({nbytes - FRAME_BYTES} bytes) cannot be " \
                   f"delivered"
        else:
            what = "this rank still expected data from it"
        return PeerFailure(f"{opname} on rank {self.rank}: rank {peer} {why}, and {what}",
                           peer=peer)

    def _check_delivered(self, op: Op) -> None:
        """A message completed on a link whose peer has already closed: unless the peer had
        consumed it before closing, it is lost."""
        consumed = self.state.closed_peers[op.link.peer]
        if op.link.sent() > consumed:
            raise self._gone(op)

    # -- errors ----------------------------------------------------------------------------
    def _root_cause(self, exc: PeerFailure, deadline: float) -> GpucollError:
        """A data link broke: let the monitor say why (the peer may have closed because a third
        rank died), within ROOT_CAUSE_S; else report the broken link."""
        state = self.state
        limit = min(deadline or math.inf, time.monotonic() + ROOT_CAUSE_S)
        while state.failure is None and exc.peer not in state.ended:
            remaining = limit - time.monotonic()
            if remaining <= 0:
                break
            self.poller.poll(min(remaining * 1000, NAP_MS))
            self._drain_bell()
        return state.failure or exc

    def _drain_bell(self) -> None:
        try:
            os.eventfd_read(self.bell)
        except (BlockingIOError, OSError):
            pass

    def _in_op(self, failure: GpucollError, opname: str) -> GpucollError:
        """The failure as this call reports it: naming the call and this rank."""
        message = f"{opname} on rank {self.rank}: {failure}"
        if isinstance(failure, PeerFailure):
            return PeerFailure(message, peer=failure.peer)
        error = type(failure)(message)
        error.peer = failure.peer
        return error

    def _mismatch(self, exc: FrameMismatch, opname: str) -> CollectiveMismatch:
        return CollectiveMismatch(
            f"{opname} on rank {self.rank}: ranks disagree: rank {exc.peer} sent a message of "
            f"{self.describe(exc.got)} where this rank expects one of "
            f"{self.describe(exc.expected)}")

    def _timeout(self, op: Op) -> CollectiveTimeout:
        verb = "send to" if op.sending else "receive from"
        return CollectiveTimeout(
            f"{op.opname} on rank {self.rank} timed out: waiting to {verb} rank {op.link.peer} "
            f"({max(op.off - FRAME_BYTES, 0)} of {op.nbytes - FRAME_BYTES} bytes done)"
        )
