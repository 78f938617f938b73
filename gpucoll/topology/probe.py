"""Probe this machine: NVML (with sysfs for NICs) when the driver works, else sysfs alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpucoll.errors import TopologyUnavailable
from gpucoll.topology.build import observed_from_nvml, observed_from_smi, observed_from_sysfs
from gpucoll.topology.layout import Layout, analyze
from gpucoll.topology.nvml import read_nvml
from gpucoll.topology.smi import read_smi
from gpucoll.topology.sysfs import read_sysfs


def probe(*, nvml: Any = None, sysfs_root: str | Path = "/") -> Layout:
    """The layout of this machine; TopologyUnavailable in one line when there is nothing to see.

    ``nvml`` replaces the pynvml module (tests pass recorded answers); ``sysfs_root`` is where
    ``sys/bus/pci/devices`` is found.
    """
    sysfs = read_sysfs(sysfs_root)
    try:
        facts = read_nvml(nvml)
    except TopologyUnavailable as exc:
        why = str(exc)
    else:
        if facts.gpus:
            return analyze(observed_from_nvml(facts, sysfs))
        why = "NVML sees no GPU"
    if sysfs.gpus:
        return analyze(observed_from_sysfs(sysfs, why))
    bus = Path(sysfs_root) / "sys" / "bus" / "pci" / "devices"
    raise TopologyUnavailable(f"no NVIDIA GPU on this machine ({why}; no device of vendor "
                              f"0x10de in {bus})")


def load(path: str | Path) -> Layout:
    """The layout of a saved ``nvidia-smi topo -m`` output."""
    return analyze(observed_from_smi(read_smi(path)))
