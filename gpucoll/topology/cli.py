"""``gpucoll topo``: show the NVLink/PCIe layout of this machine or of a saved nvidia-smi output."""

from __future__ import annotations

import argparse
import sys

from gpucoll.errors import TopologyParseError, TopologyUnavailable


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
        from gpucoll.topology.render import render_suggestion

        print(render_suggestion(layout, args.suggest, as_json=args.json), end="")
        return 0
    print(_render(layout, args), end="")
    if args.png:
        from gpucoll.topology.render import render_png

        render_png(layout, args.png)
    return 0


def _render(layout, args: argparse.Namespace) -> str:
    if args.json:
        from gpucoll.topology.render import render_json

        return render_json(layout)
    if args.dot:
        from gpucoll.topology.render import render_dot

        return render_dot(layout)
    from gpucoll.topology.render import render_text

    return render_text(layout)
