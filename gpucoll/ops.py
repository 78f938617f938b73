"""Reduction operators: the names users pass, which dtypes each accepts, and their NumPy form.

The rules live here once so that every backend rejects the same inputs with the same words;
each backend keeps its own table from ``ReduceOp`` to native codes.
"""

from __future__ import annotations

import enum

import numpy as np


class ReduceOp(str, enum.Enum):
    """How a reducing collective combines the ranks' values."""

    SUM = "sum"
    PROD = "prod"
    MIN = "min"
    MAX = "max"
    AVG = "avg"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"

    def __str__(self) -> str:
        return self.value


BITWISE = frozenset({ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR})
ORDERED = frozenset({ReduceOp.MIN, ReduceOp.MAX})


def parse_op(op: str | ReduceOp) -> ReduceOp:
    """Turn ``"sum"``, ``"SUM"`` or ``ReduceOp.SUM`` into a ``ReduceOp``; ValueError otherwise."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str):
        try:
            return ReduceOp(op.lower())
        except ValueError:
            pass
    names = " ".join(repr(o.value) for o in ReduceOp)
    raise ValueError(f"op={op!r} is not a reduce op; expected one of {names} or gpucoll.ReduceOp")


def dtype_name(dtype: np.dtype) -> str:
    return np.dtype(dtype).name


def is_bfloat16(dtype: np.dtype) -> bool:
    return np.dtype(dtype).name == "bfloat16"


def is_floating(dtype: np.dtype) -> bool:
    """True for IEEE floats including ml_dtypes' bfloat16 (which NumPy files under kind 'V')."""
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or is_bfloat16(dtype)


def check_op_dtype(op: ReduceOp, dtype: np.dtype, opname: str) -> None:
    """Raise TypeError naming the op and dtype when ``op`` is meaningless on ``dtype``.

    Bitwise ops need integer or bool dtypes, ``avg`` floating or complex ones, and ``min``/``max``
    an ordered (non-complex) dtype.
    """
    dtype = np.dtype(dtype)
    kind = dtype.kind
    if op in BITWISE and kind not in "biu":
        raise TypeError(
            f"{opname}: op={op.value!r} needs an integer or bool dtype, got {dtype.name}"
        )
    if op is ReduceOp.AVG and not (is_floating(dtype) or kind == "c"):
        raise TypeError(f"{opname}: op='avg' needs a floating or complex dtype, got {dtype.name}")
    if op in ORDERED and kind == "c":
        raise TypeError(f"{opname}: op={op.value!r} is undefined on complex dtype {dtype.name}")


_UFUNCS = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,  # summed, then divided once by the world size
    ReduceOp.PROD: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}


def host_ufunc(op: ReduceOp) -> np.ufunc:
    """The NumPy ufunc that combines two operands for ``op`` (``avg`` combines as a sum)."""
    return _UFUNCS[op]


try:  # NumPy 2: the error state is a context variable, cheap to swap per call
    from numpy._core.umath import _extobj_contextvar as _FP_STATE
    from numpy._core.umath import _make_extobj
except ImportError:  # pragma: no cover - older NumPy
    _FP_STATE = None
_quiet_states: dict = {}  # the caller's error state -> the same with over/invalid ignored


def fp_quiet() -> object:
    """Enter ``np.errstate(over="ignore", invalid="ignore")`` for a reduction; returns the token
    for ``fp_restore``. Overflow to inf (or NaN from inf - inf) is the IEEE answer, as on a GPU,
    and NumPy's warning about it would point into this package. Building NumPy's error state
    costs over a microsecond per call, so the quiet variant of each state seen is kept."""
    if _FP_STATE is None:
        state = np.errstate(over="ignore", invalid="ignore")
        state.__enter__()
        return state
    current = _FP_STATE.get()
    quiet = _quiet_states.get(current)
    if quiet is None:
        if len(_quiet_states) > 64:  # each np.errstate block of the caller's makes a new state
            _quiet_states.clear()
        quiet = _quiet_states[current] = _make_extobj(over="ignore", invalid="ignore")
    return _FP_STATE.set(quiet)


def fp_restore(token: object) -> None:
    """Leave the error state ``fp_quiet`` entered."""
    if _FP_STATE is None:
        token.__exit__(None, None, None)
    else:
        _FP_STATE.reset(token)


def finish_avg(x: np.ndarray, size: int) -> None:
    """Turn a sum over ``size`` ranks into their mean, in place."""
    np.divide(x, size, out=x, casting="unsafe")
