"""Backends by name, what ``backend="auto"`` picks, and the host ring's rank order.

``create_backend(requested, store, rank, size, ...)`` resolves the name ("auto" through
``choose_backend``; GPUCOLL_BACKEND stands in for "auto" when set) and builds that backend; the
backend modules are imported only then, so ``import gpucoll`` never loads CUDA.

The host ring's rank order is chosen from the machine's topology and agreed through one key
(``agree_order``). When every rank of a group runs on one host and each has a CUDA device of its
own, rank 0 asks ``gpucoll.topology`` for the GPU ring that keeps neighbours on the fastest links
and publishes it as a rank order; everyone else reads it. Otherwise, or when the topology cannot
be read, the ring keeps rank order. Choosing never fails a communicator: only a lost rank 0 is
an error.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from typing import Any

from gpucoll import cuda
from gpucoll.backends.base import Backend
from gpucoll.store import Liveness, fetch

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
    """Validate the ``backend=`` argument; "auto" defers to GPUCOLL_BACKEND when that is set."""
    if not isinstance(backend, str) or backend.lower() not in {"auto", *FACTORIES}:
        names = ", ".join(repr(n) for n in ("auto", *FACTORIES))
        raise ValueError(f"backend={backend!r} is not a backend; expected one of {names}")
    backend = backend.lower()
    if backend == "auto":
        env = os.environ.get("GPUCOLL_BACKEND", "").strip().lower()
        if env and env != "auto":
            return requested_name(env)
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
    from gpucoll.backends.nccl.auto import agree

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
