"""The host ring's rank order, chosen from the machine's topology and agreed through one key.

When every rank of a group runs on one host and each has a CUDA device of its own, rank 0 asks
``gpucoll.topology`` for the GPU ring that keeps neighbours on the fastest links and publishes it
as a rank order; everyone else reads it. Otherwise, or when the topology cannot be read, the ring
keeps rank order. Choosing never fails a communicator: only a lost rank 0 is an error.
"""

from __future__ import annotations

import json
import os
from typing import Any

from gpucoll import cuda
from gpucoll.store.gather import Liveness, fetch

KEY = "ring/order"


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
