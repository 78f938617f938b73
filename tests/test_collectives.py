"""Every collective x op x dtype x length matches NumPy, on 1 to 4 ranks and both transports.

One spawn per (world size, transport) runs the whole table of ``collective_cases`` and returns
a report per case; the tests below read that report, one collective per test.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from collective_cases import COLLECTIVES, cases, check, data, digest
from multiproc import spawn
from tiers import grid
from world_reports import WORLDS, assert_passed, table_reports, world_id

from gpucoll.arrays import dtype_from_name

BIT_IDENTICAL = [("float16", 7), ("bfloat16", 70001), ("float32", 70001), ("float64", 7),
                 ("complex64", 70001)]


def _run_table(rank: int, n: int, addr: str) -> dict:
    import gpucoll

    report = {}
    with gpucoll.init("ring", rank=rank, world_size=n, store=addr, timeout=15) as comm:
        report["transport"] = ("transport", sorted(set(comm._backend.links.values())))
        for case in cases(n):
            try:
                report[case.id] = (case.coll, check(comm, case))
            except Exception as exc:
                # reported; the ranks may be out of step now, so the rest of the table is not run
                report[case.id] = (case.coll, f"{type(exc).__name__}: {exc}")
                report["stopped"] = ("stopped", f"the table stopped at {case.id}")
                return report
        for dtype, count in BIT_IDENTICAL:  # values whose sums round differently by order
            x = np.random.default_rng(rank).standard_normal(count) * 1e3
            report[f"bits-{dtype}-{count}"] = ("bits", digest(comm.all_reduce(
                x.astype(dtype_from_name(dtype)))))
    return report


reports = functools.partial(table_reports, _run_table, timeout=300)  # (size, transport)


@pytest.mark.parametrize("world", WORLDS, ids=world_id)
@pytest.mark.parametrize("coll", COLLECTIVES)
def test_collective_matches_numpy_for_every_op_dtype_and_length(coll, world):
    assert_passed(reports(*world), coll)


@pytest.mark.parametrize("world", WORLDS, ids=world_id)
def test_every_case_of_the_table_ran(world):
    stopped = [f"rank {r}: {rep['stopped'][1]}" for r, rep in enumerate(reports(*world))
               if "stopped" in rep]
    assert not stopped, "\n".join(stopped)


@pytest.mark.parametrize("world", WORLDS[1:], ids=world_id)
def test_all_reduce_results_are_bit_identical_on_every_rank(world):
    per_rank = [{k: v for k, (kind, v) in report.items() if kind == "bits"}
                for report in reports(*world)]
    assert per_rank[0] and all(r == per_rank[0] for r in per_rank)


@pytest.mark.parametrize("world", WORLDS[1:], ids=world_id)
def test_the_forced_transport_carried_the_data(world):
    assert all(report["transport"][1] == [world[1]] for report in reports(*world))


def test_the_table_covers_every_collective_op_and_dtype():
    from collective_cases import OPS

    from gpucoll.arrays import SUPPORTED_DTYPES

    table = cases(3)
    reducing = {(c.coll, c.op, c.dtype) for c in table if c.op}
    assert len(reducing) == 3 * len(OPS) * len(SUPPORTED_DTYPES)
    assert {c.coll for c in table} == set(COLLECTIVES)
    assert {c.shape[0] for c in table if c.shape} >= {0, 1, 7, 70001}


def _big_all_reduce(rank: int, n: int, addr: str) -> list:
    import gpucoll

    count = (64 << 20) // 4 + 3  # just over 64 MiB of float32, odd length
    x = np.full(count, rank + 1, dtype=np.float32)
    x[0], x[-1] = -rank, 10 * rank
    with gpucoll.init("ring", rank=rank, world_size=n, store=addr, timeout=120) as comm:
        comm.all_reduce(x)
    want = np.full(count, n * (n + 1) // 2, dtype=np.float32)
    want[0], want[-1] = -sum(range(n)), 10 * sum(range(n))
    return int(np.count_nonzero(x != want))


@pytest.mark.slow
@pytest.mark.parametrize("transport", grid(["shm", "tcp"], "shm"))
def test_all_reduce_over_64_mib_is_exact(transport, store_addr):
    results = spawn(_big_all_reduce, 2, store_addr, timeout=240,
                    env={"GPUCOLL_TRANSPORT": transport})
    assert results == [0, 0]


def test_inputs_differ_between_ranks():
    from collective_cases import Case

    case = Case("all_reduce", "float32", (7,), "sum")
    assert not np.array_equal(data(case, 0, (7,)), data(case, 1, (7,)))
