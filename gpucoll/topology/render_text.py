"""The matrix as nvidia-smi prints it, with its legend, followed by what the layout found."""

from __future__ import annotations

from gpucoll.topology.labels import BANDWIDTH_CLASSES, LEGEND
from gpucoll.topology.layout import Device, Layout

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
    from gpucoll.topology.placement import suggest

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
