"""What ``backend="auto"`` picks: NCCL where it works for every rank, else the host ring.

Each rank judges itself (CuPy, a CUDA device, nccl4py and its library, which GPU it would
drive), publishes its verdict in the group's store, and all ranks apply the same rule to the
same verdicts, so they agree without a leader. NCCL refuses several ranks of one communicator on
one GPU ("Multiple Ranks are using the same GPU") unless NCCL >= 2.30 is asked to allow it with
NCCL_MULTI_RANK_GPU_ENABLE=1 (and NVLS is not forced on): ranks that would share a GPU get the
ring otherwise. The reason names the first rank (or GPU) that rules NCCL out.
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any

from gpucoll import cuda
from gpucoll.backends.nccl.backend import pick_device
from gpucoll.store import Liveness, gather

KEY = "auto/{}"
MULTI_RANK_GPU_VERSION = (2, 30)


def nccl_version(code: int) -> str:
    """NCCL's integer version as text: 23203 -> "2.32.3" (codes before 2.9 were 2804 style)."""
    if code <= 0:
        return "unknown"
    if code < 20900:
        return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"
    return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"


def library_version(nc: Any) -> str:
    """The version of the NCCL library nccl4py (``nc``) loaded, e.g. "2.32.3"."""
    lib = nc.get_version().libnccl
    if lib is None:
        raise RuntimeError("nccl4py found no NCCL library (install nvidia-nccl-cu12)")
    return str(lib.version)


def several_ranks_per_gpu(version: str, environ: Any = None) -> bool:
    """Whether NCCL ``version`` will accept several ranks of one communicator on one GPU."""
    env = os.environ if environ is None else environ
    numbers = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    return (env.get("NCCL_MULTI_RANK_GPU_ENABLE", "") == "1"
            and numbers >= MULTI_RANK_GPU_VERSION and env.get("NCCL_NVLS_ENABLE", "") != "1")


def local_verdict(rt: Any = None, *, rank: int = 0, device: Any = None) -> dict[str, Any]:
    """Whether this process can run the NCCL backend and why (never raises): ``ok``, ``why``,
    and when ok, ``gpu`` (host and PCI bus id of the device it would drive) and
    ``shareable`` (NCCL here accepts other ranks on that GPU)."""
    rt = cuda.runtime() if rt is None else rt
    ok, why = rt.available()
    if not ok:
        return {"ok": False, "why": why}
    try:
        version = library_version(rt.nccl())
    except Exception as exc:  # noqa: BLE001 - any failure to load NCCL means "not usable"
        return {"ok": False, "why": f"nccl4py cannot be loaded ({type(exc).__name__}: {exc}); "
                                    f"install gpucoll[cuda12]"}
    try:
        chosen = pick_device(rt, rank, device)
        gpu = f"{socket.gethostname()}/{rt.device_identity(chosen)}"
    except Exception as exc:  # noqa: BLE001
        return {"ok": False, "why": f"no device to drive ({type(exc).__name__}: {exc})"}
    return {"ok": True, "why": f"{why}, NCCL {version}, device {chosen}", "gpu": gpu,
            "shareable": several_ranks_per_gpu(version)}


def decide(verdicts: list[dict[str, Any]], rank: int) -> tuple[str, str]:
    """The rule every rank applies to every rank's verdict: ``("nccl"|"ring", reason)``."""
    unable = [(r, v["why"]) for r, v in enumerate(verdicts) if not v["ok"]]
    if unable:
        r, reason = unable[0]
        more = f" (and {len(unable) - 1} other rank(s))" if len(unable) > 1 else ""
        return "ring", f"auto: the host ring, because rank {r}{more} cannot use NCCL: {reason}"
    by_gpu: dict[str, list[int]] = {}
    for r, v in enumerate(verdicts):
        by_gpu.setdefault(v["gpu"], []).append(r)
    shared = [(gpu, ranks) for gpu, ranks in by_gpu.items() if len(ranks) > 1]
    if shared and not all(v["shareable"] for v in verdicts):
        gpu, ranks = shared[0]
        return "ring", (
            f"auto: the host ring, because ranks {', '.join(map(str, ranks))} would share GPU "
            f"{gpu}, and NCCL refuses several ranks on one GPU unless every rank runs NCCL >= "
            f"2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1 (and without NCCL_NVLS_ENABLE=1)")
    return "nccl", f"auto: every rank can use NCCL (rank {rank}: {verdicts[rank]['why']})"


def agree(store: Any, rank: int, size: int, timeout: float,
          device: Any = None) -> tuple[str, str]:
    """Collective: ``("nccl"|"ring", reason)``, the same on every rank."""
    mine = local_verdict(rank=rank, device=device)
    keys = [KEY.format(r) for r in range(size)]
    store.set(keys[rank], json.dumps(mine))
    values = gather(store, keys, timeout, what="backend='auto'", rank=rank,
                    absent="did not report whether it can use NCCL",
                    liveness=Liveness.of(store, rank, size))
    return decide([json.loads(v) for v in values], rank)
