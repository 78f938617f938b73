"""Errors of the topology probe: nothing to probe, or a saved output that cannot be read."""

from __future__ import annotations

from gpucoll.errors import GpucollError


class TopologyUnavailable(GpucollError):
    """This machine shows no NVIDIA device to NVML nor on its PCI bus."""


class TopologyParseError(ValueError):
    """A saved `nvidia-smi topo -m` output is malformed; the message names the file and line."""

    def __init__(self, message: str, *, source: str = "<text>", line: int | None = None):
        where = source if line is None else f"{source}:{line}"
        super().__init__(f"{where}: {message}")
        self.source = source
        self.line = line
