"""A picture of the layout (matplotlib, imported only here): GPUs, NICs and the NVSwitch, in one
box per CPU socket/NUMA node, joined by NVLinks (green, thicker for more links) and close PCIe
paths (grey, dashed)."""

from __future__ import annotations

import math
from pathlib import Path

from gpucoll.topology.graph import NVSWITCH, Node, build_graph
from gpucoll.topology.layout import Layout

DX, DY = 1.9, 1.15  # distance between neighbouring boxes, in data units
COLS = 2  # boxes per row inside a socket group
_COLOURS = {"gpu": "#c8e6c9", "nic": "#bbdefb", "switch": "#ffe0b2"}


def render_png(layout: Layout, path: str | Path) -> Path:
    """Draw the layout into ``path`` (PNG) and return the path."""
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
