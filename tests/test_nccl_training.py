"""The training calls through the NCCL backend, against the emulated NCCL (no GPU needed):
out-of-place forms, uneven collectives (both all-gather forms), objects staged through device
memory, batched point to point as one group, fused all_reduce, new_group and the monitored
barrier."""

from __future__ import annotations

import nccl_training_ranks as ranks
import pytest
from multiproc import spawn

pytestmark = pytest.mark.timeout(180)


def test_out_of_place_forms_read_x_and_write_out(store_addr):
    calls = spawn(ranks.out_of_place, 3, store_addr, timeout=150)
    assert "allreduce" in calls[0] and "reduce" in calls[0] and "broadcast" in calls[0]


def test_uneven_all_gather_is_a_group_of_broadcasts_for_small_buffers(store_addr):
    calls = spawn(ranks.uneven, 3, store_addr, "broadcasts", timeout=150)
    assert "allgather" not in calls[0] and calls[0].count("broadcast") == 2 * 3


def test_uneven_all_gather_as_a_group_of_sends_and_receives(store_addr):
    calls = spawn(ranks.uneven, 3, store_addr, "sends", timeout=150)
    assert "allgather" not in calls[0] and "broadcast" not in calls[0]


def test_uneven_all_gather_is_a_padded_all_gather_for_large_even_ones(store_addr):
    calls = spawn(ranks.uneven, 3, store_addr, "padded", timeout=150)
    assert calls[0].count("allgather") == 2  # the two all_gather_v calls


def test_objects_travel_through_device_buffers(store_addr):
    spawn(ranks.objects, 2, store_addr, timeout=150)


def test_a_batch_is_one_group_of_sends_and_receives(store_addr):
    calls = spawn(ranks.batched, 3, store_addr, timeout=150)
    assert calls[0].count("send") == 2 and calls[0].count("recv") == 2


def test_all_reduce_many_reduces_device_arrays_and_a_device_bucket(store_addr):
    calls = spawn(ranks.fused, 2, store_addr, timeout=150)
    assert calls[0].count("allreduce") == 7  # 6 arrays in one group, then the bucket


def test_new_group_and_monitored_barrier(store_addr):
    spawn(ranks.groups, 3, store_addr, timeout=150)
