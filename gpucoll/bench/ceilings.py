"""What the hardware allows, printed beside the results so bandwidths can be judged.

- host memory copy: one NumPy copy of a large array (bytes read + written, as STREAM counts),
  and an in-place add (the ring's reduce step, read twice + written once). A host ring moving
  data through shared memory cannot beat these per core.
- on GPUs: device-to-host and host-to-device copies from pinned and from pageable memory, the
  ceiling of anything staged through the host.
Each figure is the best of a few timed repetitions after a warm-up.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

HOST_BYTES = 64 << 20
DEVICE_BYTES = 64 << 20
REPEATS = 5


def best_seconds(fn: Callable[[], Any], repeats: int = REPEATS,
                 sync: Callable[[], Any] | None = None) -> float:
    """The shortest of ``repeats`` timed calls of ``fn`` after one untimed call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        best = min(best, time.perf_counter() - t0)
    return best


def _entry(name: str, what: str, nbytes: int, moved: int, seconds: float) -> dict[str, Any]:
    return {"name": name, "what": what, "bytes": nbytes, "GBps": moved / seconds / 1e9}


def host_ceilings(nbytes: int = HOST_BYTES) -> list[dict[str, Any]]:
    """Single-core host memory bandwidth: copy (2N bytes moved) and in-place add (3N)."""
    a = np.ones(nbytes // 4, np.float32)
    b = np.zeros_like(a)
    copy = best_seconds(lambda: np.copyto(b, a))
    add = best_seconds(lambda: np.add(b, a, out=b))
    return [_entry("host memcpy", "numpy copy, read+write counted", nbytes, 2 * nbytes, copy),
            _entry("host add (reduce step)", "numpy a+=b, 3 accesses counted", nbytes,
                   3 * nbytes, add)]


def device_ceilings(nbytes: int = DEVICE_BYTES) -> list[dict[str, Any]]:
    """D2H and H2D bandwidth of device 0 from pinned and pageable host memory (GPUs only)."""
    import cupy

    dev = cupy.empty(nbytes, np.uint8)
    stream = cupy.cuda.Stream(non_blocking=True)
    pageable = np.empty(nbytes, np.uint8)
    pinned_mem = cupy.cuda.alloc_pinned_memory(nbytes)
    pinned = np.frombuffer(pinned_mem, np.uint8, nbytes)
    out = []
    for kind, host in (("pinned", pinned), ("pageable", pageable)):
        h2d = best_seconds(lambda h=host: dev.set(h, stream=stream), sync=stream.synchronize)
        d2h = best_seconds(lambda h=host: dev.get(stream=stream, out=h),
                           sync=stream.synchronize)
        out.append(_entry(f"H2D {kind}", "cudaMemcpyAsync host to device", nbytes, nbytes, h2d))
        out.append(_entry(f"D2H {kind}", "cudaMemcpyAsync device to host", nbytes, nbytes, d2h))
    return out


def measure(device: bool) -> list[dict[str, Any]]:
    """Every ceiling that applies here: host always, device copies when ``device``."""
    found = host_ceilings()
    if device:
        try:
            found += device_ceilings()
        except Exception as exc:  # a broken driver must not lose the host figures
            found.append({"name": "device copies", "what": f"not measured: {exc}",
                          "bytes": 0, "GBps": float("nan")})
    return found
