"""The correctness matrix: every collective x op x dtype x length, and its NumPy reference.

A case is a small tuple every rank builds identically from the world size alone. A rank's input
for a case is a pure function of (case, rank), so each rank computes the expected result on its
own. Values are small integers (floats too), so sums and products are exact in any order and
results are compared for equality, not closeness.
"""

from __future__ import annotations

import functools
import hashlib
import zlib
from typing import NamedTuple

import numpy as np

from gpucoll.arrays import SUPPORTED_DTYPES, dtype_from_name
from gpucoll.ops import ReduceOp, check_op_dtype, host_ufunc

OPS = tuple(o.value for o in ReduceOp)
REDUCING = ("all_reduce", "reduce", "reduce_scatter")
MOVING = ("broadcast", "all_gather", "gather", "scatter", "all_to_all", "send_recv")
COLLECTIVES = REDUCING + MOVING
# 0 and 1 element, odd lengths, and one above 64 KiB for every dtype (the large-message path)
LENGTHS = (0, 1, 7, 70001)
OTHER_OP_LENGTHS = (7, 70001)


class Case(NamedTuple):
    coll: str
    dtype: str
    shape: tuple  # x's shape (per slot for slot-per-rank ops)
    op: str | None = None
    root: int = 0
    tiled: bool = False
    variant: str = ""  # scatter: "none" (non-roots pass None) or "out"

    @property
    def id(self) -> str:
        parts = [self.coll, self.dtype, "x".join(map(str, self.shape)) or "0d"]
        if self.op:
            parts.append(self.op)
        if self.coll in ("reduce", "broadcast", "gather", "scatter"):
            parts.append(f"root{self.root}")
        if self.tiled:
            parts.append("tiled")
        if self.variant:
            parts.append(self.variant)
        return "-".join(parts)

    def valid(self) -> bool:
        if self.op is None:
            return True
        try:
            check_op_dtype(ReduceOp(self.op), dtype_from_name(self.dtype), self.coll)
        except TypeError:
            return False
        return True


def cases(size: int) -> list[Case]:
    """The whole table for one world size."""
    table = []
    for coll in REDUCING:
        for op in OPS:
            for dtype in SUPPORTED_DTYPES:
                probe = Case(coll, dtype, (7,), op, size - 1)
                lengths = (LENGTHS if op == "sum" else OTHER_OP_LENGTHS) if probe.valid() else (7,)
                table += [probe._replace(shape=(n,)) for n in lengths]
        table.append(Case(coll, "float32", (3, 5), "sum", 0))
        table.append(Case(coll, "int32", (3, 5), "max", size // 2, tiled=coll == "reduce_scatter"))
    table.append(Case("all_reduce", "float64", (), "sum"))
    for dtype in SUPPORTED_DTYPES:
        for n in LENGTHS:
            table += [
                Case("broadcast", dtype, (n,), root=size - 1),
                Case("all_gather", dtype, (n,)),
                Case("all_gather", dtype, (n, 1), tiled=True),
                Case("gather", dtype, (n,), root=size - 1),
                Case("scatter", dtype, (n,), root=size - 1, variant="none"),
                Case("scatter", dtype, (n,), root=0, tiled=True, variant="out"),
                Case("all_to_all", dtype, (n,)),
                Case("all_to_all", dtype, (n, 2), tiled=True),
                Case("send_recv", dtype, (n,)),
            ]
    table += [Case("broadcast", "int16", (2, 3, 4), root=size // 2),
              Case("gather", "complex64", (3, 2), root=0, tiled=True)]
    return table


def data(case: Case, rank: int, shape: tuple) -> np.ndarray:
    """Rank ``rank``'s input for ``case``: small integers, full range for integer dtypes."""
    dtype = dtype_from_name(case.dtype)
    rng = np.random.default_rng([zlib.crc32(case.id.encode()), rank])
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    values = rng.integers(-3, 4, shape)
    if dtype.kind == "c":
        values = values + 1j * rng.integers(-3, 4, shape)
    return values.astype(dtype)


def reduced(case: Case, arrays: list[np.ndarray]) -> np.ndarray:
    """The reference reduction of ``arrays`` with the case's op."""
    ufunc = host_ufunc(ReduceOp(case.op))
    acc = functools.reduce(lambda a, b: ufunc(a, b), arrays).copy()
    if case.op == "avg":
        np.divide(acc, len(arrays), out=acc, casting="unsafe")
    return acc


def slots_shape(case: Case, size: int) -> tuple:
    """x's shape for slot-per-rank inputs: a leading axis of ``size`` (or ``size`` tiles)."""
    if case.tiled:
        return (size * case.shape[0],) + case.shape[1:]
    return (size,) + case.shape


def blocks(arr: np.ndarray, size: int, tiled: bool) -> list[np.ndarray]:
    """Rank i's slot of a slot-per-rank array (or its i-th tile)."""
    return np.split(arr, size) if tiled else list(arr)


def run(comm, case: Case) -> np.ndarray | None:
    """Make this rank's call for ``case``; returns the result (None where there is none)."""
    r, n = comm.rank, comm.size
    if case.coll in ("all_reduce", "reduce"):
        x = data(case, r, case.shape)
        call = getattr(comm, case.coll)
        return call(x, op=case.op) if case.coll == "all_reduce" else call(x, case.root, case.op)
    if case.coll == "reduce_scatter":
        return comm.reduce_scatter(data(case, r, slots_shape(case, n)), case.op, tiled=case.tiled)
    if case.coll == "broadcast":
        x = data(case, r, case.shape) if r == case.root else np.zeros(case.shape,
                                                                     dtype_from_name(case.dtype))
        return comm.broadcast(x, case.root)
    if case.coll == "all_gather":
        return comm.all_gather(data(case, r, case.shape), tiled=case.tiled)
    if case.coll == "gather":
        return comm.gather(data(case, r, case.shape), case.root, tiled=case.tiled)
    if case.coll == "scatter":
        return _scatter(comm, case)
    if case.coll == "all_to_all":
        return comm.all_to_all(data(case, r, slots_shape(case, n)), tiled=case.tiled)
    return _send_recv(comm, case)


def _scatter(comm, case: Case) -> np.ndarray:
    n = comm.size
    if comm.rank == case.root:
        return comm.scatter(data(case, case.root, slots_shape(case, n)), case.root,
                            tiled=case.tiled)
    if case.variant == "out":
        out = np.empty(case.shape, dtype_from_name(case.dtype))
        assert comm.scatter(None, case.root, tiled=case.tiled, out=out) is out
        return out
    return comm.scatter(None, case.root, tiled=case.tiled)


def _send_recv(comm, case: Case) -> np.ndarray:
    """Each rank sends to the next and receives from the previous one."""
    r, n = comm.rank, comm.size
    got = np.zeros(case.shape, dtype_from_name(case.dtype))
    if n == 1:
        return data(case, 0, case.shape)
    work = comm.send(data(case, r, case.shape), (r + 1) % n, async_op=True)
    comm.recv(got, (r - 1) % n)
    work.wait()
    return got


def expected(case: Case, rank: int, size: int) -> np.ndarray | None:
    """What ``run`` must return on ``rank``."""
    if case.coll in ("all_reduce", "reduce"):
        if case.coll == "reduce" and rank != case.root:
            return data(case, rank, case.shape)  # left as it was
        return reduced(case, [data(case, j, case.shape) for j in range(size)])
    if case.coll == "reduce_scatter":
        whole = reduced(case, [data(case, j, slots_shape(case, size)) for j in range(size)])
        return blocks(whole, size, case.tiled)[rank]
    if case.coll == "broadcast":
        return data(case, case.root, case.shape)
    if case.coll in ("all_gather", "gather"):
        if case.coll == "gather" and rank != case.root:
            return None
        parts = [data(case, j, case.shape) for j in range(size)]
        return np.concatenate(parts) if case.tiled else np.stack(parts)
    if case.coll == "scatter":
        return blocks(data(case, case.root, slots_shape(case, size)), size, case.tiled)[rank]
    if case.coll == "all_to_all":
        return np.stack([blocks(data(case, j, slots_shape(case, size)), size, case.tiled)[rank]
                         for j in range(size)]).reshape(slots_shape(case, size))
    return data(case, (rank - 1) % size, case.shape)


def check(comm, case: Case) -> str | None:
    """Run ``case`` on this rank; None if it behaved, else what went wrong."""
    if not case.valid():
        try:
            run(comm, case)
        except TypeError as exc:
            return None if f"op={case.op!r}" in str(exc) else f"wrong TypeError: {exc}"
        return "accepted a meaningless op/dtype pair"
    got = run(comm, case)
    want = expected(case, comm.rank, comm.size)
    if want is None:
        return None if got is None else f"expected None, got {got!r}"
    if got is None or got.dtype != want.dtype or got.shape != want.shape:
        what = None if got is None else (got.dtype, got.shape)
        return f"expected {want.dtype}{want.shape}, got {what}"
    if not np.array_equal(got, want):
        bad = np.flatnonzero(got.reshape(-1) != want.reshape(-1))[:5]
        return (f"values differ at flat indices {bad.tolist()}: got "
                f"{got.reshape(-1)[bad].tolist()}, expected {want.reshape(-1)[bad].tolist()}")
    return None


def digest(arr: np.ndarray) -> str:
    return hashlib.sha256(arr.tobytes()).hexdigest()[:16]
