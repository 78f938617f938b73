"""gpucoll.store.gather: one key per rank, and a timeout naming the ranks that never came."""

from __future__ import annotations

import pytest

from gpucoll.errors import CollectiveTimeout
from gpucoll.store.gather import gather


def test_gather_returns_every_ranks_value_in_rank_order(store_server):
    keys = [f"g/{r}" for r in range(3)]
    for r in (2, 0, 1):
        store_server.set(keys[r], f"v{r}")
    assert gather(store_server, keys, 5.0, what="exchange", rank=0) == [b"v0", b"v1", b"v2"]


def test_a_missing_rank_is_a_collective_timeout_naming_it_and_the_operation(store_server):
    keys = [f"m/{r}" for r in range(3)]
    store_server.set(keys[0], "here")
    store_server.set(keys[2], "here")
    expected = r"exchange on rank 0 of 3: rank\(s\) \[1\] never arrived within [0-9.]+ s"
    with pytest.raises(CollectiveTimeout, match=expected + r" \(timeout=0.2 s\)"):
        gather(store_server, keys, 0.2, what="exchange", rank=0)
