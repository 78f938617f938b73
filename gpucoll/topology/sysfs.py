"""Reader of the PCI tree in sysfs: NVIDIA devices and network devices, without any driver.

Reads ``<root>/sys/bus/pci/devices``; ``root`` is "/" on a live machine and a copied or built
tree in tests. Each entry there is a symlink into ``/sys/devices/pciDDDD:BB/...`` whose path
names every bridge between the device and its root complex.
"""

from __future__ import annotations

import re
from pathlib import Path

from gpucoll.topology.facts import PciDevice, PcieLink, SysfsFacts

NVIDIA = 0x10DE
_BDF = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]\Z")
_ROOT = re.compile(r"pci[0-9a-f]{4}:[0-9a-f]{2}\Z")
_GT_PER_GEN = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6}


def read_sysfs(root: str | Path = "/") -> SysfsFacts:
    """NVIDIA GPUs, NVIDIA bridges (NVSwitch) and network devices under ``root``."""
    base = Path(root) / "sys" / "bus" / "pci" / "devices"
    devices = [read_device(entry) for entry in _entries(base)]
    devices = [d for d in devices if d is not None]
    return SysfsFacts(
        root=str(root),
        gpus=tuple(d for d in devices if d.vendor == NVIDIA and d.pci_class >> 16 == 0x03),
        switches=tuple(d for d in devices if d.vendor == NVIDIA and d.pci_class >> 16 == 0x06),
        nics=tuple(d for d in devices if _is_network(d.pci_class)))


def _entries(base: Path) -> list[Path]:
    try:
        return sorted(base.iterdir())
    except OSError:  # no sysfs (not Linux, or a container without /sys)
        return []


def _is_network(pci_class: int) -> bool:
    """Network controllers (0x02xxxx) and old InfiniBand serial-bus controllers (0x0c06xx)."""
    return pci_class >> 16 == 0x02 or pci_class >> 8 == 0x0C06


def read_device(entry: Path) -> PciDevice | None:
    """One device's facts; None when it is not a PCI function we can read."""
    vendor, pci_class = _hex(entry / "vendor"), _hex(entry / "class")
    if vendor is None or pci_class is None:
        return None
    if vendor != NVIDIA and not _is_network(pci_class):
        return None
    root, bridges = chain(entry)
    numa = _int(entry / "numa_node")
    return PciDevice(
        address=entry.name.lower(), vendor=vendor, device=_hex(entry / "device") or 0,
        pci_class=pci_class, root=root, bridges=bridges,
        numa_node=None if numa is None or numa < 0 else numa,
        cpus=_text(entry / "local_cpulist") or None, link=link(entry),
        driver=_link_name(entry / "driver"), rdma_names=_names(entry / "infiniband"),
        net_names=_names(entry / "net"))


def chain(entry: Path) -> tuple[str, tuple[str, ...]]:
    """(root complex, bridge addresses from it down) of a device, from its resolved path."""
    parts = entry.resolve().parts
    roots = [i for i, p in enumerate(parts) if _ROOT.match(p)]
    if not roots:
        return "", ()
    below = [p for p in parts[roots[-1] + 1:] if _BDF.match(p)]
    return parts[roots[-1]], tuple(below[:-1])


def link(entry: Path) -> PcieLink | None:
    """Current and max PCIe generation and width; None when sysfs shows none of them."""
    found = PcieLink(gen=_gen(entry / "current_link_speed"), max_gen=_gen(entry / "max_link_speed"),
                     width=_int(entry / "current_link_width"),
                     max_width=_int(entry / "max_link_width"))
    return None if found == PcieLink() else found


def _gen(path: Path) -> int | None:
    """'16.0 GT/s PCIe' (or '16 GT/s' on older kernels) -> 4."""
    match = re.match(r"([\d.]+)\s*GT/s", _text(path) or "")
    return _GT_PER_GEN.get(float(match.group(1))) if match else None


def _text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _hex(path: Path) -> int | None:
    try:
        return int(_text(path) or "", 16)
    except ValueError:
        return None


def _int(path: Path) -> int | None:
    try:
        return int(_text(path) or "")
    except ValueError:
        return None


def _link_name(path: Path) -> str | None:
    try:
        return Path(path.readlink()).name if path.is_symlink() else None
    except OSError:
        return None


def _names(path: Path) -> tuple[str, ...]:
    try:
        return tuple(sorted(p.name for p in path.iterdir()))
    except OSError:
        return ()
