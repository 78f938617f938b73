"""Backends by name, what ``backend="auto"`` picks, the host ring's rank order, and what a
communicator asks of a backend (``Backend``).

``create_backend(requested, store, rank, size, ...)`` resolves the name ("auto" through
``choose_backend``; GPUCOLL_BACKEND stands in for "auto" when set) and builds that backend; the
backend modules are imported only then, so ``import gpucoll`` never loads CUDA.

The host ring's rank order is chosen from the machine's topology and agreed through one key
(``agree_order``). When every rank of a group runs on one host and each has a CUDA device of its
own, rank 0 asks ``gpucoll.topology`` for the GPU ring that keeps neighbours on the fastest links
and publishes it as a rank order; everyone else reads it. Otherwise, or when the topology cannot
be read, the ring keeps rank order. Choosing never fails a communicator: only a lost rank 0 is
an error.

What a communicator asks of a backend (``Backend``): the communicator validates every argument
once, then hands a backend flat, contiguous buffers (``ArrayRef``) of one supported dtype, roots
in range and sizes that agree, so a backend only moves and combines bytes. Backends never import
the communicator.

Buffer layout, ``n`` = elements of one slot:
  all_reduce/broadcast/reduce   x: n elements, in place (reduce: result meaningful on root)
  all_gather                    x: n, out: size*n (slot i = rank i's x)
  gather                        x: n, out: size*n on root, None elsewhere
  scatter                       x: size*n on root, None elsewhere; out: n
  reduce_scatter                x: size*n, out: n (slot `rank` reduced over ranks)
  all_to_all                    x: size*n, out: size*n (out slot j = rank j's x slot `rank`)
  send/recv                     x: n

Out of place (``x`` is left as it is; the ring copies it into ``out`` first, NCCL reads ``x``):
  all_reduce_out                x: n, out: n
  reduce_out                    x: n, out: n on root (None elsewhere)
  broadcast_out                 x: n on root (None elsewhere), out: n

Uneven sizes (``counts[r]``: rank r's elements; ``layout``: a digest of the counts and trailing
shape that every rank must agree on, which the ring stamps on its messages):
  exchange                      sends, recvs: [(peer, ref)]; one grouped round of messages that
                                progress together; between two ranks they pair in order; a
                                send to this rank pairs with a receive from it (a copy)
  all_gather_v                  x: counts[rank], out: sum(counts), slot r at sum(counts[:r])
  reduce_scatter_v              x: sum(counts) (slots as all_gather_v's out), out: counts[rank]

Many arrays, and point to point in one go:
  all_reduce_coalesced          xs: arrays, each reduced in place, fused where the backend can
  batch_p2p                     ops: [(is_send, ref, peer)] -> one Work per op, all posted together

Modules: ``ring`` (``RingBackend``, the host ring: NumPy arrays over shared memory and TCP),
``ring_algos`` (its algorithms, one function per collective, and its grouped and uneven
rounds), ``staged`` (device arrays staged through host memory over the ring), and the package
``nccl`` (the NCCL backend: device arrays, and NumPy arrays staged through device memory).
"""

from __future__ import annotations

import abc
import json
import logging
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from gpucoll import cuda
from gpucoll.errors import BackendUnavailable, GpucollError
from gpucoll.progress import Progress
from gpucoll.store import Liveness, fetch

if TYPE_CHECKING:
    from gpucoll.arrays import ArrayRef
    from gpucoll.ops import ReduceOp
    from gpucoll.work import Work


# ---- what a communicator asks of a backend -------------------------------------------------------

class Backend(abc.ABC):
    """A communicator's engine for one group of ranks; constructing one is collective."""

    name: ClassVar[str]
    # True when collectives accept host (NumPy) arrays, so that the communicator can agree on
    # small values (scatter's slot layout, split's colours) in-band rather than in the store
    host_control: ClassVar[bool] = False

    rank: int
    size: int
    # the backend that serves flat NumPy arrays through ``host_all_reduce(x, op, seq, timeout)``
    # and ``host_broadcast(x, root, seq, timeout)``, the communicator's lean path for the common
    # calls, and async all_reduces through ``can_start(x, op)`` and ``start_all_reduce(x, op,
    # seq, timeout)`` (None: every call takes the general path)
    lean: Backend | None = None

    @property
    def progress(self) -> Progress:
        """This rank's progress record: the communicator marks each call in it; a backend
        may share it with its peers (the ring does) and stamps its messages with it."""
        record = self.__dict__.get("_progress_record")
        if record is None:
            record = self.__dict__["_progress_record"] = Progress()
        return record

    @abc.abstractmethod
    def all_reduce(self, x: ArrayRef, op: ReduceOp, *, timeout: float, stream: Any = None) -> None:
        ...

    @abc.abstractmethod
    def broadcast(self, x: ArrayRef, root: int, *, timeout: float, stream: Any = None) -> None:
        ...

    @abc.abstractmethod
    def reduce(
        self, x: ArrayRef, root: int, op: ReduceOp, *, timeout: float, stream: Any = None
    ) -> None:
        ...

    @abc.abstractmethod
    def all_gather(self, x: ArrayRef, out: ArrayRef, *, timeout: float, stream: Any = None) -> None:
        ...

    @abc.abstractmethod
    def gather(
        self, x: ArrayRef, out: ArrayRef | None, root: int, *, timeout: float, stream: Any = None
    ) -> None:
        ...

    @abc.abstractmethod
    def scatter(
        self, x: ArrayRef | None, out: ArrayRef, root: int, *, timeout: float, stream: Any = None
    ) -> None:
        ...

    @abc.abstractmethod
    def reduce_scatter(
        self, x: ArrayRef, out: ArrayRef, op: ReduceOp, *, timeout: float, stream: Any = None
    ) -> None:
        ...

    @abc.abstractmethod
    def all_to_all(self, x: ArrayRef, out: ArrayRef, *, timeout: float, stream: Any = None) -> None:
        ...

    # send, recv, isend, irecv and batch_p2p are given ``tag=``/``tags=`` only for tagged
    # messages (tag > 0), so that a backend without tags still serves untagged ones
    @abc.abstractmethod
    def send(self, x: ArrayRef, dst: int, *, timeout: float, stream: Any = None) -> None:
        ...

    @abc.abstractmethod
    def recv(self, x: ArrayRef, src: int, *, timeout: float, stream: Any = None) -> None:
        ...

    @abc.abstractmethod
    def barrier(self, *, timeout: float) -> None:
        ...

    # -- out of place, uneven sizes, many arrays (see the module docstring for the layouts) --

    @abc.abstractmethod
    def all_reduce_out(self, x: ArrayRef, out: ArrayRef, op: ReduceOp, *, timeout: float,
                       stream: Any = None) -> None:
        ...

    @abc.abstractmethod
    def reduce_out(self, x: ArrayRef, out: ArrayRef | None, root: int, op: ReduceOp, *,
                   timeout: float, stream: Any = None) -> None:
        ...

    @abc.abstractmethod
    def broadcast_out(self, x: ArrayRef | None, out: ArrayRef, root: int, *, timeout: float,
                      stream: Any = None) -> None:
        ...

    @abc.abstractmethod
    def exchange(self, sends: Sequence[tuple[int, ArrayRef]],
                 recvs: Sequence[tuple[int, ArrayRef]], layout: int, *, timeout: float,
                 stream: Any = None) -> None:
        ...

    @abc.abstractmethod
    def all_gather_v(self, x: ArrayRef, out: ArrayRef, counts: Sequence[int], layout: int, *,
                     timeout: float, stream: Any = None) -> None:
        ...

    @abc.abstractmethod
    def reduce_scatter_v(self, x: ArrayRef, out: ArrayRef, counts: Sequence[int], op: ReduceOp,
                         layout: int, *, timeout: float, stream: Any = None) -> None:
        ...

    def all_reduce_coalesced(self, xs: Sequence[ArrayRef], op: ReduceOp, *, timeout: float,
                             stream: Any = None) -> None:
        """Reduce every array of ``xs`` in place; by default one all_reduce each, in order
        (backends that can fuse them override this)."""
        for x in xs:
            self.all_reduce(x, op, timeout=timeout, stream=stream)

    def batch_p2p(self, ops: Sequence[tuple[bool, ArrayRef, int]], *, timeout: float,
                  stream: Any = None, tags: Sequence[int] | None = None) -> list[Work]:
        """Post sends (``is_send``) and receives together and return a Work for each, in order
        (``tags``: each one's tag); by default each through ``isend``/``irecv`` (which must
        then progress side by side)."""
        tags = tags or [0] * len(ops)
        return [self.isend(x, peer, timeout=timeout, stream=stream, **tagged(tag)) if sending
                else self.irecv(x, peer, timeout=timeout, stream=stream, **tagged(tag))
                for (sending, x, peer), tag in zip(ops, tags, strict=True)]

    def isend(self, x: ArrayRef, dst: int, *, timeout: float, stream: Any = None,
              **kw: int) -> Work:
        """Start a send; by default one more call in issue order (backends that can let sends
        and receives progress side by side override this). ``kw``: its ``tag``, if any."""
        return self.run_async(lambda: self.send(x, dst, timeout=timeout, stream=stream, **kw),
                              stream=stream)

    def irecv(self, x: ArrayRef, src: int, *, timeout: float, stream: Any = None,
              **kw: int) -> Work:
        """Start a receive into ``x``; see ``isend``."""
        return self.run_async(lambda: self.recv(x, src, timeout=timeout, stream=stream, **kw),
                              stream=stream)

    @abc.abstractmethod
    def run_async(self, call: Callable[[], None], *, stream: Any = None) -> Work:
        """Start ``call`` (one of the methods above, bound) and return its Work handle.

        Work on one backend completes in issue order.
        """

    @abc.abstractmethod
    def run_sync(self, call: Callable[[], None]) -> None:
        """Run ``call`` after every earlier ``run_async`` call of this backend."""

    @abc.abstractmethod
    def split(self, store: Any, rank: int | None, size: int, color: int | None, key: int,
              *, timeout: float) -> Backend | None:
        """Collective over this backend's ranks: the backend of the new group, or None for a
        rank whose ``color`` is None. ``store`` is the new group's namespace."""

    def shrink(self, store: Any, members: list[int], *, timeout: float,
               liveness: Any = None) -> Backend:
        """Collective over ``members`` (this group's ranks that survive, ascending; this rank
        among them): the backend of a new group of them, rank i being ``members[i]``. Runs
        after a failure, so this backend may be aborted; ``store`` is the new group's
        namespace and ``liveness`` names a member that dies meanwhile."""
        raise BackendUnavailable(f"the {self.name} backend cannot shrink a group")

    @abc.abstractmethod
    def abort(self, reason: str | GpucollError) -> None:
        """Fail every pending and future call fast with ``reason`` (a message, or the error that
        ended the group: later calls say they are unusable after it); safe from any thread."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release every socket, segment and thread; idempotent; returns even after abort."""


def tagged(tag: int) -> dict[str, int]:
    """The keyword a message's ``tag`` goes to a backend as: none for an untagged one."""
    return {"tag": tag} if tag else {}


# ---- backends by name, and what backend="auto" picks ---------------------------------------------

NAMES = ("auto", "nccl", "ring")

# name -> factory(store, rank, size, *, timeout, device) -> Backend
Factory = Callable[..., Backend]


def _ring(store: Any, rank: int, size: int, *, timeout: float, device: Any = None) -> Backend:
    from gpucoll.backends.ring import RingBackend
    from gpucoll.backends.staged import StagedBackend

    # transport="auto": the mesh reads GPUCOLL_TRANSPORT (the one place that does).
    ring = RingBackend(store, rank, size, timeout=timeout, transport="auto")
    try:  # the ring follows the GPUs' fastest links when all ranks share a host
        ring.use_order(agree_order(store, rank, size, same_host=ring.local_ranks == size,
                                   timeout=timeout))
    except BaseException:
        ring.close()
        raise
    # Device arrays on the ring are staged through pinned host memory; host ones pass through.
    return StagedBackend(ring)


def _nccl(store: Any, rank: int, size: int, *, timeout: float, device: Any = None) -> Backend:
    from gpucoll.backends.nccl import NcclBackend

    return NcclBackend(store, rank, size, timeout=timeout, device=device)


FACTORIES: dict[str, Factory] = {"ring": _ring, "nccl": _nccl}


def register_backend(name: str, factory: Factory) -> None:
    """Make ``backend=name`` build ``factory(store, rank, size, timeout=, device=)``."""
    FACTORIES[name] = factory


def requested_name(backend: Any) -> str:
    """Validate the ``backend=`` argument; "auto" defers to GPUCOLL_BACKEND when that is set.
    A backend this process can be told at once it cannot use (nccl under
    NCCL_COMM_BLOCKING=1) is refused here, before the rank waits for anyone."""
    if not isinstance(backend, str) or backend.lower() not in {"auto", *FACTORIES}:
        names = ", ".join(repr(n) for n in ("auto", *FACTORIES))
        raise ValueError(f"backend={backend!r} is not a backend; expected one of {names}")
    backend = backend.lower()
    if backend == "auto":
        env = os.environ.get("GPUCOLL_BACKEND", "").strip().lower()
        if env and env != "auto":
            return requested_name(env)
    if backend == "nccl":
        from gpucoll.backends.nccl.driver import forced_blocking

        forced = forced_blocking()
        if forced:
            raise BackendUnavailable(f"nccl backend: {forced}")
    return backend


def choose_backend(requested: str, store: Any, rank: int, size: int,
                   device: Any = None) -> tuple[str, str]:
    """The backend to build for ``requested`` and why: ``(name, reason)``.

    An explicit name is taken as is. For "auto" every rank reports whether it can use NCCL on
    the device it would drive (``device``, else its local rank's), and all ranks apply one rule
    to the reports (every rank must reach the same answer, which is why the group's store is
    passed).
    """
    if requested != "auto":
        return requested, f"backend={requested!r} was requested"
    from gpucoll.backends.nccl.backend import agree

    return agree(store, rank, size, float(getattr(store, "timeout", 300.0)), device)


def create_backend(requested: str, store: Any, rank: int, size: int, *, timeout: float,
                   device: Any = None) -> Backend:
    """Build the backend for ``requested`` ("auto", "ring", "nccl"); collective over the group.

    The backend's ``backend_reason`` says why it was chosen (the Communicator shows it); the
    choice is logged once, at INFO, on the ``gpucoll`` logger.
    """
    name, reason = choose_backend(requested_name(requested), store, rank, size, device)
    backend = FACTORIES[name](store, rank, size, timeout=timeout, device=device)
    try:
        backend.backend_reason = reason
    except AttributeError:  # a registered backend with __slots__: the Communicator says less
        pass
    logging.getLogger("gpucoll").info("rank %d of %d: backend %s (%s)", rank, size, name, reason)
    return backend


# ---- the host ring's rank order ------------------------------------------------------------------

KEY = "ring/order"  # where rank 0 publishes the ring order


def rank_devices(size: int) -> list[int] | None:
    """The NVML index of each rank's GPU when all ``size`` ranks share this host, or None.

    Rank r drives CUDA device r (its local rank, as the NCCL backend picks), so every rank needs a
    device of its own; CUDA_VISIBLE_DEVICES, when it lists indices, maps ordinals to indices.
    """
    if cuda.runtime().device_count() < size:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return list(range(size))
    ids = [v.strip() for v in visible.split(",")][:size]
    if len(ids) < size or not all(v.isdigit() for v in ids):
        return None  # UUIDs or MIG names: no index to ask the topology about
    return [int(v) for v in ids]


def topology_order(size: int) -> list[int] | None:
    """The rank order the topology suggests for ``size`` ranks on this host, or None (never
    raises: a machine whose topology cannot be read keeps rank order)."""
    try:
        from gpucoll import topology  # only here: most groups never get this far

        gpus = rank_devices(size)
        if gpus is None or len(set(gpus)) != size:
            return None
        ring = topology.probe_ring_order(gpus=gpus)
        if ring is None or sorted(ring) != sorted(gpus):
            return None
        rank_of = {gpu: r for r, gpu in enumerate(gpus)}
        return [rank_of[gpu] for gpu in ring]
    except Exception:  # noqa: BLE001 - a topology problem must never stop a communicator
        return None


def agree_order(store: Any, rank: int, size: int, *, same_host: bool,
                timeout: float) -> list[int] | None:
    """Collective: the ring order every rank of the group uses (None: rank order).

    Rank 0 decides (``same_host``: it sees every rank on its host) and publishes its answer
    under one key of the group's ``store``; two ranks have only one ring, so they skip this.
    """
    if size < 3:
        return None
    if rank == 0:
        order = topology_order(size) if same_host else None
        store.set(KEY, json.dumps(order))
        return order
    return json.loads(fetch(store, KEY, 0, timeout, what="ring set-up", rank=rank,
                            absent="did not publish the ring order",
                            liveness=Liveness.of(store, rank, size)))


__all__ = ["Backend", "FACTORIES", "NAMES", "choose_backend", "create_backend",
           "register_backend", "requested_name"]
