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
import os
import select
import time
from collections.abc import Sequence

import numpy as np

from gpucoll.errors import CollectiveTimeout, GpucollError, PeerFailure

SPIN_S = 50e-6  # busy polling before yielding: peers on other cores answer within this
YIELD_S = 25e-6  # then sched_yield, only when processes outnumber cores
LOAD_CHECK_S = 0.1  # how often to look at the machine's load
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
NAP_MS = 2  # longest sleep between re-checks (covers a doorbell raced past)
ROOT_CAUSE_S = 2.0  # how long a broken link waits for the monitor to learn why


def runnable_tasks() -> int:
    """Processes running or ready to run on this machine now (0 if unknown)."""
    try:
        with open("/proc/loadavg", "rb") as f:
            return int(f.read().split()[3].split(b"/")[0])
    except (OSError, ValueError, IndexError):
        return 0


class Op:
    """Part of a collective step: move ``nbytes`` to or from ``link``."""

    __slots__ = ("link", "nbytes", "off", "sending")

    def __init__(self, link, nbytes: int, sending: bool):
        self.link = link
        self.nbytes = nbytes
        self.off = 0
        self.sending = sending

    def ready(self) -> bool:
        """Whether a shared-memory link could move bytes for this op now (before sleeping)."""
        return self.link.can_send() if self.sending else self.link.can_recv()

    def finish(self) -> None:
        """The message is complete: let the link close it (padding, alignment)."""
        if self.sending:
            self.link.end_send()
        else:
            self.link.end_recv()


class Send(Op):
    """Send the bytes of ``arr``; with ``gate`` only those ``gate`` has received so far."""

    __slots__ = ("mv", "item", "gate")

    def __init__(self, link, arr: np.ndarray, gate: Op | None = None):
        super().__init__(link, arr.nbytes, True)
        self.mv = memoryview(arr.view(np.uint8))
        self.item = arr.itemsize
        self.gate = gate

    def blocked_on_gate(self) -> bool:
        gate = self.gate
        return gate is not None and gate.off < gate.nbytes and \
            gate.off - gate.off % self.item <= self.off

    def step(self) -> int:
        gate = self.gate
        if gate is None or gate.off >= gate.nbytes:
            end = self.nbytes
        else:  # whole elements only: a reduction holds back a partial element
            end = gate.off - gate.off % self.item
        if self.off >= end:
            return 0
        n = self.link.send_some(self.mv, self.off, end, self.item)
        self.off += n
        return n


class Recv(Op):
    """Receive ``arr.nbytes`` bytes into ``arr``."""

    __slots__ = ("mv",)

    def __init__(self, link, arr: np.ndarray):
        super().__init__(link, arr.nbytes, False)
        self.mv = memoryview(arr.view(np.uint8))

    def step(self) -> int:
        n = self.link.recv_copy(self.mv, self.off, self.nbytes)
        self.off += n
        return n


class RecvReduce(Op):
    """Receive ``acc.size`` elements and store ``ufunc(src, incoming)`` into ``acc``."""

    __slots__ = ("acc", "src", "ufunc")

    def __init__(self, link, acc: np.ndarray, ufunc, src: np.ndarray | None = None):
        super().__init__(link, acc.nbytes, False)
        self.acc = acc
        self.src = acc if src is None else src
        self.ufunc = ufunc

    def step(self) -> int:
        n = self.link.recv_reduce(self.acc, self.src, self.ufunc, self.off, self.nbytes)
        self.off += n
        return n


class Put(Op):
    """Send a small message to a shared-memory link in one piece."""

    __slots__ = ("mv",)

    def __init__(self, link, arr: np.ndarray):
        super().__init__(link, arr.nbytes, True)
        self.mv = memoryview(arr.view(np.uint8))

    def blocked_on_gate(self) -> bool:
        return False

    def ready(self) -> bool:
        return self.link.can_put(self.nbytes)

    def step(self) -> int:
        if self.link.put(self.mv):
            self.off = self.nbytes
            return self.nbytes
        return 0

    def finish(self) -> None:
        pass


class Peek(Op):
    """Wait for a small message on a shared-memory link; ``view`` then shows it in the ring
    (read it, then ``link.release(nbytes)``)."""

    __slots__ = ("view",)

    def __init__(self, link, nbytes: int):
        super().__init__(link, nbytes, False)
        self.view = None

    def step(self) -> int:
        view = self.link.peek(self.nbytes)
        if view is None:
            return 0
        self.view = view
        self.off = self.nbytes
        return self.nbytes

    def finish(self) -> None:
        pass


class State:
    """What the failure monitor tells the engine: the first failure, and who closed cleanly."""

    def __init__(self):
        self.failure: GpucollError | None = None
        self.closed_peers: set[int] = set()
        self.ended: set[int] = set()  # peers whose control connection is finished


class Engine:
    """Runs ops for one rank; ``links[peer]`` is a TcpLink or ShmLink (None for self)."""

    def __init__(self, rank: int, links: list, bell: int, state: State, oversubscribed: bool):
        self.rank = rank
        self.links = links
        self.bell = bell
        self.state = state
        self.oversubscribed = oversubscribed  # this job alone has more ranks than cores
        self._load_checked = 0.0
        self._set_policy(oversubscribed)
        self.poller = select.poll()
        self.poller.register(bell, select.POLLIN)

    def _set_policy(self, crowded: bool) -> None:
        """Long spins when every rank has a core; when cores are short (our ranks or other
        processes), spin a little, then yield the core to whoever we wait for, then sleep.
        (Yielding longer would give whole time slices to unrelated processes.)"""
        self.spin_s = 5e-6 if crowded else SPIN_S
        self.yield_s = self.spin_s + YIELD_S if crowded else 0.0

    def _watch_load(self, now: float) -> None:
        """Every LOAD_CHECK_S, see whether other processes crowd the cores."""
        if now - self._load_checked < LOAD_CHECK_S:
            return
        self._load_checked = now
        self._set_policy(self.oversubscribed or runnable_tasks() > CORES)

    def run(self, ops: Sequence[Op], deadline: float, opname: str) -> None:
        """Complete every op by ``deadline`` (time.monotonic) or raise naming the peer.

        Ops on one link in one direction are messages in that order: each starts when the one
        before it is complete; all others progress together.
        """
        pending = [op for op in ops if op.nbytes]
        queues = None
        if len({(id(op.link), op.sending) for op in pending}) < len(pending):
            queues, pending = {}, []
            for op in ops:
                if op.nbytes:
                    queues.setdefault((id(op.link), op.sending), collections.deque()).append(op)
            for queue in queues.values():
                self._start_next(queue, pending)
        else:
            for op in pending:
                op.link.begin(op.sending, op.nbytes)
        idle_since = 0.0
        while pending:
            try:
                moved = [op for op in pending if op.step()]
            except PeerFailure as exc:
                raise self._in_op(self._root_cause(exc, deadline), opname) from None
            if moved:
                for op in [op for op in pending if op.off >= op.nbytes]:
                    pending.remove(op)
                    op.finish()
                    if queues is not None:
                        self._start_next(queues[id(op.link), op.sending], pending)
                idle_since = 0.0
                continue
            idle_since = self._idle(pending, idle_since, deadline, opname)

    @staticmethod
    def _start_next(queue: collections.deque, pending: list) -> None:
        if queue:
            op = queue.popleft()
            op.link.begin(op.sending, op.nbytes)
            pending.append(op)

    def _idle(self, pending, idle_since: float, deadline: float, opname: str) -> float:
        """Nothing moved: fail, time out, spin, yield or sleep; returns when idleness began."""
        if self.state.failure is not None:
            raise self._in_op(self.state.failure, opname)
        now = time.monotonic()
        if now >= deadline:
            raise self._timeout(pending, opname)
        if not idle_since:
            self._watch_load(now)
            return now
        idle = now - idle_since
        if idle < self.spin_s:
            pass
        elif idle < self.yield_s:
            os.sched_yield()
        else:
            self._sleep(pending, deadline, opname)
        return idle_since

    def _root_cause(self, exc: PeerFailure, deadline: float) -> GpucollError:
        """A data link broke: let the monitor say why (the peer may have closed because a third
        rank died), within ROOT_CAUSE_S; else report the broken link."""
        state = self.state
        limit = min(deadline, time.monotonic() + ROOT_CAUSE_S)
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
        except BlockingIOError:
            pass

    def _in_op(self, failure: GpucollError, opname: str) -> GpucollError:
        """The failure as this call reports it: naming the call and this rank."""
        message = f"{opname} on rank {self.rank}: {failure}"
        if isinstance(failure, PeerFailure):
            return PeerFailure(message, peer=failure.peer)
        return type(failure)(message)

    def _timeout(self, pending, opname: str) -> CollectiveTimeout:
        # blame a peer we wait to hear from before one we cannot yet send to
        op = next((op for op in pending if not op.sending), pending[0])
        verb = "send to" if op.sending else "receive from"
        return CollectiveTimeout(
            f"{opname} on rank {self.rank} timed out: waiting to {verb} rank {op.link.peer} "
            f"({op.off} of {op.nbytes} bytes done)"
        )

    def _sleep(self, pending, deadline: float, opname: str) -> None:
        """Block until a doorbell, a socket or a short nap says something may have changed."""
        pending = [op for op in pending if not (op.sending and op.blocked_on_gate())]
        shm = [op for op in pending if op.link.kind == "shm"]
        for op in shm:
            op.link.sleep_flags(op.sending, not op.sending, 1)
        try:
            if any(op.ready() for op in shm):
                return
            self._check_closed(shm, opname)
            masks: dict[int, int] = {}
            for op in pending:
                if op.link.kind == "tcp":
                    mask = select.POLLOUT if op.sending else select.POLLIN
                    masks[op.link.fd] = masks.get(op.link.fd, 0) | mask
            for fd, mask in masks.items():
                self.poller.register(fd, mask)
            try:
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

    def _check_closed(self, shm_ops, opname: str) -> None:
        """A peer that closed cleanly will never write to its ring again."""
        closed = self.state.closed_peers
        for op in shm_ops:
            if op.link.peer in closed:
                raise PeerFailure(
                    f"{opname} on rank {self.rank}: rank {op.link.peer} closed its communicator "
                    f"while this rank still expected data from it", peer=op.link.peer)
