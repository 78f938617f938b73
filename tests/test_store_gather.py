"""Ranks meeting in the store (gpucoll.store's gather, share, wait_for_ranks): one key per rank,
a wait that names the ranks that never came, and Liveness, which turns a rank that died or left
into a PeerFailure naming it within a second."""

from __future__ import annotations

import os
import signal
import time

import pytest
from multiproc import spawn

from gpucoll import PrefixStore, TCPStore
from gpucoll.errors import CollectiveTimeout, PeerFailure, StoreTimeout
from gpucoll.store import Liveness, gather, leave_group, share, wait_for_ranks


def test_gather_returns_every_ranks_value_in_rank_order(store_server):
    keys = [f"g/{r}" for r in range(3)]
    for r in (2, 0, 1):
        store_server.set(keys[r], f"v{r}")
    assert gather(store_server, keys, 5.0, what="exchange", rank=0) == [b"v0", b"v1", b"v2"]


def test_a_missing_rank_is_a_collective_timeout_naming_it_and_the_operation(store_server):
    keys = [f"m/{r}" for r in range(3)]
    store_server.set(keys[0], "here")
    store_server.set(keys[2], "here")
    expected = r"exchange on rank 0 of 3: rank 1 never arrived within [0-9.]+ s"
    with pytest.raises(CollectiveTimeout, match=expected + r" \(timeout=0.2 s\)"):
        gather(store_server, keys, 0.2, what="exchange", rank=0)


def test_share_publishes_this_ranks_value_and_returns_everyones(store_server):
    keys = [f"sh/{r}" for r in range(3)]
    store_server.set(keys[0], "v0")
    store_server.set(keys[2], "v2")
    assert share(store_server, keys, "v1", 5.0, what="agree", rank=1) == [b"v0", b"v1", b"v2"]


def test_share_names_the_ranks_that_did_not_share_and_leaves_this_ranks_value(store_server):
    keys = [f"sm/{r}" for r in range(3)]
    with pytest.raises(CollectiveTimeout, match=r"agree on rank 1 of 3: ranks 0, 2 did not "
                                                r"call it"):
        share(store_server, keys, b"mine", 0.1, what="agree", rank=1, absent="did not call it")
    assert store_server.get(keys[1]) == b"mine"


def test_keys_already_there_need_no_time_at_all(store_server):
    store_server.multi_set(["z/0", "z/1"], [b"a", b"b"])
    wait_for_ranks(store_server, ["z/0", "z/1"], 0, what="exchange", rank=1)


def test_absent_says_what_the_missing_ranks_did_not_do(store_server):
    with pytest.raises(CollectiveTimeout, match=r"split on rank 1 of 2: rank 0 did "
                                                r"not call it"):
        store_server.set("s/1", b"here")
        wait_for_ranks(store_server, ["s/0", "s/1"], 0.1, what="split", rank=1,
                       absent="did not call it")


# ----------------------------------------------------------------------------- Liveness
def test_liveness_reports_nobody_gone_at_first(store_server):
    space = PrefixStore("grp", store_server)
    assert Liveness(space, 0, 3).gone() == {}


def test_liveness_leave_marks_the_rank_closed_and_withdraws_its_will(store_server):
    with TCPStore("127.0.0.1", store_server.port, timeout=10) as c:
        live = Liveness(PrefixStore("grp", c), 1, 2)
        live.leave()
        live.leave()  # idempotent
    # the closed connection fired no will: "closed" stays
    assert Liveness(PrefixStore("grp", store_server), 0, 2).gone() == {1: "closed"}


def test_liveness_of_a_closed_store_connection_reports_the_rank_died(store_server):
    c = TCPStore("127.0.0.1", store_server.port, timeout=10)
    Liveness(PrefixStore("grp", c), 2, 3)
    c.close()
    store_server.wait(["grp/gone/2"], timeout=10)
    assert Liveness(PrefixStore("grp", store_server), 0, 3).gone() == {2: "died"}


def test_liveness_leave_never_raises_once_the_store_is_gone():
    server = TCPStore("127.0.0.1", 0, is_server=True, timeout=10)
    client = TCPStore("127.0.0.1", server.port, timeout=10)
    live = Liveness(PrefixStore("grp", client), 0, 2)
    server.close()
    live.leave()
    client.close()


class _SliceEndsAsPeerSetsThenDies(PrefixStore):
    """The store as rank 0 sees it while rank 1 sets its key and then dies, between the end of
    rank 0's wait slice (a StoreTimeout) and its look at who is gone."""

    def __init__(self, server):
        super().__init__("grp", server)
        self._server, self._raced = server, False

    def wait(self, keys, timeout=None):
        if self._raced:
            return super().wait(keys, timeout=timeout)
        self._raced = True
        peer = TCPStore("127.0.0.1", self._server.port, timeout=10)
        Liveness(PrefixStore("grp", peer), 1, 2)
        peer.set("grp/key/1", b"v")
        peer.close()
        self._server.wait(["grp/gone/1"], timeout=10)
        raise StoreTimeout("the slice ran out")


def test_a_rank_that_set_its_key_before_it_died_does_not_fail_the_wait(store_server):
    """Its death, seen only after its key came, is no failure of this wait (the wait has what
    it waited for): every rank that saw the key first went on, and this one must agree."""
    store = _SliceEndsAsPeerSetsThenDies(store_server)
    live = Liveness(store, 0, 2)
    store.set("key/0", b"v")
    wait_for_ranks(store, ["key/0", "key/1"], 10, what="share", rank=0, liveness=live,
                   poll=0.01)
    assert live.gone() == {1: "died"}


# ----------------------------------------------------------------------------- across processes
def _split(rank: int, n: int, port: int, fate: dict) -> str:
    """Rank ``rank`` of a group meeting in the store for a 'split'; ``fate`` says what the
    odd rank does instead: die (SIGKILL), close (leave the group) or never come. Every rank
    that lives keeps its connection until all have their outcome (closing it unannounced is
    dying, as far as the others can tell)."""
    with TCPStore("127.0.0.1", port, timeout=60) as store:
        space = PrefixStore("job/comm0", store)
        live = Liveness(space, rank, n)
        if store.add("registered", 1) == n:
            store.set("everyone-registered", b"1")
        store.wait(["everyone-registered"], timeout=30)
        if rank == fate["rank"]:
            if fate["does"] == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            if fate["does"] == "close":
                live.leave()
            result = "left"
        else:
            space.set(f"split/{rank}", b"colour")
            start = time.monotonic()
            try:
                wait_for_ranks(space, [f"split/{r}" for r in range(n)], fate["timeout"],
                               what="split", rank=rank, liveness=live)
                result = "completed"
            except (PeerFailure, CollectiveTimeout) as exc:
                result = f"{type(exc).__name__}({getattr(exc, 'peer', None)}) after " \
                         f"{time.monotonic() - start:.1f}: {exc}"
            if store.add("finished", 1) == n - 1:
                store.set("release", b"1")
        store.wait(["release"], timeout=60)
        live.leave()
        return result


def _outcome(result: str) -> tuple[str, float, str]:
    head, _, message = result.partition(": ")
    kind, _, seconds = head.partition(" after ")
    return kind, float(seconds), message


def test_a_rank_that_dies_is_named_by_every_waiting_rank_within_seconds(store_server):
    fate = {"rank": 2, "does": "die", "timeout": 60.0}
    outcomes = spawn(_split, 3, store_server.port, fate, timeout=90, check=False)
    assert outcomes[2].exitcode == -signal.SIGKILL
    for r in (0, 1):
        kind, seconds, message = _outcome(outcomes[r].value)
        assert kind == "PeerFailure(2)"
        assert message.startswith(f"rank 2 died during split on rank {r} of 3")
        assert seconds < 10, f"rank {r} took {seconds} s to learn (timeout 60 s)"


def test_a_rank_that_closes_is_named_as_having_closed(store_server):
    fate = {"rank": 0, "does": "close", "timeout": 60.0}
    outcomes = spawn(_split, 3, store_server.port, fate, timeout=90)
    for r in (1, 2):
        kind, seconds, message = _outcome(outcomes[r])
        assert kind == "PeerFailure(0)" and seconds < 10
        assert message == f"rank 0 closed its communicator during split on rank {r} of 3"


def test_a_rank_that_never_comes_is_a_timeout_naming_it_at_the_deadline(store_server):
    fate = {"rank": 1, "does": "stay away", "timeout": 2.0}
    outcomes = spawn(_split, 3, store_server.port, fate, timeout=90)
    for r in (0, 2):
        kind, seconds, message = _outcome(outcomes[r])
        assert kind == "CollectiveTimeout(None)" and seconds >= 2.0
        assert message.startswith(f"split on rank {r} of 3: rank 1 never arrived within")


# ----------------------------------------------------------------------------- leaving a group
def test_the_last_rank_to_leave_deletes_the_groups_keys(store_server):
    store_server.set("other-job/k", b"kept")
    clients = [TCPStore("127.0.0.1", store_server.port, timeout=10) for _ in range(3)]
    spaces = [PrefixStore("job/comm0", c) for c in clients]
    for r, space in enumerate(spaces):
        Liveness(space, r, 3)
        space.set(f"addr/{r}", b"x")
    before = store_server.num_keys()
    for r in (2, 0):
        leave_group(spaces[r], r, 3)
    assert store_server.num_keys() == before + 2  # two "closed" marks, nothing deleted yet
    leave_group(spaces[1], 1, 3)
    assert store_server.num_keys() == 1 and store_server.get("other-job/k") == b"kept"
    for c in clients:
        c.close()
    assert store_server.num_keys() == 1  # no will fired after leaving


def test_a_rank_that_aborted_is_named_with_its_reason_and_its_group_still_cleans_up(
        store_server):
    clients = [TCPStore("127.0.0.1", store_server.port, timeout=10) for _ in range(2)]
    spaces = [PrefixStore("job/comm0", c) for c in clients]
    lives = [Liveness(space, r, 2) for r, space in enumerate(spaces)]
    lives[1].leave(aborted="the loss is NaN")
    with pytest.raises(PeerFailure) as caught:
        lives[0].check("split")
    assert caught.value.peer == 1
    assert str(caught.value) == ("rank 1 aborted its communicator during split on rank 0 of 2: "
                                 "the loss is NaN")
    leave_group(spaces[1], 1, 2, aborted="the loss is NaN")  # (its close, after the abort)
    leave_group(spaces[0], 0, 2)
    assert store_server.num_keys() == 0
    for c in clients:
        c.close()


def test_a_group_with_a_dead_rank_keeps_its_keys(store_server):
    dead = TCPStore("127.0.0.1", store_server.port, timeout=10)
    Liveness(PrefixStore("job/comm0", dead), 1, 2)
    dead.close()  # its will fires: rank 1 died
    store_server.wait(["job/comm0/gone/1"], timeout=10)
    with TCPStore("127.0.0.1", store_server.port, timeout=10) as c:
        space = PrefixStore("job/comm0", c)
        Liveness(space, 0, 2)
        leave_group(space, 0, 2)
    assert store_server.peek(["job/comm0/gone/0", "job/comm0/gone/1"]) == [b"closed", b"died"]


def test_leaving_a_group_never_raises_once_the_store_is_gone():
    server = TCPStore("127.0.0.1", 0, is_server=True, timeout=10)
    client = TCPStore("127.0.0.1", server.port, timeout=10)
    server.close()
    start = time.monotonic()
    leave_group(PrefixStore("job/comm0", client), 0, 2)
    assert time.monotonic() - start < 10
    client.close()
