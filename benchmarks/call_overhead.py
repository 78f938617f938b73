"""Python-side cost of one collective call on the NCCL backend, with NCCL and CUDA as no-ops.

What is measured is everything gpucoll does around ``ncclAllReduce`` & co: argument checks,
turning the array into a pointer, resolving the stream, recording the completion event and
handing it to the watchdog. NCCL's and CUDA's own cost is left out (their calls return at once),
so this runs without a GPU. Target: at most 10 us per call.

    python benchmarks/call_overhead.py [--calls 20000] [--json call_overhead.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Any

import numpy as np

from gpucoll import cuda
from gpucoll.arrays import as_ref
from gpucoll.default import create
from gpucoll.ops import ReduceOp
from gpucoll.store import TCPStore

TARGET_US = 10.0


class _DoneEvent:
    ptr = 1

    def done(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class _NoopComm:
    """NcclCommunicator whose calls return at once (as enqueueing on a GPU roughly does)."""

    def __init__(self, n: int, uid: bytes, rank: int):
        pass

    def allReduce(self, *args): pass  # noqa: E704
    def broadcast(self, *args): pass  # noqa: E704
    def reduce(self, *args): pass  # noqa: E704
    def allGather(self, *args): pass  # noqa: E704
    def reduceScatter(self, *args): pass  # noqa: E704
    def send(self, *args): pass  # noqa: E704
    def recv(self, *args): pass  # noqa: E704
    def check_async_error(self): pass  # noqa: E704
    def abort(self): pass  # noqa: E704
    def destroy(self): pass  # noqa: E704


class _NoopNccl:
    NcclCommunicator = _NoopComm
    NcclError = RuntimeError

    @staticmethod
    def get_unique_id() -> bytes:
        return os.urandom(128)

    @staticmethod
    def get_version() -> int:
        return 23203

    def groupStart(self): pass  # noqa: E704
    def groupEnd(self): pass  # noqa: E704


class _DeviceBuffer:
    """A device array as another library would hand it over: CAI v3, no stream named."""

    def __init__(self, shape: tuple, dtype: Any):
        self.host = np.zeros(shape, dtype)  # real memory behind the pointer, never touched
        self.__cuda_array_interface__ = {
            "shape": self.host.shape, "typestr": self.host.dtype.str, "version": 3,
            "data": (self.host.__array_interface__["data"][0], False), "strides": None,
            "stream": None,
        }
        self.dtype, self.shape = self.host.dtype, self.host.shape


class NoopRuntime:
    """The ``gpucoll.cuda`` seam with every CUDA call a no-op on device 0."""

    name = "noop"
    _event = _DoneEvent()

    def available(self): return True, "no-op CUDA"  # noqa: E704
    def device_count(self): return 1  # noqa: E704
    def set_device(self, device): pass  # noqa: E704
    def current_device(self): return 0  # noqa: E704
    def current_stream(self): return 0  # noqa: E704
    def stream_handle(self, stream): return 0 if stream is None else cuda.stream_handle(stream, 0)  # noqa: E501,E704
    def record_event(self, stream): return self._event  # noqa: E704
    def wait_event(self, stream, event): pass  # noqa: E704
    def memcpy_async(self, dst, src, nbytes, stream): pass  # noqa: E704
    def pointer_device(self, ptr): return 0  # noqa: E704
    def empty(self, shape, dtype, device): return _DeviceBuffer(shape, dtype)  # noqa: E704
    def nccl(self): return _NoopNccl()  # noqa: E704


def _time(fn, calls: int, repeats: int = 5) -> float:
    """Median microseconds per call over ``repeats`` runs of ``calls`` calls."""
    for _ in range(min(calls, 1000)):
        fn()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(runs)


def measure(calls: int) -> list[dict[str, Any]]:
    server = TCPStore("127.0.0.1", 0, is_server=True, timeout=30)
    previous = cuda.set_runtime(NoopRuntime())
    try:
        comm = create("nccl", rank=0, world_size=1, store=server, timeout=60)
        backend = comm._backend
        x = _DeviceBuffer((1024,), np.float32)
        ref = as_ref(x, "x")
        cases = [
            ("backend.all_reduce (ArrayRef given)",
             lambda: backend.all_reduce(ref, ReduceOp.SUM, timeout=60.0)),
            ("as_ref(CAI array)", lambda: as_ref(x, "x")),
            ("comm.all_reduce(x)", lambda: comm.all_reduce(x)),
            ("comm.all_reduce(x, stream=s)", lambda: comm.all_reduce(x, stream=7)),
            ("comm.all_reduce(x, async_op=True)", lambda: comm.all_reduce(x, async_op=True)),
            ("comm.broadcast(x, root=0)", lambda: comm.broadcast(x, root=0)),
            ("comm.all_gather(x) (allocates out)", lambda: comm.all_gather(x)),
        ]
        rows = [{"case": name, "us_per_call": round(_time(fn, calls), 3)} for name, fn in cases]
        comm.close()
        return rows
    finally:
        cuda.set_runtime(previous)
        server.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=20000, help="calls per timed run")
    parser.add_argument("--json", default="call_overhead.json", help="where to write results")
    args = parser.parse_args(argv)
    rows = measure(args.calls)
    print(f"{'case':<40} {'us/call':>8}  target <= {TARGET_US:g} us")
    for row in rows:
        flag = "" if row["us_per_call"] <= TARGET_US else "  over target"
        print(f"{row['case']:<40} {row['us_per_call']:>8.2f}{flag}")
    report = {"benchmark": "call_overhead", "target_us": TARGET_US, "calls": args.calls,
              "python": platform.python_version(), "machine": platform.machine(),
              "cpus": os.cpu_count(), "rows": rows}
    with open(args.json, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
