"""Reader of NVML through nvidia-ml-py (module ``pynvml``, imported only when called).

Raw answers only: per GPU its identity, memory, PCIe link, NVLinks and CPU affinity; per pair
of GPUs the common PCIe ancestor and peer-to-peer capabilities. Calls a GPU does not support
give None rather than failing the whole probe.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

from gpucoll.errors import TopologyUnavailable
from gpucoll.topology.facts import NvLink, NvmlFacts, NvmlGpu, NvmlPair, PcieLink

_REMOTE_KINDS = {0: "gpu", 1: "cpu", 2: "switch"}  # NVML_NVLINK_DEVICE_TYPE_{GPU,IBMNPU,SWITCH}


def load_nvml() -> ModuleType:
    """The pynvml module; TopologyUnavailable naming the package when it is not installed."""
    try:
        import pynvml
    except ImportError:
        raise TopologyUnavailable("NVML bindings missing: pip install nvidia-ml-py") from None
    return pynvml


def read_nvml(nvml: Any = None) -> NvmlFacts:
    """Everything NVML tells about this machine's GPUs; ``nvml`` defaults to pynvml."""
    nvml = nvml or load_nvml()
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        raise TopologyUnavailable(f"NVML cannot start: {exc}") from None
    try:
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        gpus = tuple(read_gpu(nvml, i, h) for i, h in enumerate(handles))
        pairs = tuple(read_pair(nvml, i, j, handles[i], handles[j])
                      for i in range(len(handles)) for j in range(i + 1, len(handles)))
        return NvmlFacts(_text(_try(nvml, nvml.nvmlSystemGetDriverVersion)), gpus, pairs)
    except nvml.NVMLError as exc:  # e.g. a GPU fell off the bus: identity calls fail
        raise TopologyUnavailable(f"NVML failed while reading GPUs: {exc}") from None
    finally:
        nvml.nvmlShutdown()


def read_gpu(nvml: Any, index: int, handle: Any) -> NvmlGpu:
    """One GPU's answers."""
    memory = _try(nvml, nvml.nvmlDeviceGetMemoryInfo, handle)
    pcie = PcieLink(*(_try(nvml, fn, handle) for fn in (
        nvml.nvmlDeviceGetCurrPcieLinkGeneration, nvml.nvmlDeviceGetMaxPcieLinkGeneration,
        nvml.nvmlDeviceGetCurrPcieLinkWidth, nvml.nvmlDeviceGetMaxPcieLinkWidth)))
    numa = _try(nvml, nvml.nvmlDeviceGetNumaNodeId, handle)
    return NvmlGpu(
        index=index, name=_text(nvml.nvmlDeviceGetName(handle)),
        uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
        bus_id=normalize_bus_id(_text(nvml.nvmlDeviceGetPciInfo(handle).busId)),
        memory_bytes=None if memory is None else int(memory.total),
        pcie=None if pcie == PcieLink() else pcie, nvlinks=read_nvlinks(nvml, handle),
        cpus=_cpus(nvml, handle), gpu_numa_id=None if numa is None or numa < 0 else numa)


def read_nvlinks(nvml: Any, handle: Any) -> tuple[NvLink, ...]:
    """Every link the GPU has; a link number the GPU lacks answers NOT_SUPPORTED and is skipped."""
    links = []
    for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))):
        state = _try(nvml, nvml.nvmlDeviceGetNvLinkState, handle, link)
        if state is None:
            continue
        if not state:
            links.append(NvLink(link, False))
            continue
        remote = _try(nvml, nvml.nvmlDeviceGetNvLinkRemotePciInfo, handle, link)
        kind = _try(nvml, nvml.nvmlDeviceGetNvLinkRemoteDeviceType, handle, link)
        links.append(NvLink(
            link, True, _try(nvml, nvml.nvmlDeviceGetNvLinkVersion, handle, link),
            None if remote is None else normalize_bus_id(_text(remote.busId)),
            _REMOTE_KINDS.get(kind, "unknown")))
    return tuple(links)


def read_pair(nvml: Any, i: int, j: int, hi: Any, hj: Any) -> NvmlPair:
    """Common ancestor and P2P capabilities of GPUs i and j."""
    def p2p(name: str, default: int) -> bool | None:
        index = getattr(nvml, name, default)
        index = index[0] if isinstance(index, tuple) else index  # some versions export (0,)
        status = _try(nvml, nvml.nvmlDeviceGetP2PStatus, hi, hj, index)
        return None if status is None else status == getattr(nvml, "NVML_P2P_STATUS_OK", 0)

    return NvmlPair(i, j, _try(nvml, nvml.nvmlDeviceGetTopologyCommonAncestor, hi, hj),
                    p2p("NVML_P2P_CAPS_INDEX_READ", 0), p2p("NVML_P2P_CAPS_INDEX_NVLINK", 2))


def normalize_bus_id(bus_id: str) -> str:
    """NVML's '00000000:07:00.0' -> sysfs's '0000:07:00.0' (lower case, 4-digit domain)."""
    domain, rest = bus_id.strip().lower().split(":", 1)
    return f"{int(domain, 16):04x}:{rest}"


def cpulist(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5', the way Linux writes CPU lists."""
    ranges: list[list[int]] = []
    for cpu in sorted(cpus):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def _cpus(nvml: Any, handle: Any) -> str | None:
    words = max(16, (os.cpu_count() or 1) // 64 + 1)  # 16 words: up to 1024 CPUs
    mask = _try(nvml, nvml.nvmlDeviceGetCpuAffinity, handle, words)
    if mask is None:
        return None
    cpus = [64 * w + bit for w, value in enumerate(mask) for bit in range(64)
            if int(value) >> bit & 1]
    return cpulist(cpus) or None


def _try(nvml: Any, fn: Any, *args: Any) -> Any:
    """fn(*args), or None when NVML answers an error (not supported, no permission...)."""
    try:
        return fn(*args)
    except nvml.NVMLError:
        return None


def _text(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value
