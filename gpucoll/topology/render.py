"""The layout shown: as text (the matrix as nvidia-smi prints it, with its legend, then what the
layout found, and ``--suggest``'s placement), as JSON, as a Graphviz graph, as a PNG; and
``gpucoll topo`` (:func:`main`), which shows the NVLink/PCIe layout of this machine or of a saved
nvidia-smi output in any of these forms.

The JSON is a stable schema (version in ``schema``; fields are only ever added). Top level::

    schema        "gpucoll.topology/1"
    source        {"kind": "nvidia-smi"|"nvml"|"sysfs", "path": str|null}
    devices       [{"name": "GPU0"|"NIC0"|"mlx5_0", "kind": "gpu"|"nic", "index": int,
                    "device": NIC legend name or null, "model", "bus_id", "uuid",
                    "memory_bytes", "cpu_affinity", "numa_affinity", "gpu_numa_id",
                    "pcie": {"gen", "max_gen", "width", "max_width"} or null,
                    "nvlinks_down": [link numbers], "netdevs": [a NIC's network interfaces]}]
    matrix        {name: {name: label}}: labels exactly as nvidia-smi prints them ("X" on the
                  diagonal, "NV12", "PIX", "SOC" from old drivers...), null where the source did
                  not show the pair
    nvlink        {"pairs": [{"a": "GPU0", "b": "GPU1", "links": 12}], "islands": [["GPU0", ...]],
                   "nvswitch": bool, "nvswitch_basis": "nvml"|"sysfs"|"link counts"}
    nearest_nic   {gpu name: {"nics": [names], "label": label}} (GPUs with a NIC in the matrix)
    bandwidth     {gpu: {gpu: "nvlink"|"pcie-switch"|"pcie-host"|"cross-socket"|null}}
    ring_order    [GPU indices], the suggested ring
    warnings      [{"code": str, "message": str, "devices": [names]}]

The picture (DOT and PNG share its content, :func:`build_graph`): GPUs, NICs and the
NVSwitch, in one box per CPU socket/NUMA node, joined by NVLinks (green, thicker for more
links) and close PCIe paths (grey, dashed); matplotlib is imported only for the PNG.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from gpucoll.errors import TopologyParseError, TopologyUnavailable, require
from gpucoll.topology.layout import (
    BANDWIDTH_CLASSES,
    LEGEND,
    PCIE_LEVELS,
    Device,
    Layout,
    pcie_level,
    suggest,
)

# ---- text ----------------------------------------------------------------------------------------

_EXTRAS = (("CPU Affinity", "cpu_affinity"), ("NUMA Affinity", "numa_affinity"),
           ("GPU NUMA ID", "gpu_numa_id"))


def render_text(layout: Layout) -> str:
    """The whole report: matrix, legends, findings."""
    parts = [matrix_text(layout), legend_text(layout), summary_text(layout)]
    return "\n\n".join(p for p in parts if p) + "\n"


def matrix_text(layout: Layout) -> str:
    """The pair matrix, one row per device, with the affinity columns the source knows."""
    names = [d.name for d in layout.devices]
    extras = [(title, attr) for title, attr in _EXTRAS
              if any(getattr(d, attr) for d in layout.devices if d.kind == "gpu")]
    width = max(8, *(len(n) + 2 for n in names))
    widths = [max(len(title), *(len(getattr(d, attr) or "") for d in layout.gpus)) + 3
              for title, attr in extras]
    head = " " * width + "".join(n.ljust(width) for n in names)
    head += "".join(title.ljust(w) for (title, _), w in zip(extras, widths, strict=True))
    rows = [head.rstrip()]
    for dev in layout.devices:
        cells = "".join(_cell(layout.matrix[dev.name][n]).ljust(width) for n in names)
        values = "" if dev.kind != "gpu" else "".join(
            (getattr(dev, attr) or "").ljust(w)
            for (_, attr), w in zip(extras, widths, strict=True))
        rows.append((dev.name.ljust(width) + cells + values).rstrip())
    return "\n".join(rows)


def _cell(label: str | None) -> str:
    return " X" if label == "X" else ("?" if label is None else label)


def legend_text(layout: Layout) -> str:
    shown = {label for row in layout.matrix.values() for label in row.values()}
    lines = ["Legend:", ""] + [f"  {label:<4} = {text}" for label, text in LEGEND]
    if "SOC" in shown:
        lines.append("  SOC  = Connection traversing PCIe as well as the SMP link between CPU "
                     "sockets (printed by old drivers; SYS today)")
    if None in shown:
        lines.append("  ?    = Not shown by the source")
    named = [d for d in layout.nics if d.device and d.device != d.name]
    if named:
        lines += ["", "NIC Legend:", ""] + [f"  {d.name}: {d.device}" for d in named]
    return "\n".join(lines)


def summary_text(layout: Layout) -> str:
    """What nvidia-smi leaves to the reader, one fact per line."""
    lines = [f"Source: {layout.observed.source}"
             + (f" ({layout.observed.path})" if layout.observed.path else "")]
    lines.append(f"GPUs: {len(layout.gpus)}, NICs: {len(layout.nics)}")
    lines.append("NVLink islands: " + "  ".join("{" + " ".join(i) + "}" for i in layout.islands))
    if layout.nvlink_pairs:
        counts = sorted(set(layout.nvlink_pairs.values()))
        lines.append(f"NVLink pairs: {len(layout.nvlink_pairs)} (links per pair: "
                     f"{', '.join(map(str, counts))})")
    lines.append(f"NVSwitch: {'yes' if layout.nvswitch else 'no'} "
                 f"(from {layout.nvswitch_basis})")
    if len(layout.gpus) > 1:
        lines.append("GPU pairs by bandwidth class: " + _class_counts(layout))
    for gpu in layout.gpus:
        lines.append(f"{gpu.name}: {_gpu_line(layout, gpu)}")
    lines.append("Suggested ring order: " + " ".join(f"GPU{i}" for i in layout.ring_order))
    lines += [f"warning [{w.code}]: {w.message}" for w in layout.warnings]
    return "\n".join(lines)


def _class_counts(layout: Layout) -> str:
    names = [g.name for g in layout.gpus]
    found = [layout.bandwidth[a][b] or "unknown"
             for i, a in enumerate(names) for b in names[i + 1:]]
    order = [*BANDWIDTH_CLASSES, "unknown"]
    return ", ".join(f"{c} {found.count(c)}" for c in order if c in found)


def _gpu_line(layout: Layout, gpu: Device) -> str:
    bits = []
    if gpu.model:
        bits.append(gpu.model)
    near = layout.nearest_nic.get(gpu.name)
    if near:
        bits.append(f"nearest NIC {', '.join(near[0])} ({near[1]})")
    bits.append(f"CPUs {gpu.cpu_affinity or 'unknown'}")
    bits.append(f"NUMA {gpu.numa_affinity or 'unknown'}")
    return "; ".join(bits)


def render_suggestion(layout: Layout, nranks: int, as_json: bool = False) -> str:
    """``gpucoll topo --suggest N``: the GPU order, CPUs and NICs for N ranks, and the command
    that applies them."""
    places, notes = suggest(layout, nranks)
    order = ",".join(str(p.gpu) for p in places[: len(layout.gpus)] if p.gpu is not None)
    if as_json:
        import json

        doc = {"ranks": nranks, "cuda_visible_devices": order,
               "cuda_device_order": "PCI_BUS_ID",
               "placements": [{"rank": p.rank, "gpu": p.gpu, "cpus": p.cpus, "numa": p.numa,
                               "nics": list(p.nics), "netdevs": list(p.netdevs),
                               "nic_label": p.nic_label, "env": p.nccl_env()} for p in places],
               "notes": notes}
        return json.dumps(doc, indent=2) + "\n"
    source = layout.observed.path or layout.observed.source
    lines = [f"Placement of {nranks} rank(s), from {source}:"]
    if order:
        lines.append(f"  CUDA_VISIBLE_DEVICES={order}  (with CUDA_DEVICE_ORDER=PCI_BUS_ID: "
                     "these are PCI bus order indices)")
    for p in places:
        env = " ".join(f"{k}={v}" for k, v in p.nccl_env().items())
        lines.append(f"  rank {p.rank}: {p.describe()}" + (f"; {env}" if env else ""))
    lines += [f"  note: {n}" for n in notes]
    if order:
        lines += ["Apply it with:",
                  f"  CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES={order} "
                  f"gpucoll run -n {nranks} --bind train.py"]
    return "\n".join(lines) + "\n"


# ---- JSON ----------------------------------------------------------------------------------------

SCHEMA = "gpucoll.topology/1"


def to_dict(layout: Layout) -> dict:
    """The layout as plain JSON-ready data."""
    return {
        "schema": SCHEMA,
        "source": {"kind": layout.observed.source, "path": layout.observed.path},
        "devices": [_device(d) for d in layout.devices],
        "matrix": layout.matrix,
        "nvlink": {
            "pairs": [{"a": a, "b": b, "links": n} for (a, b), n in layout.nvlink_pairs.items()],
            "islands": layout.islands,
            "nvswitch": layout.nvswitch,
            "nvswitch_basis": layout.nvswitch_basis,
        },
        "nearest_nic": {g: {"nics": nics, "label": label}
                        for g, (nics, label) in layout.nearest_nic.items()},
        "bandwidth": layout.bandwidth,
        "ring_order": layout.ring_order,
        "warnings": [dataclasses.asdict(w) | {"devices": list(w.devices)}
                     for w in layout.warnings],
    }


def render_json(layout: Layout) -> str:
    return json.dumps(to_dict(layout), indent=2) + "\n"


def _device(dev) -> dict:
    out = dataclasses.asdict(dev)
    out["nvlinks_down"] = list(dev.nvlinks_down)
    out["netdevs"] = list(dev.netdevs)
    return out


# ---- the picture's content -----------------------------------------------------------------------

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
    near = [(pcie_level(layout.matrix[g][nic.name]), g) for g in groups]
    near = [(level, g) for level, g in near if level is not None and level <= 3]
    return groups[min(near)[1]] if near else None


def _nearest_gpu(layout: Layout, nic: Device) -> int:
    """Index of the GPU nearest to a NIC (the first of equals), so NICs line up with GPUs."""
    levels = [(pcie_level(layout.matrix[g.name][nic.name]), g.index) for g in layout.gpus]
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
    level = {p: pcie_level(layout.matrix[p[0]][p[1]]) for p in pairs}
    best = {g: min((lv for p, lv in level.items() if g in p), default=None) for g in gpus}
    edges = [Edge(a, b, layout.matrix[a][b], "pcie") for a, b in pairs
             if level[(a, b)] in (best[a], best[b])]
    for gpu, (nics, label) in layout.nearest_nic.items():
        edges += [Edge(gpu, nic, label, "pcie") for nic in nics if _close(label)]
    return edges


def _close(label: str | None) -> bool:
    level = pcie_level(label)
    return level is not None and level <= PCIE_LEVELS.index("PHB")


# ---- Graphviz ------------------------------------------------------------------------------------

_SHAPES = {"gpu": "box", "nic": "ellipse", "switch": "hexagon"}
_EDGE_STYLE = {"nvlink": 'color="#2e7d32", penwidth=2.5',
               "pcie": 'color="#607d8b", style=dashed'}


def render_dot(layout: Layout) -> str:
    """DOT text; ``dot -Tsvg`` draws it."""
    nodes, edges = build_graph(layout)
    lines = ["graph topology {", "  graph [rankdir=TB, fontname=Helvetica];",
             "  node [fontname=Helvetica]; edge [fontname=Helvetica, fontsize=10];"]
    groups = list(dict.fromkeys(n.group for n in nodes if n.group))  # in GPU order
    for i, group in enumerate(groups):
        lines.append(f"  subgraph cluster_{i} {{ label={_q(group)}; style=rounded;")
        lines += [f"    {_node(n)}" for n in nodes if n.group == group]
        lines.append("  }")
    lines += [f"  {_node(n)}" for n in nodes if not n.group]
    lines += [f"  {_q(e.a)} -- {_q(e.b)} [label={_q(e.label)}, {_EDGE_STYLE[e.kind]}];"
              for e in edges]
    lines.append("}")
    return "\n".join(lines) + "\n"


def _node(node) -> str:
    return f"{_q(node.name)} [shape={_SHAPES[node.kind]}, label={_q(node.text)}];"


def _q(text: str) -> str:
    """A DOT string literal."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


# ---- PNG -----------------------------------------------------------------------------------------

DX, DY = 1.9, 1.15  # distance between neighbouring boxes, in data units
COLS = 2  # boxes per row inside a socket group
_COLOURS = {"gpu": "#c8e6c9", "nic": "#bbdefb", "switch": "#ffe0b2"}


def render_png(layout: Layout, path: str | Path) -> Path:
    """Draw the layout into ``path`` (PNG) and return the path."""
    require("matplotlib", "topo --png")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    nodes, edges = build_graph(layout)
    where, boxes = place(nodes)
    xs = [x for x, _ in where.values()]
    ys = [y for _, y in where.values()]
    width, height = max(xs) - min(xs) + 2 * DX, max(ys) - min(ys) + 2.6 * DY
    fig = Figure(figsize=(max(6.0, 1.3 * width), max(4.0, 1.3 * height)), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0, 0, 1, 0.9))
    ax.set_xlim(min(xs) - DX, max(xs) + DX)
    ax.set_ylim(min(ys) - 1.4 * DY, max(ys) + 0.9 * DY)
    ax.set_aspect("equal")
    ax.axis("off")
    _draw_groups(ax, boxes)
    for edge in edges:
        _draw_edge(ax, where[edge.a], where[edge.b], edge)
    for node in nodes:
        _draw_node(ax, where[node.name], node)
    _draw_legend(ax)
    fig.suptitle(_title(layout), fontsize=11)
    fig.savefig(path, format="png")
    return Path(path)


def place(nodes: list[Node]) -> tuple[dict, list]:
    """Node name -> (x, y), and (group label, x0, y0, x1, y1) boxes around each group.

    Groups (sockets) stand in at most two rows, in GPU order; inside each, GPUs come first and
    NICs below them, in the order of their nearest GPU. With an NVSwitch the two rows face each
    other across it: GPUs on the side of the switch, NICs on the outside. Ungrouped devices form
    a group of their own.
    """
    order = list(dict.fromkeys(n.group for n in nodes if n.kind != "switch" and n.group))
    switch = any(n.kind == "switch" for n in nodes)
    two_rows = len(order) > 3 or (switch and len(order) > 1)
    per_row = max(1, math.ceil(len(order) / 2) if two_rows else len(order))
    rows = [order[i:i + per_row] for i in range(0, len(order), per_row)] or [[]]
    if any(n.group is None and n.kind != "switch" for n in nodes):
        rows[-1].append(None)
    gap = 2.6 * DY if switch else 1.2 * DY
    where, boxes, top = {}, [], 0.0
    for r, row in enumerate(rows):
        height = 0
        x0 = 0.0
        for group in row:
            gpus = [n for n in nodes if n.group == group and n.kind == "gpu"]
            nics = [n for n in nodes if n.group == group and n.kind == "nic"]
            # without NVLinks to draw between GPUs, one row of GPUs over their NICs reads best
            per = min(4, max(COLS, len(gpus))) if switch else COLS
            blocks = [nics, gpus] if switch and r == 0 and len(rows) > 1 else [gpus, nics]
            depth = 0
            for block in blocks:
                for i, node in enumerate(block):
                    where[node.name] = (x0 + (i % per) * DX, top - (depth + i // per) * DY)
                depth += math.ceil(len(block) / per)
            cols = min(per, max(len(gpus), len(nics)))
            boxes.append((group, x0 - DX / 2.3, top - (depth - 1) * DY - DY / 2.2,
                          x0 + (cols - 1) * DX + DX / 2.3, top + DY / 1.6))
            x0 += cols * DX + DX / 2
            height = max(height, depth)
        if r == 0 and switch:
            below = top - (height - 1) * DY - gap / 2 if len(rows) > 1 else top + 1.6 * DY
        top -= (height - 1) * DY + gap
    if switch:
        xs = [x for x, _ in where.values()]
        where[NVSWITCH] = ((min(xs) + max(xs)) / 2, below)
    return where, boxes


def _draw_groups(ax, boxes) -> None:
    from matplotlib.patches import FancyBboxPatch

    for label, x0, y0, x1, y1 in boxes:
        if label is None:
            continue
        ax.add_patch(FancyBboxPatch((x0, y0), x1 - x0, y1 - y0, boxstyle="round,pad=0.05",
                                    facecolor="#f5f5f5", edgecolor="#9e9e9e", zorder=0))
        ax.text(x0 + 0.05, y1 - 0.05, label, fontsize=8, va="top", color="#616161", zorder=1)


def _draw_edge(ax, a, b, edge) -> None:
    from matplotlib.patches import FancyArrowPatch

    nvlink = edge.kind == "nvlink"
    links = int(edge.label[2:]) if nvlink else 0
    rad = 0.0 if NVSWITCH in (edge.a, edge.b) else 0.18
    ax.add_patch(FancyArrowPatch(
        a, b, arrowstyle="-", connectionstyle=f"arc3,rad={rad}", zorder=2,
        color="#2e7d32" if nvlink else "#78909c", linestyle="-" if nvlink else "--",
        linewidth=1.0 + min(links, 18) / 4 if nvlink else 1.2))
    mx, my = (a[0] + b[0]) / 2, (a[1] + b[1]) / 2
    if rad:  # a quadratic arc's midpoint is half way to its control point
        mx, my = mx + rad / 2 * (b[1] - a[1]), my - rad / 2 * (b[0] - a[0])
    elif NVSWITCH in (edge.a, edge.b):  # near the GPU end, where labels do not pile up
        gx, gy = a if edge.b == NVSWITCH else b
        mx, my = gx + 0.7 * (mx - gx), gy + 0.7 * (my - gy)
    ax.text(mx, my, edge.label, fontsize=7, ha="center", va="center", zorder=3,
            bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "none"})


def _draw_node(ax, xy, node: Node) -> None:
    from matplotlib.patches import Ellipse, FancyBboxPatch, RegularPolygon

    x, y = xy
    colour = _COLOURS[node.kind]
    if node.kind == "gpu":
        patch = FancyBboxPatch((x - 0.62, y - 0.3), 1.24, 0.6, boxstyle="round,pad=0.04",
                               facecolor=colour, edgecolor="#1b5e20")
    elif node.kind == "nic":
        patch = Ellipse((x, y), 1.3, 0.62, facecolor=colour, edgecolor="#0d47a1")
    else:
        patch = RegularPolygon((x, y), 6, radius=0.6, facecolor=colour, edgecolor="#e65100")
    patch.set_zorder(4)
    ax.add_patch(patch)
    ax.text(x, y, node.text, fontsize=7.5, ha="center", va="center", zorder=5)


def _draw_legend(ax) -> None:
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color="#2e7d32", linewidth=3, label="NVLink (NV#)"),
               Line2D([], [], color="#78909c", linestyle="--", label="PCIe (PIX/PXB/PHB)")]
    ax.legend(handles=handles, loc="lower center", ncol=2, fontsize=8, frameon=False)


def _title(layout: Layout) -> str:
    source = layout.observed.path or layout.observed.source
    ring = " ".join(str(i) for i in layout.ring_order)
    return (f"{Path(source).name}\n{len(layout.gpus)} GPUs, {len(layout.nics)} NICs, "
            f"NVSwitch {'yes' if layout.nvswitch else 'no'}, ring: {ring}, "
            f"{len(layout.warnings)} warning(s)")


# ---- gpucoll topo --------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpucoll topo",
        description="Show what connects to what: the nvidia-smi style matrix with its legend, "
                    "NVLink islands, NVSwitch, nearest NICs, CPU affinity, a suggested ring "
                    "order and warnings.")
    p.add_argument("--from", dest="source", metavar="FILE",
                   help="read a saved `nvidia-smi topo -m` output instead of probing")
    p.add_argument("--json", action="store_true", help="print the layout as JSON")
    p.add_argument("--dot", action="store_true", help="print a Graphviz graph")
    p.add_argument("--png", metavar="FILE", help="also draw a picture into FILE")
    p.add_argument("--sysfs-root", default="/", metavar="DIR",
                   help="read DIR/sys/bus/pci/devices (a copied tree) instead of /")
    p.add_argument("--suggest", type=int, metavar="N",
                   help="print where N ranks should run: the CUDA_VISIBLE_DEVICES order, each "
                        "rank's CPUs and NICs (what `gpucoll run --bind` applies)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.json and args.dot:
        print("gpucoll topo: choose one of --json and --dot", file=sys.stderr)
        return 2
    if args.suggest is not None and (args.suggest < 1 or args.dot or args.png):
        print("gpucoll topo: --suggest takes a number of ranks (1 or more), with --json or "
              "alone", file=sys.stderr)
        return 2
    from gpucoll.topology.probe import load, probe

    try:
        layout = load(args.source) if args.source else probe(sysfs_root=args.sysfs_root)
    except (TopologyUnavailable, TopologyParseError) as exc:
        print(f"gpucoll topo: {exc}", file=sys.stderr)
        return 1
    if args.suggest is not None:
        print(render_suggestion(layout, args.suggest, as_json=args.json), end="")
        return 0
    print(_render(layout, args), end="")
    if args.png:
        render_png(layout, args.png)
    return 0


def _render(layout, args: argparse.Namespace) -> str:
    if args.json:
        return render_json(layout)
    if args.dot:
        return render_dot(layout)
    return render_text(layout)
