"""Bandwidths as nccl-tests' doc/PERFORMANCE.md defines them: algbw = S/t, busbw = algbw * factor.

Factors from its summary: AllReduce 2(n-1)/n, ReduceScatter, AllGather and AlltoAll (n-1)/n,
Broadcast and Reduce 1; SendRecv reports algbw as busbw. S is the total array for AllGather
(sendcount * n) and ReduceScatter (recvcount * n).
"""

from __future__ import annotations

import pytest

from gpucoll.bench.options import OPS, bandwidths, bus_factor

FACTORS = {  # op -> {ranks: factor}, values worked out by hand from PERFORMANCE.md
    "all_reduce": {1: 0.0, 2: 1.0, 4: 1.5, 8: 1.75},
    "reduce_scatter": {1: 0.0, 2: 0.5, 4: 0.75, 8: 0.875},
    "all_gather": {1: 0.0, 2: 0.5, 4: 0.75, 8: 0.875},
    "all_to_all": {1: 0.0, 2: 0.5, 4: 0.75, 8: 0.875},
    "broadcast": {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0},
    "reduce": {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0},
    "sendrecv": {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0},
}


@pytest.mark.parametrize("op", sorted(FACTORS))
def test_bus_factor_matches_nccl_tests_summary(op):
    for ranks, factor in FACTORS[op].items():
        assert bus_factor(op, ranks) == pytest.approx(factor)


def test_every_benchmarked_op_has_a_checked_factor():
    assert set(OPS) == set(FACTORS)


def test_algbw_is_bytes_over_seconds_in_decimal_gigabytes():
    algbw, busbw = bandwidths("broadcast", 2_000_000_000, 4.0, 8)
    assert (algbw, busbw) == (0.5, 0.5)


def test_all_reduce_busbw_on_four_ranks_is_one_and_a_half_algbw():
    algbw, busbw = bandwidths("all_reduce", 32 << 20, 0.01, 4)
    assert algbw == pytest.approx((32 << 20) / 0.01 / 1e9)
    assert busbw == pytest.approx(algbw * 1.5)


def test_zero_time_reports_zero_bandwidth_not_infinity():
    assert bandwidths("all_reduce", 8, 0.0, 2) == (0.0, 0.0)


def test_all_gather_size_is_the_whole_output_of_all_ranks():
    spec = OPS["all_gather"]
    assert spec.counts(1 << 20, 4, 4) == (65536, 262144)  # per-rank send, total receive
    assert spec.size_bytes(1 << 20, 4, 4) == 1 << 20


def test_reduce_scatter_size_is_the_whole_input_and_each_rank_gets_one_slot():
    spec = OPS["reduce_scatter"]
    assert spec.counts(1 << 20, 4, 4) == (262144, 65536)
    assert spec.size_bytes(1 << 20, 4, 4) == 1 << 20


def test_slotted_sizes_round_down_to_whole_elements_per_rank():
    # 1000 B of float on 3 ranks: 250 elements -> 83 per rank -> 249 in all
    assert OPS["all_gather"].counts(1000, 4, 3) == (83, 249)
    assert OPS["all_gather"].size_bytes(1000, 4, 3) == 996
    assert OPS["all_to_all"].counts(1000, 4, 3) == (249, 249)


def test_unslotted_sizes_round_down_to_whole_elements_only():
    assert OPS["all_reduce"].counts(10, 4, 3) == (2, 2)
    assert OPS["sendrecv"].size_bytes(10, 4, 3) == 8


def test_bus_factor_refuses_an_empty_world():
    with pytest.raises(ValueError, match="nranks=0"):
        bus_factor("all_reduce", 0)
