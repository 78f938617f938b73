"""Where each rank of a job on one machine should run: its GPU, its CPUs and its NICs.

- GPUs: for N ranks, the N GPUs whose best ring has the fastest slowest hop (then the fastest
  hops in all, then the fewest NUMA nodes), in that ring's order, so that ranks next to each
  other in rank order are GPUs next to each other on the fastest links.
- CPUs: the GPU's CPU affinity, the CPUs of its NUMA node (what torchrun's
  ``--numa-binding=node`` binds); memory then comes from that node too, Linux allocating it
  where the thread that first touches it runs.
- NICs: the NICs nearest to the GPU (the nearest PCIe level), for NCCL: ``NCCL_IB_HCA`` names
  their RDMA devices, ``NCCL_SOCKET_IFNAME`` their network interfaces where those are known
  (a probe sees them; a saved nvidia-smi output does not). Only when some NICs are nearer than
  others: where every NIC is equally far, NCCL's own choice is as good.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

from gpucoll.topology.layout import Device, Layout, pcie_level, ring_key, ring_over, weight

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
