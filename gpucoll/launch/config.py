"""What one ``gpucoll run`` was asked to do, checked once before any process starts, and what each
rank gets from it.

- ``LaunchConfig`` and ``validate``: the job; one that cannot run is a ``LaunchError`` before
  anything starts.
- GPUs, found without importing CuPy (the launcher must start fast): the NVIDIA driver makes one
  ``/dev/nvidiaN`` node per GPU a process may use (containers see only the GPUs given to them);
  ``/proc/driver/nvidia/gpus`` is the fallback. ``CUDA_VISIBLE_DEVICES``, when set, narrows the
  list the way CUDA itself does.
- ``rank_env``: gpucoll's variables and torchrun's, so either kind of script runs. torchrun's
  ``MASTER_PORT`` is not the gpucoll store's port: a torch.distributed script hosts its own
  store there (rank 0 binds it), so the two must not collide. ``thread_env``:
  ``OMP_NUM_THREADS=1`` where it is unset and several ranks share the node, as torchrun sets it.
- ``bindings`` (``--bind``): where each rank runs, its CPUs and, for NCCL, its NICs.
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import importlib.util
import os
import re
import sys
from collections.abc import Mapping

from gpucoll.errors import LaunchError
from gpucoll.rendezvous import store_url


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """The job: which program, how many ranks where, and how to supervise them."""

    program: str
    args: tuple[str, ...] = ()
    module: bool = False
    nproc: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    tee: str | None = None
    timeout: float | None = None
    grace: float = 5.0
    device: bool = False
    isolate_gpus: bool = False
    token: str | None = None
    bind: bool = False  # pin ranks to their GPU's NUMA node, export its nearest NICs
    topology: str | None = None  # a saved `nvidia-smi topo -m` for --bind instead of a probe
    keep_going: bool = False  # a rank that dies leaves the others running
    verbose: bool = False  # ranks' tracebacks of gpucoll errors keep gpucoll's own frames

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes

    def global_rank(self, local_rank: int) -> int:
        return self.node_rank * self.nproc + local_rank

    def command(self) -> list[str]:
        """The argv each rank runs: this Python on the script or module."""
        if self.module:
            return [sys.executable, "-m", self.program, *self.args]
        return [sys.executable, self.program, *self.args]

    def package(self) -> str | None:
        """The directory of the gpucoll package the ranks will import (None: none found): the
        first on their path, which starts with the script's directory (for ``-m``, the working
        directory) and PYTHONPATH, so a script saved in a source tree imports that tree's."""
        first = os.getcwd() if self.module else os.path.dirname(os.path.realpath(self.program))
        path = [first, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)),
                *sys.path[1:]]
        spec = importlib.machinery.PathFinder.find_spec("gpucoll", path) \
            or importlib.util.find_spec("gpucoll")  # an editable install's own finder
        return os.path.dirname(spec.origin) if spec is not None and spec.origin else None


def validate(cfg: LaunchConfig, environ: dict[str, str] | None = None) -> list[str]:
    """Raise LaunchError for an impossible job; return the GPUs the ranks will use."""
    _check_counts(cfg)
    _check_program(cfg)
    if cfg.nnodes > 1 and not cfg.token:
        raise LaunchError(
            "a job of several nodes needs one store token shared by every node: "
            "export GPUCOLL_STORE_TOKEN=<same secret on each node> (or pass --token)")
    if cfg.topology is not None and not cfg.bind:
        raise LaunchError("--topology is what --bind reads; give --bind too")
    if cfg.topology is not None and not os.path.isfile(cfg.topology):
        raise LaunchError(f"--topology: no such file: {cfg.topology!r}")
    gpus = visible_gpus(environ)
    if cfg.device and len(gpus) < cfg.nproc:
        raise LaunchError(
            f"--device gives each rank its own GPU, but this node has {len(gpus)} visible "
            f"GPU(s) for -n {cfg.nproc} ranks")
    return gpus


def _check_counts(cfg: LaunchConfig) -> None:
    if cfg.nproc < 1:
        raise LaunchError(f"-n must be at least 1, got {cfg.nproc}")
    if cfg.nnodes < 1:
        raise LaunchError(f"--nnodes must be at least 1, got {cfg.nnodes}")
    if not 0 <= cfg.node_rank < cfg.nnodes:
        raise LaunchError(f"--node-rank must be in [0, {cfg.nnodes}), got {cfg.node_rank}")
    if not 0 <= cfg.master_port < 65536:
        raise LaunchError(f"--master-port must be in [0, 65535], got {cfg.master_port}")
    if cfg.nnodes > 1 and cfg.node_rank > 0 and cfg.master_port == 0:
        raise LaunchError("--master-port is required on nodes other than node 0 "
                          "(node 0 prints the store address it listens on)")
    if cfg.timeout is not None and cfg.timeout <= 0:
        raise LaunchError(f"--timeout must be positive, got {cfg.timeout}")
    if cfg.grace < 0:
        raise LaunchError(f"--grace must not be negative, got {cfg.grace}")


def _check_program(cfg: LaunchConfig) -> None:
    if not cfg.module:
        if not os.path.isfile(cfg.program):
            raise LaunchError(f"script not found: {cfg.program!r} (looked in {os.getcwd()})")
        return
    # The ranks run `python -m` from this directory, so look there too.
    sys.path.insert(0, os.getcwd())
    try:
        found = importlib.util.find_spec(cfg.program) is not None
    except (ImportError, ValueError):
        found = False
    finally:
        sys.path.pop(0)
    if not found:
        raise LaunchError(f"module not found: {cfg.program!r} (for -m)")


# ---- GPUs ----------------------------------------------------------------------------------------

_DEV_NODE = re.compile(r"nvidia(\d+)$")


def visible_gpus(environ: dict[str, str] | None = None, dev_dir: str = "/dev",
                 proc_dir: str = "/proc/driver/nvidia/gpus") -> list[str]:
    """Device identifiers a rank may be given, as ``CUDA_VISIBLE_DEVICES`` would list them."""
    environ = os.environ if environ is None else environ
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return _parse_visible(listed)
    return [str(i) for i in range(_count_gpus(dev_dir, proc_dir))]


def _parse_visible(listed: str) -> list[str]:
    # CUDA stops at the first invalid entry; "-1" or "" hides every device.
    ids = []
    for item in listed.split(","):
        item = item.strip()
        if not item or item.startswith("-"):
            break
        ids.append(item)
    return ids


def _count_gpus(dev_dir: str, proc_dir: str) -> int:
    try:
        nodes = [n for n in os.listdir(dev_dir) if _DEV_NODE.match(n)]
    except OSError:
        nodes = []
    if nodes:
        return len(nodes)
    try:
        return len(os.listdir(proc_dir))
    except OSError:
        return 0


def device_env(local_rank: int, gpus: list[str], isolate: bool) -> dict[str, str]:
    """Environment giving a rank its GPU: local rank i uses GPU i (torchrun's convention).

    With ``isolate`` the rank sees only that GPU (``CUDA_VISIBLE_DEVICES`` narrowed to it), so
    device 0 inside the rank is its own GPU. Without GPUs there is nothing to set.
    """
    if not gpus or not isolate:
        return {}
    return {"CUDA_VISIBLE_DEVICES": gpus[local_rank % len(gpus)]}


# ---- each rank's environment and binding ---------------------------------------------------------

def thread_env(cfg: LaunchConfig, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``OMP_NUM_THREADS=1`` when ``environ`` (default: the launcher's) does not set it and
    several ranks share this node, as torchrun does: each rank's OpenMP (torch's CPU kernels,
    a BLAS) would otherwise start a thread per core, N ranks on C cores N * C threads, and a
    rank waiting in a collective spins its cores away from the others."""
    env = os.environ if environ is None else environ
    if "OMP_NUM_THREADS" in env or cfg.nproc < 2:
        return {}
    return {"OMP_NUM_THREADS": "1"}


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
    env.update(thread_env(cfg))
    if cfg.verbose:
        env["GPUCOLL_VERBOSE"] = "1"
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
    from gpucoll.topology.layout import parse_cpulist

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
    from gpucoll.topology.layout import place, visible_indices

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
    from gpucoll.topology.layout import parse_cpulist

    if cpulist:
        return parse_cpulist(cpulist)
    return set(nodes.get(int(numa), ())) if numa and numa.isdigit() else set()


def format_cpus(cpus: set[int]) -> str:
    from gpucoll.topology.layout import format_cpulist

    return format_cpulist(cpus) or "none"
