"""Starting an NCCL communicator through the store: device choice, arrival, the unique id.

Every rank first announces itself in the store and waits for the others with the start-up
deadline, so a missing rank becomes a ``CollectiveTimeout`` naming it (and a rank that died a
``PeerFailure`` naming it) before any rank enters NCCL. Rank 0 then makes the unique id and
publishes its 128 bytes; the others read them. The communicator itself is made by ``driver``.
"""

from __future__ import annotations

from typing import Any

from gpucoll.errors import BackendUnavailable
from gpucoll.rendezvous import local_rank
from gpucoll.store.gather import Liveness, fetch, wait_for_ranks

UID_KEY = "nccl/unique_id"
ARRIVE_KEY = "nccl/arrived/{}"
ENTER_KEY = "nccl/entered/{}"
UID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES


def pick_device(rt: Any, rank: int, device: int | None) -> int:
    """The device ordinal this rank drives: ``device`` if given, else its local rank (modulo
    the devices this process sees)."""
    count = rt.device_count()
    if count < 1:
        raise BackendUnavailable(f"nccl backend on rank {rank}: this process sees no CUDA device")
    if device is None:
        return local_rank(rank) % count
    if isinstance(device, int) and not isinstance(device, bool) and 0 <= device < count:
        return device
    raise ValueError(
        f"device={device!r} on rank {rank}: expected an int in [0, {count}) "
        f"(this process sees {count} CUDA device(s))"
    )


def arrive(store: Any, rank: int, size: int, timeout: float, liveness: Liveness | None,
           what: str = "NCCL start-up") -> None:
    """Store barrier: return once all ``size`` ranks arrived, else CollectiveTimeout naming the
    ranks that never did (PeerFailure for one that died)."""
    store.set(ARRIVE_KEY.format(rank), str(rank))
    wait_for_ranks(store, [ARRIVE_KEY.format(r) for r in range(size)], timeout, what=what,
                   rank=rank, liveness=liveness)


def share_unique_id(store: Any, rank: int, nc: Any, timeout: float, liveness: Liveness | None,
                    root: int = 0) -> bytes:
    """Rank ``root`` makes the unique id (``nc`` is nccl4py's ``nccl.core``) and publishes it;
    every rank returns its bytes."""
    if rank == root:
        raw = bytes(nc.get_unique_id())
        store.set(UID_KEY, raw)
        return raw
    raw = fetch(store, UID_KEY, root, timeout, what="NCCL start-up", rank=rank,
                absent="did not publish the unique id", liveness=liveness)
    if len(raw) != UID_BYTES:
        raise ValueError(f"an NCCL unique id has {UID_BYTES} bytes, got {len(raw)}")
    return raw


def enter(store: Any, rank: int) -> None:
    """Mark that this rank is about to enter NCCL's start-up (``ncclCommInitRankConfig``)."""
    store.set(ENTER_KEY.format(rank), str(rank))


def not_entered(store: Any, rank: int, size: int) -> str:
    """Which ranks have not entered NCCL's start-up, for a start-up that timed out."""
    try:
        values = store.peek([ENTER_KEY.format(r) for r in range(size)])
    except Exception as exc:  # noqa: BLE001 - a diagnosis aid: the store may be gone
        return f"which ranks entered it could not be read ({exc})"
    missing = [r for r, v in enumerate(values) if v is None and r != rank]
    if not missing:
        return "every rank entered it"
    names = ", ".join(map(str, missing))
    return f"rank{'s' if len(missing) > 1 else ''} {names} never entered it"
