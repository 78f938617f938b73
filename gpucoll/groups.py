"""Subgroups by member list, and a barrier that names the ranks that never arrived: what
torch.distributed users reach for as ``new_group(ranks)`` and ``monitored_barrier``."""

from __future__ import annotations

import operator
import struct
import zlib
from collections.abc import Sequence
from typing import Any

from gpucoll.errors import CollectiveMismatch, UsageError
from gpucoll.store import wait_for_ranks
from gpucoll.validation import Call, entry


class GroupCalls:
    """``new_group`` and ``monitored_barrier`` for ``Communicator`` (a mixin: it uses the
    communicator's argument checks, store and ``split``)."""

    _monitored = 0  # monitored barriers so far, the same count on every rank

    @entry
    def new_group(self, ranks: Sequence[int], *, timeout: float | None = None) -> Any:
        """A communicator of the listed ranks, numbered in sorted order (as
        torch.distributed.new_group); None on the ranks not listed. Collective over this
        communicator: every rank passes the same ranks (else CollectiveMismatch everywhere)."""
        c = self._call("new_group")
        members = _members(c, ranks, self.size)
        t = c.timeout(timeout, self.timeout)
        seq = self._signature(c, t, None, ranks=members)
        digest = zlib.crc32(struct.pack(f"<{len(members)}q", *members))
        lists = self._agree(c, seq, struct.pack("<I", digest), t, "new_group")
        odd = [r for r, v in enumerate(lists) if v != lists[self.rank]]
        if odd:
            same = [r for r, v in enumerate(lists) if v == lists[self.rank]]
            raise CollectiveMismatch(
                f"{c.where}: the ranks pass different member lists: {_ranks(same)} "
                f"{'passes' if len(same) == 1 else 'pass'} {members}, {_ranks(odd)} "
                f"{'passes' if len(odd) == 1 else 'pass'} another; no group was made")
        mine = self.rank in members
        return self._split(c, 0 if mine else None, members.index(self.rank) if mine else 0, t)

    @entry
    def monitored_barrier(self, *, timeout: float | None = None) -> None:
        """A barrier through the store that, when ranks do not arrive within ``timeout``,
        raises CollectiveTimeout naming every one of them on every rank that did (a rank that
        died is a PeerFailure naming it at once). After earlier asynchronous work, like
        ``barrier``; the communicator is unusable after it fails."""
        c = self._call("monitored_barrier")
        if self._store is None:
            raise c.fail(UsageError, "this communicator has no store to meet in")
        t = c.timeout(timeout, self.timeout)
        seq = self._signature(c, t, None)
        n = self._monitored
        self._monitored = n + 1
        store, me = self._store, self.rank

        def meet() -> None:
            keys = [f"monitored/{n}/{r}" for r in range(self.size)]
            store.set(keys[me], b"1")
            # only the ranks not there yet are waited for: one that arrived and then left (it
            # timed out first, say) is no reason to fail
            missing = [r for r, v in enumerate(store.peek(keys)) if v is None]
            if missing:
                wait_for_ranks(store, [keys[r] for r in missing], t, ranks=missing,
                               what=f"monitored_barrier #{seq}", rank=me,
                               absent="never arrived", liveness=self._liveness)
            if n >= 2:  # every rank has read the keys of two barriers ago
                store.delete_key(f"monitored/{n - 2}/{me}")

        self._issue(c, seq, lambda: self._in_store(meet), None, False, None)


def _members(c: Call, ranks: Any, size: int) -> list[int]:
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence):
        raise c.fail(TypeError, f"ranks must be a list of ranks, got {type(ranks).__name__}")
    out = []
    for i, r in enumerate(ranks):
        if isinstance(r, bool) or not hasattr(type(r), "__index__"):
            raise c.fail(TypeError, f"ranks[{i}] must be an int, got {type(r).__name__}")
        r = operator.index(r)
        if not 0 <= r < size:
            raise c.fail(ValueError, f"ranks[{i}] = {r} is not a rank of this communicator "
                                     f"(0..{size - 1})")
        out.append(r)
    if not out:
        raise c.fail(ValueError, "ranks is empty; a group needs at least one rank")
    if len(set(out)) != len(out):
        raise c.fail(ValueError, f"ranks {list(ranks)} lists a rank twice")
    return sorted(out)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
