"""gpucoll.distributed checked on real torch CPU tensors: each case is a function of the module
(imported as ``dist``) that raises on a wrong result or a wrong error. Every rank runs the same
cases in the same order; ``run`` returns ``{case name: error text or ""}``.

A rank's inputs are pure functions of its rank, so each rank computes what it must get. Values
are small integers held in floats, so sums are exact in any order and compared for equality.
Each error case ends with a collective that every rank makes, which checks that the refused
call sent nothing and left the ranks in step.
"""

from __future__ import annotations

import re
import traceback
import warnings
from collections.abc import Callable

import numpy as np
import torch

CASES: list[tuple[str, Callable]] = []


def case(fn: Callable) -> Callable:
    CASES.append((fn.__name__, fn))
    return fn


def val(rank: int, n: int = 6, dtype=torch.float32, salt: int = 0) -> torch.Tensor:
    return ((torch.arange(n) % 11 + rank * 3 + salt) % 50).to(dtype)


def check(got, want, what: str) -> None:
    if not isinstance(got, torch.Tensor) or got.dtype != want.dtype or not torch.equal(got, want):
        raise AssertionError(f"{what}: got {got!r}, want {want!r}")


def refuses(dist, exc: type, pattern: str, call: Callable) -> None:
    """``call()`` raises ``exc`` whose message matches ``pattern`` and names this rank; then
    the ranks are still in step."""
    try:
        call()
    except exc as e:
        text = str(e)
        if not re.search(pattern, text):
            raise AssertionError(f"message {text!r} does not match {pattern!r}") from e
        if f"rank {dist.get_rank()} " not in text:
            raise AssertionError(f"message {text!r} does not name rank {dist.get_rank()}") from e
    else:
        raise AssertionError(f"no {exc.__name__} raised (wanted {pattern!r})")
    in_step(dist)


def in_step(dist) -> None:
    t = torch.ones(1)
    dist.all_reduce(t)
    check(t, torch.full((1,), float(dist.get_world_size())), "the all_reduce after")


# -- reductions and broadcast ------------------------------------------------------------------

@case
def all_reduce_sums_in_place_by_default(dist, r, n):
    t = val(r)
    assert dist.all_reduce(t) is None
    check(t, sum(val(k) for k in range(n)), "all_reduce")


@case
def all_reduce_takes_torch_ops(dist, r, n):
    for op, want in [(dist.ReduceOp.MAX, val(n - 1)), (dist.ReduceOp.MIN, val(0)),
                     (dist.ReduceOp.AVG, sum(val(k) for k in range(n)) / n)]:
        t = val(r)
        dist.all_reduce(t, op=op)
        check(t, want, f"all_reduce op={op}")
    t = torch.tensor([r + 1, 3], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.PRODUCT)
    check(t, torch.tensor([int(np.prod(range(1, n + 1))), 3 ** n]), "PRODUCT")
    t = torch.tensor([1 << r], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.BOR)
    check(t, torch.tensor([(1 << n) - 1], dtype=torch.int32), "BOR")


@case
def all_reduce_accepts_torch_distributed_own_reduce_op(dist, r, n):
    import torch.distributed as tdist

    t = val(r)
    dist.all_reduce(t, op=tdist.ReduceOp.MAX)
    check(t, val(n - 1), "torch.distributed.ReduceOp.MAX")


@case
def async_all_reduce_returns_a_handle_that_waits(dist, r, n):
    t = val(r)
    work = dist.all_reduce(t, async_op=True)
    assert work.wait() is True
    assert work.is_completed()
    check(t, sum(val(k) for k in range(n)), "async all_reduce")


@case
def all_reduce_reduces_a_parameter_that_requires_grad(dist, r, n):
    p = torch.nn.Parameter(val(r))
    dist.all_reduce(p.data)
    dist.all_reduce(p)  # torch allows the parameter itself too
    check(p.detach(), n * sum(val(k) for k in range(n)), "parameter")
    assert p.requires_grad


@case
def all_reduce_on_a_non_contiguous_tensor_writes_back_into_it(dist, r, n):
    base = val(r, 12).reshape(3, 4)
    view = base.t()
    dist.all_reduce(view)
    check(base, sum(val(k, 12) for k in range(n)).reshape(3, 4), "through a transposed view")


@case
def all_reduce_on_bfloat16_and_float16(dist, r, n):
    for dtype in (torch.bfloat16, torch.float16):
        t = val(r, dtype=dtype)
        dist.all_reduce(t)
        check(t, sum(val(k) for k in range(n)).to(dtype), f"{dtype}")


@case
def broadcast_copies_src_given_as_a_global_rank(dist, r, n):
    t = val(r)
    dist.broadcast(t, src=n - 1)
    check(t, val(n - 1), "broadcast")


@case
def reduce_lands_on_dst_only(dist, r, n):
    t = val(r)
    dist.reduce(t, dst=n - 1)
    check(t, sum(val(k) for k in range(n)) if r == n - 1 else val(r), "reduce")


# -- gathering and scattering ------------------------------------------------------------------

@case
def all_gather_fills_the_list(dist, r, n):
    out = [torch.zeros(6) for _ in range(n)]
    dist.all_gather(out, val(r))
    for k in range(n):
        check(out[k], val(k), f"all_gather slot {k}")


@case
def all_gather_takes_a_different_size_from_each_rank(dist, r, n):
    out = [torch.zeros(k + 1) for k in range(n)]
    dist.all_gather(out, val(r, r + 1))
    for k in range(n):
        check(out[k], val(k, k + 1), f"uneven all_gather slot {k}")


@case
def async_all_gather_fills_the_list_at_wait(dist, r, n):
    out = [torch.zeros(2, 3) for _ in range(n)]
    dist.all_gather(out, val(r).reshape(2, 3), async_op=True).wait()
    for k in range(n):
        check(out[k], val(k).reshape(2, 3), f"async all_gather slot {k}")


@case
def async_all_gather_fills_the_list_at_synchronize_too(dist, r, n):
    out = [torch.zeros(3) for _ in range(n)]
    work = dist.all_gather(out, val(r, 3), async_op=True)
    assert work.synchronize() is None
    for k in range(n):
        check(out[k], val(k, 3), f"all_gather slot {k} after synchronize")
    try:
        work.result()
    except NotImplementedError as e:
        assert "the results are in the tensors given to the call" in str(e), e
    else:
        raise AssertionError("Work.result() returned")


@case
def all_gather_into_tensor_concatenates_or_stacks(dist, r, n):
    flat = torch.zeros(n * 6)
    dist.all_gather_into_tensor(flat, val(r))
    check(flat, torch.cat([val(k) for k in range(n)]), "concatenated")
    stacked = torch.zeros(n, 6)
    dist.all_gather_single(stacked, val(r))
    check(stacked, torch.stack([val(k) for k in range(n)]), "stacked")


@case
def reduce_scatter_tensor_gives_each_rank_its_block(dist, r, n):
    out = torch.zeros(2)
    dist.reduce_scatter_tensor(out, val(r, 2 * n))
    check(out, sum(val(k, 2 * n) for k in range(n))[2 * r:2 * r + 2], "reduce_scatter_tensor")


@case
def the_older_names_of_the_single_tensor_calls_warn_as_torchs_do(dist, r, n):
    flat, out = torch.zeros(n * 3), torch.zeros(2)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        dist.all_gather_into_tensor(flat, val(r, 3))
        dist.reduce_scatter_tensor(out, val(r, 2 * n))
    said = [str(w.message) for w in seen if w.category is FutureWarning]
    assert said == [
        "`dist.all_gather_into_tensor` is deprecated (as `torch.distributed."
        "all_gather_into_tensor` is). Please use `dist.all_gather_single` instead.",
        "`dist.reduce_scatter_tensor` is deprecated (as `torch.distributed."
        "reduce_scatter_tensor` is). Please use `dist.reduce_scatter_single` instead."], said
    assert all(w.filename == __file__ for w in seen), [w.filename for w in seen]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the current names do not warn
        dist.all_gather_single(flat, val(r, 3))
        dist.reduce_scatter_single(out, val(r, 2 * n))
    check(flat, torch.cat([val(k, 3) for k in range(n)]), "all_gather_single")
    check(out, sum(val(k, 2 * n) for k in range(n))[2 * r:2 * r + 2], "reduce_scatter_single")


@case
def reduce_scatter_reduces_the_list(dist, r, n):
    out = torch.zeros(3)
    dist.reduce_scatter(out, [val(r, 3, salt=j) for j in range(n)], op=dist.ReduceOp.MAX)
    check(out, val(n - 1, 3, salt=r), "reduce_scatter")


@case
def all_to_all_single_with_equal_blocks(dist, r, n):
    out = torch.zeros(n * 2)
    dist.all_to_all_single(out, val(r, n * 2))
    check(out, torch.cat([val(k, n * 2)[2 * r:2 * r + 2] for k in range(n)]), "equal blocks")


@case
def all_to_all_single_with_split_sizes(dist, r, n):
    # rank k sends j + 1 rows to rank j; rows of 2 elements
    sends = [j + 1 for j in range(n)]
    x = val(r, 2 * sum(sends)).reshape(-1, 2)
    out = torch.zeros(n * (r + 1), 2)
    dist.all_to_all_single(out, x, output_split_sizes=[r + 1] * n, input_split_sizes=sends)
    start = sum(sends[:r])
    want = torch.cat([val(k, 2 * sum(sends)).reshape(-1, 2)[start:start + r + 1]
                      for k in range(n)])
    check(out, want, "split sizes")


@case
def all_to_all_exchanges_lists(dist, r, n):
    out = [torch.zeros(j + 1) for j in range(n)]
    dist.all_to_all(out, [val(r, r + 1, salt=j) for j in range(n)])
    for j in range(n):
        check(out[j], val(j, j + 1, salt=r), f"all_to_all slot {j}")


@case
def gather_fills_the_list_on_dst(dist, r, n):
    out = [torch.zeros(6) for _ in range(n)] if r == 0 else None
    dist.gather(val(r), out, dst=0)
    if r == 0:
        for k in range(n):
            check(out[k], val(k), f"gather slot {k}")


@case
def scatter_gives_each_rank_its_list_entry(dist, r, n):
    out = torch.zeros(4)
    dist.scatter(out, [val(j, 4, salt=5) for j in range(n)] if r == n - 1 else None, src=n - 1)
    check(out, val(r, 4, salt=5), "scatter")


# -- point to point ------------------------------------------------------------------------------

@case
def send_and_recv_pass_a_tensor_around_the_ring(dist, r, n):
    got = torch.zeros(6)
    if r % 2 == 0:
        dist.send(val(r), dst=(r + 1) % n)
        src = dist.recv(got, src=(r - 1) % n)
    else:
        src = dist.recv(got, src=(r - 1) % n)
        dist.send(val(r), dst=(r + 1) % n)
    assert src == (r - 1) % n
    check(got, val((r - 1) % n), "recv")


@case
def isend_and_irecv_return_handles(dist, r, n):
    got = torch.zeros(6)
    works = [dist.isend(val(r), dst=(r + 1) % n), dist.irecv(got, src=(r - 1) % n)]
    for w in works:
        assert w.wait() is True
    check(got, val((r - 1) % n), "irecv")


@case
def batch_isend_irecv_runs_p2pops_together(dist, r, n):
    got = [torch.zeros(3) for _ in range(n)]
    ops = [dist.P2POp(dist.isend, val(r, 3, salt=j), j) for j in range(n) if j != r]
    ops += [dist.P2POp(dist.irecv, got[j], j) for j in range(n) if j != r]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    for j in range(n):
        if j != r:
            check(got[j], val(j, 3, salt=r), f"from {j}")


# -- groups and barriers -------------------------------------------------------------------------

@case
def new_group_runs_collectives_with_global_ranks(dist, r, n):
    last = [0, n - 1]
    g = dist.new_group(last)
    if r in last:
        assert dist.get_rank(g) == last.index(r) and dist.get_world_size(g) == 2
        assert dist.get_process_group_ranks(g) == last
        t = val(r)
        dist.broadcast(t, src=n - 1, group=g)  # a global rank, as in torch
        check(t, val(n - 1), "broadcast in the group")
        t = val(r)
        dist.all_reduce(t, group=g)
        check(t, val(0) + val(n - 1), "all_reduce in the group")
        dist.destroy_process_group(g)
    else:
        assert g is dist.GroupMember.NON_GROUP_MEMBER and dist.get_rank(g) == -1
    in_step(dist)


@case
def barriers_return_on_every_rank(dist, r, n):
    assert dist.barrier() is None
    dist.barrier(async_op=True).wait()
    dist.monitored_barrier(timeout=30)
    in_step(dist)


# -- objects -----------------------------------------------------------------------------------

@case
def object_collectives_carry_python_objects_and_tensors(dist, r, n):
    mine = {"rank": r, "t": val(r, 2)}
    every = [None] * n
    dist.all_gather_object(every, mine)
    assert [o["rank"] for o in every] == list(range(n))
    check(every[n - 1]["t"], val(n - 1, 2), "all_gather_object's tensor")
    items = [("cfg", n), [1, 2, 3]] if r == 0 else [None, None]
    dist.broadcast_object_list(items, src=0)
    assert items == [("cfg", n), [1, 2, 3]], items
    got = [None] * n if r == n - 1 else None
    dist.gather_object(f"from {r}", got, dst=n - 1)
    if r == n - 1:
        assert got == [f"from {k}" for k in range(n)], got
    out = [None]
    dist.scatter_object_list(out, [{"to": k} for k in range(n)] if r == 0 else None, src=0)
    assert out == [{"to": r}], out


# -- NumPy arrays through the same functions -----------------------------------------------------

@case
def numpy_arrays_work_like_tensors(dist, r, n):
    a = val(r).numpy().copy()
    dist.all_reduce(a)
    assert np.array_equal(a, sum(val(k) for k in range(n)).numpy())
    out = [np.zeros(6, np.float32) for _ in range(n)]
    dist.all_gather(out, val(r).numpy())
    assert all(np.array_equal(out[k], val(k).numpy()) for k in range(n))


# -- errors, raised before anything is sent ------------------------------------------------------

@case
def an_unknown_op_is_refused(dist, r, n):
    refuses(dist, ValueError, r"all_reduce.*op='mean' is not a reduce op",
            lambda: dist.all_reduce(val(r), op="mean"))


@case
def avg_on_an_integer_tensor_is_a_type_error(dist, r, n):
    refuses(dist, TypeError, r"all_reduce.*avg.*int64",
            lambda: dist.all_reduce(torch.ones(2, dtype=torch.int64), op=dist.ReduceOp.AVG))


@case
def an_all_gather_list_of_the_wrong_length_is_refused(dist, r, n):
    refuses(dist, ValueError, rf"all_gather.*tensor_list must be a list of {n}.*list of {n + 1}",
            lambda: dist.all_gather([torch.zeros(6)] * (n + 1), val(r)))


@case
def an_output_list_of_another_dtype_is_refused_rather_than_cast(dist, r, n):
    refuses(dist, TypeError, r"all_gather.*tensor_list\[0\] is int32.*tensor sent is float32",
            lambda: dist.all_gather([torch.zeros(6, dtype=torch.int32)] * n, val(r)))
    refuses(dist, TypeError, r"all_to_all.*output_tensor_list\[0\] is float64",
            lambda: dist.all_to_all([torch.zeros(1, dtype=torch.float64)] * n,
                                    [val(r, 1)] * n))


@case
def an_own_all_gather_slot_of_another_size_is_refused(dist, r, n):
    out = [torch.zeros(6) for _ in range(n)]
    out[r] = torch.zeros(5)
    refuses(dist, ValueError, rf"all_gather.*tensor_list\[{r}\], this rank's slot, has 5 "
            r"elements, but tensor has 6", lambda: dist.all_gather(out, val(r)))


@case
def a_gather_list_entry_of_another_size_is_refused_on_dst(dist, r, n):
    def call():
        got = [torch.zeros(6) for _ in range(n - 1)] + [torch.zeros(7)]
        dist.gather(val(r), got, dst=r)  # every rank names itself dst: each checks its list
    refuses(dist, ValueError, rf"gather.*gather_list\[{n - 1}\] has 7 elements, but the "
            r"tensor sent has 6", call)


@case
def a_tensor_argument_that_is_no_tensor_is_refused_by_its_name(dist, r, n):
    refuses(dist, TypeError, r"all_reduce.*tensor must be a tensor.*got NoneType",
            lambda: dist.all_reduce(None))  # a parameter's .grad before backward()
    refuses(dist, TypeError, r"broadcast.*tensor must be a tensor.*got list",
            lambda: dist.broadcast([1.0, 2.0], src=0))


@case
def a_src_outside_the_group_is_refused(dist, r, n):
    refuses(dist, ValueError, rf"broadcast.*src={n} is not a rank of the group",
            lambda: dist.broadcast(val(r), src=n))


@case
def a_recv_without_src_is_refused(dist, r, n):
    refuses(dist, ValueError, r"recv.*src is required.*any source",
            lambda: dist.recv(torch.zeros(2)))


@case
def a_message_tag_is_refused(dist, r, n):
    refuses(dist, ValueError, r"send.*tag=7.*only tag 0 is taken",
            lambda: dist.send(val(r), dst=(r + 1) % n, tag=7))


@case
def a_non_contiguous_output_that_cannot_be_written_back_is_refused(dist, r, n):
    out = torch.zeros(8, 2).t()[0]  # every other element: strided
    refuses(dist, ValueError, r"scatter.*tensor must be contiguous.*contiguous\(\)",
            lambda: dist.scatter(out[:4], [torch.zeros(4)] * n if r == 0 else None, src=0))


@case
def split_sizes_that_do_not_add_up_are_refused(dist, r, n):
    refuses(dist, ValueError, r"all_to_all_single.*input_split_sizes=.*adding up to dim 0",
            lambda: dist.all_to_all_single(torch.zeros(n), torch.zeros(n),
                                           [1] * n, [2] * n))


@case
def a_wrong_output_shape_is_refused(dist, r, n):
    refuses(dist, ValueError, r"all_gather_into_tensor.*output_tensor has shape \[5\]",
            lambda: dist.all_gather_into_tensor(torch.zeros(5), val(r)))


@case
def a_group_that_is_not_a_group_is_refused(dist, r, n):
    refuses(dist, TypeError, r"all_reduce.*group must be",
            lambda: dist.all_reduce(val(r), group="everyone"))


def run(dist) -> dict[str, str]:
    rank, size = dist.get_rank(), dist.get_world_size()
    report = {}
    for name, body in CASES:
        try:
            body(dist, rank, size)
            report[name] = ""
        except Exception:  # noqa: BLE001 - the report carries it to the test
            report[name] = traceback.format_exc()
    return report
