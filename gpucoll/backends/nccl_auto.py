"""What ``backend="auto"`` picks: NCCL when every rank can use it, else the host ring.

Each rank judges itself (CuPy importable, a CUDA device visible, ``cupy.cuda.nccl`` loaded),
publishes its verdict in the group's store, and all ranks apply the same rule to the same
verdicts, so they agree without a leader. The reason names the first rank that cannot use NCCL.
"""

from __future__ import annotations

import json
from typing import Any

from gpucoll import cuda
from gpucoll.store.gather import Liveness, gather

KEY = "auto/{}"


def nccl_version(code: int) -> str:
    """NCCL's integer version as text: 23203 -> "2.32.3" (codes before 2.9 were 2804 style)."""
    if code <= 0:
        return "unknown"
    if code < 20900:
        return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"
    return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"


def local_verdict(rt: Any = None) -> tuple[bool, str]:
    """Whether this process can run the NCCL backend, and why (never raises)."""
    rt = cuda.runtime() if rt is None else rt
    ok, why = rt.available()
    if not ok:
        return False, why
    try:
        nccl = rt.nccl()
        if not getattr(nccl, "available", True):
            return False, "CuPy was built without NCCL (cupy.cuda.nccl.available is False)"
        version = nccl_version(nccl.get_version())
    except Exception as exc:  # noqa: BLE001 - any failure to load NCCL means "not usable"
        return False, f"NCCL cannot be loaded ({type(exc).__name__}: {exc})"
    return True, f"{why}, NCCL {version}"


def agree(store: Any, rank: int, size: int, timeout: float) -> tuple[str, str]:
    """Collective: ``("nccl"|"ring", reason)``, the same on every rank."""
    ok, why = local_verdict()
    keys = [KEY.format(r) for r in range(size)]
    store.set(keys[rank], json.dumps([ok, why]))
    values = gather(store, keys, timeout, what="backend='auto'", rank=rank,
                    absent="did not report whether it can use NCCL",
                    liveness=Liveness.of(store, rank, size))
    verdicts = [json.loads(v) for v in values]
    unable = [(r, reason) for r, (usable, reason) in enumerate(verdicts) if not usable]
    if not unable:
        return "nccl", f"auto: every rank can use NCCL (rank {rank}: {why})"
    r, reason = unable[0]
    more = f" (and {len(unable) - 1} other rank(s))" if len(unable) > 1 else ""
    return "ring", f"auto: the host ring, because rank {r}{more} cannot use NCCL: {reason}"
