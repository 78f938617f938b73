"""The correctness pass knows each operation's exact output and counts every wrong element.

Outputs are simulated here with NumPy from the same inputs the ranks start with, so the
expected values are checked against an independent statement of each operation.
"""

from __future__ import annotations

import numpy as np
import pytest

from gpucoll.bench import engine
from gpucoll.bench.options import numpy_dtype

N = 3
REDUCE = {"sum": np.sum, "prod": np.prod, "min": np.min, "max": np.max}


def _inputs(op, count, dtype, redop="sum", root=0):
    return [engine.inputs(op, r, root, redop, count, dtype) for r in range(N)]


def _redop(op):
    return "sum" if op in ("all_reduce", "reduce", "reduce_scatter") else "none"


def _simulate(op, dtype, redop=None, root=1, slot=5):
    """Every rank's correct output for ``op`` on N ranks, from the check's inputs."""
    redop = redop or _redop(op)
    if op in ("all_reduce", "reduce", "broadcast", "sendrecv"):
        xs = _inputs(op, slot, dtype, redop, root)
    else:
        send = slot if op == "all_gather" else slot * N
        xs = _inputs(op, send, dtype, redop, root)
    stack = np.stack(xs)
    if op in ("all_reduce", "reduce"):
        red = REDUCE[redop](stack.astype(np.float64), axis=0).astype(dtype)
        return [red] * N
    if op == "broadcast":
        return [xs[root]] * N
    if op == "sendrecv":
        return [xs[(r - 1) % N] for r in range(N)]
    if op == "all_gather":
        return [stack.reshape(-1)] * N
    if op == "reduce_scatter":
        red = REDUCE[redop](stack.astype(np.float64), axis=0).astype(dtype)
        return [red[r * slot:(r + 1) * slot] for r in range(N)]
    if op == "all_to_all":
        return [np.concatenate([xs[j][r * slot:(r + 1) * slot] for j in range(N)])
                for r in range(N)]
    raise AssertionError(op)


OPS = ("all_reduce", "reduce", "broadcast", "sendrecv", "all_gather", "reduce_scatter",
       "all_to_all")


@pytest.mark.parametrize("op", OPS)
def test_correct_outputs_have_no_wrong_elements(op):
    dtype = numpy_dtype("float")
    for rank, got in enumerate(_simulate(op, dtype)):
        assert engine.wrong_elements(op, rank, N, 1, _redop(op), got) == 0, rank


@pytest.mark.parametrize("op", OPS)
def test_each_corrupted_element_is_counted(op):
    dtype = numpy_dtype("int32")
    outs = _simulate(op, dtype)
    rank = 1  # the root, so reduce's output is checked too
    got = outs[rank].copy()
    got[[0, -1]] += 1
    assert engine.wrong_elements(op, rank, N, 1, _redop(op), got) == 2


def test_data_from_the_wrong_rank_is_caught():
    outs = _simulate("all_gather", numpy_dtype("float"))
    swapped = outs[0].reshape(N, -1)[[1, 0, 2]].reshape(-1)
    assert engine.wrong_elements("all_gather", 0, N, 0, "none", swapped) > 0


def test_reduce_output_is_checked_on_root_only():
    junk = np.full(5, 7, np.float32)
    assert engine.wrong_elements("reduce", 0, N, 1, "sum", junk) == 0
    assert engine.wrong_elements("reduce", 1, N, 1, "sum", junk) > 0


@pytest.mark.parametrize("dtype", ["int8", "uint8", "half", "float", "double", "bfloat16",
                                   "int64"])
@pytest.mark.parametrize("redop", ["sum", "prod", "min", "max"])
def test_reductions_are_exact_in_every_type(dtype, redop):
    dt = numpy_dtype(dtype)
    outs = _simulate("all_reduce", dt, redop)
    assert engine.wrong_elements("all_reduce", 0, N, 0, redop, outs[0]) == 0


def test_avg_is_the_sum_divided_by_the_ranks():
    got = engine.reduced(N, np.arange(4), np.dtype(np.float32), "avg")
    want = sum(engine.values(r, np.arange(4), np.float32, "sum") for r in range(N)) / N
    np.testing.assert_allclose(got, want)


def test_bitwise_reductions_follow_numpy():
    idx = np.arange(64)
    want = np.bitwise_xor.reduce([engine.values(r, idx, np.int32, "bxor") for r in range(N)])
    np.testing.assert_array_equal(engine.reduced(N, idx, np.dtype(np.int32), "bxor"), want)


def test_half_precision_tolerates_rounding_but_not_a_wrong_value():
    exp = np.array([3.0, 1000.0], np.float64)
    close = np.array([3.0, 1000.5], np.float16)
    assert engine.count_wrong(close, exp, np.dtype(np.float16)) == 0
    assert engine.count_wrong(np.array([3.0, 1100.0], np.float16), exp, np.dtype(np.float16)) == 1


def test_nan_is_always_wrong():
    assert engine.count_wrong(np.array([np.nan], np.float32), np.array([1.0]),
                             np.dtype(np.float32)) == 1


def test_large_outputs_are_checked_in_chunks(monkeypatch):
    monkeypatch.setattr(engine, "CHUNK", 7)
    outs = _simulate("all_to_all", numpy_dtype("float"), slot=11)
    got = outs[2].copy()
    got[15] = -1
    assert engine.wrong_elements("all_to_all", 2, N, 0, "none", got) == 1
