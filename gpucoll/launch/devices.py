"""Which GPUs this node has, found without importing CuPy (the launcher must start fast).

The NVIDIA driver makes one ``/dev/nvidiaN`` node per GPU a process may use (containers see only
the GPUs given to them); ``/proc/driver/nvidia/gpus`` is the fallback. ``CUDA_VISIBLE_DEVICES``,
when set, narrows the list the way CUDA itself does.
"""

from __future__ import annotations

import os
import re

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
