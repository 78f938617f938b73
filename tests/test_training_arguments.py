"""Bad arguments to the training calls are refused on the rank that made them, with the
argument named, before anything reaches the backend (nothing is sent)."""

from __future__ import annotations

import numpy as np
import pytest
from recording import recording_comm

import gpucoll


@pytest.fixture
def comm():
    c = recording_comm(rank=1, size=4)
    yield c
    c.close()


def nothing_sent(comm) -> bool:
    return comm._backend.calls == []


X = np.zeros((3, 2), np.float32)


@pytest.mark.parametrize("call, kind, message", [
    (lambda c: c.all_gather_v(np.float32(1)), TypeError, "NumPy scalar"),
    (lambda c: c.all_gather_v(np.zeros(())), ValueError, "x is 0-d"),
    (lambda c: c.all_gather_v(X, counts=[3, 3]), ValueError, "counts has 2 entries"),
    (lambda c: c.all_gather_v(X, counts=[1, 3, -1, 2]), ValueError, r"counts\[2\] = -1"),
    (lambda c: c.all_gather_v(X, counts=[1, 3.0, 1, 1]), TypeError, r"counts\[1\] must be an int"),
    (lambda c: c.all_gather_v(X, counts="1234"), TypeError, "counts must be a list"),
    (lambda c: c.all_gather_v(X, counts=[3, 2, 3, 3]), ValueError,
     r"counts\[1\] = 2, but x has 3 rows"),
    (lambda c: c.all_gather_v(X, out=np.zeros((12, 2), np.float32)), ValueError,
     "out= needs counts="),
    (lambda c: c.all_gather_v(X, counts=[3] * 4, out=np.zeros((11, 2), np.float32)),
     ValueError, "out has shape"),
    (lambda c: c.all_gather_v(X, counts=[3] * 4, out=np.zeros((12, 2), np.float64)),
     TypeError, "out has dtype float64"),
    (lambda c: c.gather_v(X, root=4), ValueError, "root=4 is out of range"),
    (lambda c: c.scatter_v(None, root=1), TypeError, "chunks must be a list of 4 arrays"),
    (lambda c: c.scatter_v([X] * 3, root=1), ValueError, "chunks has 3 arrays"),
    (lambda c: c.scatter_v([X, X, X.astype(np.int8), X], root=1), TypeError,
     r"chunks\[2\] is host int8"),
    (lambda c: c.scatter_v([X, X, np.zeros((3, 5), np.float32), X], root=1), ValueError,
     "every chunk needs one dtype, trailing shape"),
    (lambda c: c.scatter_v([X] * 4, root=1, counts=[3, 3, 2, 3]), ValueError,
     r"chunks\[2\] has 3 rows, but counts\[2\] = 2"),
    (lambda c: c.scatter_v(None, root=0, counts=[1] * 4), ValueError,
     "with counts= a rank other than root passes out="),
    (lambda c: c.scatter_v(None, root=0, out=X), ValueError, "out= needs counts="),
    (lambda c: c.scatter_v(None, root=0, counts=[1] * 4, out=X), ValueError,
     r"but counts\[1\] = 1 rows"),
    (lambda c: c.all_to_all_v(X), TypeError, "chunks must be a list of 4 arrays"),
    (lambda c: c.all_to_all_v([X] * 4, counts=[3, 1, 3, 3]), ValueError,
     r"counts\[1\] = 1, but chunks\[1\]"),
    (lambda c: c.all_to_all_v([X] * 4, counts=[3] * 4, out=X), ValueError, "out has shape"),
    (lambda c: c.reduce_scatter_v(X, [1, 1, 1, 1]), ValueError,
     "x has 3 rows, but counts add up to 4"),
    (lambda c: c.reduce_scatter_v(X, [1, 1, 1, 0], "band"), TypeError, "op='band' needs an "),
    (lambda c: c.reduce_scatter_v(X, [1, 1, 1, 0], out=np.zeros((2, 2), np.float32)),
     ValueError, "out has shape"),
])
def test_uneven_calls_refuse_bad_arguments_before_sending(comm, call, kind, message):
    with pytest.raises(kind, match=message):
        call(comm)
    assert nothing_sent(comm)


@pytest.mark.parametrize("call, kind, message", [
    (lambda c: c.all_reduce(X, out=np.zeros((3, 3), np.float32)), ValueError, "out has shape"),
    (lambda c: c.all_reduce(X, out=np.zeros((3, 2), np.int32)), TypeError, "out has dtype"),
    (lambda c: c.all_reduce(X, out=X[:, :]), ValueError, "out shares memory with the input"),
    (lambda c: c.all_reduce(X, out=np.zeros((2, 3), np.float32).T), ValueError,
     "must be C-contiguous"),
    (lambda c: c.all_reduce(X, "band", out=np.zeros_like(X)), TypeError, "op='band' needs"),
    (lambda c: c.reduce(X, root=1, out=np.zeros(4, np.float32)), ValueError, "out has shape"),
    (lambda c: c.broadcast(None, root=1, out=np.zeros(3)), TypeError, "x is None on the root"),
    (lambda c: c.broadcast(None, root=0, out=np.zeros(6)[::2]), ValueError,
     "must be C-contiguous"),
])
def test_out_of_place_forms_refuse_bad_out(comm, call, kind, message):
    with pytest.raises(kind, match=message):
        call(comm)
    assert nothing_sent(comm)


def test_out_of_place_reduce_on_root_needs_out_when_others_pass_one():
    c = recording_comm(rank=0, size=2)
    c.reduce(X, root=1, out=np.zeros_like(X))  # off root: out is checked, never written
    assert [call[0] for call in c._backend.calls] == ["reduce_out"]


def test_read_only_x_is_fine_out_of_place(comm):
    x = X.copy()
    x.flags.writeable = False
    comm.all_reduce(x, out=np.zeros_like(x))
    assert comm._backend.calls[0][0] == "all_reduce_out"


@pytest.mark.parametrize("call, kind, message", [
    (lambda c: c.all_reduce_many(X), TypeError, None),
    (lambda c: c.all_reduce_many("abc"), TypeError, "arrays must be a list"),
    (lambda c: c.all_reduce_many([X, _read_only()]), ValueError, r"arrays\[1\] is read-only"),
    (lambda c: c.all_reduce_many([X, X.astype(np.int8)], "avg"), TypeError,
     "op='avg' needs a floating"),
    (lambda c: c.all_reduce_many([X, X.astype(">f4")]), TypeError, "unsupported dtype"),
    (lambda c: c.all_reduce_many([X, [1, 2]]), TypeError, r"arrays\[1\] must be an array"),
])
def test_all_reduce_many_refuses_bad_arrays(comm, call, kind, message):
    with pytest.raises(kind, match=message):
        call(comm)
    assert nothing_sent(comm)


def _read_only():
    a = np.zeros(3, np.float32)
    a.flags.writeable = False
    return a


def test_a_bucket_needs_shapes_and_a_supported_dtype():
    with pytest.raises(TypeError, match=r"shapes\[1\] must be a shape"):
        gpucoll.Bucket([(2,), "x"])
    with pytest.raises(ValueError, match="negative extent"):
        gpucoll.Bucket([(2, -1)])
    with pytest.raises(TypeError, match="unsupported dtype"):
        gpucoll.Bucket([(2,)], np.dtype("U3"))
    b = gpucoll.Bucket([4, (2, 3), ()], np.float64)
    assert [a.shape for a in b] == [(4,), (2, 3), ()] and b.flat.size == 11
    assert all(np.shares_memory(a, b.flat) for a in b) and not b.flat.any()


@pytest.mark.parametrize("call, kind, message", [
    (lambda c: gpucoll.P2POp("send", X, 0), TypeError, "op must be isend or irecv"),
    (lambda c: c.batch_isend_irecv([("isend", X, 0)]), TypeError, "list of gpucoll.P2POp"),
    (lambda c: c.isend(X, 1), ValueError, "dst=1 is this rank"),
    (lambda c: c.irecv(np.zeros(6)[::2], 0), ValueError, "must be C-contiguous"),
    (lambda c: c.irecv(_read_only(), 0), ValueError, "read-only"),
    (lambda c: c.isend(X, 7), ValueError, "dst=7 is out of range"),
])
def test_point_to_point_refuses_bad_arguments(comm, call, kind, message):
    with pytest.raises(kind, match=message):
        call(comm)
    assert nothing_sent(comm)


def test_a_batch_posts_nothing_until_it_ends(comm):
    with comm.batch() as b:
        w = comm.isend(X, 0)
        comm.irecv(np.zeros(4), 2)
        assert nothing_sent(comm)
        with pytest.raises(gpucoll.UsageError, match="has not been posted yet"):
            w.wait()
        with pytest.raises(gpucoll.UsageError, match="do not nest"):
            with comm.batch():
                pass
    b.wait()
    assert w.is_completed()


def test_a_batch_whose_block_raises_sends_nothing(comm):
    with pytest.raises(KeyError):
        with comm.batch():
            w = comm.isend(X, 0)
            raise KeyError("user error")
    assert nothing_sent(comm)
    with pytest.raises(gpucoll.UsageError, match="abandoned"):
        w.wait()
    with comm.batch():  # and the next one works
        comm.isend(X, 0)


def test_scatter_object_needs_one_object_per_rank_on_the_root(comm):
    with pytest.raises(ValueError, match="objs must be a list of 4 objects"):
        comm.scatter_object([1, 2], root=1)
    with pytest.raises(TypeError, match="objs must be a list of 4 objects"):
        comm.scatter_object(None, root=1)
    assert nothing_sent(comm)


@pytest.mark.parametrize("ranks, kind, message", [
    ([], ValueError, "ranks is empty"),
    ([0, 0], ValueError, "lists a rank twice"),
    ([0, 4], ValueError, r"ranks\[1\] = 4 is not a rank"),
    ([0, 1.0], TypeError, r"ranks\[1\] must be an int"),
    (3, TypeError, "ranks must be a list"),
])
def test_new_group_refuses_bad_member_lists(comm, ranks, kind, message):
    with pytest.raises(kind, match=message):
        comm.new_group(ranks)
    assert nothing_sent(comm)


def test_monitored_barrier_needs_a_store(comm):
    with pytest.raises(gpucoll.UsageError, match="no store"):
        comm.monitored_barrier()


def test_module_level_functions_need_init():
    with pytest.raises(RuntimeError, match="not initialised"):
        gpucoll.all_gather_v(X)
    with pytest.raises(RuntimeError, match="not initialised"):
        gpucoll.new_group([0])


def test_a_batch_belongs_to_the_thread_that_opened_it(comm):
    import threading

    errors = []
    with comm.batch():
        t = threading.Thread(target=lambda: errors.append(_raises(lambda: comm.isend(X, 0))))
        t.start()
        t.join()
    assert errors == ["UsageError"] and nothing_sent(comm)


def _raises(fn) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test reads the kind
        return type(exc).__name__
    return "ok"
