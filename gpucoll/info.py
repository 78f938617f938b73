"""``gpucoll info``: what this machine can do - CuPy, CUDA, NCCL (through nccl4py), devices, the
backend ``auto`` would pick and why.

Every probe catches its own failure and reports it as text, so the command prints a full report
(and exits 0) on a machine without a GPU, without CuPy or without NCCL.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from gpucoll.backends.nccl.backend import library_version, local_verdict


def _cuda_version(code: int) -> str:
    """CUDA's integer version as text: 12090 -> "12.9"; 0 means no driver."""
    return "none" if not code else f"{code // 1000}.{code % 1000 // 10}"


def _probe(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - a report line, never a traceback
        return f"unavailable ({type(exc).__name__}: {exc})"


def _cupy_version() -> str:
    import cupy

    return cupy.__version__


def _runtime() -> Any:
    from cupy_backends.cuda.api import runtime

    return runtime


def devices() -> list[dict[str, Any]]:
    """Index, name, memory, compute capability and PCI bus id of every visible CUDA device."""
    rt = _runtime()
    found = []
    for i in range(rt.getDeviceCount()):
        props = rt.getDeviceProperties(i)
        name = props["name"]
        found.append({
            "index": i,
            "name": name.decode() if isinstance(name, bytes) else str(name),
            "memory_gib": round(props["totalGlobalMem"] / 2**30, 1),
            "compute_capability": f"{props['major']}.{props['minor']}",
            "pci_bus_id": _probe(lambda i=i: rt.deviceGetPCIBusId(i)),
        })
    return found


def _nccl() -> dict[str, str]:
    import nccl.core as nc

    return {"library": library_version(nc), "nccl4py": str(nc.get_version().nccl4py)}


def collect() -> dict[str, Any]:
    """Everything ``gpucoll info`` reports, as a JSON-able dict (never raises)."""
    from gpucoll import __version__

    verdict = local_verdict()
    usable, why = verdict["ok"], verdict["why"]
    return {
        "gpucoll": __version__,
        "python": sys.version.split()[0],
        "cupy": _probe(_cupy_version),
        "cuda_driver": _probe(lambda: _cuda_version(_runtime().driverGetVersion())),
        "cuda_runtime": _probe(lambda: _cuda_version(_runtime().runtimeGetVersion())),
        "nccl": _probe(_nccl),
        "devices": _probe(devices),
        "auto_backend": "nccl" if usable else "ring",
        "auto_reason": (f"this process can use NCCL ({why}); auto picks it when every rank can"
                        if usable else f"NCCL is not usable here: {why}"),
    }


def render(info: dict[str, Any]) -> str:
    nccl = info["nccl"]
    if isinstance(nccl, dict):
        nccl = f"library {nccl['library']} (nccl4py {nccl['nccl4py']})"
    devices = info["devices"]
    lines = [
        f"gpucoll       {info['gpucoll']} (Python {info['python']})",
        f"CuPy          {info['cupy']}",
        f"CUDA driver   {info['cuda_driver']}",
        f"CUDA runtime  {info['cuda_runtime']}",
        f"NCCL          {nccl}",
    ]
    if isinstance(devices, list):
        lines.append(f"devices       {len(devices)}")
        lines += [f"  [{d['index']}] {d['name']}, {d['memory_gib']} GiB, "
                  f"sm {d['compute_capability']}, {d['pci_bus_id']}" for d in devices]
    else:
        lines.append(f"devices       {devices}")
    lines.append(f"auto backend  {info['auto_backend']}: {info['auto_reason']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpucoll info", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    info = collect()
    print(json.dumps(info, indent=2) if args.json else render(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
