"""How gpucoll's dtypes and reduce ops map onto NCCL's ``ncclDataType_t`` and ``ncclRedOp_t``.

The codes are nccl.h's (NCCL >= 2.10 for bfloat16) and equal nccl4py's ``NcclDataType`` and
``NcclRedOp``; a test checks both against the installed packages. Only dtypes gpucoll accepts
are listed (NCCL's fp8 types are not among them). nccl4py reads an NCCL datatype off the array it
is handed, so each plan also names the NumPy dtype of that array. What NCCL cannot reduce
natively is either carried exactly another way (complex sum/avg as float pairs; bitwise ops and
dtypes NCCL lacks through an all-gather and a local reduction) or refused with a TypeError
naming the op and dtype.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from gpucoll.ops import BITWISE, ReduceOp

# ncclDataType_t (nccl.h): NumPy / ml_dtypes name -> code
DTYPE_CODES: dict[str, int] = {
    "int8": 0,
    "uint8": 1,
    "int32": 2,
    "uint32": 3,
    "int64": 4,
    "uint64": 5,
    "float16": 6,
    "float32": 7,
    "float64": 8,
    "bfloat16": 9,
}

# ncclRedOp_t (nccl.h): note max is 2 and min is 3
OP_CODES: dict[ReduceOp, int] = {
    ReduceOp.SUM: 0,
    ReduceOp.PROD: 1,
    ReduceOp.MAX: 2,
    ReduceOp.MIN: 3,
    ReduceOp.AVG: 4,
}

_UINT8 = np.dtype(np.uint8)
# a complex number travels as two floats of this dtype
_COMPLEX_PARTS = {"complex64": np.dtype(np.float32), "complex128": np.dtype(np.float64)}


@dataclasses.dataclass(frozen=True, slots=True)
class Wire:
    """How a dtype travels: as ``factor`` elements of ``dtype`` (an NCCL type) per element."""

    dtype: np.dtype
    factor: int


@dataclasses.dataclass(frozen=True, slots=True)
class ReducePlan:
    """How a reduction runs: ``native`` with NCCL's ``op`` on ``factor``x the elements as
    ``dtype``, or (``native`` False) through an all-gather of ``dtype`` and a local reduction."""

    native: bool
    dtype: np.dtype
    op: int
    factor: int


@functools.lru_cache(maxsize=256)
def wire(dtype: np.dtype) -> Wire:
    """The NCCL type that moves ``dtype`` unchanged (movement only: any dtype can travel)."""
    name = dtype.name
    if name in DTYPE_CODES:
        return Wire(dtype, 1)
    if name in _COMPLEX_PARTS:
        return Wire(_COMPLEX_PARTS[name], 2)
    return Wire(_UINT8, dtype.itemsize)


@functools.lru_cache(maxsize=256)
def reduce_plan(op: ReduceOp, dtype: np.dtype, opname: str) -> ReducePlan:
    """How NCCL carries out ``op`` on ``dtype``; TypeError when it cannot do so honestly."""
    name = dtype.name
    if name in DTYPE_CODES and op in OP_CODES:
        return ReducePlan(True, dtype, OP_CODES[op], 1)
    if name in _COMPLEX_PARTS and op in (ReduceOp.SUM, ReduceOp.AVG):
        # (a+bi)+(c+di) is a componentwise sum, and so is the mean: exact as float pairs
        return ReducePlan(True, _COMPLEX_PARTS[name], OP_CODES[op], 2)
    if dtype.kind in "biu" and (op in BITWISE or op in OP_CODES):
        w = wire(dtype)
        return ReducePlan(False, w.dtype, -1, w.factor)
    raise TypeError(
        f"{opname}: the NCCL backend cannot apply op={op.value!r} to dtype {name} "
        "(NCCL has no such reduction and no exact substitute)"
    )
