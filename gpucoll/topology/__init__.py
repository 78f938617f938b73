"""Topology probe: what connects to what (NVLink, PCIe, NICs, CPUs), and what follows from it.

Readers gather raw facts (:mod:`.nvml`, :mod:`.sysfs`, :mod:`.smi` for saved
``nvidia-smi topo -m`` outputs); :mod:`.layout` draws the conclusions; ``render_*`` show them.
This package knows nothing of collectives: the communicator only asks it for a ring order.
"""

from __future__ import annotations

from gpucoll.topology.errors import TopologyParseError, TopologyUnavailable
from gpucoll.topology.layout import Layout
from gpucoll.topology.probe import load, probe

__all__ = ["Layout", "TopologyParseError", "TopologyUnavailable", "load", "probe",
           "probe_ring_order", "ring_order"]


def ring_order(layout: Layout) -> list[int]:
    """GPU indices in the order a ring should visit them: neighbours on the fastest links."""
    return list(layout.ring_order)


def probe_ring_order() -> list[int] | None:
    """The ring order of this machine's GPUs, or None when the topology cannot be seen."""
    try:
        return ring_order(probe())
    except TopologyUnavailable:
        return None
