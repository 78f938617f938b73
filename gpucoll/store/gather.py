"""One key per rank in the store: wait for all of them, or name the ranks that never came.

Bootstrap steps (the ring's address exchange, NCCL's start-up barrier, ``backend="auto"``'s
verdicts) each publish one key per rank and need every other rank's; a rank that never shows up
must become a ``CollectiveTimeout`` naming it, not a bare store timeout listing keys.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from gpucoll.errors import CollectiveTimeout, StoreTimeout


def wait_for_ranks(store: Any, keys: Sequence[str], timeout: float, *, what: str, rank: int,
                   absent: str = "never arrived") -> None:
    """Block until ``keys[r]`` (rank r's key) is in ``store`` for every r; else a
    CollectiveTimeout saying, for operation ``what`` on ``rank``, which ranks are ``absent``
    and after how long."""
    start = time.monotonic()
    try:
        store.wait(list(keys), timeout=timeout)
    except StoreTimeout:
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        raise CollectiveTimeout(
            f"{what} on rank {rank} of {len(keys)}: rank(s) {missing} {absent} within "
            f"{time.monotonic() - start:.1f} s (timeout={timeout:g} s)"
        ) from None


def gather(store: Any, keys: Sequence[str], timeout: float, *, what: str, rank: int,
           absent: str = "never arrived") -> list[bytes]:
    """Every rank's value (rank order) once all are in ``store``; timeouts as ``wait_for_ranks``."""
    wait_for_ranks(store, keys, timeout, what=what, rank=rank, absent=absent)
    return store.multi_get(list(keys))
