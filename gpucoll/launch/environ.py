"""The environment of one rank: gpucoll's variables and torchrun's, so either kind of script runs,
and with ``--bind`` where it runs: its CPUs and, for NCCL, its NICs.

torchrun's ``MASTER_PORT`` is not the gpucoll store's port: a torch.distributed script hosts its
own store there (rank 0 binds it), so the two must not collide.
"""

from __future__ import annotations

import dataclasses
import os
import re

from gpucoll.launch.config import LaunchConfig
from gpucoll.launch.devices import device_env
from gpucoll.rendezvous import store_url


def rank_env(cfg: LaunchConfig, local_rank: int, store: tuple[str, int], token: str,
             torch_port: int, gpus: list[str]) -> dict[str, str]:
    """Variables to add to the launcher's own environment for ``local_rank`` of this node."""
    host, port = store
    rank = cfg.global_rank(local_rank)
    env = {
        "GPUCOLL_RANK": str(rank),
        "GPUCOLL_WORLD_SIZE": str(cfg.world_size),
        "GPUCOLL_LOCAL_RANK": str(local_rank),
        "GPUCOLL_LOCAL_WORLD_SIZE": str(cfg.nproc),
        "GPUCOLL_NODE_RANK": str(cfg.node_rank),
        "GPUCOLL_STORE": store_url(host, port),
        "GPUCOLL_STORE_TOKEN": token,
        # torchrun's names
        "RANK": str(rank),
        "WORLD_SIZE": str(cfg.world_size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(cfg.nproc),
        "GROUP_RANK": str(cfg.node_rank),
        "MASTER_ADDR": host,
        "MASTER_PORT": str(torch_port),
        # prefixed output is only useful if it arrives while the job runs
        "PYTHONUNBUFFERED": "1",
    }
    env.update(device_env(local_rank, gpus, cfg.isolate_gpus))
    return env


@dataclasses.dataclass(frozen=True)
class Binding:
    """What ``--bind`` gives one local rank: CPUs to pin it to (None: leave it), variables to
    add to its environment, and the line the launcher prints about it."""

    cpus: frozenset[int] | None
    env: dict[str, str]
    line: str


NUMA_ROOT = "/sys/devices/system/node"


def numa_nodes(root: str = NUMA_ROOT) -> dict[int, set[int]]:
    """This machine's NUMA nodes and their CPUs (empty when sysfs does not say)."""
    from gpucoll.topology.placement import parse_cpulist

    nodes = {}
    try:
        names = os.listdir(root)
    except OSError:
        return {}
    for name in names:
        match = re.fullmatch(r"node(\d+)", name)
        if not match:
            continue
        try:
            with open(os.path.join(root, name, "cpulist")) as f:
                cpus = parse_cpulist(f.read().strip())
        except (OSError, ValueError):
            continue
        if cpus:
            nodes[int(match.group(1))] = cpus
    return nodes


def bindings(cfg: LaunchConfig, gpus: list[str], environ: dict[str, str] | None = None,
             allowed: set[int] | None = None, nodes: dict[int, set[int]] | None = None
             ) -> list[Binding]:
    """``--bind``: each local rank pinned to its GPU's NUMA node (CPUs) and given its GPU's
    nearest NICs for NCCL, from the topology probe (or ``--topology FILE``). Without a GPU
    topology the ranks are spread over this machine's NUMA nodes, and on one node left as
    they are; every line says which."""
    from gpucoll.topology import TopologyUnavailable, load, probe

    environ = dict(os.environ if environ is None else environ)
    allowed = set(os.sched_getaffinity(0)) if allowed is None else allowed
    nodes = numa_nodes() if nodes is None else nodes
    if not gpus and not cfg.topology:
        why = ("CUDA_VISIBLE_DEVICES hides every GPU" if "CUDA_VISIBLE_DEVICES" in environ
               else "no GPU is visible here")
        return _numa_spread(cfg, why, allowed, nodes)
    try:
        layout = load(cfg.topology) if cfg.topology else probe()
    except TopologyUnavailable as exc:
        return _numa_spread(cfg, str(exc), allowed, nodes)
    if not layout.gpus:
        return _numa_spread(cfg, "the topology shows no GPU", allowed, nodes)
    return _gpu_bindings(cfg, layout, gpus, environ, allowed, nodes)


def _numa_spread(cfg: LaunchConfig, why: str, allowed: set[int],
                 nodes: dict[int, set[int]]) -> list[Binding]:
    """No GPU topology: ranks in blocks over the NUMA nodes (rank r on node r*nodes//n)."""
    usable = {n: cpus & allowed for n, cpus in sorted(nodes.items()) if cpus & allowed}
    if len(usable) <= 1:
        cpus = format_cpus(allowed)
        line = (f"no GPU topology here ({why}); one NUMA node (CPUs {cpus}): the ranks are "
                "not pinned and no NIC is exported")
        return [Binding(None, {}, line if local == 0 else "") for local in range(cfg.nproc)]
    order = list(usable)
    out = []
    for local in range(cfg.nproc):
        node = order[local * len(order) // cfg.nproc]
        out.append(Binding(frozenset(usable[node]), {},
                           f"rank {cfg.global_rank(local)}: no GPU topology here ({why}): "
                           f"pinned to NUMA node {node} (CPUs {format_cpus(usable[node])}); "
                           "no NIC exported"))
    return out


def _gpu_bindings(cfg: LaunchConfig, layout, gpus: list[str], environ: dict[str, str],
                  allowed: set[int], nodes: dict[int, set[int]]) -> list[Binding]:
    from gpucoll.topology.placement import place, visible_indices

    shown = gpus or [str(g.index) for g in layout.gpus]  # a saved topology of another machine
    indices = visible_indices(layout, shown)
    out = []
    for local in range(cfg.nproc):
        rank, entry = cfg.global_rank(local), shown[local % len(shown)]
        index = indices[local % len(shown)]
        if index is None:
            out.append(Binding(None, {}, f"rank {rank}: GPU {entry!r} is not in the "
                               "topology: not pinned, no NIC exported"))
            continue
        p = place(layout, [index])[0]
        want = _wanted_cpus(p.cpus, p.numa, nodes)
        cpus = want & allowed
        env, kept = {}, []
        for key, value in p.nccl_env().items():
            (kept.append(key) if key in environ else env.__setitem__(key, value))
        if entry.isdigit() and "CUDA_DEVICE_ORDER" not in environ:
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # CUDA's indices = the topology's
        pin = (f"pinned to CPUs {format_cpus(cpus)}" if cpus else
               "not pinned: its CPUs are unknown" if not want else
               f"not pinned: CPUs {format_cpus(want)} are not among this launcher's "
               f"({format_cpus(allowed)})")
        line = f"rank {rank}: {p.describe()}; {pin}"
        line += "".join(f"; {k}={v}" for k, v in env.items() if k.startswith("NCCL_"))
        line += "".join(f"; {k} already set, kept" for k in kept)
        out.append(Binding(frozenset(cpus) or None, env, line))
    return out


def _wanted_cpus(cpulist: str | None, numa: str | None, nodes: dict[int, set[int]]) -> set[int]:
    """The GPU's CPUs: its affinity as the topology gives it, else its NUMA node's CPUs here."""
    from gpucoll.topology.placement import parse_cpulist

    if cpulist:
        return parse_cpulist(cpulist)
    return set(nodes.get(int(numa), ())) if numa and numa.isdigit() else set()


def format_cpus(cpus: set[int]) -> str:
    from gpucoll.topology.placement import format_cpulist

    return format_cpulist(cpus) or "none"
