"""Starting an NCCL communicator through the store: device choice, arrival, the unique id.

Every rank first announces itself in the store and waits for the others with the start-up
deadline, so a missing rank becomes a ``CollectiveTimeout`` naming it instead of a hang inside
``ncclCommInitRank``. Rank 0 then makes the unique id and publishes it; the others read it and
all build their ``NcclCommunicator`` together.
"""

from __future__ import annotations

import os
from typing import Any

from gpucoll.errors import BackendUnavailable
from gpucoll.store.gather import Liveness, fetch, wait_for_ranks

UID_KEY = "nccl/unique_id"
ARRIVE_KEY = "nccl/arrived/{}"
UID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES
LOCAL_RANK_VARS = ("GPUCOLL_LOCAL_RANK", "LOCAL_RANK", "SLURM_LOCALID",
                   "OMPI_COMM_WORLD_LOCAL_RANK")


def local_rank(rank: int, environ: dict[str, str] | None = None) -> int:
    """This process's rank on its host: the launcher's variable, else the global rank."""
    environ = os.environ if environ is None else environ
    for var in LOCAL_RANK_VARS:
        value = environ.get(var)
        if value is not None and value.strip().isdigit():
            return int(value)
    return rank


def select_device(rt: Any, rank: int, device: int | None) -> int:
    """The device ordinal this rank drives: ``device`` if given, else its local rank."""
    count = rt.device_count()
    if count < 1:
        raise BackendUnavailable(f"nccl backend on rank {rank}: this process sees no CUDA device")
    if device is None:
        chosen = local_rank(rank) % count
    elif isinstance(device, int) and not isinstance(device, bool) and 0 <= device < count:
        chosen = device
    else:
        raise ValueError(
            f"device={device!r} on rank {rank}: expected an int in [0, {count}) "
            f"(this process sees {count} CUDA device(s))"
        )
    rt.set_device(chosen)
    return chosen


def arrive(store: Any, rank: int, size: int, timeout: float, what: str = "NCCL start-up") -> None:
    """Store barrier: return once all ``size`` ranks arrived, else CollectiveTimeout naming the
    ranks that never did."""
    store.set(ARRIVE_KEY.format(rank), str(rank))
    wait_for_ranks(store, [ARRIVE_KEY.format(r) for r in range(size)], timeout, what=what,
                   rank=rank, liveness=Liveness.of(store, rank, size))


def uid_to_bytes(uid: bytes | tuple) -> bytes:
    """The 128 bytes of a unique id in either of CuPy's forms (bytes since 14, signed-char
    tuple before)."""
    raw = bytes(uid) if isinstance(uid, (bytes, bytearray)) else bytes(v & 0xFF for v in uid)
    if len(raw) != UID_BYTES:
        raise ValueError(f"an NCCL unique id has {UID_BYTES} bytes, got {len(raw)}")
    return raw


def uid_to_tuple(raw: bytes) -> tuple[int, ...]:
    """CuPy < 14's form: a tuple of 128 signed chars."""
    return tuple(b - 256 if b > 127 else b for b in raw)


def share_unique_id(store: Any, rank: int, size: int, nccl: Any, timeout: float,
                    root: int = 0) -> bytes:
    """Rank ``root`` makes the unique id and publishes it; every rank returns its bytes."""
    if rank == root:
        raw = uid_to_bytes(nccl.get_unique_id())
        store.set(UID_KEY, raw)
        return raw
    return uid_to_bytes(fetch(store, UID_KEY, root, timeout, what="NCCL start-up", rank=rank,
                              absent="did not publish the unique id",
                              liveness=Liveness.of(store, rank, size)))


def create_comm(nccl: Any, size: int, raw_uid: bytes, rank: int) -> Any:
    """``NcclCommunicator(size, uid, rank)`` with the id in the form this CuPy accepts."""
    try:
        return nccl.NcclCommunicator(size, raw_uid, rank)
    except TypeError:  # CuPy < 14 declares the id as a tuple
        return nccl.NcclCommunicator(size, uid_to_tuple(raw_uid), rank)
