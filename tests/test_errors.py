"""Bad arguments: a ValueError/TypeError naming the op, this rank, the argument and what was
expected, raised before anything reaches the backend, and the communicator still works."""

import numpy as np
import pytest
from recording import recording_comm

X = np.arange(8, dtype=np.float32)
SLOTS = np.zeros((4, 2), dtype=np.float32)  # one slot per rank of a 4-rank group


def _read_only():
    x = np.zeros(4, dtype=np.float32)
    x.flags.writeable = False
    return x


# (what, call on a communicator that is rank 1 of 4, error type, message pattern)
BAD_CALLS = [
    ("root past the last rank", lambda c: c.broadcast(X.copy(), root=4), ValueError,
     r"broadcast on rank 1 of 4: root=4 is out of range; expected 0 <= root < 4"),
    ("negative root", lambda c: c.reduce(X.copy(), root=-1), ValueError,
     r"reduce on rank 1 of 4: root=-1 is out of range"),
    ("root not an int", lambda c: c.gather(X, root="0"), TypeError,
     r"gather on rank 1 of 4: root must be an int rank, got str"),
    ("slots not matching the world size", lambda c: c.reduce_scatter(np.zeros((3, 2))),
     ValueError, r"reduce_scatter on rank 1 of 4: x has shape \(3, 2\): its leading axis must "
                 r"have one slot per rank \(4\), got 3"),
    ("tiled rows not a multiple of the world size",
     lambda c: c.all_to_all(np.zeros(6), tiled=True), ValueError,
     r"all_to_all on rank 1 of 4: .*multiple of the world size 4"),
    ("scatter root's slots not matching", lambda c: c.scatter(np.zeros((2, 3)), root=1),
     ValueError, r"scatter on rank 1 of 4: x has shape \(2, 3\)"),
    ("0-d input where slots are needed", lambda c: c.reduce_scatter(np.array(1.0)),
     ValueError, r"reduce_scatter on rank 1 of 4: x is 0-d"),
    ("unsupported dtype", lambda c: c.all_reduce(np.array(["a", "b"])), TypeError,
     r"all_reduce on rank 1 of 4: x has unsupported dtype str\d*; expected"),
    ("object dtype", lambda c: c.all_gather(np.array([object()])), TypeError,
     r"all_gather on rank 1 of 4: x has unsupported dtype object"),
    ("out dtype differs from x", lambda c: c.all_gather(X, out=np.zeros((4, 8))), TypeError,
     r"all_gather on rank 1 of 4: out has dtype float64, expected float32"),
    ("out shape differs", lambda c: c.all_gather(X, out=np.zeros((3, 8), np.float32)),
     ValueError, r"all_gather on rank 1 of 4: out has shape \(3, 8\), expected \(4, 8\)"),
    ("tiled out shape differs",
     lambda c: c.all_gather(X, tiled=True, out=np.zeros((4, 8), np.float32)), ValueError,
     r"out has shape \(4, 8\), expected \(32,\)"),
    ("non-contiguous out",
     lambda c: c.reduce_scatter(SLOTS, out=np.zeros((2, 2), np.float32)[:, 0]), ValueError,
     r"reduce_scatter on rank 1 of 4: out must be C-contiguous"),
    ("out overlapping x", lambda c: c.all_to_all(SLOTS, out=SLOTS), ValueError,
     r"all_to_all on rank 1 of 4: out shares memory with the input"),
    ("a list", lambda c: c.all_reduce([1.0, 2.0]), TypeError,
     r"all_reduce on rank 1 of 4: x must be an array .* got list: make it one with "
     r"numpy.asarray\(x\) \(cupy.asarray\(x\) for device memory\) and keep that array"),
    ("a tuple, async", lambda c: c.broadcast((1, 2), async_op=True), TypeError,
     r"broadcast on rank 1 of 4: x must be an array .* got tuple: make it one with "
     r"numpy.asarray\(x\)"),
    ("a list as out", lambda c: c.all_gather(X, out=[0.0] * 32), TypeError,
     r"all_gather on rank 1 of 4: out must be an array .* got list: .*numpy.asarray\(out\)"),
    ("a list among many arrays", lambda c: c.all_reduce_many([X.copy(), [1.0]]), TypeError,
     r"all_reduce_many on rank 1 of 4: arrays\[1\] must be an array .* "
     r"numpy.asarray\(arrays\[1\]\)"),
    ("None as x", lambda c: c.broadcast(None), TypeError,
     r"broadcast on rank 1 of 4: x must be an array .* got NoneType$"),  # no asarray hint
    ("bitwise op on floats", lambda c: c.all_reduce(X.copy(), op="band"), TypeError,
     r"all_reduce on rank 1 of 4: op='band' needs an integer or bool dtype, got float32"),
    ("avg on integers", lambda c: c.reduce_scatter(np.zeros((4, 1), np.int32), op="avg"),
     TypeError, r"reduce_scatter on rank 1 of 4: op='avg' needs a floating or complex dtype"),
    ("max on complex", lambda c: c.all_reduce(np.zeros(2, np.complex64), op="max"),
     TypeError, r"all_reduce on rank 1 of 4: op='max' is undefined on complex dtype complex64"),
    ("unknown op", lambda c: c.all_reduce(X.copy(), op="mean"), ValueError,
     r"all_reduce on rank 1 of 4: op='mean' is not a reduce op"),
    ("read-only x for an in-place op", lambda c: c.all_reduce(_read_only()), ValueError,
     r"all_reduce on rank 1 of 4: x is read-only"),
    ("send to itself", lambda c: c.send(X, 1), ValueError,
     r"send on rank 1 of 4: dst=1 is this rank"),
    ("recv from outside the group", lambda c: c.recv(X.copy(), 9), ValueError,
     r"recv on rank 1 of 4: src=9 is out of range"),
    ("negative timeout", lambda c: c.barrier(timeout=-1), ValueError,
     r"barrier on rank 1 of 4: timeout must be a positive finite number of seconds"),
    ("timeout not a number", lambda c: c.all_reduce(X.copy(), timeout="5"), TypeError,
     r"all_reduce on rank 1 of 4: timeout must be a number of seconds, got str"),
    ("split color not an int", lambda c: c.split("red"), TypeError,
     r"split on rank 1 of 4: color must be an int or None, got str"),
    ("scatter root without x", lambda c: c.scatter(None, root=1), TypeError,
     r"scatter on rank 1 of 4: x is None on the root"),
    ("non-root scatter out not an array", lambda c: c.scatter(None, root=0, out=[1]),
     TypeError, r"scatter on rank 1 of 4: out must be an array"),
]


@pytest.mark.parametrize("call, exc, pattern", [c[1:] for c in BAD_CALLS],
                         ids=[c[0] for c in BAD_CALLS])
def test_bad_argument_is_refused_before_the_backend_sees_anything(call, exc, pattern):
    comm = recording_comm(rank=1, size=4)
    with pytest.raises(exc, match=pattern):
        call(comm)
    assert comm._backend.calls == []


@pytest.mark.parametrize("call", [c[1] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_communicator_still_works_after_a_bad_argument(call):
    comm = recording_comm(rank=1, size=4)
    with pytest.raises((TypeError, ValueError)):
        call(comm)
    x = X.copy()
    assert comm.all_reduce(x) is x
    assert [c[0] for c in comm._backend.calls] == ["all_reduce"]


def test_read_only_out_is_refused():
    comm = recording_comm(rank=1, size=4)
    out = np.zeros((4, 8), np.float32)
    out.flags.writeable = False
    with pytest.raises(ValueError, match=r"all_gather on rank 1 of 4: out is read-only"):
        comm.all_gather(X, out=out)


def test_a_closed_communicator_says_so():
    comm = recording_comm(rank=1, size=4)
    comm.close()
    with pytest.raises(ValueError, match=r"all_reduce on rank 1 of 4: the communicator is closed"):
        comm.all_reduce(X.copy())
    assert comm._backend.calls == []


def test_close_is_idempotent_and_releases_the_backend():
    comm = recording_comm()
    comm.close()
    comm.close()
    assert comm.closed and comm._backend.closed


def test_context_manager_closes():
    with recording_comm() as comm:
        comm.barrier()
    assert comm.closed
