"""``gpucoll.init()`` and the module-level functions that act on the default communicator."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from gpucoll import rendezvous
from gpucoll.backends import create_backend, requested_name
from gpucoll.communicator import Communicator
from gpucoll.errors import CollectiveTimeout, PeerFailure
from gpucoll.messages import ANY_SOURCE
from gpucoll.progress import size_from_env
from gpucoll.transport.mesh import check_environment
from gpucoll.validation import check_timeout
from gpucoll.work import Work

DEFAULT_TIMEOUT = 300.0
_default: Communicator | None = None
_torchrun_stores = 0  # start-ups of this process through torchrun's store (_torchrun_store)


def init(backend: str = "auto", *, rank: int | None = None, world_size: int | None = None,
         store: Any = None, timeout: float | None = None, device: Any = None) -> Communicator:
    """Join the group and return its communicator, which also becomes the default one.

    With ``rank``/``world_size`` None they come from the environment (gpucoll's launcher, torchrun,
    Slurm, Open MPI, MPICH); a script started without any launcher runs as a world of one rank (as
    under mpi4py), with one notice line on stderr that says so. ``store`` is a TCPStore/PrefixStore,
    an address ``"tcp://host:port"`` of a running store, or None: the environment's store (rank 0
    hosts it unless it already runs), or for a one-rank group given explicitly a private one.
    ``timeout`` (seconds; default GPUCOLL_TIMEOUT or 300) bounds start-up and every call.
    ``device`` is the CUDA device for the NCCL backend. Collective over the group.
    """
    global _default
    if _default is not None and not _default.closed:
        raise RuntimeError(f"gpucoll.init: already initialised ({_default!r}); call "
                           f"gpucoll.close() first")
    _default = create(backend, rank=rank, world_size=world_size, store=store, timeout=timeout,
                      device=device)
    return _default


def create(backend: str = "auto", *, rank: int | None = None, world_size: int | None = None,
           store: Any = None, timeout: float | None = None, device: Any = None) -> Communicator:
    """What ``init`` does, without making the result the default communicator."""
    from gpucoll.progress import interval
    from gpucoll.store import leave_group

    name = requested_name(backend)
    timeout = _timeout(timeout)
    interval()  # a bad GPUCOLL_WAIT_LOG is an error here, before any wait
    size_from_env()  # a bad GPUCOLL_TRACE_SIZE is an error before anything is made
    check_environment()  # and so are the transports' variables
    rank, world_size, base, owned = _rendezvous(rank, world_size, store, timeout)
    space = None
    try:
        space = _namespace(base, rank, world_size, timeout)
        engine = create_backend(name, space, rank, world_size, timeout=timeout, device=device)
    except BaseException as exc:
        if space is not None:  # the others learn that this rank left, and for whose failure
            culprit = getattr(exc, "peer", None) if isinstance(exc, PeerFailure) else None
            if culprit is not None and culprit != rank:
                leave_group(space, rank, world_size, str(exc), culprit)
            else:
                leave_group(space, rank, world_size)
        if owned is not None:
            owned.close()
        raise
    return Communicator(engine, space, timeout=timeout, owned_store=owned)


def _timeout(timeout: float | None) -> float:
    if timeout is None:
        raw = os.environ.get("GPUCOLL_TIMEOUT", "").strip()
        try:
            timeout = float(raw) if raw else DEFAULT_TIMEOUT
        except ValueError:
            raise ValueError(f"GPUCOLL_TIMEOUT={raw!r}: expected the seconds start-up and each "
                             f"call may take (a number > 0)") from None
        return check_timeout(timeout, "GPUCOLL_TIMEOUT", "gpucoll.init")
    return check_timeout(timeout, "timeout", "gpucoll.init")


def _rendezvous(rank: Any, world_size: Any, store: Any,
                timeout: float) -> tuple[int, int, Any, Any]:
    """(rank, world size, store, the store if init made it and must close it, else None)."""
    from gpucoll.store import TCPStore, parse_address

    if (rank is None) != (world_size is None):
        raise ValueError("gpucoll.init: pass both rank and world_size, or neither (then they "
                         "come from the environment)")
    env = None
    if rank is None:
        if rendezvous.launcher_named():
            env = rendezvous.from_env()
            rank, world_size = env.rank, env.world_size
        else:
            rank, world_size = 0, 1
            _say_alone()
    _check_rank(rank, world_size)
    if isinstance(store, str):
        host, port = parse_address(store)
        made = TCPStore(host, port, timeout=timeout)
        return rank, world_size, made, made
    if store is not None:
        return rank, world_size, store, None
    if env is None and world_size == 1:
        made = TCPStore("127.0.0.1", 0, is_server=True, timeout=timeout)
        return rank, world_size, made, made
    if env is None:  # explicit rank and size: the store's address may still be in the env
        try:
            env = dataclasses.replace(rendezvous.from_env(), rank=rank, world_size=world_size)
        except rendezvous.RendezvousError:
            raise ValueError("gpucoll.init: with rank and world_size given, also pass store= "
                             "(a TCPStore or 'tcp://host:port') or set GPUCOLL_STORE or "
                             "GPUCOLL_MASTER_ADDR") from None
    made = _torchrun_store(env, timeout) if _under_torchrun(env) else \
        rendezvous.connect_store(env, timeout)
    return rank, world_size, made, made


def _under_torchrun(env: Any) -> bool:
    """True under torchrun, whose agent hosts a store at MASTER_ADDR:MASTER_PORT that the
    ranks may use, when nothing names gpucoll's own store and torch can be imported."""
    import importlib.util

    return (env.source == "torchrun" and not env.store_is_running
            and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and not os.environ.get("GPUCOLL_MASTER_PORT")
            and importlib.util.find_spec("torch") is not None)


def _torchrun_store(env: Any, timeout: float) -> Any:
    """Under torchrun: rank 0 hosts gpucoll's store on a free port and tells the other ranks
    that port through the store of torchrun's agent. (MASTER_PORT + 1, the port used without
    torchrun's store, is not reserved: under load another process may hold it.)"""
    import datetime
    import time

    from torch.distributed import TCPStore as AgentStore

    from gpucoll import rendezvous
    from gpucoll.progress import Waiting

    global _torchrun_stores
    agent = AgentStore(os.environ.get("MASTER_ADDR", "127.0.0.1"),
                       int(os.environ["MASTER_PORT"]), is_master=False,
                       timeout=datetime.timedelta(seconds=timeout))
    # one key per start-up: a job that starts again (after close) must not read the port of
    # its last store, which rank 0 closed; every rank starts up as often, in the same order
    _torchrun_stores += 1
    key = f"gpucoll/store-port/{env.job_id}/{_torchrun_stores}"
    if env.rank == 0:
        made = rendezvous.connect_store(dataclasses.replace(env, store_port=0), timeout)
        agent.set(key, str(made.port))
        return made
    deadline = time.monotonic() + timeout
    notice = Waiting(f"start-up on rank {env.rank} of {env.world_size}", timeout)
    while not agent.check([key]):
        now = time.monotonic()
        if now >= deadline:
            raise CollectiveTimeout(
                f"start-up on rank {env.rank} of {env.world_size}: rank 0 never arrived (it "
                f"did not publish its store's port in torchrun's store within {timeout:g} s)")
        notice.tick(lambda: "for rank 0 to publish its store's port in torchrun's store", now)
        time.sleep(0.05)  # a poll of torchrun's store, bounded by the deadline above
    port = int(agent.get(key))
    return rendezvous.connect_store(dataclasses.replace(env, store_port=port), timeout)


def _say_alone() -> None:
    """The one line a script started without a launcher gets (it runs as a world of one)."""
    import sys

    print("gpucoll: no launcher found (no rank or world size in the environment): running as "
          "a world of 1 rank; start N ranks with `gpucoll run -n N script.py`",
          file=sys.stderr, flush=True)


def _check_rank(rank: Any, world_size: Any) -> None:
    for name, value in (("rank", rank), ("world_size", world_size)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"gpucoll.init: {name} must be an int, got {type(value).__name__}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"gpucoll.init: need 0 <= rank < world_size, got rank={rank}, "
                         f"world_size={world_size}")
    if world_size > rendezvous.MAX_WORLD_SIZE:
        raise ValueError(f"gpucoll.init: world_size={world_size} is more ranks than gpucoll "
                         f"supports ({rendezvous.MAX_WORLD_SIZE})")


def _namespace(store: Any, rank: int, world_size: int, timeout: float) -> Any:
    """A namespace of ``store`` for this communicator alone, under its job's (the launcher's
    job id), agreed on by every rank of the group; its keys go when its last rank closes it."""
    from gpucoll import rendezvous

    return rendezvous.join_group(store, rank, world_size, job=rendezvous.job_id(),
                                 timeout=timeout)


def is_initialized() -> bool:
    """True while a default communicator is open."""
    return _default is not None and not _default.closed


def get_default() -> Communicator:
    """The communicator ``gpucoll.init()`` made; RuntimeError before init or after close."""
    if not is_initialized():
        raise RuntimeError("gpucoll is not initialised: call gpucoll.init() first")
    return _default


def get_rank() -> int:
    """This process's rank in the default communicator."""
    return get_default().rank


def get_world_size() -> int:
    """The number of ranks in the default communicator."""
    return get_default().size


def close() -> None:
    """Close the default communicator (a no-op when there is none)."""
    global _default
    comm, _default = _default, None
    if comm is not None:
        comm.close()


def all_reduce(x: Any, op: Any = "sum", **kwargs: Any) -> Any:
    """``Communicator.all_reduce`` on the default communicator."""
    return get_default().all_reduce(x, op, **kwargs)


def reduce(x: Any, root: int = 0, op: Any = "sum", **kwargs: Any) -> Any:
    """``Communicator.reduce`` on the default communicator."""
    return get_default().reduce(x, root, op, **kwargs)


def broadcast(x: Any, root: int = 0, **kwargs: Any) -> Any:
    """``Communicator.broadcast`` on the default communicator."""
    return get_default().broadcast(x, root, **kwargs)


def all_gather(x: Any, **kwargs: Any) -> Any:
    """``Communicator.all_gather`` on the default communicator."""
    return get_default().all_gather(x, **kwargs)


def gather(x: Any, root: int = 0, **kwargs: Any) -> Any:
    """``Communicator.gather`` on the default communicator."""
    return get_default().gather(x, root, **kwargs)


def scatter(x: Any = None, root: int = 0, **kwargs: Any) -> Any:
    """``Communicator.scatter`` on the default communicator."""
    return get_default().scatter(x, root, **kwargs)


def reduce_scatter(x: Any, op: Any = "sum", **kwargs: Any) -> Any:
    """``Communicator.reduce_scatter`` on the default communicator."""
    return get_default().reduce_scatter(x, op, **kwargs)


def all_to_all(x: Any, **kwargs: Any) -> Any:
    """``Communicator.all_to_all`` on the default communicator."""
    return get_default().all_to_all(x, **kwargs)


def send(x: Any, dst: int, **kwargs: Any) -> Work | None:
    """``Communicator.send`` on the default communicator."""
    return get_default().send(x, dst, **kwargs)


def recv(x: Any, src: int, **kwargs: Any) -> Any:
    """``Communicator.recv`` on the default communicator."""
    return get_default().recv(x, src, **kwargs)


def barrier(**kwargs: Any) -> Work | None:
    """``Communicator.barrier`` on the default communicator."""
    return get_default().barrier(**kwargs)


def split(color: int | None, key: int = 0, **kwargs: Any) -> Communicator | None:
    """``Communicator.split`` on the default communicator."""
    return get_default().split(color, key, **kwargs)


def isend(x: Any, dst: int, **kwargs: Any) -> Work:
    """``Communicator.isend`` on the default communicator."""
    return get_default().isend(x, dst, **kwargs)


def irecv(x: Any, src: int, **kwargs: Any) -> Work:
    """``Communicator.irecv`` on the default communicator."""
    return get_default().irecv(x, src, **kwargs)


def batch(**kwargs: Any) -> Any:
    """``Communicator.batch`` on the default communicator."""
    return get_default().batch(**kwargs)


def batch_isend_irecv(ops: Any, **kwargs: Any) -> list[Work]:
    """``Communicator.batch_isend_irecv`` on the default communicator."""
    return get_default().batch_isend_irecv(ops, **kwargs)


def all_gather_v(x: Any, **kwargs: Any) -> Any:
    """``Communicator.all_gather_v`` on the default communicator."""
    return get_default().all_gather_v(x, **kwargs)


def gather_v(x: Any, root: int = 0, **kwargs: Any) -> Any:
    """``Communicator.gather_v`` on the default communicator."""
    return get_default().gather_v(x, root, **kwargs)


def scatter_v(chunks: Any = None, root: int = 0, **kwargs: Any) -> Any:
    """``Communicator.scatter_v`` on the default communicator."""
    return get_default().scatter_v(chunks, root, **kwargs)


def all_to_all_v(chunks: Any, **kwargs: Any) -> Any:
    """``Communicator.all_to_all_v`` on the default communicator."""
    return get_default().all_to_all_v(chunks, **kwargs)


def reduce_scatter_v(x: Any, counts: Any, op: Any = "sum", **kwargs: Any) -> Any:
    """``Communicator.reduce_scatter_v`` on the default communicator."""
    return get_default().reduce_scatter_v(x, counts, op, **kwargs)


def all_reduce_many(arrays: Any, op: Any = "sum", **kwargs: Any) -> Any:
    """``Communicator.all_reduce_many`` on the default communicator."""
    return get_default().all_reduce_many(arrays, op, **kwargs)


def broadcast_object(obj: Any = None, root: int = 0, **kwargs: Any) -> Any:
    """``Communicator.broadcast_object`` on the default communicator."""
    return get_default().broadcast_object(obj, root, **kwargs)


def all_gather_object(obj: Any, **kwargs: Any) -> list:
    """``Communicator.all_gather_object`` on the default communicator."""
    return get_default().all_gather_object(obj, **kwargs)


def gather_object(obj: Any, root: int = 0, **kwargs: Any) -> Any:
    """``Communicator.gather_object`` on the default communicator."""
    return get_default().gather_object(obj, root, **kwargs)


def scatter_object(objs: Any = None, root: int = 0, **kwargs: Any) -> Any:
    """``Communicator.scatter_object`` on the default communicator."""
    return get_default().scatter_object(objs, root, **kwargs)


def send_object(obj: Any, dst: int, **kwargs: Any) -> None:
    """``Communicator.send_object`` on the default communicator."""
    get_default().send_object(obj, dst, **kwargs)


def recv_object(src: int = ANY_SOURCE, **kwargs: Any) -> Any:
    """``Communicator.recv_object`` on the default communicator."""
    return get_default().recv_object(src, **kwargs)


def isend_object(obj: Any, dst: int, **kwargs: Any) -> Work:
    """``Communicator.isend_object`` on the default communicator."""
    return get_default().isend_object(obj, dst, **kwargs)


def irecv_object(src: int = ANY_SOURCE, **kwargs: Any) -> Work:
    """``Communicator.irecv_object`` on the default communicator."""
    return get_default().irecv_object(src, **kwargs)


def all_reduce_object(obj: Any, op: Any = "sum", **kwargs: Any) -> Any:
    """``Communicator.all_reduce_object`` on the default communicator."""
    return get_default().all_reduce_object(obj, op, **kwargs)


def reduce_object(obj: Any, root: int = 0, op: Any = "sum", **kwargs: Any) -> Any:
    """``Communicator.reduce_object`` on the default communicator."""
    return get_default().reduce_object(obj, root, op, **kwargs)


def new_group(ranks: Any, **kwargs: Any) -> Communicator | None:
    """``Communicator.new_group`` on the default communicator: collective over all its ranks,
    listed or not (as torch.distributed.new_group)."""
    return get_default().new_group(ranks, **kwargs)


def monitored_barrier(**kwargs: Any) -> None:
    """``Communicator.monitored_barrier`` on the default communicator."""
    get_default().monitored_barrier(**kwargs)
