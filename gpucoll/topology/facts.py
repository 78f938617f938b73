"""Raw facts as the readers find them: no analysis, no derived labels.

Three sources feed the layout: a saved ``nvidia-smi topo -m`` output (:class:`SmiFacts`),
NVML (:class:`NvmlFacts`) and the PCI tree in sysfs (:class:`SysfsFacts`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PcieLink:
    """A PCIe link's generation and width, now and at most (None where unknown)."""

    gen: int | None = None
    max_gen: int | None = None
    width: int | None = None
    max_width: int | None = None


@dataclass(frozen=True)
class NvLink:
    """One NVLink of a GPU: whether it is up, its version and what sits at the other end."""

    link: int
    active: bool
    version: int | None = None
    remote_bus_id: str | None = None
    remote_kind: str = "unknown"  # gpu | switch | cpu | unknown


@dataclass(frozen=True)
class NvmlGpu:
    """What NVML says about one GPU."""

    index: int
    name: str
    uuid: str
    bus_id: str  # normalised: dddd:bb:dd.f, lower case
    memory_bytes: int | None = None
    pcie: PcieLink | None = None
    nvlinks: tuple[NvLink, ...] = ()
    cpus: str | None = None  # cpulist, e.g. "0-19,80-99"
    gpu_numa_id: int | None = None  # NUMA node of the GPU's own memory (Grace Hopper), else None


@dataclass(frozen=True)
class NvmlPair:
    """NVML's answers for one ordered pair of GPUs (by index)."""

    a: int
    b: int
    common_ancestor: int | None = None  # NVML_TOPOLOGY_* value
    p2p_read: bool | None = None
    p2p_nvlink: bool | None = None


@dataclass(frozen=True)
class NvmlFacts:
    """Everything read from NVML on one machine."""

    driver_version: str | None
    gpus: tuple[NvmlGpu, ...]
    pairs: tuple[NvmlPair, ...] = ()


@dataclass(frozen=True)
class PciDevice:
    """One device from /sys/bus/pci/devices, with the bridges between it and its root complex."""

    address: str  # dddd:bb:dd.f
    vendor: int
    device: int
    pci_class: int
    root: str  # the root complex directory, e.g. "pci0000:00"
    bridges: tuple[str, ...]  # bridge addresses from the root complex down, excluding itself
    numa_node: int | None = None
    cpus: str | None = None
    link: PcieLink | None = None
    driver: str | None = None
    rdma_names: tuple[str, ...] = ()  # e.g. ("mlx5_0",)
    net_names: tuple[str, ...] = ()  # e.g. ("ib0",)


@dataclass(frozen=True)
class SysfsFacts:
    """NVIDIA and network devices found in a sysfs tree."""

    root: str
    gpus: tuple[PciDevice, ...]
    switches: tuple[PciDevice, ...]  # NVIDIA bridges such as NVSwitch
    nics: tuple[PciDevice, ...]


@dataclass(frozen=True)
class SmiFacts:
    """A saved ``nvidia-smi topo -m`` output, cell by cell as printed."""

    source: str
    columns: tuple[str, ...]  # device names in header order
    extra_columns: tuple[str, ...]  # e.g. ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")
    rows: dict[str, tuple[str, ...]]  # printed rows: name -> labels in column order
    extras: dict[str, dict[str, str]]  # printed rows: name -> extra column -> value ("" = blank)
    nic_legend: dict[str, str] = field(default_factory=dict)  # "NIC0" -> "mlx5_0"
    legend: dict[str, str] = field(default_factory=dict)  # label -> meaning, as printed
    tab_separated: bool = False
    notes: tuple[str, ...] = ()  # what the reader inferred from a damaged paste
