"""Backends by name, and what ``backend="auto"`` picks.

``create_backend(requested, store, rank, size, ...)`` resolves the name ("auto" through
``choose_backend``; GPUCOLL_BACKEND stands in for "auto" when set) and builds that backend; the
backend modules are imported only then, so ``import gpucoll`` never loads CUDA.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from gpucoll.backends.base import Backend

NAMES = ("auto", "nccl", "ring")

# name -> factory(store, rank, size, *, timeout, device) -> Backend
Factory = Callable[..., Backend]


def _ring(store: Any, rank: int, size: int, *, timeout: float, device: Any = None) -> Backend:
    from gpucoll.backends.ring import RingBackend
    from gpucoll.backends.ring_order import agree_order
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


__all__ = ["Backend", "FACTORIES", "NAMES", "choose_backend", "create_backend",
           "register_backend", "requested_name"]
