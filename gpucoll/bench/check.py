"""The correctness pass: known inputs per rank, the exact expected output, wrong-element counts.

Inputs are small integers chosen per operator so that every rank's result is exact in any
dtype (sums of 1..5, products of 1s and 2s, bit patterns below 128); floating results are still
compared with a tolerance of a few units in the last place of the dtype, because ``avg`` divides.
Expected values are computed chunk by chunk, so checking a large buffer needs little memory.
"""

from __future__ import annotations

import numpy as np

from gpucoll.ops import ReduceOp, host_ufunc, is_floating

CHUNK = 1 << 20  # elements compared at a time
SENTINEL = 121  # written to outputs before a check; never an expected value's only source


def values(rank, index: np.ndarray, dtype: np.dtype, redop: str) -> np.ndarray:
    """The input element ``index`` of ``rank`` (either may be an array) for this operator."""
    index = np.asarray(index, dtype=np.int64)
    if redop in ("sum", "avg", "min", "max"):
        v = (index + rank) % 5 + 1
    elif redop == "prod":
        v = (index + rank) % 2 + 1
    elif redop in ("band", "bor", "bxor"):
        v = (index * 31 + np.asarray(rank) * 17 + 5) & 0x7F
    else:  # data movement: values that tell ranks and positions apart
        v = ((index % 61) * 3 + np.asarray(rank) * 7) % 113 + 1
    return v.astype(dtype)


def reduced(nranks: int, index: np.ndarray, dtype: np.dtype, redop: str) -> np.ndarray:
    """The reduction over all ranks of ``values(r, index)``, exactly as the dtype holds it."""
    op = ReduceOp(redop)
    work = _work_dtype(dtype)
    acc = values(0, index, dtype, redop).astype(work)
    ufunc = host_ufunc(op)
    for r in range(1, nranks):
        ufunc(acc, values(r, index, dtype, redop).astype(work), out=acc)
    if op is ReduceOp.AVG:
        acc = acc / nranks
    return acc


def _work_dtype(dtype: np.dtype) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype.kind == "c":
        return np.dtype(np.complex128)
    if is_floating(dtype):
        return np.dtype(np.float64)
    return dtype  # integers wrap the same way in any order


def tolerance(dtype: np.dtype) -> float:
    """Relative error allowed for a floating dtype (0 for integers)."""
    dtype = np.dtype(dtype)
    if not (is_floating(dtype) or dtype.kind == "c"):
        return 0.0
    return {2: 1e-2, 4: 1e-5, 8: 1e-12, 16: 1e-5}.get(dtype.itemsize, 1e-12)


def count_wrong(got: np.ndarray, expected: np.ndarray, dtype: np.dtype) -> int:
    """Elements of ``got`` that differ from ``expected`` beyond the dtype's tolerance."""
    tol = tolerance(dtype)
    if tol == 0.0:
        return int(np.count_nonzero(got != expected))
    work = _work_dtype(dtype)
    g = got.astype(work)
    e = np.asarray(expected).astype(work)
    bad = ~(np.abs(g - e) <= tol * np.maximum(1.0, np.abs(e)))
    return int(np.count_nonzero(bad))


def inputs(op: str, rank: int, root: int, redop: str, count: int, dtype: np.dtype) -> np.ndarray:
    """The send buffer rank ``rank`` starts the check with (``count`` elements)."""
    if op == "broadcast":
        rank = root if rank == root else rank + 1000  # only root's data may arrive
    return values(rank, np.arange(count), dtype, redop)


def expected(op: str, rank: int, nranks: int, root: int, redop: str, dtype: np.dtype,
             recv_count: int, start: int, count: int) -> np.ndarray | None:
    """Elements ``start:start+count`` of rank ``rank``'s output; None where none is defined."""
    idx = np.arange(start, start + count, dtype=np.int64)
    slot = recv_count // nranks if op in ("all_gather", "all_to_all") else recv_count
    if op == "all_reduce":
        return reduced(nranks, idx, dtype, redop)
    if op == "reduce":
        return reduced(nranks, idx, dtype, redop) if rank == root else None
    if op == "reduce_scatter":
        return reduced(nranks, rank * recv_count + idx, dtype, redop)
    if op == "broadcast":
        return values(root, idx, dtype, redop)
    if op == "all_gather":
        return values(idx // slot, idx % slot, dtype, redop)
    if op == "all_to_all":
        return values(idx // slot, rank * slot + idx % slot, dtype, redop)
    if op == "sendrecv":
        return values((rank - 1) % nranks, idx, dtype, redop)
    raise ValueError(f"no expected output for operation {op!r}")


def wrong_elements(op: str, rank: int, nranks: int, root: int, redop: str,
                   got: np.ndarray) -> int:
    """Count wrong elements of one rank's whole output buffer ``got`` (a host array)."""
    wrong = 0
    for start in range(0, got.size, CHUNK):
        count = min(CHUNK, got.size - start)
        want = expected(op, rank, nranks, root, redop, got.dtype, got.size, start, count)
        if want is not None:
            wrong += count_wrong(got[start:start + count], want, got.dtype)
    return wrong
