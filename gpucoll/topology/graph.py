"""The picture's content, shared by the DOT and PNG renderers: boxes, groups and lines."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from gpucoll.topology import labels
from gpucoll.topology.layout import Device, Layout

NVSWITCH = "NVSwitch"


@dataclass(frozen=True)
class Node:
    name: str
    kind: str  # gpu | nic | switch
    group: str | None  # the CPU socket / NUMA node it hangs off, when known
    text: str  # what the box says, lines separated by "\n"


@dataclass(frozen=True)
class Edge:
    a: str
    b: str
    label: str
    kind: str  # nvlink | pcie


def build_graph(layout: Layout) -> tuple[list[Node], list[Edge]]:
    """Nodes (GPUs, NICs, one NVSwitch node when present) and the edges worth drawing."""
    groups = {g.name: _group(g) for g in layout.gpus}
    nodes = [Node(g.name, "gpu", groups[g.name], _gpu_text(g)) for g in layout.gpus]
    nics = sorted(layout.nics, key=lambda n: (_nearest_gpu(layout, n), n.index))
    nodes += [Node(n.name, "nic", _nic_group(layout, n, groups), _nic_text(n)) for n in nics]
    edges = _nvlink_edges(layout) + _pcie_edges(layout)
    if layout.nvswitch and layout.nvlink_pairs:
        nodes.append(Node(NVSWITCH, "switch", None, "NVSwitch"))
    return nodes, edges


def _group(gpu: Device) -> str | None:
    if gpu.numa_affinity and gpu.numa_affinity != "N/A":
        return f"NUMA {gpu.numa_affinity}"
    return f"CPUs {gpu.cpu_affinity}" if gpu.cpu_affinity else None


def _nic_group(layout: Layout, nic: Device, groups: dict[str, str | None]) -> str | None:
    """A NIC sits with the nearest GPU within its socket (NODE or nearer), if any."""
    near = [(labels.pcie_level(layout.matrix[g][nic.name]), g) for g in groups]
    near = [(level, g) for level, g in near if level is not None and level <= 3]
    return groups[min(near)[1]] if near else None


def _nearest_gpu(layout: Layout, nic: Device) -> int:
    """Index of the GPU nearest to a NIC (the first of equals), so NICs line up with GPUs."""
    levels = [(labels.pcie_level(layout.matrix[g.name][nic.name]), g.index) for g in layout.gpus]
    known = [lv for lv in levels if lv[0] is not None]
    return min(known)[1] if known else len(layout.gpus)


def _gpu_text(gpu: Device) -> str:
    return gpu.name if not gpu.model else f"{gpu.name}\n{gpu.model.replace('NVIDIA ', '')}"


def _nic_text(nic: Device) -> str:
    return nic.name if not nic.device or nic.device == nic.name else f"{nic.name}\n{nic.device}"


def _nvlink_edges(layout: Layout) -> list[Edge]:
    if layout.nvswitch:  # one line per GPU to the switch instead of n*(n-1)/2 pairs
        per_gpu: dict[str, Counter] = {g.name: Counter() for g in layout.gpus}
        for (a, b), links in layout.nvlink_pairs.items():
            per_gpu[a][links] += 1
            per_gpu[b][links] += 1
        return [Edge(g, NVSWITCH, f"NV{c.most_common(1)[0][0]}", "nvlink")
                for g, c in per_gpu.items() if c]
    return [Edge(a, b, f"NV{n}", "nvlink") for (a, b), n in layout.nvlink_pairs.items()]


def _pcie_edges(layout: Layout) -> list[Edge]:
    """Close PCIe paths only (PIX, PXB, PHB): between GPUs without NVLink, each GPU's nearest
    peers (farther ones follow from the picture); and each GPU's nearest NICs."""
    gpus = [g.name for g in layout.gpus]
    pairs = [(a, b) for i, a in enumerate(gpus) for b in gpus[i + 1:]
             if (a, b) not in layout.nvlink_pairs and _close(layout.matrix[a][b])]
    level = {p: labels.pcie_level(layout.matrix[p[0]][p[1]]) for p in pairs}
    best = {g: min((lv for p, lv in level.items() if g in p), default=None) for g in gpus}
    edges = [Edge(a, b, layout.matrix[a][b], "pcie") for a, b in pairs
             if level[(a, b)] in (best[a], best[b])]
    for gpu, (nics, label) in layout.nearest_nic.items():
        edges += [Edge(gpu, nic, label, "pcie") for nic in nics if _close(label)]
    return edges


def _close(label: str | None) -> bool:
    level = labels.pcie_level(label)
    return level is not None and level <= labels.PCIE_LEVELS.index("PHB")
