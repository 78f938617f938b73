"""Topology probe: what connects to what (NVLink, PCIe, NICs, CPUs), and what follows from it.

Modules: ``smi`` (saved ``nvidia-smi topo -m`` outputs, however pasted), ``probe`` (this
machine: NVML and sysfs), ``layout`` (the raw facts as each source gives them, and what they all
mean: labels, bandwidth classes, nearest NICs, the ring order, warnings, and where each rank of
a job should run), ``render`` (text, JSON, Graphviz, PNG, and ``gpucoll topo`` that prints
them). This package knows nothing of collectives: the communicator only asks it for
a ring order, and the launcher where its ranks go.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpucoll.errors import TopologyParseError, TopologyUnavailable
from gpucoll.topology.layout import Layout, ring_over
from gpucoll.topology.probe import load, probe

__all__ = ["Layout", "TopologyParseError", "TopologyUnavailable", "load", "probe",
           "probe_ring_order", "ring_order"]


def ring_order(layout: Layout, gpus: Iterable[int] | None = None) -> list[int]:
    """GPU indices in the order a ring should visit them: neighbours on the fastest links.

    ``gpus`` limits the ring to those indices (the GPUs a job's ranks use). Indices are NVML's,
    in PCI bus order: CUDA numbers GPUs the same way only with CUDA_DEVICE_ORDER=PCI_BUS_ID.
    """
    return list(layout.ring_order) if gpus is None else ring_over(layout.observed, gpus)


def probe_ring_order(gpus: Iterable[int] | None = None) -> list[int] | None:
    """The ring order of this machine's GPUs (see ring_order), or None when the topology
    cannot be seen."""
    try:
        return ring_order(probe(), gpus)
    except TopologyUnavailable:
        return None
