"""The training calls (out-of-place forms, uneven collectives, objects, fused all_reduce,
batched point to point, new_group, monitored_barrier) match NumPy on 1 to 4 ranks over both
transports.

One spawn per (world size, transport) runs every case of ``training_cases``; the tests below
read its report, one topic per test.
"""

from __future__ import annotations

import functools

import pytest
import training_cases
from world_reports import WORLDS, assert_passed, table_reports, world_id

pytestmark = pytest.mark.timeout(600)

TOPICS = sorted({topic for topic, _, _ in training_cases.CASES})


def _run(rank: int, n: int, addr: str) -> dict:
    import gpucoll

    with gpucoll.init("ring", rank=rank, world_size=n, store=addr, timeout=60) as comm:
        report = training_cases.run(comm)
        report["links"] = ("links", sorted(set(comm._backend.links.values())))
        return report


reports = functools.partial(table_reports, _run, timeout=500)  # (size, transport)


@pytest.mark.parametrize("world", WORLDS, ids=world_id)
@pytest.mark.parametrize("topic", TOPICS)
def test_training_calls_match_numpy(topic, world):
    assert_passed(reports(*world), topic, most=20)


@pytest.mark.parametrize("world", WORLDS, ids=world_id)
def test_every_training_case_ran_on_the_transport_asked_for(world):
    for rank, report in enumerate(reports(*world)):
        assert "stopped" not in report, f"rank {rank}: {report['stopped'][1]}"
        assert len([k for k, (t, _) in report.items() if t not in ("links",)]) == len(
            training_cases.CASES)
        if world[0] > 1:
            assert report["links"][1] == [world[1]]
