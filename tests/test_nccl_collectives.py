"""The collective suite through the NCCL backend, against the emulated NCCL (no GPU needed).

Device inputs are host buffers exposing ``__cuda_array_interface__``; the emulation reads and
writes them at the pointers the backend passes and checks every argument as NCCL would.
"""

from __future__ import annotations

import nccl_ranks
import pytest
from multiproc import spawn

pytestmark = pytest.mark.timeout(120)


def test_all_reduce_of_every_dtype_and_op_matches_numpy(store_addr):
    calls = spawn(nccl_ranks.all_reduce_cases, 2, store_addr, timeout=90)
    # bitwise ops and dtypes NCCL lacks go through allgather plus a local reduction
    assert calls[0].count("allgather") == 5
    assert calls[0].count("allreduce") == len(nccl_ranks.ALL_REDUCE_CASES) - 5


def test_all_reduce_on_three_ranks(store_addr):
    spawn(nccl_ranks.all_reduce_cases, 3, store_addr, timeout=90)


def test_broadcast_and_reduce_from_every_root(store_addr):
    spawn(nccl_ranks.rooted_cases, 3, store_addr, timeout=90)


def test_all_gather_and_gather_in_slot_and_tiled_layouts(store_addr):
    spawn(nccl_ranks.gather_cases, 3, store_addr, timeout=90)


def test_scatter_from_every_root_allocates_the_callers_array_type(store_addr):
    spawn(nccl_ranks.scatter_cases, 3, store_addr, timeout=90)


def test_reduce_scatter_and_all_to_all(store_addr):
    spawn(nccl_ranks.exchange_cases, 3, store_addr, timeout=90)


def test_send_and_recv_around_a_ring(store_addr):
    spawn(nccl_ranks.send_recv_ring, 2, store_addr, timeout=60)


def test_nccl_gets_the_stream_argument_else_the_current_stream(store_addr):
    streams = spawn(nccl_ranks.stream_cases, 2, store_addr, timeout=60)
    for seen in streams:
        s1, s2 = seen[0], seen[1]
        assert s1 != s2 and s1 >= 0x1000 and s2 >= 0x1000
        assert seen == [s1, s2, s2, 0]


def test_work_waits_for_the_stream_a_cuda_array_interface_names(store_addr):
    assert spawn(nccl_ranks.producer_stream_is_waited_on, 2, store_addr, timeout=60) == [True] * 2


def test_async_op_returns_event_work(store_addr):
    spawn(nccl_ranks.async_cases, 2, store_addr, timeout=60)


def test_split_groups_ranks_by_color_and_orders_them_by_key(store_addr):
    got = spawn(nccl_ranks.split_cases, 3, store_addr, timeout=60)
    # colors: rank 0 -> 0, rank 1 -> 1, rank 2 -> None; each group has one member
    assert got == [(0, 1, 0), (0, 1, 1), (None, None, None)]


def test_a_rank_missing_at_start_up_is_a_timeout_naming_it(store_addr):
    message = spawn(nccl_ranks.missing_rank_at_start, 2, store_addr, timeout=60)[0]
    assert "rank 1 never arrived" in message


def test_a_collective_whose_peer_never_comes_times_out_and_aborts(store_addr):
    message = spawn(nccl_ranks.peer_never_calls, 2, store_addr, timeout=60)[0]
    assert "all_reduce on rank 0 of 2 did not complete within 1 s" in message
    assert "aborted" in message


def test_a_peer_that_aborts_fails_the_others_call_with_its_reason(store_addr):
    kind, text = spawn(nccl_ranks.peer_aborts, 2, store_addr, timeout=60)[0]
    assert kind == "PeerFailure", text
    assert "rank 1 aborted its communicator" in text and "the loss is NaN at step 7" in text
    assert float(text.split(" s:")[0]) < 10, text  # the call's timeout is 30 s


@pytest.mark.slow
def test_the_shared_correctness_matrix_passes_through_the_nccl_backend(store_addr):
    reports = spawn(nccl_ranks.collective_matrix, 2, store_addr, timeout=110)
    failures = [f"rank {r}: {case}: {error}" for r, report in enumerate(reports)
                for case, error in report.items() if error is not None]
    assert len(reports[0]) > 800
    assert failures == []


# ---- host (NumPy) arrays on the NCCL backend: staged through device memory ----------------------

def test_numpy_arrays_come_back_written_and_inputs_it_only_reads_are_left_alone(store_addr):
    spawn(nccl_ranks.host_array_results, 3, store_addr, timeout=60)


def test_sends_and_receives_of_numpy_arrays_never_block_and_async_collectives_finish(
        store_addr):
    kinds = spawn(nccl_ranks.host_array_async, 2, store_addr, timeout=60)
    assert kinds == [["HostWork", "EventWork", "HostWork", "HostWork"]] * 2


def test_a_numpy_all_reduce_whose_peer_never_comes_times_out_and_keeps_its_values(store_addr):
    message = spawn(nccl_ranks.host_array_without_its_peer, 2, store_addr, False, timeout=60)[0]
    assert float(message.split(" s:")[0]) < 10, message
    assert "all_reduce on rank 0 of 2 did not complete within 1 s" in message


def test_a_numpy_all_reduce_whose_peer_dies_names_it_at_once_and_keeps_its_values(store_addr):
    outcome = spawn(nccl_ranks.host_array_without_its_peer, 2, store_addr, True, timeout=60,
                    check=False)[0]
    assert outcome.ok, outcome.trace
    seconds, message = outcome.value.split(" s: ", 1)
    assert float(seconds) < 10 and message.startswith("rank 1 died during all_reduce"), message


@pytest.mark.slow
def test_the_shared_correctness_matrix_passes_on_numpy_arrays_through_the_nccl_backend(
        store_addr):
    reports = spawn(nccl_ranks.collective_matrix, 2, store_addr, True, timeout=110)
    failures = [f"rank {r}: {case}: {error}" for r, report in enumerate(reports)
                for case, error in report.items() if error is not None]
    assert len(reports[0]) > 800
    assert failures == []
