"""Probe this machine: NVML (with sysfs for NICs) when the driver works, else sysfs alone; and
``load``, a saved ``nvidia-smi topo -m`` output (read by :mod:`.smi`).

- NVML, through nvidia-ml-py (module ``pynvml``, imported only when called): raw answers only,
  per GPU its identity, memory, PCIe link, NVLinks and CPU affinity; per pair of GPUs the
  common PCIe ancestor and peer-to-peer capabilities. Calls a GPU does not support give None
  rather than failing the whole probe.
- sysfs, the PCI tree: NVIDIA devices and network devices, without any driver. It reads
  ``<root>/sys/bus/pci/devices``; ``root`` is "/" on a live machine and a copied or built tree
  in tests. Each entry there is a symlink into ``/sys/devices/pciDDDD:BB/...`` whose path names
  every bridge between the device and its root complex, from which nvidia-smi's path label for
  two devices follows.
- The builders that turn these raw facts into one :class:`~gpucoll.topology.layout.Observed`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from types import ModuleType
from typing import Any

from gpucoll.errors import TopologyUnavailable, install_hint
from gpucoll.topology.layout import (
    Device,
    Finding,
    Layout,
    NvLink,
    NvmlFacts,
    NvmlGpu,
    NvmlPair,
    Observed,
    PciDevice,
    PcieLink,
    SysfsFacts,
    analyze,
)
from gpucoll.topology.smi import observed_from_smi, read_smi

# ---- probe and load ------------------------------------------------------------------------------

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


# ---- NVML ----------------------------------------------------------------------------------------

_REMOTE_KINDS = {0: "gpu", 1: "cpu", 2: "switch"}  # NVML_NVLINK_DEVICE_TYPE_{GPU,IBMNPU,SWITCH}


def load_nvml() -> ModuleType:
    """The pynvml module; TopologyUnavailable naming the package when it is not installed."""
    try:
        import pynvml
    except ImportError:
        raise TopologyUnavailable(f"NVML bindings missing: {install_hint('pynvml')}") from None
    return pynvml


def read_nvml(nvml: Any = None) -> NvmlFacts:
    """Everything NVML tells about this machine's GPUs; ``nvml`` defaults to pynvml."""
    nvml = nvml or load_nvml()
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        raise TopologyUnavailable(f"NVML cannot start: {exc}") from None
    try:
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        gpus = tuple(read_gpu(nvml, i, h) for i, h in enumerate(handles))
        pairs = tuple(read_pair(nvml, i, j, handles[i], handles[j])
                      for i in range(len(handles)) for j in range(i + 1, len(handles)))
        return NvmlFacts(_decoded(_try(nvml, nvml.nvmlSystemGetDriverVersion)), gpus, pairs)
    except nvml.NVMLError as exc:  # e.g. a GPU fell off the bus: identity calls fail
        raise TopologyUnavailable(f"NVML failed while reading GPUs: {exc}") from None
    finally:
        nvml.nvmlShutdown()


def read_gpu(nvml: Any, index: int, handle: Any) -> NvmlGpu:
    """One GPU's answers."""
    memory = _try(nvml, nvml.nvmlDeviceGetMemoryInfo, handle)
    pcie = PcieLink(*(_try(nvml, fn, handle) for fn in (
        nvml.nvmlDeviceGetCurrPcieLinkGeneration, nvml.nvmlDeviceGetMaxPcieLinkGeneration,
        nvml.nvmlDeviceGetCurrPcieLinkWidth, nvml.nvmlDeviceGetMaxPcieLinkWidth)))
    numa = _try(nvml, nvml.nvmlDeviceGetNumaNodeId, handle)
    return NvmlGpu(
        index=index, name=_decoded(nvml.nvmlDeviceGetName(handle)),
        uuid=_decoded(nvml.nvmlDeviceGetUUID(handle)),
        bus_id=normalize_bus_id(_decoded(nvml.nvmlDeviceGetPciInfo(handle).busId)),
        memory_bytes=None if memory is None else int(memory.total),
        pcie=None if pcie == PcieLink() else pcie, nvlinks=read_nvlinks(nvml, handle),
        cpus=_cpus(nvml, handle), gpu_numa_id=None if numa is None or numa < 0 else numa)


def read_nvlinks(nvml: Any, handle: Any) -> tuple[NvLink, ...]:
    """Every link the GPU has; a link number the GPU lacks answers NOT_SUPPORTED and is skipped."""
    links = []
    for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))):
        state = _try(nvml, nvml.nvmlDeviceGetNvLinkState, handle, link)
        if state is None:
            continue
        if not state:
            links.append(NvLink(link, False))
            continue
        remote = _try(nvml, nvml.nvmlDeviceGetNvLinkRemotePciInfo, handle, link)
        kind = _try(nvml, nvml.nvmlDeviceGetNvLinkRemoteDeviceType, handle, link)
        links.append(NvLink(
            link, True, _try(nvml, nvml.nvmlDeviceGetNvLinkVersion, handle, link),
            None if remote is None else normalize_bus_id(_decoded(remote.busId)),
            _REMOTE_KINDS.get(kind, "unknown")))
    return tuple(links)


def read_pair(nvml: Any, i: int, j: int, hi: Any, hj: Any) -> NvmlPair:
    """Common ancestor and P2P capabilities of GPUs i and j."""
    def p2p(name: str, default: int) -> bool | None:
        index = getattr(nvml, name, default)
        index = index[0] if isinstance(index, tuple) else index  # some versions export (0,)
        status = _try(nvml, nvml.nvmlDeviceGetP2PStatus, hi, hj, index)
        return None if status is None else status == getattr(nvml, "NVML_P2P_STATUS_OK", 0)

    return NvmlPair(i, j, _try(nvml, nvml.nvmlDeviceGetTopologyCommonAncestor, hi, hj),
                    p2p("NVML_P2P_CAPS_INDEX_READ", 0), p2p("NVML_P2P_CAPS_INDEX_NVLINK", 2))


def normalize_bus_id(bus_id: str) -> str:
    """NVML's '00000000:07:00.0' -> sysfs's '0000:07:00.0' (lower case, 4-digit domain)."""
    domain, rest = bus_id.strip().lower().split(":", 1)
    return f"{int(domain, 16):04x}:{rest}"


def cpulist(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5', the way Linux writes CPU lists."""
    ranges: list[list[int]] = []
    for cpu in sorted(cpus):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def _cpus(nvml: Any, handle: Any) -> str | None:
    words = max(16, (os.cpu_count() or 1) // 64 + 1)  # 16 words: up to 1024 CPUs
    mask = _try(nvml, nvml.nvmlDeviceGetCpuAffinity, handle, words)
    if mask is None:
        return None
    cpus = [64 * w + bit for w, value in enumerate(mask) for bit in range(64)
            if int(value) >> bit & 1]
    return cpulist(cpus) or None


def _try(nvml: Any, fn: Any, *args: Any) -> Any:
    """fn(*args), or None when NVML answers an error (not supported, no permission...)."""
    try:
        return fn(*args)
    except nvml.NVMLError:
        return None


def _decoded(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value


# ---- sysfs ---------------------------------------------------------------------------------------

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
        cpus=_read_text(entry / "local_cpulist") or None, link=link(entry),
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
    match = re.match(r"([\d.]+)\s*GT/s", _read_text(path) or "")
    return _GT_PER_GEN.get(float(match.group(1))) if match else None


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _hex(path: Path) -> int | None:
    try:
        return int(_read_text(path) or "", 16)
    except ValueError:
        return None


def _int(path: Path) -> int | None:
    try:
        return int(_read_text(path) or "")
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


# ---- PCIe path labels ----------------------------------------------------------------------------

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


# ---- from facts to observations ------------------------------------------------------------------

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
