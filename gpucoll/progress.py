"""Where a rank is in its communicator's sequence of calls, kept where its peers can read it.

Every collective has a sequence number, the same on every rank: the n-th collective a
communicator makes. A rank records the call it enters and when it leaves it in a handful of
int64 slots. The ring backend puts those slots in shared memory that the ranks on its host map,
so a peer can read them even while the rank is stopped; peers on other hosts ask for them over
the control connection. When a call times out, every rank can then say which rank is behind
and where ("rank 2 is stuck before all_reduce #17; ranks 0, 1, 3 reached #18").

Call kinds are small integers (``KINDS``), also used in the ring's frame headers.
"""

from __future__ import annotations

import dataclasses

# kind code -> call name; the index is what frames and progress slots carry
KINDS = (
    "", "all_reduce", "broadcast", "reduce", "all_gather", "gather", "scatter",
    "reduce_scatter", "all_to_all", "barrier", "send", "recv", "split", "scatter header",
    "all_gather_v", "gather_v", "scatter_v", "all_to_all_v", "reduce_scatter_v",
    "all_reduce_many", "broadcast_object", "all_gather_object", "gather_object",
    "scatter_object", "new_group", "monitored_barrier",
)
KIND = {name: code for code, name in enumerate(KINDS)}

SEQ, STATE, KIND_SLOT, PEER, P2P = range(5)
SLOTS = 8  # int64 slots of one record (room to grow)
IDLE, IN_CALL, DONE, FAILED = 0, 1, 2, 3  # STATE values


def kind_name(code: int) -> str:
    return KINDS[code] if 0 <= code < len(KINDS) else f"call kind {code}"


@dataclasses.dataclass(frozen=True)
class Position:
    """A snapshot of one rank's progress: its latest collective and what it does now."""

    rank: int
    seq: int  # latest collective entered (-1: none yet)
    state: int  # IN_CALL, DONE or FAILED for ``seq``; IDLE before the first call
    kind: int
    peer: int = -1  # a point-to-point call in progress: its peer, else -1
    p2p: int = 0  # ... and its kind (send/recv), else 0
    responsive: bool = True  # False: read from memory while the rank did not answer

    @property
    def order(self) -> int:
        """Sorts positions: inside call n < after call n < inside call n + 1."""
        return 2 * self.seq + (1 if self.state == IN_CALL else 2)

    def where(self) -> str:
        """``in all_reduce #17``, ``before call #18 (after all_reduce #17)``, ``in
        all_reduce #17 (failed)``, or ``before its first collective``."""
        if self.seq < 0:
            text = "before its first collective"
        elif self.state == IN_CALL:
            text = f"in {kind_name(self.kind)} #{self.seq}"
        elif self.state == FAILED:
            text = f"in {kind_name(self.kind)} #{self.seq} (failed)"
        else:
            text = f"before call #{self.seq + 1} (after {kind_name(self.kind)} #{self.seq})"
        if self.p2p:
            text += f", in {kind_name(self.p2p)} {'to' if KINDS[self.p2p] == 'send' else 'from'}"
            text += f" rank {self.peer}"
        return text


class Progress:
    """One rank's progress slots; ``buf`` (a writable buffer of SLOTS int64) may be shared."""

    def __init__(self, buf=None):
        if buf is None:
            buf = bytearray(8 * SLOTS)
        self._slots = memoryview(buf).cast("B")[:8 * SLOTS].cast("q")
        self._slots[SEQ] = -1

    def detach(self) -> None:
        """Keep the record in private memory from now on, releasing the shared buffer."""
        private = memoryview(bytearray(self._slots.tobytes())).cast("q")
        self._slots.release()
        self._slots = private

    @property
    def seq(self) -> int:
        return self._slots[SEQ]

    @property
    def kind(self) -> int:
        return self._slots[KIND_SLOT]

    @property
    def state(self) -> int:
        return self._slots[STATE]

    def enter(self, seq: int, kind: int) -> None:
        """This rank starts collective ``seq`` of kind ``kind``."""
        s = self._slots
        s[STATE] = IN_CALL
        s[KIND_SLOT] = kind
        s[SEQ] = seq

    def leave(self, ok: bool = True) -> None:
        """The current collective finished (or failed)."""
        self._slots[STATE] = DONE if ok else FAILED

    def p2p(self, kind: int, peer: int) -> None:
        """A point-to-point call with ``peer`` starts (kind > 0) or ends (kind 0)."""
        s = self._slots
        s[PEER] = peer
        s[P2P] = kind

    def position(self, rank: int, responsive: bool = True) -> Position:
        s = self._slots.tolist()
        return Position(rank, s[SEQ], s[STATE], s[KIND_SLOT], s[PEER], s[P2P], responsive)

    def encode(self) -> bytes:
        return self._slots.tobytes()

    @staticmethod
    def decode(rank: int, data: bytes, responsive: bool = True) -> Position:
        s = memoryview(data).cast("q").tolist()
        return Position(rank, s[SEQ], s[STATE], s[KIND_SLOT], s[PEER], s[P2P], responsive)


def diagnose(positions: dict[int, Position], silent: list[int]) -> str:
    """One line naming the ranks that are behind and where, from every rank's ``Position``.

    ``silent`` ranks neither answered nor could be read: they are named as unreachable.
    """
    groups: dict[tuple[int, str], list[int]] = {}
    for r, p in sorted(positions.items()):
        note = "" if p.responsive else " and does not respond (stopped?)"
        groups.setdefault((p.order, p.where() + note), []).append(r)
    ordered = sorted(groups.items())
    parts = []
    for i, ((_, where), ranks) in enumerate(ordered):
        verb = "is" if len(ranks) == 1 else "are"
        if i == 0 and len(ordered) > 1:
            verb += " behind,"
        parts.append(f"{_ranks(ranks)} {verb} {where}")
    if silent:
        parts.append(f"{_ranks(silent)} did not answer and could not be read")
    return "; ".join(parts) or "no rank's progress could be read"


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
