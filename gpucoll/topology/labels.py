"""The vocabulary of ``nvidia-smi topo -m``: labels, how near each one is, and bandwidth classes."""

from __future__ import annotations

import re

# PCIe path labels, nearest first. Drivers before the NODE/SYS split printed SOC for any path
# crossing the CPU socket interconnect; it means what SYS means now.
PCIE_LEVELS = ("PIX", "PXB", "PHB", "NODE", "SYS")
ALIASES = {"SOC": "SYS"}

LEGEND = (
    ("X", "Self"),
    ("SYS", "Connection traversing PCIe as well as the SMP interconnect between NUMA nodes "
            "(e.g., QPI/UPI)"),
    ("NODE", "Connection traversing PCIe as well as the interconnect between PCIe Host Bridges "
             "within a NUMA node"),
    ("PHB", "Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)"),
    ("PXB", "Connection traversing multiple PCIe bridges (without traversing the PCIe Host "
            "Bridge)"),
    ("PIX", "Connection traversing at most a single PCIe bridge"),
    ("NV#", "Connection traversing a bonded set of # NVLinks"),
)

# Bandwidth classes, fastest first: NVLink; PCIe peer-to-peer below a switch; PCIe through the
# CPU's root complex(es) of one socket; PCIe across the socket interconnect.
BANDWIDTH_CLASSES = ("nvlink", "pcie-switch", "pcie-host", "cross-socket")

_NV = re.compile(r"NV(\d+)\Z")


def is_label(cell: str) -> bool:
    """True for any label nvidia-smi prints in its matrix (old drivers' SOC included)."""
    return cell == "X" or cell in PCIE_LEVELS or cell in ALIASES or _NV.match(cell) is not None


def nvlinks(label: str | None) -> int:
    """The number of bonded NVLinks a label names (NV12 -> 12), 0 for PCIe labels."""
    match = _NV.match(label or "")
    return int(match.group(1)) if match else 0


def pcie_level(label: str | None) -> int | None:
    """Index of a PCIe label in PCIE_LEVELS (0 = PIX, nearest), None for NV#, X or unknown."""
    label = ALIASES.get(label or "", label)
    return PCIE_LEVELS.index(label) if label in PCIE_LEVELS else None


def crosses_sockets(label: str | None) -> bool:
    """True when the path goes over the CPU socket interconnect (SYS, or SOC of old drivers)."""
    return ALIASES.get(label or "", label) == "SYS"


def weight(label: str | None) -> int:
    """A path's speed as an orderable number: any NVLink beats any PCIe, more links beat fewer.

    Unknown paths weigh 0, below the slowest PCIe path.
    """
    links = nvlinks(label)
    if links:
        return 100 + links
    level = pcie_level(label)
    return 0 if level is None else len(PCIE_LEVELS) - level


def bandwidth_class(label: str | None) -> str | None:
    """The bandwidth class of a path label (see BANDWIDTH_CLASSES); None when unknown."""
    if nvlinks(label):
        return "nvlink"
    level = pcie_level(label)
    if level is None:
        return None
    return ("pcie-switch", "pcie-switch", "pcie-host", "pcie-host", "cross-socket")[level]
