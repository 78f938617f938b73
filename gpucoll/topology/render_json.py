"""The layout as JSON, in a stable schema (version in ``schema``; fields are only ever added).

Top level::

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
"""

from __future__ import annotations

import dataclasses
import json

from gpucoll.topology.layout import Layout

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
