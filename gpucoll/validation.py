"""The checks on a call of a communicator: at its entry, on its arguments, and (under
GPUCOLL_DEBUG=1) across ranks, all before any byte moves.

``entry`` guards every public call: it is refused in a forked child, and while another thread is
inside a call of the same communicator; a failure that ends the group dumps the flight recorder
(``gpucoll.dumps``). It lives here rather than in ``communicator`` so that the modules adding
calls to the Communicator (``uneven``, ``objects``, ``batch``, ``fused``, ``groups``) can guard
theirs the same way.

``Call`` checks the arguments of the public collectives, once. Every error is a ValueError or
TypeError whose message starts with ``Call.where`` (the op and this rank) and names the argument
and what was expected, so that a rank's mistake reads the same whatever backend runs underneath.

``SignatureCheck`` (GPUCOLL_DEBUG=1) checks that every rank makes the same call. Each rank
publishes the signature of its call (op, dtype, shape, root, reduce op, sequence number) under
its communicator's store namespace and reads everyone's; if they differ, every rank raises
``CollectiveMismatch`` naming who called what, instead of hanging or computing wrong data. A rank
deletes its own key two calls later: by then every rank has read it (a rank publishes call N only
after reading everything of call N-1).
"""

from __future__ import annotations

import functools
import json
import math
import operator
from collections.abc import Callable
from typing import Any

from gpucoll.arrays import ArrayRef, as_ref, check_dtype, empty_ref
from gpucoll.errors import CollectiveMismatch, GpucollError
from gpucoll.ops import ReduceOp, check_op_dtype, parse_op
from gpucoll.progress import ranks_text
from gpucoll.store import Liveness, fetch, share


# -- the guard at a call's entry ---------------------------------------------------------------
def entry(method: Callable) -> Callable:
    """A public call: refused in a forked child, and while another thread is inside a call.
    (A public method that hands off to a guarded ``_name`` is named ``name`` in messages.)"""
    name = method.__name__.lstrip("_")

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self._forked:
            raise self._in_child(name)
        if not self._entry.acquire(blocking=False):
            raise self._concurrent(name)
        self._inside = name
        try:
            return method(self, *args, **kwargs)
        except GpucollError as exc:
            self._flight.failed(exc)  # the flight recorder dumps on the group's first failure
            raise
        finally:
            self._entry.release()

    return call


# -- the arguments of a call -------------------------------------------------------------------
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

    def tag(self, value: Any, *, receiving: bool = False) -> int:
        """A message tag: an int in [0, 2**31) (a receive of an object may also pass ANY_TAG,
        -1); frame headers carry it in 32 bits."""
        tag = self.integer(value, "tag", expected="an int >= 0")
        if tag < 0 and not (receiving and tag == -1):
            raise self.fail(ValueError, f"tag={tag} is negative; expected an int >= 0"
                                        + (" or gpucoll.ANY_TAG" if receiving else ""))
        if tag >= 1 << 31:
            raise self.fail(ValueError, f"tag={tag} is too large; tags are below 2**31")
        return tag

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


# -- GPUCOLL_DEBUG=1: the same call on every rank ----------------------------------------------
# Signature fields a rank may leave unknown (None): scatter's non-roots without out= learn the
# slot's dtype and shape from the root.
_WILDCARD = ("dtype", "shape")


def describe(sig: dict[str, Any]) -> str:
    """``all_reduce(float32[4], op=sum)``: a call as a reader recognises it."""
    args = []
    dtype, shape = sig.get("dtype"), sig.get("shape")
    if dtype is not None or shape is not None:
        args.append(f"{dtype or '?'}{list(shape) if shape is not None else '[?]'}")
    for field in ("op", "root", "peer", "tiled", "color"):
        if sig.get(field) is not None:
            args.append(f"{field}={sig[field]}")
    return f"{sig['call']}({', '.join(args)})"


def compatible(a: dict[str, Any], b: dict[str, Any]) -> bool:
    for field in a.keys() | b.keys():
        va, vb = a.get(field), b.get(field)
        if va != vb and not (field in _WILDCARD and (va is None or vb is None)):
            return False
    return True


class SignatureCheck:
    """The debug check of one communicator; ``store`` is its namespace."""

    def __init__(self, store: Any, rank: int, size: int, liveness: Liveness | None = None):
        self.store, self.rank, self.size = store, rank, size
        self.liveness = liveness  # a rank that dies during a check is named at once
        self._channels: dict[str, int] = {}  # "src->dst" -> messages so far

    def collective(self, seq: int, sig: dict[str, Any], timeout: float, name: str) -> None:
        """Raise CollectiveMismatch unless all ranks call ``sig`` as their call ``seq``."""
        where = self._where(name)
        sig = {**sig, "seq": seq}
        keys = [f"debug/{seq}/{r}" for r in range(self.size)]
        sigs = self._exchange(keys, sig, timeout, name)
        if seq >= 2:
            self.store.delete_key(f"debug/{seq - 2}/{self.rank}")
        # every rank compares against the same signature: the root's, as rank 0 names it
        root = sigs[0].get("root")
        anchor = sigs[root] if isinstance(root, int) and 0 <= root < self.size else sigs[0]
        if all(compatible(anchor, s) for s in sigs):
            return
        calls: dict[str, list[int]] = {}
        for r, s in enumerate(sigs):
            calls.setdefault(describe(s), []).append(r)
        odd = [r for r, s in enumerate(sigs) if not compatible(anchor, s)]
        detail = "; ".join(f"{ranks_text(rs)} called {call}" for call, rs in calls.items())
        raise CollectiveMismatch(
            f"{where}: collective #{seq} differs across ranks ({ranks_text(odd)} "
            f"{'disagrees' if len(odd) == 1 else 'disagree'} with rank {sigs.index(anchor)}): "
            f"{detail}"
        )

    def point_to_point(self, peer: int, sending: bool, sig: dict[str, Any],
                       name: str) -> Callable[[float], None]:
        """Publish this side of a send/recv now; return the check to run just before the
        transfer (it waits for the peer's side, so async sends never block the issuing thread).

        Sends from one rank to another pair with the receiver's receives from it, in order.
        """
        src, dst = (self.rank, peer) if sending else (peer, self.rank)
        channel = f"{src}->{dst}"
        n = self._channels.get(channel, 0)
        self._channels[channel] = n + 1
        base = f"debug/p2p/{channel}/{n}"
        mine, theirs = (f"{base}/send", f"{base}/recv") if sending else (f"{base}/recv",
                                                                          f"{base}/send")
        self.store.set(mine, json.dumps(sig))

        def verify(timeout: float) -> None:
            other = json.loads(fetch(
                self.store, theirs, peer, timeout, what=name, rank=self.rank,
                absent=f"did not make the {'recv' if sending else 'send'} matching "
                       f"{describe(sig)} (GPUCOLL_DEBUG signature check)",
                liveness=self.liveness))
            if self.store.add(f"{base}/read", 1) == 2:  # both sides have read: clean up
                for key in (mine, theirs, f"{base}/read"):
                    self.store.delete_key(key)
            if other.get("tag", 0) != sig.get("tag", 0):
                raise CollectiveMismatch(
                    f"{self._where(name)}: message #{n} from rank {src} to rank {dst} does "
                    f"not match: rank {self.rank} called {describe(sig)} with tag "
                    f"{sig.get('tag', 0)}, rank {peer} called {describe(other)} with tag "
                    f"{other.get('tag', 0)} (arrays pair in order; tags must agree)")
            if other["dtype"] != sig["dtype"] or other["count"] != sig["count"]:
                raise CollectiveMismatch(
                    f"{self._where(name)}: message #{n} from rank {src} to rank {dst} does "
                    f"not match: rank {self.rank} called {describe(sig)} with {sig['count']} "
                    f"elements, rank {peer} called {describe(other)} with {other['count']} "
                    f"elements")

        return verify

    def _exchange(self, keys: list[str], sig: dict[str, Any], timeout: float,
                  name: str) -> list[dict[str, Any]]:
        values = share(self.store, keys, json.dumps(sig), timeout, what=name, rank=self.rank,
                       absent=f"did not make call {describe(sig)} (GPUCOLL_DEBUG signature "
                              f"check)", liveness=self.liveness)
        return [json.loads(v) for v in values]

    def _where(self, name: str) -> str:
        return f"{name} on rank {self.rank} of {self.size}"
