"""nvidia-smi's path label for two PCI devices, from their bridge chains (pure)."""

from __future__ import annotations

from gpucoll.topology.facts import PciDevice


def pci_label(a: PciDevice, b: PciDevice) -> str:
    """X, PIX, PXB, PHB, NODE or SYS for the PCIe path between two devices.

    A PCIe switch shows in sysfs as an upstream port with downstream ports below it, so two
    devices below one switch share every bridge but their own downstream port: at most one
    bridge of their own each is PIX, more is PXB. No shared bridge but one root complex is PHB;
    different root complexes are NODE on one NUMA node and SYS across NUMA nodes.
    """
    if a.address == b.address:
        return "X"
    if a.root != b.root:
        return "NODE" if a.numa_node == b.numa_node else "SYS"
    shared = 0
    while (shared < min(len(a.bridges), len(b.bridges))
           and a.bridges[shared] == b.bridges[shared]):
        shared += 1
    if shared == 0:
        return "PHB"
    own = max(len(a.bridges), len(b.bridges)) - shared
    return "PIX" if own <= 1 else "PXB"
