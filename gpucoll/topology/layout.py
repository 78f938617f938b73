"""What a topology means: the raw facts the readers find, and pure functions from observed
devices and path labels to a Layout.

Three sources feed the layout: a saved ``nvidia-smi topo -m`` output (:class:`SmiFacts`), NVML
(:class:`NvmlFacts`) and the PCI tree in sysfs (:class:`SysfsFacts`), each held here as its
reader finds it, with no analysis and no derived labels. The readers (:mod:`.smi`,
:mod:`.probe`) turn each source's raw facts into one :class:`Observed`; :func:`analyze` draws
every conclusion from it, whatever the source. Here too: the vocabulary of ``nvidia-smi topo -m``
(labels, how near each one is, bandwidth classes), and the ring order that keeps neighbours on
the fastest links. A ring collective runs at the speed of its slowest hop, so orders are
compared by their slowest hop first, then by the sum of all hops, then lexicographically (so the
answer is deterministic).

And where each rank of a job on one machine should run (:class:`Placement`): for N ranks, the N
GPUs whose best ring has the fastest slowest hop (then the fastest hops in all, then the fewest
NUMA nodes), in that ring's order; each GPU's CPUs (its NUMA node); and its nearest NICs, named
for NCCL only when some NICs are nearer than others.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import permutations

# ---- the labels of nvidia-smi topo -m ------------------------------------------------------------

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
    """The number of bonded NVLinks a label names (NV12 -> 12), 0 for PCIe """
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


# ---- ring order ----------------------------------------------------------------------------------

EXACT_UP_TO = 9  # (n-1)!/2 rings: 20160 for 9 nodes, checked in well under a second


def best_ring(nodes: Sequence[int], speed: Callable[[int, int], int]) -> list[int]:
    """The best ring over ``nodes`` (higher speed = faster hop), starting at the smallest node."""
    nodes = sorted(nodes)
    if len(nodes) <= 3:
        return nodes
    if len(nodes) <= EXACT_UP_TO:
        return _exhaustive(nodes, speed)
    return _two_opt(_greedy(nodes, speed), speed)


def ring_key(order: Sequence[int], speed: Callable[[int, int], int]) -> tuple[int, int]:
    """(slowest hop, sum of hops) of the closed ring ``order``: larger is better."""
    hops = [speed(a, b) for a, b in zip(order, [*order[1:], order[0]], strict=True)]
    return min(hops), sum(hops)


def _exhaustive(nodes: list[int], speed: Callable[[int, int], int]) -> list[int]:
    first, rest = nodes[0], nodes[1:]
    best, best_key = None, None
    for perm in permutations(rest):
        if perm[0] > perm[-1]:  # the same ring walked backwards
            continue
        order = [first, *perm]
        key = ring_key(order, speed)
        if best_key is None or key > best_key:  # permutations come in lexicographic order
            best, best_key = order, key
    return best


def _greedy(nodes: list[int], speed: Callable[[int, int], int]) -> list[int]:
    """Nearest-neighbour tour from the smallest node: always step to the fastest unvisited one."""
    order, left = [nodes[0]], set(nodes[1:])
    while left:
        here = order[-1]
        order.append(max(sorted(left), key=lambda n: speed(here, n)))
        left.remove(order[-1])
    return order


def _two_opt(order: list[int], speed: Callable[[int, int], int]) -> list[int]:
    """Reverse segments while that improves the ring; bounded, and deterministic."""
    key = ring_key(order, speed)
    for _ in range(len(order) ** 2):
        improved = False
        for i in range(1, len(order) - 1):
            for j in range(i + 1, len(order)):
                cand = order[:i] + order[i:j + 1][::-1] + order[j + 1:]
                cand_key = ring_key(cand, speed)
                if cand_key > key:
                    order, key, improved = cand, cand_key, True
        if not improved:
            break
    return order


# ---- raw facts, as the readers find them --------------------------------------------------------


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


# ---- the layout ----------------------------------------------------------------------------------

# No GPU has more NVLinks than this (H100: 18). A GPU whose pair counts add up to more must
# reach its peers through NVSwitches, which report every link to every peer.
MAX_NVLINKS_PER_GPU = 18


@dataclass(frozen=True)
class Device:
    """One GPU or NIC, named as nvidia-smi names it (GPU0, NIC0, or mlx5_0 on old drivers)."""

    name: str
    kind: str  # gpu | nic
    index: int  # the GPU's index, or the NIC's position among NICs
    device: str | None = None  # a NIC's legend/RDMA name, e.g. mlx5_0
    model: str | None = None
    bus_id: str | None = None
    uuid: str | None = None
    memory_bytes: int | None = None
    cpu_affinity: str | None = None  # cpulist as printed; None when blank or unknown
    numa_affinity: str | None = None  # as printed, e.g. "0" or "N/A"
    gpu_numa_id: str | None = None  # as printed; a NUMA node of the GPU's own memory (GH200)
    pcie: PcieLink | None = None
    nvlinks_down: tuple[int, ...] = ()  # link numbers NVML reports as supported but inactive
    netdevs: tuple[str, ...] = ()  # a NIC's network interfaces (ib0, ens1f0), where known


@dataclass(frozen=True)
class Finding:
    """A warning about the layout: a stable code, a sentence, and the devices concerned."""

    code: str  # cross-socket | no-nearby-nic | pcie-degraded | nvlink-down | nvlink-uneven |
    #            p2p-unavailable | partial | no-driver | inferred
    message: str
    devices: tuple[str, ...] = ()


@dataclass(frozen=True)
class Observed:
    """Devices and path labels from one source, before any analysis."""

    source: str  # nvidia-smi | nvml | sysfs
    path: str | None
    devices: tuple[Device, ...]
    matrix: dict[str, dict[str, str | None]]  # None: not shown by the source
    nvswitch: bool | None = None  # None: the source cannot tell, infer from link counts
    notes: tuple[Finding, ...] = ()  # source-specific findings (partial input, no driver)
    p2p_blocked: tuple[tuple[str, str], ...] = ()  # GPU pairs NVML says cannot read each other


@dataclass(frozen=True)
class Layout:
    """Everything the layout found; render_json documents its serialised form."""

    observed: Observed
    nvlink_pairs: dict[tuple[str, str], int]
    islands: list[list[str]]
    nvswitch: bool
    nvswitch_basis: str  # "nvml", "pci", or "link counts"
    nearest_nic: dict[str, tuple[list[str], str]]  # GPU -> (nearest NICs, their label)
    bandwidth: dict[str, dict[str, str | None]]  # GPU -> GPU -> bandwidth class
    ring_order: list[int]
    warnings: list[Finding] = field(default_factory=list)

    @property
    def devices(self) -> tuple[Device, ...]:
        return self.observed.devices

    @property
    def matrix(self) -> dict[str, dict[str, str | None]]:
        return self.observed.matrix

    @property
    def gpus(self) -> list[Device]:
        return [d for d in self.observed.devices if d.kind == "gpu"]

    @property
    def nics(self) -> list[Device]:
        return [d for d in self.observed.devices if d.kind == "nic"]


def analyze(obs: Observed) -> Layout:
    """Draw every conclusion from one source's observations."""
    gpus = [d.name for d in obs.devices if d.kind == "gpu"]
    pairs = nvlink_pairs(obs.matrix, gpus)
    nvswitch, basis = _nvswitch(obs, pairs, gpus)
    nearest = nearest_nics(obs)
    layout = Layout(
        observed=obs, nvlink_pairs=pairs, islands=islands(gpus, pairs), nvswitch=nvswitch,
        nvswitch_basis=basis, nearest_nic=nearest, bandwidth=bandwidth(obs.matrix, gpus),
        ring_order=ring_order_of(obs))
    layout.warnings.extend(findings(layout))
    return layout


def gpu_index(name: str) -> int:
    """GPU3 -> 3."""
    match = re.fullmatch(r"GPU(\d+)", name)
    if not match:
        raise ValueError(f"{name!r} is not a GPU name like GPU0")
    return int(match.group(1))


def nvlink_pairs(matrix: dict[str, dict[str, str | None]], gpus: list[str]) -> dict:
    """(GPUa, GPUb) -> bonded NVLink count, for each unordered pair joined by NVLink."""
    out = {}
    for i, a in enumerate(gpus):
        for b in gpus[i + 1:]:
            links = nvlinks(matrix[a][b])
            if links:
                out[(a, b)] = links
    return out


def islands(gpus: list[str], pairs: dict[tuple[str, str], int]) -> list[list[str]]:
    """GPUs grouped by NVLink reachability; a GPU without NVLink is an island of its own."""
    group = {g: {g} for g in gpus}
    for a, b in pairs:
        if group[a] is not group[b]:
            merged = group[a] | group[b]
            for g in merged:
                group[g] = merged
    seen, out = set(), []
    for g in gpus:
        if g not in seen:
            seen |= group[g]
            out.append([x for x in gpus if x in group[g]])
    return out


def _nvswitch(obs: Observed, pairs: dict, gpus: list[str]) -> tuple[bool, str]:
    """Whether NVSwitches join the GPUs, and how that is known."""
    if obs.nvswitch is not None:
        return obs.nvswitch, obs.source
    totals = {g: 0 for g in gpus}
    for (a, b), links in pairs.items():
        totals[a] += links
        totals[b] += links
    return any(t > MAX_NVLINKS_PER_GPU for t in totals.values()), "link counts"


def nearest_nics(obs: Observed) -> dict[str, tuple[list[str], str]]:
    """GPU -> (the NICs at the nearest PCIe level, that level's label as printed)."""
    nics = [d.name for d in obs.devices if d.kind == "nic"]
    out = {}
    for gpu in (d.name for d in obs.devices if d.kind == "gpu"):
        levels = {n: pcie_level(obs.matrix[gpu][n]) for n in nics}
        known = [lv for lv in levels.values() if lv is not None]
        if known:
            best = min(known)
            names = [n for n in nics if levels[n] == best]
            out[gpu] = (names, obs.matrix[gpu][names[0]])
    return out


def bandwidth(matrix: dict, gpus: list[str]) -> dict[str, dict[str, str | None]]:
    """GPU -> GPU -> bandwidth class of the path between them (None on the diagonal)."""
    return {a: {b: None if a == b else bandwidth_class(matrix[a][b]) for b in gpus}
            for a in gpus}


def ring_order_of(obs: Observed) -> list[int]:
    """GPU indices in the suggested ring order."""
    return ring_over(obs, [gpu_index(d.name) for d in obs.devices if d.kind == "gpu"])


def ring_over(obs: Observed, gpus: Iterable[int]) -> list[int]:
    """The suggested ring over some of the GPUs, by index; ValueError naming unknown ones."""
    known = {gpu_index(d.name) for d in obs.devices if d.kind == "gpu"}
    gpus = sorted(set(gpus))
    unknown = [g for g in gpus if g not in known]
    if unknown:
        raise ValueError(f"gpus {unknown} are not in the topology (it has GPUs {sorted(known)})")

    def hop(a: int, b: int) -> int:
        return weight(obs.matrix[f"GPU{a}"][f"GPU{b}"])

    return best_ring(gpus, hop)


def findings(layout: Layout) -> list[Finding]:
    """Every warning about the layout, source notes first."""
    out = list(layout.observed.notes)
    out += _cross_socket(layout)
    out += _no_nearby_nic(layout)
    out += _pcie_degraded(layout)
    out += _nvlink_down(layout)
    out += _nvlink_uneven(layout)
    out += _p2p_blocked(layout)
    return out


def _p2p_blocked(layout: Layout) -> list[Finding]:
    pairs = layout.observed.p2p_blocked
    if not pairs:
        return []
    text = ", ".join(f"{a}-{b}" for a, b in pairs)
    gpus = tuple(dict.fromkeys(g for p in pairs for g in p))
    return [Finding("p2p-unavailable", f"{len(pairs)} GPU pair(s) cannot read each other's "
                    f"memory directly: {text}; their traffic is staged through host memory "
                    "(PCIe ACS or the IOMMU often cause this)", gpus)]


def _cross_socket(layout: Layout) -> list[Finding]:
    gpus = [d.name for d in layout.gpus]
    pairs = [(a, b) for i, a in enumerate(gpus) for b in gpus[i + 1:]
             if crosses_sockets(layout.matrix[a][b])]
    if not pairs:
        return []
    text = ", ".join(f"{a}-{b}" for a, b in pairs)
    return [Finding("cross-socket", f"{len(pairs)} GPU pair(s) talk across the CPU socket "
                    f"interconnect (SYS): {text}; keep them apart in rings or expect PCIe+QPI/UPI "
                    "bandwidth", tuple(sorted({g for p in pairs for g in p}, key=gpus.index)))]


def _no_nearby_nic(layout: Layout) -> list[Finding]:
    """GPUs whose nearest NIC is beyond a PCIe switch, where GPUDirect RDMA is slow or off."""
    out = []
    for gpu, (nics, label) in layout.nearest_nic.items():
        if pcie_level(label) > PCIE_LEVELS.index("PXB"):
            out.append(Finding("no-nearby-nic", f"{gpu} has no NIC below a shared PCIe switch "
                               f"(nearest: {', '.join(nics)} at {label}); GPUDirect RDMA will "
                               "be slow or disabled for it", (gpu, *nics)))
    return out


def _pcie_degraded(layout: Layout) -> list[Finding]:
    out = []
    for dev in layout.devices:
        link = dev.pcie
        if link is None:
            continue
        slow_gen = None not in (link.gen, link.max_gen) and link.gen < link.max_gen
        narrow = None not in (link.width, link.max_width) and link.width < link.max_width
        if slow_gen or narrow:
            out.append(Finding("pcie-degraded", f"{dev.name} PCIe link runs at gen {link.gen} "
                               f"x{link.width}, below its max gen {link.max_gen} "
                               f"x{link.max_width} (idle GPUs lower their generation to save "
                               "power: check again under load)", (dev.name,)))
    return out


def _nvlink_down(layout: Layout) -> list[Finding]:
    return [Finding("nvlink-down", f"{d.name} has {len(d.nvlinks_down)} NVLink(s) down: "
                    f"link {', '.join(map(str, d.nvlinks_down))}", (d.name,))
            for d in layout.gpus if d.nvlinks_down]


def _nvlink_uneven(layout: Layout) -> list[Finding]:
    """On an NVSwitch every pair has the same link count; fewer on some means links are down.

    A pair shows the fewer links of its two GPUs, so a GPU short on most of its pairs is the
    culprit; without one, every GPU of a short pair is named.
    """
    if not layout.nvswitch or not layout.nvlink_pairs:
        return []
    counts = list(layout.nvlink_pairs.values())
    usual = max(set(counts), key=lambda c: (counts.count(c), c))
    pairs = [(p, c < usual) for p, c in layout.nvlink_pairs.items()]
    names = [g.name for g in layout.gpus]
    mine = {g: [s for p, s in pairs if g in p] for g in names}
    short = [g for g in names if 2 * sum(mine[g]) > len(mine[g])]
    short = short or [g for g in names if any(s and g in p for p, s in pairs)]
    if not short:
        return []
    return [Finding("nvlink-uneven", f"NVSwitch pairs usually have NV{usual}, but "
                    f"{', '.join(short)} have fewer: NVLinks may be down", tuple(short))]


# ---- placement: where each rank of a job on one machine should run -------------------------------
#
# - GPUs: for N ranks, the N GPUs whose best ring has the fastest slowest hop (then the fastest
#   hops in all, then the fewest NUMA nodes), in that ring's order, so that ranks next to each
#   other in rank order are GPUs next to each other on the fastest links.
# - CPUs: the GPU's CPU affinity, the CPUs of its NUMA node (what torchrun's
#   `--numa-binding=node` binds); memory then comes from that node too, Linux allocating it
#   where the thread that first touches it runs.
# - NICs: the NICs nearest to the GPU (the nearest PCIe level), for NCCL: NCCL_IB_HCA names
#   their RDMA devices, NCCL_SOCKET_IFNAME their network interfaces where those are known
#   (a probe sees them; a saved nvidia-smi output does not). Only when some NICs are nearer than
#   others: where every NIC is equally far, NCCL's own choice is as good.

EXHAUSTIVE_RINGS = 20_000  # rings to compare at most when choosing a subset of GPUs


@dataclasses.dataclass(frozen=True)
class Placement:
    """One local rank's share of the machine."""

    rank: int
    gpu: int | None  # GPU index (NVML's, in PCI bus order); None without GPUs
    cpus: str | None  # cpulist as the topology gives it, e.g. "0-19,80-99"; None: unknown
    numa: str | None  # the NUMA node of those CPUs, where known
    nics: tuple[str, ...] = ()  # RDMA devices of the nearest NICs, e.g. ("mlx5_0",)
    netdevs: tuple[str, ...] = ()  # their network interfaces, e.g. ("ib0",), where known
    nic_label: str | None = None  # the path label to those NICs (PIX, PXB, ...)

    def nccl_env(self) -> dict[str, str]:
        """NCCL's variables restricting this rank to its nearest NICs (exact names, ``=``)."""
        env = {}
        if self.nics:
            env["NCCL_IB_HCA"] = "=" + ",".join(self.nics)
        if self.netdevs:
            env["NCCL_SOCKET_IFNAME"] = "=" + ",".join(self.netdevs)
        return env

    def describe(self) -> str:
        """``GPU3, CPUs 0-19 (NUMA 0), NICs mlx5_2 (PIX)``."""
        where = "no GPU" if self.gpu is None else f"GPU{self.gpu}"
        if self.cpus:
            cpus = f"CPUs {self.cpus}" + (f" (NUMA {self.numa})" if self.numa else "")
        else:
            cpus = f"the CPUs of NUMA node {self.numa}" if self.numa else "CPUs unknown"
        nics = (f"NICs {', '.join(self.nics)} ({self.nic_label})" if self.nics
                else "NCCL picks the NIC")
        return f"{where}, {cpus}, {nics}"


def parse_cpulist(text: str) -> set[int]:
    """``"0-3,8,10-11"`` -> {0, 1, 2, 3, 8, 10, 11}; ValueError naming a malformed part."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        low, sep, high = part.partition("-")
        try:
            first, last = int(low), int(high) if sep else int(low)
        except ValueError:
            raise ValueError(f"cpulist {text!r}: {part!r} is not a CPU number or range") from None
        if first < 0 or last < first:
            raise ValueError(f"cpulist {text!r}: {part!r} is not a range of CPUs")
        cpus.update(range(first, last + 1))
    return cpus


def format_cpulist(cpus: set[int]) -> str:
    """{0, 1, 2, 5} -> ``"0-2,5"``."""
    parts, run = [], []
    for cpu in sorted(cpus):
        if run and cpu != run[-1] + 1:
            parts.append(_run(run))
            run = []
        run.append(cpu)
    if run:
        parts.append(_run(run))
    return ",".join(parts)


def _run(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"


def suggest(layout: Layout, nranks: int) -> tuple[list[Placement], list[str]]:
    """Placements for ``nranks`` local ranks, and notes on what could not be done."""
    if nranks < 1:
        raise ValueError(f"ranks must be at least 1, got {nranks}")
    gpus = [g.index for g in layout.gpus]
    notes = []
    if not gpus:
        return [Placement(r, None, None, None) for r in range(nranks)], ["no GPU in the layout"]
    order = choose_gpus(layout, min(nranks, len(gpus)))
    if nranks > len(gpus):
        notes.append(f"{nranks} ranks share {len(gpus)} GPU(s) (NCCL needs one GPU per rank): "
                     f"rank r uses the GPU of rank r mod {len(gpus)}")
    return place(layout, [order[r % len(order)] for r in range(nranks)]), notes


def place(layout: Layout, gpus: Sequence[int]) -> list[Placement]:
    """Placements of ranks 0, 1, ... on the given GPU indices (one per rank)."""
    by_index = {g.index: g for g in layout.gpus}
    unknown = sorted({g for g in gpus if g not in by_index})
    if unknown:
        raise ValueError(f"GPUs {unknown} are not in the topology (it has GPUs "
                         f"{sorted(by_index)})")
    return [_placement(layout, rank, by_index[g]) for rank, g in enumerate(gpus)]


def _placement(layout: Layout, rank: int, gpu: Device) -> Placement:
    numa = gpu.numa_affinity if gpu.numa_affinity not in (None, "N/A") else None
    nics, label = layout.nearest_nic.get(gpu.name, ([], None))
    if not _nearer_than_others(layout, gpu, label):
        nics, label = [], None
    devices = {d.name: d for d in layout.nics}
    rdma = tuple(devices[n].device for n in nics if devices[n].device)
    netdevs = tuple(x for n in nics for x in devices[n].netdevs)
    return Placement(rank, gpu.index, gpu.cpu_affinity, numa, rdma, netdevs, label)


def _nearer_than_others(layout: Layout, gpu: Device, label: str | None) -> bool:
    """True when the GPU's nearest NICs are nearer than some other NIC."""
    if label is None:
        return False
    best = pcie_level(label)
    levels = [pcie_level(layout.matrix[gpu.name][n.name]) for n in layout.nics]
    return any(level is not None and level > best for level in levels)


def choose_gpus(layout: Layout, count: int) -> list[int]:
    """The ``count`` GPUs that make the best ring, in ring order (see the module's docstring)."""
    gpus = [g.index for g in layout.gpus]
    if count >= len(gpus):
        return ring_over(layout.observed, gpus)
    numa = {g.index: g.numa_affinity or g.cpu_affinity for g in layout.gpus}
    rings = math.comb(len(gpus), count) * max(1, math.factorial(max(count - 1, 1)) // 2)
    if rings > EXHAUSTIVE_RINGS:  # too many subsets: the best arc of the whole ring
        ring = ring_over(layout.observed, gpus)
        arcs = [[ring[(i + k) % len(ring)] for k in range(count)] for i in range(len(ring))]
        candidates = [sorted(arc) for arc in arcs]
    else:
        candidates = [list(c) for c in itertools.combinations(gpus, count)]

    def score(subset: list[int]) -> tuple:
        order = ring_over(layout.observed, subset)
        slowest, total = ring_key(order, lambda a, b: _weight(layout, a, b))
        return (slowest, total, -len({numa[g] for g in subset}), [-g for g in subset])

    best = max(candidates, key=score)
    return ring_over(layout.observed, best)


def _weight(layout: Layout, a: int, b: int) -> int:
    return weight(layout.matrix[f"GPU{a}"][f"GPU{b}"])


def visible_indices(layout: Layout, visible: Sequence[str]) -> list[int | None]:
    """The GPU index of each ``CUDA_VISIBLE_DEVICES`` entry (an index or a GPU UUID); None for
    an entry the layout cannot match (a MIG instance, an unknown UUID)."""
    uuids = {g.uuid: g.index for g in layout.gpus if g.uuid}
    known = {g.index for g in layout.gpus}
    out: list[int | None] = []
    for entry in visible:
        if entry.isdigit():
            out.append(int(entry) if int(entry) in known else None)
        else:
            out.append(uuids.get(entry))
    return out
