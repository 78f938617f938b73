"""The layout as a Graphviz graph: GPUs, NICs and NVSwitch grouped by CPU socket/NUMA node."""

from __future__ import annotations

from gpucoll.topology.graph import build_graph
from gpucoll.topology.layout import Layout

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
