"""gpucoll itself as a benchmarked library: each case becomes one call on a Communicator.

Each ``prepare`` returns a closure holding everything the call needs, so the timed loop measures
the call and nothing else. ``None`` means the library has no such form of the operation (the
table shows N/A there rather than a number measured some other way).
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Callable
from typing import Any

from gpucoll import info
from gpucoll.backends import nccl_auto


def versions(*modules: str) -> dict[str, str]:
    """Installed versions of ``modules`` (absent ones left out), plus Python's."""
    from importlib import metadata

    out = {"python": platform.python_version()}
    for name in modules:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


class GpucollLibrary:
    """gpucoll's Communicator: ``gpucoll.init()`` from the launcher's environment."""

    name = "gpucoll"

    def __init__(self, comm: Any):
        self.comm = comm
        self.rank, self.size = comm.rank, comm.size

    @classmethod
    def from_env(cls, backend: str = "auto", transport: str = "auto",
                 timeout: float = 300.0) -> GpucollLibrary:
        """``gpucoll.init()`` from the launcher's environment (collective)."""
        import gpucoll

        if transport != "auto":
            os.environ["GPUCOLL_TRANSPORT"] = transport  # the backend reads it from the env
        return cls(gpucoll.init(backend=backend, timeout=timeout))

    def describe(self) -> dict[str, Any]:
        info = {"library": self.name, "backend": self.comm.backend,
                "transport": transport_of(self.comm),
                "versions": versions("gpucoll", "numpy", "cupy-cuda12x", "nvidia-nccl-cu12")}
        if self.comm.backend == "nccl":
            info["versions"]["nccl"] = nccl_version()
        return info

    def prepare(self, op: str, send: Any, recv: Any, redop: str, root: int,
                in_place: bool) -> Callable[[], None] | None:
        c = self.comm
        if op == "all_reduce":
            if in_place:
                return lambda: c.all_reduce(recv, op=redop)
            return lambda: c.all_reduce(send, op=redop, out=recv)
        if op == "broadcast":
            if in_place:
                return lambda: c.broadcast(recv, root=root)
            return lambda: c.broadcast(send, root=root, out=recv)
        if op == "reduce":
            if in_place:
                return lambda: c.reduce(recv, root=root, op=redop)
            return lambda: c.reduce(send, root=root, op=redop, out=recv)
        if in_place:  # the remaining ops take out=, which may not overlap the input
            return None
        if op == "all_gather":
            return lambda: c.all_gather(send, out=recv, tiled=True)
        if op == "reduce_scatter":
            return lambda: c.reduce_scatter(send, op=redop, out=recv, tiled=True)
        if op == "all_to_all":
            return lambda: c.all_to_all(send, out=recv, tiled=True)
        if op == "sendrecv":
            return self._sendrecv(send, recv)
        raise ValueError(f"operation {op!r} is not benchmarked")

    def _sendrecv(self, send: Any, recv: Any) -> Callable[[], None]:
        """Each rank sends to the next and receives from the previous, both in flight at once."""
        c, nxt, prv = self.comm, (self.rank + 1) % self.size, (self.rank - 1) % self.size

        def shift() -> None:
            work = c.send(send, nxt, async_op=True)
            c.recv(recv, prv)
            work.wait()

        return shift

    def barrier(self) -> None:
        self.comm.barrier()

    def close(self) -> None:
        self.comm.close()


def transport_of(comm: Any) -> str:
    """The transport(s) the backend's links use, e.g. ``shm`` or ``shm+tcp``; ``nccl`` for NCCL."""
    backend = getattr(comm, "_backend", None)
    links = getattr(backend, "links", None)
    if isinstance(links, dict) and links:
        return "+".join(sorted(set(links.values())))
    if getattr(comm, "backend", "") == "nccl":
        return "nccl"
    return str(getattr(backend, "transport", None) or "none")


def nccl_version() -> str:
    """NCCL's library version as ``2.23.4`` (empty when it does not load)."""
    try:
        from cupy.cuda import nccl

        code = nccl.get_version()
    except Exception:
        return ""
    return nccl_auto.nccl_version(code)


def machine() -> dict[str, Any]:
    """The host as the header names it: name, CPU, cores, memory, GPUs."""
    info: dict[str, Any] = {"host": platform.node(), "system": platform.platform(terse=True),
                            "cpu": cpu_model(), "cores": os.cpu_count(),
                            "python": sys.version.split()[0]}
    try:
        pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        info["memory_gib"] = round(pages * page / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    info["gpus"] = gpu_names()
    return info


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_names() -> list[str]:
    """Names of the visible CUDA devices; empty without CuPy or a device (never raises)."""
    try:
        return [d["name"] for d in info.devices()]
    except Exception:
        return []
