"""The calls mpi4py programs port to, on every backend: object messages with tags, from any
source with a status, non-blocking object sends and receives, all_reduce_object and
reduce_object, and their bad input. Two ranks run in the fast tier on each backend; three and
four ranks are the slow grid."""

from __future__ import annotations

import mpi_ranks as ranks
import pytest
from multiproc import spawn
from tiers import grid

pytestmark = pytest.mark.timeout(120)

BACKENDS = grid(["shm", "tcp", "nccl"], ["shm", "nccl"])
SLOW_WORLDS = [pytest.param(n, marks=pytest.mark.slow) for n in (3, 4)]


def _run(body, n: int, addr: str, backend: str, *args) -> list:
    return spawn(body, n, addr, backend, *args, timeout=100)


# -- tags ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_a_receive_takes_the_first_message_with_its_tag(store_addr, backend):
    got = _run(ranks.tags_reorder_objects, 2, store_addr, backend)[1]
    # sent: tag 1 (#0), tag 2 (#1), tag 1 (#2), tag 0 (#3); tag 1 twice keeps their order
    assert got == [(0, 3), (1, 0), (2, 1), (1, 2)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_posted_receives_are_matched_in_posting_order(store_addr, backend):
    early, values = _run(ranks.non_blocking_receives_match_in_posting_order, 2, store_addr,
                         backend)[1]
    assert early == [False, False, False]
    assert values == ["7:1", "7:2", "3:0"]


# -- non-blocking objects ------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_isend_and_irecv_objects_exchange_without_deadlock(store_addr, backend):
    assert _run(ranks.isend_irecv_exchange, 2, store_addr, backend) == [[1, 1], [0, 0]]


@pytest.mark.parametrize("n", SLOW_WORLDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_isend_and_irecv_objects_around_a_ring(store_addr, backend, n):
    got = _run(ranks.isend_irecv_exchange, n, store_addr, backend)
    assert got == [[(r - 1) % n] * 2 for r in range(n)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_isend_objects_arrive_in_order_and_results_are_the_objects(store_addr, backend):
    sends, receives = _run(ranks.isend_object_result_and_order, 2, store_addr, backend)
    assert sends == [None] * 5 and receives == list(range(5))


@pytest.mark.parametrize("backend", BACKENDS)
def test_objects_in_many_pieces_arrive_whole(store_addr, backend):
    assert _run(ranks.objects_in_small_pieces, 2, store_addr, backend)[1] == [b"xxx", 1, 0, 2]


# -- any source ----------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_any_source_receive_says_who_sent_it_and_the_tag(store_addr, backend):
    assert _run(ranks.any_source_with_status, 2, store_addr, backend)[0] == [(1, 1, 11)]


@pytest.mark.parametrize("n", SLOW_WORLDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_any_source_receives_every_sender(store_addr, backend, n):
    got = _run(ranks.any_source_with_status, n, store_addr, backend)[0]
    assert got == [(r, r, 10 + r) for r in range(1, n)]


@pytest.mark.parametrize("n", [2] + SLOW_WORLDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_any_source_keeps_each_senders_order(store_addr, backend, n):
    got = _run(ranks.any_source_keeps_each_senders_order, n, store_addr, backend)[0]
    assert sorted(got) == [(r, i) for r in range(1, n) for i in range(3)]
    for r in range(1, n):
        assert [i for s, i in got if s == r] == [0, 1, 2]


@pytest.mark.parametrize("backend", BACKENDS)
def test_receives_that_nothing_matches_time_out_and_the_communicator_goes_on(store_addr,
                                                                              backend):
    out = _run(ranks.timed_out_receives, 2, store_addr, backend)[0]
    assert [kind for kind, _ in out] == ["CollectiveTimeout"] * 3 + ["ok", "ok"]
    assert "recv_object on rank 0 of 2: no object from any rank with tag 2" in out[0][1]
    assert "irecv_object on rank 0 of 2: no object from any rank with tag 3" in out[1][1]
    assert "still running after waiting 0.2 s" in out[2][1]
    assert out[3][1] == "'other tag'" and out[4][1] == "'late'"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_receive_from_any_source_whose_senders_died_fails_within_seconds(store_addr, backend):
    from multiproc import RanksFailed

    with pytest.raises(RanksFailed) as failed:
        _run(ranks.any_source_receive_whose_senders_are_gone, 2, store_addr, backend)
    rank0 = failed.value.outcomes[0]
    assert rank0.ok, rank0.trace
    (kind, text), took = rank0.value
    assert kind == "PeerFailure" and "rank 1 died" in text, text
    assert "no object from any rank with tag 4" in text and took < 10


def test_a_blocking_receive_from_a_named_rank_that_times_out_ends_the_group(store_addr):
    first, then = _run(ranks.named_source_receive_that_times_out_ends_the_group, 2, store_addr,
                       "shm")[0]
    assert first[0] == "CollectiveTimeout" and then[0] in ("CollectiveTimeout", "PeerFailure",
                                                          "GpucollError"), (first, then)


# -- bad input ------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_object_arguments_raise_before_anything_is_sent(store_addr, backend):
    sender, receiver = _run(ranks.bad_object_arguments, 2, store_addr, backend)
    kinds = [kind for kind, _ in sender]
    assert kinds[:9] == ["TypeError", "ValueError", "TypeError", "ValueError", "ValueError",
                         "ValueError", "ValueError", "ValueError", "TypeError"], sender
    texts = [text for _, text in sender]
    assert texts[0].startswith("send_object on rank 0 of 2: tag must be an int >= 0, got str")
    assert "tag=-2 is negative" in texts[1]
    assert texts[3].startswith("isend_object on rank 0 of 2: dst=2 is out of range")
    assert "dst=0 is this rank" in texts[4]
    assert texts[5].startswith("recv_object on rank 0 of 2: src=5 is out of range")
    assert "src=-5 is out of range" in texts[6] and "tag=-4 is negative" in texts[7]
    # unpicklable: the sender's own error, noted; the receive that matches it is told
    assert "obj could not be pickled" in texts[9] and "send_object on rank 0" in texts[9]
    assert "obj could not be pickled" in texts[10] and "isend_object on rank 0" in texts[10]
    assert texts[11].startswith("irecv_object on rank 0 of 2: status must be a gpucoll.Status")
    assert receiver[0][0] == "PicklingError" and "rank 0: TypeError" in receiver[0][1]
    assert receiver[1][0] == "PicklingError"  # the isend's, with tag 2
    assert receiver[2] == ("ok", "'good'")


# -- tags on arrays ------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_arrays_carry_tags_through_every_point_to_point_call(store_addr, backend):
    for rank, got in enumerate(_run(ranks.array_tags, 2, store_addr, backend)):
        if rank == 1:
            assert got[:4] == [[0, 1, 2, 3], [2.5] * 3, [1, 1], [0.0, 0.0]]
        bad = got[-5:]
        assert [kind for kind, _ in bad] == ["ValueError", "TypeError", "TypeError",
                                             "ValueError", "ValueError"], bad
        assert "tag=2147483648 is too large" in bad[4][1]
        assert bad[0][1].startswith(f"send on rank {rank} of 2: tag=-1 is negative")
        assert bad[1][1].startswith(f"recv on rank {rank} of 2: tag must be an int >= 0")
        assert "batch_isend_irecv" in bad[3][1] or "isend" in bad[3][1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_array_tags_that_disagree_are_a_mismatch_under_debug(store_addr, backend):
    results = spawn(ranks.array_tags_that_disagree, 2, store_addr, backend, timeout=100,
                    env={"GPUCOLL_DEBUG": "1"})
    for kind, text in results:  # the debug check runs before the message moves, on both
        assert kind == "CollectiveMismatch", results
        assert "with tag 4" in text and "with tag 6" in text, text


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_on_the_host_ring_array_tags_that_disagree_are_a_mismatch_without_debug(store_addr,
                                                                               backend):
    kind, text = _run(ranks.array_tags_that_disagree, 2, store_addr, backend)[1]
    assert kind == "CollectiveMismatch", text
    assert "tag=4" in text and "tag=6" in text, text


def test_on_nccl_array_tags_pair_in_order_without_debug(store_addr):
    """NCCL has no tags: without the debug check the receive takes the next array."""
    got = _run(ranks.array_tags_that_disagree, 2, store_addr, "nccl")
    assert got == [("ok", "None"), ("ok", "array([0., 0., 0.])")]


# -- reductions of objects ------------------------------------------------------------------------

def _reductions_want(n: int) -> list[dict]:
    every = {"sum": n * (n + 1) // 2, "default": sum(r + 0.5 for r in range(n)),
             "prod": 1, "min": 0, "max": f"r{n - 1}", "lists": list(range(n)),
             "callable": {0} | {r * 10 for r in range(1, n)},
             "dicts": {r: r for r in range(n)}}
    for r in range(n):
        every["prod"] *= r + 2
    return [{**every, "reduce": list(range(n)) if r == n - 1 else None,
             "reduce_max": n - 1 if r == 0 else None} for r in range(n)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_reduce_object_folds_in_rank_order_the_same_on_every_rank(store_addr, backend):
    assert _run(ranks.object_reductions, 2, store_addr, backend) == _reductions_want(2)


@pytest.mark.parametrize("n", SLOW_WORLDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_all_reduce_object_on_more_ranks(store_addr, backend, n):
    assert _run(ranks.object_reductions, n, store_addr, backend) == _reductions_want(n)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_reduce_ops_raise_before_anything_is_sent(store_addr, backend):
    for rank, out in enumerate(_run(ranks.bad_reduce_ops, 2, store_addr, backend)):
        assert [kind for kind, _ in out[:4]] == ["ValueError", "ValueError", "TypeError",
                                                 "ValueError"], out
        assert out[0][1].startswith(f"all_reduce_object on rank {rank} of 2: op='avg' does "
                                    f"not combine Python objects")
        assert "op must be 'sum', 'prod', 'min', 'max'" in out[2][1]
        assert "root=2 is out of range" in out[3][1]
        assert out[4][0] == "ZeroDivisionError" and "combining rank 1's object" in out[4][1]
        assert out[5][0] == ("TypeError" if rank else "PicklingError")
        assert out[6] == ("ok", "1")


def test_module_level_functions_act_on_the_default_communicator():
    import gpucoll

    with gpucoll.init("ring", rank=0, world_size=1, timeout=10):
        assert gpucoll.all_reduce_object([1], op=lambda a, b: a + b) == [1]
        assert gpucoll.reduce_object(3, 0, "max") == 3
        with pytest.raises(ValueError, match="isend_object on rank 0 of 1: dst=0 is this rank"):
            gpucoll.isend_object("x", 0)
        with pytest.raises(gpucoll.CollectiveTimeout, match="no object from any rank"):
            gpucoll.irecv_object(tag=1, timeout=0.2).wait()
        assert gpucoll.Status().Get_source() == -1 and gpucoll.ANY_SOURCE == gpucoll.ANY_TAG == -1
