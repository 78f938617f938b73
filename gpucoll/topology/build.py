"""Builders: each source's raw facts -> one :class:`~gpucoll.topology.layout.Observed`."""

from __future__ import annotations

import re

from gpucoll.topology.facts import NvmlFacts, NvmlGpu, PciDevice, SmiFacts, SysfsFacts
from gpucoll.topology.layout import Device, Finding, Observed
from gpucoll.topology.pcipath import pci_label


def observed_from_smi(smi: SmiFacts) -> Observed:
    """Devices and labels of a saved nvidia-smi output; a missing row is filled from the
    columns of the printed rows (the matrix is symmetric), else left None."""
    devices = tuple(_smi_device(smi, name) for name in smi.columns)
    matrix = {a: {b: _smi_cell(smi, a, b) for b in smi.columns} for a in smi.columns}
    missing = [name for name in smi.columns if name not in smi.rows]
    notes = tuple(Finding("inferred", f"read from a damaged copy: {note}") for note in smi.notes)
    if missing:
        notes += (Finding("partial", f"the output lacks the rows of {', '.join(missing)}: "
                          "their cells come from the other rows' columns where printed, and "
                          "their CPU affinity is unknown", tuple(missing)),)
    return Observed("nvidia-smi", smi.source, devices, matrix, None, notes)


def _smi_cell(smi: SmiFacts, a: str, b: str) -> str | None:
    if a == b:
        return "X"
    if a in smi.rows:
        return smi.rows[a][smi.columns.index(b)]
    if b in smi.rows:
        return smi.rows[b][smi.columns.index(a)]
    return None


def _smi_device(smi: SmiFacts, name: str) -> Device:
    extras = smi.extras.get(name, {})
    gpu = re.fullmatch(r"GPU(\d+)", name)
    if gpu:
        kind, index, legend = "gpu", int(gpu.group(1)), None
    else:
        nics = [c for c in smi.columns if not re.fullmatch(r"GPU\d+", c)]
        kind, index = "nic", nics.index(name)
        legend = smi.nic_legend.get(name, None if re.fullmatch(r"NIC\d+", name) else name)
    return Device(name=name, kind=kind, index=index, device=legend,
                  cpu_affinity=extras.get("CPU Affinity") or None,
                  numa_affinity=extras.get("NUMA Affinity") or extras.get("NUMA ID") or None,
                  gpu_numa_id=extras.get("GPU NUMA ID") or None)


# NVML_TOPOLOGY_* -> label: INTERNAL (two GPUs on one board) and SINGLE both cross one switch.
_ANCESTOR_LABELS = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}


def observed_from_nvml(nvml: NvmlFacts, sysfs: SysfsFacts | None = None) -> Observed:
    """GPUs from NVML, NICs and PCIe paths from sysfs (NVML knows nothing of NICs)."""
    pci = {d.address: d for d in sysfs.gpus + sysfs.nics} if sysfs else {}
    nics = rdma_nics(sysfs)
    gpus = {f"GPU{g.index}": g for g in nvml.gpus}
    ancestors = {frozenset((f"GPU{p.a}", f"GPU{p.b}")): p.common_ancestor for p in nvml.pairs}
    devices = tuple(_nvml_device(name, g, pci.get(g.bus_id)) for name, g in gpus.items())
    devices += tuple(_nic_device(i, n) for i, n in enumerate(nics))
    where = {**{n: pci.get(g.bus_id) for n, g in gpus.items()},
             **{f"NIC{i}": n for i, n in enumerate(nics)}}

    def label(a: str, b: str) -> str | None:
        if a == b:
            return "X"
        if a in gpus and b in gpus:
            found = nvlink_label(gpus[a], gpus[b])
            found = found or _ANCESTOR_LABELS.get(ancestors.get(frozenset((a, b))))
            if found:
                return found
        return pci_label(where[a], where[b]) if where[a] and where[b] else None

    names = [d.name for d in devices]
    matrix = {a: {b: label(a, b) for b in names} for a in names}
    switch = any(link.remote_kind == "switch" and link.active
                 for g in nvml.gpus for link in g.nvlinks)
    blocked = tuple((f"GPU{p.a}", f"GPU{p.b}") for p in nvml.pairs if p.p2p_read is False)
    return Observed("nvml", None, devices, matrix, switch, p2p_blocked=blocked)


def nvlink_label(a: NvmlGpu, b: NvmlGpu) -> str | None:
    """NV# between two GPUs: links from a to b, or through NVSwitches the fewer switch links."""
    direct = sum(1 for link in a.nvlinks if link.active and link.remote_bus_id == b.bus_id)
    if direct:
        return f"NV{direct}"
    switched = [sum(1 for link in g.nvlinks if link.active and link.remote_kind == "switch")
                for g in (a, b)]
    return f"NV{min(switched)}" if min(switched) else None


def _nvml_device(name: str, gpu: NvmlGpu, pci: PciDevice | None) -> Device:
    active = [link for link in gpu.nvlinks if link.active]
    down = tuple(link.link for link in gpu.nvlinks if not link.active) if active else ()
    return Device(
        name=name, kind="gpu", index=gpu.index, model=gpu.name, bus_id=gpu.bus_id,
        uuid=gpu.uuid, memory_bytes=gpu.memory_bytes,
        cpu_affinity=gpu.cpus or (pci.cpus if pci else None),
        numa_affinity=_numa(pci), gpu_numa_id=_opt_str(gpu.gpu_numa_id),
        pcie=gpu.pcie or (pci.link if pci else None), nvlinks_down=down)


def rdma_nics(sysfs: SysfsFacts | None) -> list[PciDevice]:
    """The NICs nvidia-smi shows: those with an RDMA device, ordered by its name (mlx5_2 <
    mlx5_10)."""
    if sysfs is None:
        return []
    with_rdma = [n for n in sysfs.nics if n.rdma_names]
    return sorted(with_rdma, key=lambda n: [int(t) if t.isdigit() else t
                                            for t in re.split(r"(\d+)", n.rdma_names[0])])


def _nic_device(i: int, nic: PciDevice) -> Device:
    return Device(name=f"NIC{i}", kind="nic", index=i, device=nic.rdma_names[0],
                  bus_id=nic.address, cpu_affinity=nic.cpus, numa_affinity=_numa(nic),
                  pcie=nic.link, netdevs=nic.net_names)


def observed_from_sysfs(sysfs: SysfsFacts, why: str) -> Observed:
    """PCIe paths only, for GPUs seen on the bus without a working driver (``why`` says why)."""
    nics = rdma_nics(sysfs)
    gpus = [(f"GPU{i}", g) for i, g in enumerate(sorted(sysfs.gpus, key=lambda g: g.address))]
    devices = tuple(
        Device(name=name, kind="gpu", index=i, model=f"NVIDIA device 0x{g.device:04x}",
               bus_id=g.address, cpu_affinity=g.cpus, numa_affinity=_numa(g), pcie=g.link)
        for i, (name, g) in enumerate(gpus))
    devices += tuple(_nic_device(i, n) for i, n in enumerate(nics))
    where = dict(gpus) | {f"NIC{i}": n for i, n in enumerate(nics)}
    matrix = {a: {b: pci_label(where[a], where[b]) for b in where} for a in where}
    note = Finding("no-driver", f"no NVIDIA driver ({why}): paths are PCIe only, NVLinks "
                   f"cannot be seen; {len(sysfs.switches)} NVIDIA bridge(s) (NVSwitch) on the bus",
                   tuple(name for name, _ in gpus))
    return Observed("sysfs", sysfs.root, devices, matrix, bool(sysfs.switches) or None, (note,))


def _numa(pci: PciDevice | None) -> str:
    return "N/A" if pci is None or pci.numa_node is None else str(pci.numa_node)


def _opt_str(value: int | None) -> str:
    return "N/A" if value is None else str(value)
