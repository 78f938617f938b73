"""The self-check's report: what ran where, each check's result, and bandwidth beside
nccl-tests', as Markdown to paste into an issue (and as JSON)."""

from __future__ import annotations

import dataclasses
from typing import Any

PASS, FAIL, SKIP = "pass", "fail", "skip"
EXIT = {"passed": 0, "failed": 1, "nothing ran": 2}


@dataclasses.dataclass
class Check:
    name: str
    status: str
    seconds: float
    detail: str


@dataclasses.dataclass
class Report:
    """Everything ``gpucoll selftest`` found; ``note`` says why nothing ran, if nothing did."""

    environment: dict[str, Any]
    runtime: str
    checks: list[Check] = dataclasses.field(default_factory=list)
    bandwidth: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    bandwidth_setup: str = ""
    note: str = ""

    @property
    def outcome(self) -> str:
        if self.note:
            return "nothing ran"
        return "failed" if any(c.status == FAIL for c in self.checks) else "passed"

    @property
    def status(self) -> int:
        """The exit status: 0 every check passed, 1 one failed, 2 nothing could run."""
        return EXIT[self.outcome]


def render(report: Report) -> str:
    env = report.environment
    nccl = env.get("nccl")
    nccl = (f"NCCL {nccl['library']} (nccl4py {nccl['nccl4py']})" if isinstance(nccl, dict)
            else f"NCCL {nccl}")
    lines = [
        "### gpucoll selftest",
        "",
        f"gpucoll {env.get('gpucoll')}, Python {env.get('python')}, CuPy {env.get('cupy')}, "
        f"{nccl}",
        f"CUDA driver {env.get('cuda_driver')}, runtime {env.get('cuda_runtime')}; "
        f"gpucoll's CUDA runtime: {report.runtime}",
    ]
    devices = env.get("devices")
    if isinstance(devices, list):
        lines.append(f"devices: {len(devices)}")
        lines += [f"  [{d['index']}] {d['name']}, {d['memory_gib']} GiB, sm "
                  f"{d['compute_capability']}, {d['pci_bus_id']}" for d in devices]
    else:
        lines.append(f"devices: {devices}")
    if report.note:
        lines += ["", f"**Nothing ran on a GPU: {report.note}.**",
                  "", f"exit status {report.status} (2: nothing could run)"]
        return "\n".join(lines)
    lines += ["", "| check | result | time | detail |", "|---|---|---|---|"]
    lines += [f"| {c.name} | {c.status} | {c.seconds:.1f} s | {_cell(c.detail)} |"
              for c in report.checks]
    if report.bandwidth:
        lines += ["", f"all_reduce, float32, {report.bandwidth_setup}; bus bandwidth as "
                      "nccl-tests computes it (bytes / time * 2(n-1)/n):", "",
                  "| size (B) | gpucoll time (us) | gpucoll busbw (GB/s) | "
                  "nccl-tests busbw (GB/s) |", "|---:|---:|---:|---:|"]
        for row in report.bandwidth:
            theirs = row.get("nccl_tests")
            lines.append(f"| {row['bytes']} | {row['us']:.1f} | {row['busbw']:.2f} | "
                         f"{'-' if theirs is None else f'{theirs:.2f}'} |")
    counts = {s: sum(c.status == s for c in report.checks) for s in (PASS, FAIL, SKIP)}
    lines += ["", f"**{report.outcome}**: {counts[PASS]} passed, {counts[FAIL]} failed, "
                  f"{counts[SKIP]} skipped (exit status {report.status})"]
    return "\n".join(lines)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "/")[:300]


def as_json(report: Report) -> dict[str, Any]:
    data = dataclasses.asdict(report)
    data["outcome"], data["status"] = report.outcome, report.status
    return data
