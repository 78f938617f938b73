"""GPUCOLL_DEBUG=1: check that every rank makes the same call before any byte moves.

Each rank publishes the signature of its call (op, dtype, shape, root, reduce op, sequence
number) under its communicator's store namespace and reads everyone's; if they differ, every
rank raises ``CollectiveMismatch`` naming who called what, instead of hanging or computing wrong
data. A rank deletes its own key two calls later: by then every rank has read it (a rank publishes
call N only after reading everything of call N-1).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from gpucoll.errors import CollectiveMismatch
from gpucoll.store.gather import Liveness, fetch, share

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

    def __init__(self, store: Any, rank: int, size: int, liveness: Liveness | None = None):
        self.store, self.rank, self.size = store, rank, size
        self.liveness = liveness  # a rank that dies during a check is named at once
        self._channels: dict[str, int] = {}  # "src->dst" -> messages so far

    def collective(self, seq: int, sig: dict[str, Any], timeout: float, name: str) -> None:
        """Raise CollectiveMismatch unless all ranks call ``sig`` as their call ``seq``."""
        where = self._where(name)
        sig = {**sig, "seq": seq}
        keys = [f"debug/{seq}/{r}" for r in range(self.size)]
        sigs = self._exchange(keys, sig, timeout, name)
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
            f"{where}: collective #{seq} differs across ranks ({_ranks(odd)} "
            f"{'disagrees' if len(odd) == 1 else 'disagree'} with rank {sigs.index(anchor)}): "
            f"{detail}"
        )

    def point_to_point(self, peer: int, sending: bool, sig: dict[str, Any],
                       name: str) -> Callable[[float], None]:
        """Publish this side of a send/recv now; return the check to run just before the
        transfer (it waits for the peer's side, so async sends never block the issuing thread).

        Sends from one rank to another pair with the receiver's receives from it, in order.
        """
        src, dst = (self.rank, peer) if sending else (peer, self.rank)
        channel = f"{src}->{dst}"
        n = self._channels.get(channel, 0)
        self._channels[channel] = n + 1
        base = f"debug/p2p/{channel}/{n}"
        mine, theirs = (f"{base}/send", f"{base}/recv") if sending else (f"{base}/recv",
                                                                          f"{base}/send")
        self.store.set(mine, json.dumps(sig))

        def verify(timeout: float) -> None:
            other = json.loads(fetch(
                self.store, theirs, peer, timeout, what=name, rank=self.rank,
                absent=f"did not make the {'recv' if sending else 'send'} matching "
                       f"{describe(sig)} (GPUCOLL_DEBUG signature check)",
                liveness=self.liveness))
            if self.store.add(f"{base}/read", 1) == 2:  # both sides have read: clean up
                for key in (mine, theirs, f"{base}/read"):
                    self.store.delete_key(key)
            if other["dtype"] != sig["dtype"] or other["count"] != sig["count"]:
                raise CollectiveMismatch(
                    f"{self._where(name)}: message #{n} from rank {src} to rank {dst} does "
                    f"not match: rank {self.rank} called {describe(sig)} with {sig['count']} "
                    f"elements, rank {peer} called {describe(other)} with {other['count']} "
                    f"elements")

        return verify

    def _exchange(self, keys: list[str], sig: dict[str, Any], timeout: float,
                  name: str) -> list[dict[str, Any]]:
        values = share(self.store, keys, json.dumps(sig), timeout, what=name, rank=self.rank,
                       absent=f"did not make call {describe(sig)} (GPUCOLL_DEBUG signature "
                              f"check)", liveness=self.liveness)
        return [json.loads(v) for v in values]

    def _where(self, name: str) -> str:
        return f"{name} on rank {self.rank} of {self.size}"


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
