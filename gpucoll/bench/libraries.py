"""gpucoll itself as a benchmarked library: each case becomes one call on a Communicator.

Each ``prepare`` returns a closure holding everything the call needs, so the timed loop measures
the call and nothing else. ``None`` means the library has no such form of the operation (the
table shows N/A there rather than a number measured some other way).

The libraries gpucoll is compared with stand behind the same ``prepare``:

- gloo: ``torch.distributed`` with the gloo backend on CPU tensors that share memory with the
  NumPy buffers (nccl on CuPy buffers when they are on a GPU), rendezvous through torchrun's
  environment (``gpucoll run`` sets it).
- mpi: mpi4py on NumPy buffers, started by ``mpirun``.

Neither is a dependency: each imports only when asked for, and ``peer_available()`` says
whether it can be.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import platform
import shutil
import sys
from collections.abc import Callable
from typing import Any

from gpucoll.backends.nccl import backend as nccl_backend
from gpucoll.selftest import devices


def versions(*modules: str) -> dict[str, str]:
    """Installed versions of ``modules`` (absent ones left out), plus Python's; a module run
    from a source tree rather than installed gives its ``__version__``."""
    from importlib import metadata

    out = {"python": platform.python_version()}
    for name in modules:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            spec = importlib.util.find_spec(name)
            version = spec and getattr(importlib.import_module(name), "__version__", None)
            if version:
                out[name] = str(version)
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
                "versions": versions("gpucoll", "numpy", "cupy-cuda12x", "nvidia-nccl-cu12",
                                     "cupy-cuda13x", "nvidia-nccl-cu13")}
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
    """The version of the NCCL library the NCCL backend loads (through nccl4py), as ``2.23.4``
    (empty when it does not load)."""
    try:
        from gpucoll import cuda

        return nccl_backend.library_version(cuda.runtime().nccl())
    except Exception:
        return ""


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
        return [d["name"] for d in devices()]
    except Exception:
        return []


# ---- the peers -----------------------------------------------------------------------------------

def peer_available(name: str) -> str | None:
    """None when peer ``name`` can run here, else the reason it cannot."""
    if name == "gloo":
        return None if importlib.util.find_spec("torch") else "torch is not installed"
    if name == "mpi":
        if importlib.util.find_spec("mpi4py") is None:
            return "mpi4py is not installed"
        return None if shutil.which("mpirun") else "mpirun is not on PATH"
    return f"unknown peer {name!r}"


class GlooLibrary:
    """torch.distributed: gloo on host buffers, nccl on device buffers."""

    name = "gloo"

    def __init__(self, timeout: float, device: bool = False, init_method: str = "env://"):
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # one core per rank, like every other library here
        self.torch, self.dist, self.device = torch, dist, device
        self.backend = "nccl" if device else "gloo"
        if device:  # one GPU per rank, as the launcher numbers them; CuPy buffers there too
            import cupy

            self.name = "torch-nccl"
            local = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
            torch.cuda.set_device(local)
            cupy.cuda.Device(local).use()
        kw = {}
        if init_method != "env://":  # env:// reads RANK and WORLD_SIZE itself
            kw = {"rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}
        dist.init_process_group(self.backend, init_method=init_method,
                                timeout=datetime.timedelta(seconds=timeout), **kw)
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self._ops = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT,
                     "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX,
                     "avg": getattr(dist.ReduceOp, "AVG", None), "band": dist.ReduceOp.BAND,
                     "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR}

    def describe(self) -> dict[str, Any]:
        return {"library": self.name, "backend": self.backend,
                "transport": "tcp" if self.backend == "gloo" else "nccl",
                "versions": versions("torch", "numpy")}

    def wrap(self, a: Any) -> Any:
        if self.device:
            return self.torch.as_tensor(a, device="cuda")  # __cuda_array_interface__, no copy
        if a.dtype.name == "bfloat16":  # NumPy knows it only through ml_dtypes
            return self.torch.from_numpy(a.view("int16")).view(self.torch.bfloat16)
        return self.torch.from_numpy(a)  # shares memory with the NumPy buffer

    def prepare(self, op: str, send: Any, recv: Any, redop: str, root: int,
                in_place: bool) -> Callable[[], None] | None:
        dist, s, r = self.dist, self.wrap(send), self.wrap(recv)
        red = self._ops.get(redop)
        if red is None and redop != "none":
            return None
        if op == "all_reduce":
            return (lambda: dist.all_reduce(r, op=red)) if in_place else None
        if op == "broadcast":
            return (lambda: dist.broadcast(r, src=root)) if in_place else None
        if op == "reduce":
            return (lambda: dist.reduce(r, dst=root, op=red)) if in_place else None
        if op == "all_gather":
            return lambda: dist.all_gather_into_tensor(r, s)
        if op == "reduce_scatter":
            return lambda: dist.reduce_scatter_tensor(r, s, op=red)
        if op == "all_to_all":
            return None if in_place else (lambda: dist.all_to_all_single(r, s))
        if op == "sendrecv":
            return None if in_place else self._sendrecv(s, r)
        raise ValueError(f"operation {op!r} is not benchmarked")

    def _sendrecv(self, s: Any, r: Any) -> Callable[[], None]:
        dist, nxt, prv = self.dist, (self.rank + 1) % self.size, (self.rank - 1) % self.size

        def shift() -> None:
            ops = [dist.P2POp(dist.isend, s, nxt), dist.P2POp(dist.irecv, r, prv)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        return shift

    def barrier(self) -> None:
        self.dist.barrier()

    def close(self) -> None:
        self.dist.destroy_process_group()


class MpiLibrary:
    """mpi4py's buffer interface (the upper-case methods) on NumPy arrays."""

    name = "mpi"

    def __init__(self, timeout: float, device: bool = False):
        from mpi4py import MPI

        self.MPI, self.comm = MPI, MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self._ops = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX,
                     "band": MPI.BAND, "bor": MPI.BOR, "bxor": MPI.BXOR}

    def describe(self) -> dict[str, Any]:
        library = self.MPI.Get_library_version().splitlines()[0].strip()
        return {"library": self.name, "backend": library.split(",")[0], "transport": "mpi",
                "versions": versions("mpi4py", "numpy")}

    def prepare(self, op: str, send: Any, recv: Any, redop: str, root: int,
                in_place: bool) -> Callable[[], None] | None:
        c, IN_PLACE = self.comm, self.MPI.IN_PLACE
        red = self._ops.get(redop)
        if (red is None and redop != "none") or not self._knows(recv.dtype):
            return None  # MPI has no average, nor half or bfloat16 types
        if op == "all_reduce":
            if in_place:
                return lambda: c.Allreduce(IN_PLACE, recv, op=red)
            return lambda: c.Allreduce(send, recv, op=red)
        if op == "broadcast":
            return (lambda: c.Bcast(recv, root=root)) if in_place else None
        if op == "reduce":
            if in_place:
                src = IN_PLACE if self.rank == root else recv
                return lambda: c.Reduce(src, recv, op=red, root=root)
            return lambda: c.Reduce(send, recv, op=red, root=root)
        if op == "all_gather":
            return lambda: c.Allgather(IN_PLACE if in_place else send, recv)
        if op == "reduce_scatter":
            return None if in_place else (lambda: c.Reduce_scatter_block(send, recv, op=red))
        if op == "all_to_all":
            return None if in_place else (lambda: c.Alltoall(send, recv))
        if op == "sendrecv":
            nxt, prv = (self.rank + 1) % self.size, (self.rank - 1) % self.size
            return None if in_place else (lambda: c.Sendrecv(send, nxt, recvbuf=recv,
                                                             source=prv))
        raise ValueError(f"operation {op!r} is not benchmarked")

    def _knows(self, dtype: Any) -> bool:
        from mpi4py.util.dtlib import from_numpy_dtype

        try:
            return from_numpy_dtype(dtype) != self.MPI.DATATYPE_NULL
        except Exception:  # mpi4py raises MPI.Exception or ValueError by type
            return False

    def barrier(self) -> None:
        self.comm.Barrier()

    def close(self) -> None:
        pass


def make_peer(name: str, timeout: float, device: bool = False) -> Any:
    """Construct peer ``name`` (collective: every rank of the job calls it)."""
    cls = {"gloo": GlooLibrary, "mpi": MpiLibrary}[name]
    return cls(timeout, device)
