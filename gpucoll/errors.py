"""The one error hierarchy of gpucoll, and the one error a missing optional package gives.

Every message names the operation, this rank and the peer or key involved. The classes are
picklable (a worker's error travels to its launcher) and reuse the standard exceptions where
they fit: a deadline passing is also a ``TimeoutError``.

Optional packages: ``PACKAGES`` says which extra of gpucoll installs each.
``require("matplotlib", "topo --png")`` imports and returns the module, or raises
``MissingPackage`` whose message is the whole story in one line: what needs it and the command
that installs it (``pip install "gpucoll[topo]"``). The ``gpucoll`` command prints that line
instead of a traceback.
"""

from __future__ import annotations

import importlib
from types import ModuleType


class GpucollError(Exception):
    """Base of every error gpucoll raises on its own account.

    ``peer`` is the rank the error is about (a dead, stuck or disagreeing rank), when known.
    """

    peer: int | None = None


class CollectiveTimeout(GpucollError, TimeoutError):
    """A collective, or the start-up of a communicator, did not complete by its deadline."""


class PeerFailure(GpucollError):
    """A named peer vanished (its process died or its connection broke) or aborted."""

    def __init__(self, message: str, peer: int | None = None):
        super().__init__(message)
        self.peer = peer

    def __reduce__(self):
        return (type(self), (str(self), self.peer))


class CollectiveMismatch(GpucollError):
    """Ranks called different collectives, or the same one with different arguments."""


class UsageError(GpucollError, RuntimeError):
    """A communicator was used in a way that cannot work: from a forked child process, or
    from a second thread while another thread is inside a call."""


class MissingPackage(GpucollError, ImportError):
    """An optional package a feature needs is not installed; the message names the extra of
    gpucoll that installs it (``require``)."""


class StoreError(GpucollError):
    """The key-value store refused a request or its connection broke."""


class StoreTimeout(StoreError, TimeoutError):
    """Keys did not appear in the store before the deadline."""


class FrameError(StoreError, ValueError):
    """A store message that breaks the wire format (from a peer that is not a gpucoll store or
    client, or a damaged stream): ``rid`` is its request id, ``fatal`` when the stream cannot be
    resynchronised."""

    def __init__(self, message: str, rid: int = 0, fatal: bool = True):
        super().__init__(message)
        self.rid = rid
        self.fatal = fatal

    def __reduce__(self):
        return (type(self), (str(self), self.rid, self.fatal))


class RendezvousError(GpucollError, ValueError):
    """The environment does not say who this rank is or where the ranks meet."""


class BackendUnavailable(GpucollError):
    """The requested backend cannot run here (no CuPy, no NCCL, no device, ...)."""


class LaunchError(GpucollError, ValueError):
    """``gpucoll run`` was asked for something that cannot run; nothing has been started."""


class TopologyUnavailable(GpucollError):
    """This machine shows no NVIDIA device to NVML nor on its PCI bus."""


class TopologyParseError(GpucollError, ValueError):
    """A saved ``nvidia-smi topo -m`` output cannot be read; the message names the file and
    line (``source``, ``line``)."""

    def __init__(self, message: str, *, source: str = "<text>", line: int | None = None):
        where = source if line is None else f"{source}:{line}"
        super().__init__(f"{where}: {message}")
        self.source = source
        self.line = line
        self._message = message

    def __reduce__(self):
        return (_topology_parse_error, (self._message, self.source, self.line))


def _topology_parse_error(message: str, source: str, line: int | None) -> TopologyParseError:
    return TopologyParseError(message, source=source, line=line)


class NcclFailure(GpucollError):
    """NCCL reported an error for an op on a rank; ``status`` is its ``ncclResult_t`` (None
    when nccl4py refused the call before NCCL saw it). ``ncclRemoteError`` is a
    ``PeerFailure`` and ``ncclTimeout`` a ``CollectiveTimeout`` instead."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status

    def __reduce__(self):
        return (type(self), (str(self), self.status))


# ---- optional packages: which extra of gpucoll installs each -------------------------------------

# module imported -> (package on PyPI, extra of gpucoll that installs it; None: no extra does)
PACKAGES = {
    "matplotlib": ("matplotlib", "topo"),
    "pynvml": ("nvidia-ml-py", "topo"),
    "ml_dtypes": ("ml_dtypes", "cuda12"),
    "cupy": ("cupy-cuda12x", "cuda12"),
    "torch": ("torch", None),
    "mpi4py": ("mpi4py", None),
}


def install_hint(module: str) -> str:
    """The command that installs ``module``: gpucoll's extra where one has it."""
    package, extra = PACKAGES.get(module.split(".")[0], (module.split(".")[0], None))
    return f'pip install "gpucoll[{extra}]"' if extra else f"pip install {package}"


def missing(module: str, purpose: str) -> MissingPackage:
    """The error for ``purpose`` (e.g. ``topo --png``) when ``module`` cannot be imported."""
    package = PACKAGES.get(module.split(".")[0], (module,))[0]
    return MissingPackage(f"{purpose} needs {package}, which is not installed: "
                          f"{install_hint(module)}")


def require(module: str, purpose: str) -> ModuleType:
    """``module`` imported, or MissingPackage naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise missing(module, purpose) from None


__all__ = [
    "BackendUnavailable",
    "CollectiveMismatch",
    "CollectiveTimeout",
    "FrameError",
    "GpucollError",
    "LaunchError",
    "NcclFailure",
    "PeerFailure",
    "RendezvousError",
    "StoreError",
    "StoreTimeout",
    "TopologyParseError",
    "TopologyUnavailable",
    "UsageError",
]
