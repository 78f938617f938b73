"""What the communicator hands its backend: flat buffers laid out as gpucoll.backends says,
the per-call timeout and stream, and Work handles bound to the call's result."""

import numpy as np
import pytest
from recording import recording_comm

from gpucoll.ops import ReduceOp


def test_all_reduce_hands_over_the_callers_buffer_and_parsed_op():
    comm = recording_comm(rank=0, size=2)
    x = np.ones((2, 3), dtype=np.int32)
    comm.all_reduce(x, op="BXOR")
    (name, ref, op), = comm._backend.calls
    assert name == "all_reduce" and ref.array is x and ref.count == 6 and op is ReduceOp.BXOR


def test_all_gather_output_holds_one_slot_per_rank():
    comm = recording_comm(rank=2, size=3)
    out = comm.all_gather(np.zeros((2, 2), np.float64))
    (_, x, res), = comm._backend.calls
    assert out.shape == (3, 2, 2) and res.count == 3 * x.count and res.array is out


def test_tiled_all_gather_concatenates_along_axis_0():
    comm = recording_comm(rank=0, size=4)
    assert comm.all_gather(np.zeros((3, 5)), tiled=True).shape == (12, 5)


def test_reduce_scatter_and_tiled_scatter_results_are_one_slot(store_server):
    comm = recording_comm(rank=1, size=4, store=store_server)
    assert comm.reduce_scatter(np.zeros((4, 3))).shape == (3,)
    assert comm.reduce_scatter(np.zeros(8), tiled=True).shape == (2,)
    assert comm.scatter(np.zeros(12), root=1, tiled=True).shape == (3,)


def test_gather_off_root_returns_none_and_hands_no_output():
    comm = recording_comm(rank=1, size=2)
    assert comm.gather(np.zeros(3), root=0) is None
    assert comm._backend.calls[0][2] is None


def test_per_call_timeout_and_stream_reach_the_backend():
    seen = {}
    comm = recording_comm(rank=0, size=2, timeout=7.0)

    def all_reduce(x, op, *, timeout, stream=None):
        seen.update(timeout=timeout, stream=stream)

    comm._backend.all_reduce = all_reduce
    comm.all_reduce(np.zeros(1))
    assert seen == {"timeout": 7.0, "stream": None}
    comm.all_reduce(np.zeros(1), timeout=2.5, stream=1234)
    assert seen == {"timeout": 2.5, "stream": 1234}


def test_async_call_returns_work_bound_to_the_result():
    comm = recording_comm(rank=0, size=2)
    x = np.zeros(3)
    work = comm.all_gather(x, async_op=True)
    assert work.wait().shape == (2, 3)
    assert comm.send(x, 1, async_op=True).wait() is None


def test_strided_input_is_handed_over_contiguous_and_written_back():
    comm = recording_comm(rank=0, size=2)

    def all_reduce(x, op, *, timeout, stream=None):
        assert x.host.flags.c_contiguous
        x.host[:] = 9

    comm._backend.all_reduce = all_reduce
    base = np.zeros((3, 4))
    comm.all_reduce(base[:, 2])
    assert (base[:, 2] == 9).all() and (base[:, :2] == 0).all()


@pytest.mark.parametrize("color, key", [(0, 0), (None, 5)])
def test_split_requires_no_store_for_its_own_validation(color, key):
    comm = recording_comm(rank=0, size=1)
    with pytest.raises(TypeError, match="key must be an int"):
        comm.split(color, key="k")
