"""Ranks meeting in the store: one key per rank, a wait for all of them that names the ranks
missing, what became of the ranks that left (``Liveness``), and the survivors' agreement on who
is left after a rank was lost (``agree_survivors``).

Start-up steps (the ring's address exchange, NCCL's arrival, ``backend="auto"``'s verdicts) and
store-side collectives (a split's colours, a debug signature check) each publish one key per rank
and need every other rank's: ``share`` does both, ``gather`` and ``wait_for_ranks`` the wait.
A rank that never shows up becomes a ``CollectiveTimeout`` naming it at the deadline; with a
``Liveness``, a rank that died becomes a ``PeerFailure`` naming it within about a second,
through the will every rank leaves in the group's namespace.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from typing import Any

from gpucoll.errors import CollectiveTimeout, GpucollError, PeerFailure, StoreError, StoreTimeout
from gpucoll.progress import Waiting

POLL = 0.5  # longest wait in the store between two looks at which ranks are gone
LEAVE_TIMEOUT = 5.0  # what leaving a group may take at most: the store may be unresponsive
_GONE = "gone/{}"


class Liveness:
    """This rank's presence in a group's store namespace, and what became of the others.

    Creating it leaves a will ``gone/{rank} = b"died"`` on the store's connection: when this
    process dies, or its connection to the store breaks, the server sets that key, and peers
    that wait with a ``Liveness`` learn which rank died. ``leave()`` is the clean exit.
    """

    def __init__(self, store: Any, rank: int, size: int,
                 earlier: tuple[Any, Sequence[int]] | None = None):
        self.store, self.rank, self.size = store, rank, size
        self.host = store_host_rank(store)
        self._keys = [_GONE.format(r) for r in range(size)]
        self._left = False
        # a group shrunk from another: rank i was rank earlier[1][i] there, and its will there
        # tells of a death before its will here was made
        self._earlier = None if earlier is None else (
            earlier[0], [_GONE.format(r) for r in earlier[1]])
        store.set_will(self._keys[rank], b"died")

    @classmethod
    def of(cls, store: Any, rank: int, size: int) -> Liveness | None:
        """This rank's liveness in namespace ``store``, or None for a store that keeps no
        wills (a user's own store class): waits there fall back to the deadline alone."""
        if not (hasattr(store, "set_will") and hasattr(store, "peek")):
            return None
        return cls(store, rank, size)

    def leave(self) -> None:
        """Clean exit: withdraw the will and set ``gone/{rank} = b"closed"``. Idempotent; never
        raises (the store may be gone already)."""
        if not self._left:
            self._left = True
            _mark_closed(self.store, self.rank, time.monotonic() + LEAVE_TIMEOUT)

    def check(self, what: str, ranks: Sequence[int] | None = None) -> None:
        """Raise PeerFailure naming the ranks (of ``ranks``; by default all others) found gone,
        for operation ``what`` on this rank."""
        others = {r: how for r, how in self.gone().items()
                  if r != self.rank and (ranks is None or r in ranks)}
        if others:
            raise _gone(others, what, self.rank, self.size)

    def gone(self) -> dict[int, str]:
        """``{rank: "died" | "closed"}`` for the ranks whose ``gone/`` key exists (one peek)."""
        values = self.store.peek(self._keys)
        found = {r: v.decode("utf-8", "replace") for r, v in enumerate(values) if v is not None}
        if self._earlier is not None:
            store, keys = self._earlier
            for r, v in enumerate(store.peek(keys)):
                if v == b"died" and r not in found:
                    found[r] = "died"
        return found


def wait_for_ranks(store: Any, keys: Sequence[str], timeout: float, *, what: str, rank: int,
                   absent: str = "never arrived", liveness: Liveness | None = None,
                   poll: float = POLL, ranks: Sequence[int] | None = None) -> None:
    """Block until ``keys[i]`` (rank ``ranks[i]``'s key; by default rank i's) is in ``store``
    for every i.

    Every ``GPUCOLL_WAIT_LOG`` seconds (default 10) of waiting, one line on stderr names the ranks
    still missing (``gpucoll.progress``). At the deadline: a CollectiveTimeout saying, for operation
    ``what`` on ``rank``, which ranks are ``absent`` and after how long. With ``liveness`` the wait
    goes in slices of ``poll`` seconds, and between them one of those ranks found gone raises
    PeerFailure naming it: "rank 2 died during split on rank 0 of 3", or that it closed its
    communicator; losing the store that a rank of the group hosts is a PeerFailure naming that rank.
    """
    keys = list(keys)
    ranks = list(range(len(keys)) if ranks is None else ranks)
    size = liveness.size if liveness is not None else len(keys)
    start = time.monotonic()
    deadline = start + timeout
    notice = Waiting(f"{what} on rank {rank} of {size}", timeout, start)
    while True:
        now = time.monotonic()
        remaining = max(deadline - now, 0.0)
        step = min(remaining, notice.until_due(now), poll if liveness is not None else math.inf)
        try:
            store.wait(keys, timeout=step)
            return
        except StoreTimeout:
            pass
        except StoreError as exc:
            if liveness is None or liveness.host in (None, rank):
                raise
            raise PeerFailure(
                f"{what} on rank {rank} of {size}: lost the store, which rank {liveness.host} "
                f"hosts (rank {liveness.host} died or closed it): {exc}",
                peer=liveness.host) from None
        if liveness is not None:
            try:
                liveness.check(what, ranks)
            except PeerFailure:
                # a rank that set its key, then died while this wait's slice ran out: the wait
                # has what it waited for (the same as if the death came just after it)
                if None not in store.peek(keys):
                    return
                raise
        notice.tick(lambda: f"for {_ranks(_missing(store, keys, ranks))}")
        if time.monotonic() >= deadline:
            missing = _missing(store, keys, ranks)
            raise CollectiveTimeout(
                f"{what} on rank {rank} of {size}: {_ranks(missing)} {absent} within "
                f"{time.monotonic() - start:.1f} s (timeout={timeout:g} s)")


def _missing(store: Any, keys: list[str], ranks: list[int]) -> list[int]:
    """The ranks whose key is not in ``store`` yet."""
    return [r for r, v in zip(ranks, store.peek(keys), strict=True) if v is None]


def gather(store: Any, keys: Sequence[str], timeout: float, *, what: str, rank: int,
           absent: str = "never arrived", liveness: Liveness | None = None,
           poll: float = POLL, ranks: Sequence[int] | None = None) -> list[bytes]:
    """Every rank's value (rank order) once all are in ``store``; errors as ``wait_for_ranks``."""
    wait_for_ranks(store, keys, timeout, what=what, rank=rank, absent=absent,
                   liveness=liveness, poll=poll, ranks=ranks)
    return store.multi_get(list(keys))


def share(store: Any, keys: Sequence[str], value: bytes | str, timeout: float, *, what: str,
          rank: int, absent: str = "never arrived",
          liveness: Liveness | None = None) -> list[bytes]:
    """A store-side all_gather: set this rank's ``value`` under ``keys[rank]``, then return every
    rank's (rank order) once all are there; errors as ``wait_for_ranks``."""
    store.set(keys[rank], value)
    return gather(store, keys, timeout, what=what, rank=rank, absent=absent, liveness=liveness)


def fetch(store: Any, key: str, owner: int, timeout: float, *, what: str, rank: int,
          absent: str, liveness: Liveness | None = None) -> bytes:
    """The value of ``key``, which rank ``owner`` publishes; errors as ``wait_for_ranks``."""
    wait_for_ranks(store, [key], timeout, what=what, rank=rank, absent=absent,
                   liveness=liveness, ranks=[owner])
    return store.get(key)


def agree_survivors(store: Any, rank: int, size: int, liveness: Liveness, timeout: float, *,
                    attempt: str, what: str = "shrink") -> list[int]:
    """The ranks of a group that are still alive, the same list on every one of them, made
    under the name ``attempt`` (one per try: a retry needs a new one). Collective over the
    survivors, and none of them is special.

    Each survivor says it is here; it waits until every rank has said so or is gone (its will:
    died, or closed), or until ``timeout``; then it proposes the ranks that said so and are not
    gone. The store's compare-and-set makes the first proposal the answer every survivor reads,
    so they agree even when a rank dies meanwhile (a proposal made before the death names it;
    building the group then fails on every member alike, and they try again without it). A
    rank that is not in the answer (it came after the deadline) raises PeerFailure.
    """
    deadline = time.monotonic() + timeout
    here = [f"{attempt}/here/{r}" for r in range(size)]
    decided_key = f"{attempt}/members"
    store.set(here[rank], b"1")
    decided = store.peek([decided_key])[0]
    while decided is None:
        present = store.peek(here)
        gone = liveness.gone()
        pending = [r for r in range(size) if present[r] is None and r not in gone]
        if not pending or time.monotonic() >= deadline:
            proposal = [r for r in range(size) if present[r] is not None and r not in gone]
            decided = store.compare_set(decided_key, "", json.dumps(proposal))
            break
        try:
            store.wait([here[pending[0]]], timeout=max(min(POLL, deadline - time.monotonic()),
                                                       0.001))
        except StoreTimeout:
            pass
        decided = store.peek([decided_key])[0]
    members = json.loads(decided)
    if rank not in members:
        raise PeerFailure(f"{what} on rank {rank} of {size}: the surviving ranks {members} "
                          f"agreed on their group before this rank arrived (it came after "
                          f"their deadline)", peer=None)
    return members


def leave_group(store: Any, rank: int, size: int) -> None:
    """This rank is done with a group's namespace ``store``: it withdraws its will, marks itself
    closed, and the rank that finds every rank closed deletes the whole namespace, so a group
    that closes leaves no keys behind. A group with a dead rank keeps its keys (the next start-up
    in the store skips and removes them). Never raises; takes at most ``LEAVE_TIMEOUT``."""
    deadline = time.monotonic() + LEAVE_TIMEOUT
    if not _mark_closed(store, rank, deadline):
        return
    try:
        states = store.peek([_GONE.format(r) for r in range(size)], timeout=_left(deadline))
        if all(s == b"closed" for s in states):
            store.delete_prefix("", timeout=_left(deadline))
    except (GpucollError, OSError):
        pass


def _mark_closed(store: Any, rank: int, deadline: float) -> bool:
    """Withdraw ``rank``'s will and set its ``gone/`` key to closed; False if the store failed."""
    key = _GONE.format(rank)
    try:
        store.clear_will(key, timeout=_left(deadline))
        store.set(key, b"closed")
        return True
    except (GpucollError, OSError):
        return False


def store_host_rank(store: Any) -> int | None:
    """The rank of the group whose process hosts ``store`` (``hosted_by`` on the client, set
    where a launcher's rank 0 serves it), looked up through PrefixStore wrappers."""
    for _ in range(16):
        if store is None or hasattr(store, "hosted_by"):
            break
        store = getattr(store, "store", None)
    return getattr(store, "hosted_by", None)


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.001)


def _gone(others: dict[int, str], what: str, rank: int, size: int) -> PeerFailure:
    """The PeerFailure for ranks found gone: those that died first, then those that closed."""
    died = sorted(r for r, how in others.items() if how != "closed")
    closed = sorted(r for r, how in others.items() if how == "closed")
    where = f"during {what} on rank {rank} of {size}"
    parts = []
    if died:
        parts.append(f"{_ranks(died)} died {where} (the process ended or lost its connection "
                     f"to the store)")
    if closed:
        parts.append(f"{_ranks(closed)} closed {'its' if len(closed) == 1 else 'their'} "
                     f"communicator {where}")
    return PeerFailure("; ".join(parts), peer=(died or closed)[0])


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
