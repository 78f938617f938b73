"""Argument checks of the public collectives, run once before any byte moves.

Every error is a ValueError or TypeError whose message starts with ``Call.where`` (the op and
this rank) and names the argument and what was expected, so that a rank's mistake reads the same
whatever backend runs underneath.
"""

from __future__ import annotations

import math
import operator
from typing import Any

from gpucoll.arrays import ArrayRef, as_ref, check_dtype, empty_ref
from gpucoll.ops import ReduceOp, check_op_dtype, parse_op

# (op as passed, dtype) -> ReduceOp, for pairs already found valid (the dtype supported too):
# the check is per call, and the communicator's lean path needs nothing more
VALID_OPS: dict[tuple[Any, Any], ReduceOp] = {}


class Call:
    """One public call being checked: knows the op's name and where it runs, for messages."""

    __slots__ = ("name", "rank", "size")

    def __init__(self, name: str, rank: int, size: int):
        self.name, self.rank, self.size = name, rank, size

    @property
    def where(self) -> str:
        return f"{self.name} on rank {self.rank} of {self.size}"

    def fail(self, kind: type[Exception], what: str) -> Exception:
        return kind(f"{self.where}: {what}")

    def op(self, op: Any, dtype) -> ReduceOp:
        """The ReduceOp for ``op``, checked against ``dtype`` (bitwise, avg and order rules)."""
        try:
            return VALID_OPS[op, dtype]
        except (KeyError, TypeError):  # TypeError: an unhashable op, refused below
            pass
        try:
            parsed = parse_op(op)
            check_op_dtype(parsed, dtype, self.where)
        except ValueError as exc:
            raise self.fail(ValueError, str(exc)) from None
        if isinstance(op, str):
            VALID_OPS[op, dtype] = parsed
        return parsed

    def integer(self, value: Any, name: str, *, expected: str = "an int") -> int:
        """``value`` as a Python int: any integral type (int, np.int64, ...) but bool."""
        if isinstance(value, bool) or not hasattr(type(value), "__index__"):
            raise self.fail(TypeError, f"{name} must be {expected}, got {type(value).__name__}")
        return operator.index(value)

    def rank_arg(self, value: Any, name: str) -> int:
        """A rank number in [0, size); ``name`` is root, src or dst."""
        if isinstance(value, bool) or not hasattr(type(value), "__index__"):
            raise self.fail(TypeError, f"{name} must be an int rank, got {type(value).__name__}")
        value = operator.index(value)
        if not 0 <= value < self.size:
            raise self.fail(
                ValueError, f"{name}={value} is out of range; expected 0 <= {name} < {self.size}"
            )
        return value

    def peer(self, value: Any, name: str) -> int:
        """A rank other than this one, for send and recv."""
        value = self.rank_arg(value, name)
        if value == self.rank:
            raise self.fail(ValueError, f"{name}={value} is this rank; send/recv need another rank")
        return value

    def timeout(self, value: Any, default: float) -> float:
        if value is None:
            return default
        return check_timeout(value, "timeout", self.where)

    def array(self, obj: Any, name: str, *, writable: bool = False,
              copy: bool = True) -> ArrayRef:
        """``obj`` as a contiguous reference of a supported dtype; a strided ``obj`` is copied
        when ``copy``, else refused."""
        try:
            ref = as_ref(obj, name, copy=copy)
            check_dtype(ref.dtype, name)
        except (TypeError, ValueError, MemoryError) as exc:
            raise self.fail(type(exc), str(exc)) from None
        if writable and not ref.writable:
            raise self.fail(ValueError, f"{name} is read-only; this op writes its result into it")
        return ref

    def output(self, out: Any, like: ArrayRef, shape: tuple[int, ...],
               inputs: tuple[ArrayRef, ...] = ()) -> ArrayRef:
        """The result buffer: the caller's ``out`` checked against the expected shape and
        dtype, or a new array like ``like``."""
        if out is None:
            return empty_ref(like, shape)
        try:
            ref = as_ref(out, "out")
        except (TypeError, ValueError) as exc:
            raise self.fail(type(exc), str(exc)) from None
        if ref.dtype != like.dtype:
            raise self.fail(TypeError, f"out has dtype {ref.dtype.name}, expected "
                                       f"{like.dtype.name} (the dtype of the input)")
        if tuple(ref.shape) != shape:
            raise self.fail(ValueError, f"out has shape {tuple(ref.shape)}, expected {shape}")
        if not ref.writable:
            raise self.fail(ValueError, "out is read-only")
        for other in inputs:
            if overlaps(ref, other):
                raise self.fail(ValueError, "out shares memory with the input; pass a separate "
                                            "buffer")
        return ref

    def slots(self, ref: ArrayRef, name: str, tiled: bool) -> tuple[int, ...]:
        """The shape of one rank's slot of ``ref``: its leading axis must hold ``size`` slots
        (or, ``tiled``, a multiple of ``size`` rows)."""
        shape = tuple(ref.shape)
        if not shape:
            raise self.fail(ValueError, f"{name} is 0-d; expected a leading axis of {self.size} "
                                        f"slots, one per rank")
        if not tiled:
            if shape[0] != self.size:
                raise self.fail(ValueError, f"{name} has shape {shape}: its leading axis must "
                                            f"have one slot per rank ({self.size}), got "
                                            f"{shape[0]} (tiled=True splits axis 0 instead)")
            return shape[1:]
        if shape[0] % self.size:
            raise self.fail(ValueError, f"{name} has shape {shape}: with tiled=True its leading "
                                        f"axis must be a multiple of the world size "
                                        f"{self.size}")
        return (shape[0] // self.size,) + shape[1:]

    def stacked(self, shape: tuple[int, ...], tiled: bool, name: str = "x") -> tuple[int, ...]:
        """The shape of ``size`` slots of ``shape`` (stacked on a new axis, or ``tiled``)."""
        if not tiled:
            return (self.size,) + shape
        if not shape:
            raise self.fail(ValueError, f"{name} is 0-d; tiled=True concatenates along axis 0, "
                                        f"which it does not have")
        return (self.size * shape[0],) + shape[1:]


def check_timeout(value: Any, name: str, where: str) -> float:
    """A positive, finite number of seconds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{where}: {name} must be a number of seconds, got {type(value).__name__}")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{where}: {name} must be a positive finite number of seconds, "
                         f"got {value!r}")
    return float(value)


def overlaps(a: ArrayRef, b: ArrayRef) -> bool:
    """True when two non-empty buffers of the same kind share any byte."""
    if a.kind != b.kind or not a.nbytes or not b.nbytes:
        return False
    return a.ptr < b.ptr + b.nbytes and b.ptr < a.ptr + a.nbytes
