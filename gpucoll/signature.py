"""GPUCOLL_DEBUG=1: check that every rank makes the same call before any byte moves.

Each rank publishes the signature of its call (op, dtype, shape, root, reduce op, sequence
number) under its communicator's store namespace and reads everyone's; if they differ, every
rank raises ``CollectiveMismatch`` naming who called what, instead of hanging or computing wrong
data. A rank deletes its own key two calls later: by then every rank has read it (a rank publishes
call N only after reading everything of call N-1).
"""

from __future__ import annotations

import json
from typing import Any

from gpucoll.errors import CollectiveMismatch, CollectiveTimeout, StoreTimeout

# Signature fields a rank may leave unknown (None): scatter's non-roots without out= learn the
# slot's dtype and shape from the root.
_WILDCARD = ("dtype", "shape")


def describe(sig: dict[str, Any]) -> str:
    """``all_reduce(float32[4], op=sum)``: a call as a reader recognises it."""
    args = []
    dtype, shape = sig.get("dtype"), sig.get("shape")
    if dtype is not None or shape is not None:
        args.append(f"{dtype or '?'}{list(shape) if shape is not None else '[?]'}")
    for field in ("op", "root", "peer", "tiled", "color"):
        if sig.get(field) is not None:
            args.append(f"{field}={sig[field]}")
    return f"{sig['call']}({', '.join(args)})"


def compatible(a: dict[str, Any], b: dict[str, Any]) -> bool:
    for field in a.keys() | b.keys():
        va, vb = a.get(field), b.get(field)
        if va != vb and not (field in _WILDCARD and (va is None or vb is None)):
            return False
    return True


class SignatureCheck:
    """The debug check of one communicator; ``store`` is its namespace."""

    def __init__(self, store: Any, rank: int, size: int):
        self.store, self.rank, self.size = store, rank, size
        self._pairs: dict[int, int] = {}  # peer -> point-to-point calls made with it

    def collective(self, seq: int, sig: dict[str, Any], timeout: float, where: str) -> None:
        """Raise CollectiveMismatch unless all ranks call ``sig`` as their call ``seq``."""
        sig = {**sig, "seq": seq}
        keys = [f"debug/{seq}/{r}" for r in range(self.size)]
        sigs = self._exchange(keys, self.rank, sig, timeout, where)
        if seq >= 2:
            self.store.delete_key(f"debug/{seq - 2}/{self.rank}")
        # every rank compares against the same signature: the root's, as rank 0 names it
        root = sigs[0].get("root")
        anchor = sigs[root] if isinstance(root, int) and 0 <= root < self.size else sigs[0]
        if all(compatible(anchor, s) for s in sigs):
            return
        calls: dict[str, list[int]] = {}
        for r, s in enumerate(sigs):
            calls.setdefault(describe(s), []).append(r)
        odd = [r for r, s in enumerate(sigs) if not compatible(anchor, s)]
        detail = "; ".join(f"{_ranks(rs)} called {call}" for call, rs in calls.items())
        raise CollectiveMismatch(
            f"{where}: collective #{seq} differs across ranks ({_ranks(odd)} disagree with "
            f"rank {sigs.index(anchor)}): {detail}"
        )

    def point_to_point(self, peer: int, sig: dict[str, Any], timeout: float, where: str) -> None:
        """Raise CollectiveMismatch unless ``peer`` makes the matching send/recv call."""
        n = self._pairs.get(peer, 0)
        self._pairs[peer] = n + 1
        lo, hi = sorted((self.rank, peer))
        keys = [f"debug/p2p/{lo}-{hi}/{n}/{r}" for r in (lo, hi)]
        mine, theirs = (0, 1) if self.rank == lo else (1, 0)
        sigs = self._exchange(keys, mine, {**sig, "n": n}, timeout, where, ranks=(lo, hi))
        if n >= 2:
            self.store.delete_key(f"debug/p2p/{lo}-{hi}/{n - 2}/{self.rank}")
        me, other = sigs[mine], sigs[theirs]
        expected = {"send": "recv", "recv": "send"}[me["call"]]
        if (other["call"] == expected and other.get("peer") == self.rank
                and other["dtype"] == me["dtype"] and other["count"] == me["count"]):
            return
        raise CollectiveMismatch(
            f"{where}: point-to-point call #{n} between ranks {lo} and {hi} does not match: "
            f"rank {self.rank} called {describe(me)} with {me['count']} elements, rank {peer} "
            f"called {describe(other)} with {other['count']} elements"
        )

    def _exchange(self, keys: list[str], index: int, sig: dict[str, Any], timeout: float,
                  where: str, ranks: tuple[int, ...] | None = None) -> list[dict[str, Any]]:
        self.store.set(keys[index], json.dumps(sig))
        try:
            self.store.wait(keys, timeout=timeout)
        except StoreTimeout:
            ranks = ranks or tuple(range(self.size))
            missing = [r for r, k in zip(ranks, keys, strict=True) if not self.store.check([k])]
            raise CollectiveTimeout(
                f"{where}: {_ranks(missing)} did not make call {describe(sig)} within "
                f"{timeout:g} s (GPUCOLL_DEBUG signature check)"
            ) from None
        return [json.loads(v) for v in self.store.multi_get(keys)]


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
