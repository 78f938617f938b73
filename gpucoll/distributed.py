"""torch.distributed's functional API on gpucoll: ``import gpucoll.distributed as dist``.

A training script written against ``torch.distributed`` runs on gpucoll by changing that one
import. Each function here is a translation onto the ``Communicator`` and nothing more: torch's
names and argument order (``src``/``dst`` as global ranks, output lists, split sizes, ``async_op``
returning a handle), gpucoll's implementation, checks and errors. Tensors may be torch tensors
(CPU or CUDA), NumPy or CuPy arrays, in any mix the underlying call accepts.

What torch does and this does too: ``init_process_group`` reads torchrun's (or gpucoll's, Slurm's,
MPI's) environment, ``MASTER_ADDR``/``MASTER_PORT`` (rank 0 hosts the store there, as torch's
TCPStore does), or an ``init_method`` of ``env://``, ``tcp://host:port`` or ``file:///path``
(``gpucoll.init_methods``); ``reduce_op`` warns that it is deprecated, as torch's does;
collectives on a group's non-member do nothing and warn; ``recv`` returns the sender's rank.
What it refuses with an error instead: receiving from any source (``src=None``), message tags
other than 0, ``new_group(use_local_synchronization=True)`` or ``sort_ranks=False``, and
``PREMUL_SUM``.
Outputs that torch fills in a list (``all_gather``, ``gather``, ``all_to_all``) are checked
before the call (one per rank, the input's dtype) and copied there when it completes: at once, or
at ``wait()`` with ``async_op=True``. torch itself is never imported here: a CPU tensor reaches
the communicator as its NumPy view, a CUDA tensor as itself (see ``_t``); docs/torch.md has the
whole story.
"""

from __future__ import annotations

import datetime
import operator
import os
import sys
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import gpucoll.default as _default
from gpucoll import init_methods
from gpucoll.arrays import as_ref, dtype_from_name, write_back
from gpucoll.batch import P2POp as _P2P
from gpucoll.communicator import Communicator
from gpucoll.errors import RendezvousError
from gpucoll.ops import ReduceOp as _Op
from gpucoll.validation import check_timeout
from gpucoll.work import Work


class ReduceOp:
    """torch.distributed's reduce ops (``ReduceOp.SUM`` ...), as gpucoll's."""

    SUM = _Op.SUM
    PRODUCT = _Op.PROD
    MIN = _Op.MIN
    MAX = _Op.MAX
    AVG = _Op.AVG
    BAND = _Op.BAND
    BOR = _Op.BOR
    BXOR = _Op.BXOR


class _DeprecatedReduceOp:
    """``dist.reduce_op``: torch's deprecated spelling of ``ReduceOp``; every use warns, as
    torch's does (a ``FutureWarning``)."""

    def __init__(self) -> None:
        for name in ("SUM", "PRODUCT", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR"):
            setattr(self, name, getattr(ReduceOp, name))

    def __getattribute__(self, key: str) -> Any:
        warnings.warn("`dist.reduce_op` is deprecated (as `torch.distributed.reduce_op` is), "
                      "please use `dist.ReduceOp` instead", FutureWarning, stacklevel=2)
        return object.__getattribute__(self, key)


reduce_op = _DeprecatedReduceOp()


class Backend:
    """torch.distributed's backend names; ``gloo`` runs on gpucoll's host ring."""

    GLOO = "gloo"
    NCCL = "nccl"


class _Sentinel:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


class GroupMember:
    """``WORLD`` stands for the default group; ``NON_GROUP_MEMBER`` is what ``new_group``
    returns on a rank it does not list (collectives given it do nothing, as in torch)."""

    WORLD = _Sentinel("GroupMember.WORLD")
    NON_GROUP_MEMBER = _Sentinel("GroupMember.NON_GROUP_MEMBER")


class group:  # noqa: N801 - torch.distributed's name: dist.group.WORLD
    WORLD = GroupMember.WORLD


# torch's backend names -> gpucoll's
_BACKENDS = {"gloo": "ring", "nccl": "nccl", "cpu:gloo,cuda:nccl": "auto",
             "cuda:nccl,cpu:gloo": "auto", "undefined": "auto", "": "auto", "auto": "auto",
             "ring": "ring"}
_members: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # group -> its global ranks
_owned_store: Any = None  # the store init_process_group made (init_methods), closed with the group


# ---- the process group ---------------------------------------------------------------------------

def init_process_group(backend: str | None = None, init_method: str | None = None,
                       timeout: Any = None, world_size: int = -1, rank: int = -1,
                       store: Any = None, group_name: str = "", pg_options: Any = None,
                       device_id: Any = None) -> None:
    """Join the job as torch does; ``backend``: ``"gloo"`` (the host ring), ``"nccl"``, or
    None/``"cpu:gloo,cuda:nccl"`` (NCCL when every rank can use it).

    ``init_method``: None or ``env://`` (gpucoll's or torchrun's launcher, else
    ``MASTER_ADDR``/``MASTER_PORT`` where rank 0 hosts the store, else Slurm's or MPI's
    environment), ``tcp://host:port`` (rank 0 hosts the store there) or ``file:///path`` (the
    ranks meet through that file); ``rank``/``world_size`` not passed come from ``RANK``/
    ``WORLD_SIZE`` or the launcher (see ``gpucoll.init_methods``). ``store``: a gpucoll
    ``TCPStore``. ``timeout``: seconds or a ``timedelta``. Collective over the job.
    """
    global _owned_store
    if is_initialized():
        raise RuntimeError("init_process_group: the default process group is already "
                           "initialized; call dist.destroy_process_group() first")
    name = _backend(backend)
    seconds = _start_timeout(timeout)
    if store is not None and init_method not in (None, "", "env://"):
        raise ValueError("init_process_group: pass init_method or store, not both")
    met = init_methods.meet(init_method, store, rank, world_size, seconds)
    _owned_store = met.owned
    try:
        _default.init(name, rank=met.rank, world_size=met.world_size, store=met.store,
                      timeout=seconds, device=_device_index(device_id))
    except RendezvousError as exc:  # ranks that disagree: say which call they disagree in
        _close_owned()
        raise RendezvousError(f"init_process_group: {exc}") from None
    except BaseException:
        _close_owned()
        raise
    finally:
        met.joined()


def destroy_process_group(group: Any = None) -> None:
    """Close ``group`` (default: the whole job's, and with it every group made from it)."""
    if group is None or group is GroupMember.WORLD:
        _default.close()
        _members.clear()
        _close_owned()
    elif isinstance(group, Communicator):
        group.close()


def is_initialized() -> bool:
    """True between ``init_process_group`` and ``destroy_process_group``."""
    return _default.is_initialized()


def is_available() -> bool:
    return True


def get_rank(group: Any = None) -> int:
    """This process's rank in ``group`` (default: the job); -1 where it is not a member."""
    comm = _group(group, "get_rank", warn=False)
    return -1 if comm is None else comm.rank


def get_world_size(group: Any = None) -> int:
    """The number of ranks in ``group`` (default: the job); -1 where this is not a member."""
    comm = _group(group, "get_world_size", warn=False)
    return -1 if comm is None else comm.size


def get_local_rank() -> int:
    """This process's rank among the job's ranks on this host (torchrun's ``LOCAL_RANK``)."""
    from gpucoll import rendezvous

    return rendezvous.local_rank(get_rank() if is_initialized() else 0)


def get_node_local_rank(fallback_rank: int | None = None) -> int:
    """torch's: this process's rank on its host as the launcher set it (``LOCAL_RANK``, or
    gpucoll's, Slurm's or MPI's variable); else ``fallback_rank``; else RuntimeError."""
    from gpucoll import rendezvous

    found = rendezvous.local_rank(-1)
    if found >= 0:
        return found
    if fallback_rank is not None:
        return fallback_rank
    raise RuntimeError("get_node_local_rank: LOCAL_RANK is not set (nor another launcher's "
                       "local rank); pass fallback_rank= to run without a launcher")


def get_backend(group: Any = None) -> str:
    """torch's name for what runs ``group``: ``"nccl"``, or ``"gloo"`` for the host ring."""
    comm = _group(group, "get_backend", warn=False)
    if comm is None:
        raise ValueError(f"{_where('get_backend')}: this rank is not in the group")
    return "nccl" if comm.backend == "nccl" else "gloo"


def new_group(ranks: Sequence[int] | None = None, timeout: Any = None, backend: Any = None,
              pg_options: Any = None, use_local_synchronization: bool = False,
              group_desc: str | None = None, device_id: Any = None,
              sort_ranks: bool = True) -> Any:
    """A group of the listed global ranks (default: all), numbered in sorted order;
    ``GroupMember.NON_GROUP_MEMBER`` on the others. Every rank of the job calls it."""
    world = _world("new_group")
    if use_local_synchronization or not sort_ranks:
        raise ValueError(f"{_where('new_group')}: use_local_synchronization=True and "
                         f"sort_ranks=False are not supported; every rank of the job calls "
                         f"new_group, and a group numbers its ranks in sorted order")
    listed = list(range(world.size)) if ranks is None else ranks
    made = world.new_group(listed, timeout=_seconds(timeout, "new_group"))
    if made is None:
        return GroupMember.NON_GROUP_MEMBER
    _members[made] = tuple(sorted(operator.index(r) for r in listed))
    return made


def get_process_group_ranks(group: Any) -> list[int]:
    """The global ranks of ``group``, in its own rank order."""
    return list(_global_ranks(_group(group, "get_process_group_ranks", warn=False)
                              or _not_member("get_process_group_ranks")))


def get_group_rank(group: Any, global_rank: int) -> int:
    """``global_rank``'s rank within ``group``."""
    comm = _group(group, "get_group_rank", warn=False) or _not_member("get_group_rank")
    return _to_group(comm, global_rank, None, "global_rank", "get_group_rank")


def get_global_rank(group: Any, group_rank: int) -> int:
    """The global rank of ``group``'s rank ``group_rank``."""
    comm = _group(group, "get_global_rank", warn=False) or _not_member("get_global_rank")
    ranks = _global_ranks(comm)
    if not isinstance(group_rank, int) or not 0 <= group_rank < len(ranks):
        raise ValueError(f"{_where('get_global_rank')}: group_rank={group_rank!r} is not a rank "
                         f"of a group of {len(ranks)}")
    return ranks[group_rank]


# ---- collectives ---------------------------------------------------------------------------------

def all_reduce(tensor: Any, op: Any = ReduceOp.SUM, group: Any = None,
               async_op: bool = False) -> Work | None:
    """Reduce ``tensor`` over the group, in place."""
    comm = _group(group, "all_reduce")
    if comm is None:
        return None
    x, rop = _t(tensor, "tensor", "all_reduce"), _op(op, "all_reduce")
    return _result(comm.all_reduce(x, rop, async_op=async_op), async_op)


def broadcast(tensor: Any, src: int | None = None, group: Any = None, async_op: bool = False,
              group_src: int | None = None) -> Work | None:
    """Copy ``src``'s ``tensor`` (global rank; ``group_src``: rank in the group) to every rank."""
    comm = _group(group, "broadcast")
    if comm is None:
        return None
    root = _to_group(comm, src, group_src, "src", "broadcast")
    x = _t(tensor, "tensor", "broadcast")
    return _result(comm.broadcast(x, root, async_op=async_op), async_op)


def reduce(tensor: Any, dst: int | None = None, op: Any = ReduceOp.SUM, group: Any = None,
           async_op: bool = False, group_dst: int | None = None) -> Work | None:
    """Reduce ``tensor`` over the group into ``dst``'s ``tensor``."""
    comm = _group(group, "reduce")
    if comm is None:
        return None
    root = _to_group(comm, dst, group_dst, "dst", "reduce")
    x, rop = _t(tensor, "tensor", "reduce"), _op(op, "reduce")
    return _result(comm.reduce(x, root, rop, async_op=async_op), async_op)


def all_gather(tensor_list: list, tensor: Any, group: Any = None,
               async_op: bool = False) -> Work | None:
    """``tensor_list[i]`` gets rank i's ``tensor``; the list's tensors may differ in size."""
    comm = _group(group, "all_gather")
    if comm is None:
        return None
    outs = _list(tensor_list, comm.size, "tensor_list", "all_gather", like=tensor)
    x = _t(tensor, "tensor", "all_gather")
    counts = _sizes(outs, "tensor_list", "all_gather")
    if counts[comm.rank] != _numel(x):
        raise ValueError(f"{_where('all_gather')}: tensor_list[{comm.rank}], this rank's slot, "
                         f"has {counts[comm.rank]} elements, but tensor has {_numel(x)}")
    if len(set(counts)) == 1:
        got = comm.all_gather(x, async_op=async_op)
        return _then(got, async_op, lambda rows: _fill(outs, list(rows)))
    got = comm.all_gather_v(_flat(x, "tensor", "all_gather"), counts=counts, async_op=async_op)
    return _then(got, async_op, lambda parts: _fill(outs, parts))


def all_gather_single(output_tensor: Any, input_tensor: Any, group: Any = None,
                      async_op: bool = False) -> Work | None:
    """Every rank's ``input_tensor`` into ``output_tensor``, concatenated along dim 0
    (``(size * n, ...)``) or stacked (``(size, n, ...)``)."""
    return _gather_single("all_gather_single", output_tensor, input_tensor, group, async_op)


def reduce_scatter_single(output: Any, input: Any, op: Any = ReduceOp.SUM, group: Any = None,
                          async_op: bool = False) -> Work | None:
    """``input`` (``size`` blocks along dim 0, or stacked) reduced over the group; this rank's
    block lands in ``output``."""
    return _scatter_single("reduce_scatter_single", output, input, op, group, async_op)


def all_gather_into_tensor(output_tensor: Any, input_tensor: Any, group: Any = None,
                           async_op: bool = False) -> Work | None:
    """``all_gather_single``'s older name, deprecated with a ``FutureWarning`` as in torch."""
    _deprecated("all_gather_into_tensor", "all_gather_single")
    return _gather_single("all_gather_into_tensor", output_tensor, input_tensor, group, async_op)


def reduce_scatter_tensor(output: Any, input: Any, op: Any = ReduceOp.SUM, group: Any = None,
                          async_op: bool = False) -> Work | None:
    """``reduce_scatter_single``'s older name, deprecated with a ``FutureWarning`` as in torch."""
    _deprecated("reduce_scatter_tensor", "reduce_scatter_single")
    return _scatter_single("reduce_scatter_tensor", output, input, op, group, async_op)


def _gather_single(fn: str, output_tensor: Any, input_tensor: Any, group: Any,
                   async_op: bool) -> Work | None:
    comm = _group(group, fn)
    if comm is None:
        return None
    out, x = _t(output_tensor), _t(input_tensor)
    tiled = _layout(out, x, comm.size, "output_tensor", fn)
    return _result(comm.all_gather(x, tiled=tiled, out=out, async_op=async_op), async_op)


def _scatter_single(fn: str, output: Any, input: Any, op: Any, group: Any,
                    async_op: bool) -> Work | None:
    comm = _group(group, fn)
    if comm is None:
        return None
    out, x = _t(output), _t(input)
    tiled = _layout(x, out, comm.size, "input", fn)
    return _result(comm.reduce_scatter(x, _op(op, fn), tiled=tiled, out=out,
                                       async_op=async_op), async_op)


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"`dist.{old}` is deprecated (as `torch.distributed.{old}` is). Please use "
                  f"`dist.{new}` instead.", FutureWarning, stacklevel=3)


def reduce_scatter(output: Any, input_list: list, op: Any = ReduceOp.SUM, group: Any = None,
                   async_op: bool = False) -> Work | None:
    """``input_list[i]`` reduced over the group lands in rank i's ``output``."""
    comm = _group(group, "reduce_scatter")
    if comm is None:
        return None
    parts = _list(input_list, comm.size, "input_list", "reduce_scatter")
    out = _t(output)
    counts = [_numel(t) for t in parts]
    if any(c != _numel(out) for c in counts):
        raise ValueError(f"{_where('reduce_scatter')}: every tensor of input_list must have "
                         f"output's {_numel(out)} elements, got {counts}")
    x = _stack(parts)
    return _result(comm.reduce_scatter(x, _op(op, "reduce_scatter"), tiled=True,
                                       out=_flat(out, "output", "reduce_scatter"),
                                       async_op=async_op), async_op)


def all_to_all_single(output: Any, input: Any, output_split_sizes: Sequence[int] | None = None,
                      input_split_sizes: Sequence[int] | None = None, group: Any = None,
                      async_op: bool = False) -> Work | None:
    """Rows of ``input`` (dim 0) go to each rank by ``input_split_sizes`` (default: equal
    blocks); ``output`` receives each rank's by ``output_split_sizes``. Split sizes that do not
    match across ranks are a CollectiveMismatch (host ring), never a hang."""
    comm = _group(group, "all_to_all_single")
    if comm is None:
        return None
    out, x = _t(output), _t(input)
    if output_split_sizes is None and input_split_sizes is None:
        return _result(comm.all_to_all(x, tiled=True, out=out, async_op=async_op), async_op)
    sends = _splits(input_split_sizes, x, comm.size, "input_split_sizes")
    counts = _splits(output_split_sizes, out, comm.size, "output_split_sizes")
    starts = [sum(sends[:i]) for i in range(comm.size)]
    chunks = [x[s:s + n] for s, n in zip(starts, sends, strict=True)]
    return _result(comm.all_to_all_v(chunks, counts=counts, tiled=True, out=out,
                                     async_op=async_op), async_op)


def all_to_all(output_tensor_list: list, input_tensor_list: list, group: Any = None,
               async_op: bool = False) -> Work | None:
    """``input_tensor_list[j]`` goes to rank j; ``output_tensor_list[j]`` gets rank j's."""
    comm = _group(group, "all_to_all")
    if comm is None:
        return None
    ins = _list(input_tensor_list, comm.size, "input_tensor_list", "all_to_all")
    outs = _list(output_tensor_list, comm.size, "output_tensor_list", "all_to_all",
                 like=ins[0])
    chunks = [_flat(t, f"input_tensor_list[{j}]", "all_to_all") for j, t in enumerate(ins)]
    got = comm.all_to_all_v(chunks, counts=[_numel(t) for t in outs], async_op=async_op)
    return _then(got, async_op, lambda parts: _fill(outs, parts))


def gather(tensor: Any, gather_list: list | None = None, dst: int | None = None,
           group: Any = None, async_op: bool = False,
           group_dst: int | None = None) -> Work | None:
    """Every rank's ``tensor`` into ``dst``'s ``gather_list`` (given on ``dst`` only)."""
    comm = _group(group, "gather")
    if comm is None:
        return None
    root = _to_group(comm, dst, group_dst, "dst", "gather")
    outs = None
    if comm.rank == root:
        outs = _list(gather_list, comm.size, "gather_list", "gather", like=tensor)
        _sizes(outs, "gather_list", "gather", _numel(_t(tensor)))
    elif gather_list:
        raise ValueError(f"{_where('gather')}: gather_list is given on a rank that is not dst")
    got = comm.gather(_t(tensor, "tensor", "gather"), root, async_op=async_op)
    return _then(got, async_op, lambda rows: outs is not None and _fill(outs, list(rows)))


def scatter(tensor: Any, scatter_list: list | None = None, src: int | None = None,
            group: Any = None, async_op: bool = False,
            group_src: int | None = None) -> Work | None:
    """``src``'s ``scatter_list[i]`` (given on ``src`` only) into rank i's ``tensor``."""
    comm = _group(group, "scatter")
    if comm is None:
        return None
    root = _to_group(comm, src, group_src, "src", "scatter")
    out = _flat(_t(tensor), "tensor", "scatter")
    chunks = None
    if comm.rank == root:
        parts = _list(scatter_list, comm.size, "scatter_list", "scatter")
        chunks = [_flat(t, f"scatter_list[{i}]", "scatter") for i, t in enumerate(parts)]
    elif scatter_list:
        raise ValueError(f"{_where('scatter')}: scatter_list is given on a rank that is not src")
    return _result(comm.scatter_v(chunks, root, counts=[_numel(out)] * comm.size, out=out,
                                  async_op=async_op), async_op)


# ---- point to point ------------------------------------------------------------------------------

def send(tensor: Any, dst: int | None = None, group: Any = None, tag: int = 0,
         group_dst: int | None = None) -> None:
    """Send ``tensor`` to ``dst``, which receives it with ``recv``."""
    comm = _group(group, "send")
    if comm is not None:
        comm.send(_t(tensor, "tensor", "send"), _to_group(comm, dst, group_dst, "dst", "send", tag))


def recv(tensor: Any, src: int | None = None, group: Any = None, tag: int = 0,
         group_src: int | None = None) -> int:
    """Receive into ``tensor`` from ``src``; returns ``src`` (a global rank)."""
    comm = _group(group, "recv")
    if comm is None:
        return -1
    peer = _to_group(comm, src, group_src, "src", "recv", tag)
    comm.recv(_t(tensor, "tensor", "recv"), peer)
    return _global_ranks(comm)[peer]


def isend(tensor: Any, dst: int | None = None, group: Any = None, tag: int = 0,
          group_dst: int | None = None) -> Work | None:
    """Start sending ``tensor`` to ``dst``; returns its handle."""
    comm = _group(group, "isend")
    if comm is None:
        return None
    peer = _to_group(comm, dst, group_dst, "dst", "isend", tag)
    return _Handle(comm.isend(_t(tensor, "tensor", "isend"), peer))


def irecv(tensor: Any, src: int | None = None, group: Any = None, tag: int = 0,
          group_src: int | None = None) -> Work | None:
    """Start receiving into ``tensor`` from ``src``; returns its handle."""
    comm = _group(group, "irecv")
    if comm is None:
        return None
    peer = _to_group(comm, src, group_src, "src", "irecv", tag)
    return _Handle(comm.irecv(_t(tensor, "tensor", "irecv"), peer))


class P2POp:
    """One send or receive for ``batch_isend_irecv``: ``op`` is ``isend`` or ``irecv``."""

    def __init__(self, op: Callable, tensor: Any, peer: int | None = None, group: Any = None,
                 tag: int = 0, group_peer: int | None = None):
        name = getattr(op, "__name__", op)
        if name not in ("isend", "irecv"):
            raise TypeError(f"P2POp: op must be dist.isend or dist.irecv, got {op!r}")
        self.op, self.tensor, self.peer, self.group = name, tensor, peer, group
        self.tag, self.group_peer = tag, group_peer


def batch_isend_irecv(p2p_op_list: Sequence[P2POp]) -> list[Work]:
    """Post every ``P2POp`` together (one group of sends and receives); their handles."""
    if not p2p_op_list or not all(isinstance(p, P2POp) for p in p2p_op_list):
        raise ValueError(f"{_where('batch_isend_irecv')}: p2p_op_list must be a non-empty list of "
                         f"P2POp")
    groups = {id(p.group) for p in p2p_op_list}
    if len(groups) > 1:
        raise ValueError(f"{_where('batch_isend_irecv')}: every P2POp of a batch must name the "
                         f"same group")
    comm = _group(p2p_op_list[0].group, "batch_isend_irecv")
    if comm is None:
        return []
    ops = [_P2P(p.op, _t(p.tensor), _to_group(comm, p.peer, p.group_peer, "peer",
                                              "batch_isend_irecv", p.tag))
           for p in p2p_op_list]
    return [_Handle(w) for w in comm.batch_isend_irecv(ops)]


# ---- barriers ------------------------------------------------------------------------------------

def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None,
            timeout: Any = None) -> Work | None:
    """Return once every rank of the group has called it."""
    comm = _group(group, "barrier")
    if comm is None:
        return None
    return _result(comm.barrier(async_op=async_op, timeout=_seconds(timeout, "barrier")),
                   async_op)


def monitored_barrier(group: Any = None, timeout: Any = None,
                      wait_all_ranks: bool = False) -> None:
    """A barrier that names every rank that did not arrive within ``timeout`` (it always names
    all of them, as torch does with ``wait_all_ranks=True``)."""
    comm = _group(group, "monitored_barrier")
    if comm is not None:
        comm.monitored_barrier(timeout=_seconds(timeout, "monitored_barrier"))


# ---- objects -------------------------------------------------------------------------------------

def broadcast_object_list(object_list: list, src: int | None = None, group: Any = None,
                          device: Any = None, group_src: int | None = None) -> None:
    """``src``'s ``object_list`` items into every rank's ``object_list`` (same length)."""
    comm = _group(group, "broadcast_object_list")
    if comm is None:
        return
    root = _to_group(comm, src, group_src, "src", "broadcast_object_list")
    got = comm.broadcast_object(list(object_list) if comm.rank == root else None, root)
    if comm.rank != root:
        if len(got) != len(object_list):
            raise ValueError(f"{_where('broadcast_object_list')}: src sent {len(got)} objects "
                             f"into an object_list of {len(object_list)}")
        object_list[:] = got


def all_gather_object(object_list: list, obj: Any, group: Any = None) -> None:
    """``object_list[i]`` gets rank i's ``obj`` (the list has one entry per rank)."""
    comm = _group(group, "all_gather_object")
    if comm is not None:
        _list(object_list, comm.size, "object_list", "all_gather_object")
        object_list[:] = comm.all_gather_object(obj)


def gather_object(obj: Any, object_gather_list: list | None = None, dst: int | None = None,
                  group: Any = None, group_dst: int | None = None) -> None:
    """Every rank's ``obj`` into ``dst``'s ``object_gather_list``."""
    comm = _group(group, "gather_object")
    if comm is None:
        return
    root = _to_group(comm, dst, group_dst, "dst", "gather_object")
    if comm.rank == root:
        _list(object_gather_list, comm.size, "object_gather_list", "gather_object")
    got = comm.gather_object(obj, root)
    if comm.rank == root:
        object_gather_list[:] = got


def scatter_object_list(scatter_object_output_list: list, scatter_object_input_list: Any = None,
                        src: int | None = None, group: Any = None,
                        group_src: int | None = None) -> None:
    """``src``'s ``scatter_object_input_list[i]`` into rank i's
    ``scatter_object_output_list[0]``."""
    comm = _group(group, "scatter_object_list")
    if comm is None:
        return
    root = _to_group(comm, src, group_src, "src", "scatter_object_list")
    if not isinstance(scatter_object_output_list, list) or not scatter_object_output_list:
        raise ValueError(f"{_where('scatter_object_list')}: scatter_object_output_list must be a "
                         "list of at least one element")
    objs = None
    if comm.rank == root:
        objs = _list(scatter_object_input_list, comm.size, "scatter_object_input_list",
                     "scatter_object_list")
    scatter_object_output_list[0] = comm.scatter_object(objs, root)


def send_object_list(object_list: list, dst: int | None = None, group: Any = None,
                     device: Any = None, group_dst: int | None = None) -> None:
    """Send the items of ``object_list`` to ``dst``."""
    comm = _group(group, "send_object_list")
    if comm is not None:
        comm.send_object(list(object_list),
                         _to_group(comm, dst, group_dst, "dst", "send_object_list"))


def recv_object_list(object_list: list, src: int | None = None, group: Any = None,
                     device: Any = None, group_src: int | None = None) -> int:
    """Receive ``src``'s objects into ``object_list`` (same length); returns ``src``."""
    comm = _group(group, "recv_object_list")
    if comm is None:
        return -1
    peer = _to_group(comm, src, group_src, "src", "recv_object_list")
    got = comm.recv_object(peer)
    if len(got) != len(object_list):
        raise ValueError(f"{_where('recv_object_list')}: rank {peer} sent {len(got)} objects into "
                         f"a list of {len(object_list)}")
    object_list[:] = got
    return _global_ranks(comm)[peer]


# ---- handles -------------------------------------------------------------------------------------

class _Handle(Work):
    """torch's ``Work`` face on a gpucoll one: ``wait()`` returns True; ``then`` runs once,
    when the call is done (copying results into the caller's list)."""

    def __init__(self, inner: Work, then: Callable[[Any], Any] | None = None):
        self._inner, self._then = inner, then
        self._label = inner._label

    def is_completed(self) -> bool:
        return self._inner.is_completed()

    def _wait(self, timeout: float | None) -> bool:
        return self._inner._wait(timeout)

    def wait(self, timeout: Any = None) -> bool:
        value = self._inner.wait(_seconds(timeout, "wait"))
        then, self._then = self._then, None
        if then is not None:
            then(value)
        return True

    def synchronize(self, timeout: Any = None) -> None:
        """torch's: block until the call is done (results in place, as ``wait()``)."""
        self.wait(timeout)

    def result(self) -> Any:
        raise NotImplementedError(f"{self._label}: Work.result() is not provided by "
                                  f"gpucoll.distributed; after wait() the results are in the "
                                  f"tensors given to the call")


def _result(value: Any, async_op: bool) -> Work | None:
    return _Handle(value) if async_op else None


def _then(value: Any, async_op: bool, then: Callable[[Any], Any]) -> Work | None:
    if async_op:
        return _Handle(value, then)
    then(value)
    return None


# ---- translating arguments -----------------------------------------------------------------------

def _world(fn: str) -> Communicator:
    if not _default.is_initialized():
        raise RuntimeError(f"{_where(fn)}: the default process group is not initialized; call "
                           f"dist.init_process_group() first")
    return _default.get_default()


def _group(group: Any, fn: str, *, warn: bool = True) -> Communicator | None:
    """The communicator ``group`` stands for; None on a rank that is not a member."""
    if group is None or group is GroupMember.WORLD:
        return _world(fn)
    if group is GroupMember.NON_GROUP_MEMBER:
        if warn:
            warnings.warn(f"{fn} on a rank that is not in the given group: it does nothing here "
                          f"(as in torch.distributed)", stacklevel=3)
        return None
    if isinstance(group, Communicator):
        return group
    raise TypeError(f"{_where(fn)}: group must be None, dist.group.WORLD or a group made by "
                    f"dist.new_group, got {type(group).__name__}")


def _where(fn: str) -> str:
    """``fn on rank R of N`` (the job's rank) for messages, as the communicator's own say."""
    world = _default.get_default() if _default.is_initialized() else None
    return fn if world is None else f"{fn} on rank {world.rank} of {world.size}"


def _not_member(fn: str) -> Any:
    raise ValueError(f"{_where(fn)}: this rank is not in the group")


def _global_ranks(comm: Communicator) -> tuple[int, ...]:
    """The global rank of each of ``comm``'s ranks (its own numbering when it was not made by
    ``new_group``)."""
    return _members.get(comm) or tuple(range(comm.size))


def _to_group(comm: Communicator, rank: Any, group_rank: Any, name: str, fn: str,
              tag: Any = 0) -> int:
    """``name`` (a global rank) or ``group_<name>`` (a rank of ``comm``) as a rank of ``comm``."""
    if tag not in (0, None):
        raise ValueError(f"{_where(fn)}: tag={tag!r}: only tag 0 is taken here, since gpucoll's "
                         "array messages between two ranks pair in the order they were sent, not "
                         "by tag as torch's do; leave tag at 0")
    if rank is not None and group_rank is not None:
        raise ValueError(f"{_where(fn)}: pass {name} or group_{name}, not both")
    if group_rank is not None:
        return group_rank  # the communicator checks it
    if rank is None:
        any_source = " (receiving from any source is not supported)" if name == "src" else ""
        raise ValueError(f"{_where(fn)}: {name} is required{any_source}")
    ranks = _global_ranks(comm)
    try:
        return ranks.index(rank)
    except ValueError:
        raise ValueError(f"{_where(fn)}: {name}={rank!r} is not a rank of the group (its global "
                         f"ranks are {list(ranks)})") from None


def _t(tensor: Any, name: str = "tensor", fn: str = "") -> Any:
    """The array the communicator sees, sharing ``tensor``'s memory. A CPU torch tensor becomes
    its NumPy view (``numpy()``; bfloat16 through ml_dtypes' dtype), so it takes the same path as
    a NumPy array; a CUDA tensor is passed on detached from autograd (the communicator reads it
    through ``__cuda_array_interface__``/DLPack). Anything else passes unchanged."""
    if not type(tensor).__module__.startswith("torch"):
        if fn and (tensor is None or isinstance(tensor, (list, tuple, int, float, complex))):
            raise TypeError(f"{_where(fn)}: {name} must be a tensor (torch, NumPy or CuPy), got "
                            f"{type(tensor).__name__}")
        return tensor
    x = tensor.detach()  # same memory; torch's collectives also take tensors that require grad
    if x.device.type != "cpu":
        return x
    torch = sys.modules["torch"]  # loaded: tensor is one of its tensors
    if x.dtype == torch.bfloat16:  # NumPy has no bfloat16 of its own
        return x.view(torch.int16).numpy().view(dtype_from_name("bfloat16"))
    try:
        return x.numpy()
    except RuntimeError as e:  # a lazy conjugate or negative view: no memory of its own to share
        raise ValueError(f"{_where(fn or 'tensor')}: {name} cannot be shared without a copy "
                         f"({e})") from None


def _op(op: Any, fn: str) -> Any:
    """gpucoll's op for torch's (ours, a name, or a ``torch.distributed.ReduceOp``)."""
    if isinstance(op, (_Op, str)):
        return op
    name = getattr(op, "name", None) or str(op).rsplit(".", 1)[-1]
    if name == "PRODUCT":
        return _Op.PROD
    if name in ("SUM", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR"):
        return _Op[name]
    raise ValueError(f"{_where(fn)}: op={op!r} is not supported; expected one of "
                     f"dist.ReduceOp.SUM, PRODUCT, MIN, MAX, AVG, BAND, BOR, BXOR")


def _backend(backend: Any) -> str:
    key = "" if backend is None else str(backend).lower()
    if key not in _BACKENDS:
        raise ValueError(f"{_where('init_process_group')}: backend={backend!r} is not supported; "
                         f"expected "
                         f"'gloo' (the host ring), 'nccl', or None (NCCL where every rank can "
                         f"use it, else the host ring)")
    return _BACKENDS[key]


def _seconds(timeout: Any, fn: str) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"{_where(fn)}: timeout must be seconds or a datetime.timedelta, got "
                        f"{type(timeout).__name__}")
    return float(timeout)


def _start_timeout(timeout: Any) -> float:
    """init_process_group's deadline in seconds: ``timeout``, else GPUCOLL_TIMEOUT or 300."""
    seconds = _seconds(timeout, "init_process_group")
    if seconds is None:
        seconds = float(os.environ.get("GPUCOLL_TIMEOUT") or _default.DEFAULT_TIMEOUT)
    return check_timeout(seconds, "timeout", "init_process_group")


def _device_index(device_id: Any) -> Any:
    if device_id is None or isinstance(device_id, int):
        return device_id
    index = getattr(device_id, "index", None)
    return 0 if index is None else index


def _close_owned() -> None:
    """Close the store init_process_group made; the rank hosting it lets the others finish with
    it first (``init_methods.release``), also when start-up failed: a rank told of a
    disagreement must still be able to read it there."""
    global _owned_store
    store, _owned_store = _owned_store, None
    if store is not None:
        init_methods.release(store)


def _list(value: Any, size: int, name: str, fn: str, like: Any = None) -> list:
    """``value`` checked to be a list of one entry per rank; with ``like`` (an array), of
    arrays of ``like``'s dtype (results are copied into them: a cast would go unnoticed)."""
    if not isinstance(value, list) or len(value) != size:
        got = f"a list of {len(value)}" if isinstance(value, list) else type(value).__name__
        raise ValueError(f"{_where(fn)}: {name} must be a list of {size} (one per rank of the "
                         f"group), got {got}")
    if like is not None:
        want = _t(like).dtype
        for i, entry in enumerate(value):
            got = getattr(_t(entry), "dtype", type(entry).__name__)
            if got != want:
                raise TypeError(f"{_where(fn)}: {name}[{i}] is {got}, but the tensor sent is "
                                f"{want}; every tensor of the call must have the same dtype")
    return value


def _sizes(tensors: list, name: str, fn: str, want: int | None = None) -> list[int]:
    """The element counts of ``tensors``; with ``want``, ValueError unless all are ``want``."""
    counts = [_numel(t) for t in tensors]
    wrong = [i for i, c in enumerate(counts) if want is not None and c != want]
    if wrong:
        raise ValueError(f"{_where(fn)}: {name}[{wrong[0]}] has {counts[wrong[0]]} elements, "
                         f"but the tensor sent has {want}")
    return counts


def _numel(tensor: Any) -> int:
    numel = getattr(tensor, "numel", None)
    if callable(numel):
        return int(numel())
    return int(getattr(tensor, "size", 0))


def _flat(tensor: Any, name: str, fn: str) -> Any:
    """A 1-D view of a contiguous tensor (its memory, not a copy)."""
    x = _t(tensor)
    try:
        as_ref(x, name)
    except ValueError:  # not contiguous: a flat copy would lose what the call writes into it
        raise ValueError(f"{_where(fn)}: {name} must be contiguous here, as torch.distributed "
                         f"requires "
                         f"(got shape {list(x.shape)}); pass {name}.contiguous()") from None
    return x.reshape(-1)


def _layout(big: Any, small: Any, size: int, name: str, fn: str) -> bool:
    """True when ``big`` holds ``size`` copies of ``small`` concatenated along dim 0, False when
    stacked on a new leading dim; ValueError otherwise."""
    shape, one = tuple(big.shape), tuple(small.shape)
    if one and shape == (size * one[0], *one[1:]):
        return True
    if shape == (size, *one):
        return False
    raise ValueError(f"{_where(fn)}: {name} has shape {list(shape)}; with {size} ranks and a "
                     f"tensor of "
                     f"shape {list(one)} it must be {[size * (one[0] if one else 1), *one[1:]]} "
                     f"or {[size, *one]}")


def _splits(sizes: Any, tensor: Any, size: int, name: str) -> list[int]:
    rows = tuple(tensor.shape)[0] if tuple(tensor.shape) else 1
    if sizes is None:
        if rows % size:
            raise ValueError(f"{_where('all_to_all_single')}: without {name}, dim 0 ({rows}) must "
                             f"divide into {size} equal blocks")
        return [rows // size] * size
    sizes = [operator.index(s) for s in sizes]
    if len(sizes) != size or any(s < 0 for s in sizes) or sum(sizes) != rows:
        raise ValueError(f"{_where('all_to_all_single')}: {name}={sizes} must be {size} "
                         f"non-negative sizes adding up to dim 0 ({rows})")
    return sizes


def _stack(tensors: list) -> Any:
    """The tensors, flattened and concatenated, in one new array of their library."""
    arrays = [_t(t).reshape(-1) for t in tensors]
    if type(arrays[0]).__module__.startswith("torch"):  # CUDA tensors
        return sys.modules["torch"].cat(arrays)
    xp = sys.modules["cupy"] if type(arrays[0]).__module__.startswith("cupy") else np
    return xp.concatenate([xp.asarray(a) for a in arrays])


def _fill(outs: list, parts: list) -> None:
    """Copy each result into the caller's tensor of the same index."""
    for i, (dst, part) in enumerate(zip(outs, parts, strict=True)):
        if _numel(part) != _numel(dst):
            raise ValueError(f"output list entry {i} has {_numel(dst)} elements, but rank {i} "
                             f"sent {_numel(part)}")
        write_back(as_ref(part.reshape(tuple(dst.shape)), "result"), _t(dst))


__all__ = [
    "Backend", "GroupMember", "P2POp", "ReduceOp", "all_gather", "all_gather_into_tensor",
    "all_gather_single", "reduce_scatter_single",
    "all_gather_object", "all_reduce", "all_to_all", "all_to_all_single", "barrier",
    "batch_isend_irecv", "broadcast", "broadcast_object_list", "destroy_process_group",
    "gather", "gather_object", "get_backend", "get_global_rank", "get_group_rank",
    "get_local_rank", "get_node_local_rank", "get_process_group_ranks", "get_rank",
    "get_world_size", "group", "init_process_group", "irecv", "is_available",
    "is_initialized", "isend", "monitored_barrier", "new_group", "recv", "recv_object_list",
    "reduce", "reduce_op", "reduce_scatter", "reduce_scatter_tensor", "scatter",
    "scatter_object_list", "send", "send_object_list",
]

