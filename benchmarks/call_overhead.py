"""Python-side cost of one collective call on the NCCL backend, with NCCL and CUDA as no-ops.

What is measured is everything gpucoll does around NCCL's ``ncclAllReduce`` & co (called through
nccl4py's raw bindings): argument checks, turning the array into an address, a count and a
datatype code, resolving the stream and ordering it, the device guard, polling the
communicator's state, recording the completion event and handing it to the watchdog. NCCL's and
CUDA's own cost is left out (their calls return at once), and so is CuPy's own cost of
allocating a result (the stand-in allocator hands out a block of one arena, like a warm memory
pool, without touching memory), so this runs without a GPU. The calls run on rank 0 of a
two-rank communicator whose NCCL does nothing, so the grouped send/recv paths of gather, scatter
and all-to-all run as they would across GPUs. On more than one rank the ranks of a scatter first
agree on the slot layout through the store (the only per-call store traffic; the absent rank 1's
side of it is put in the store beforehand); a one-rank scatter shows the cost without it.
Target: at most 10 us per call.

The flight recorder's rows time what the communicator adds to every call for it, alone: making
the call's entry and stamping its start and end (two clock reads). Its budget is 0.5 us per
call; an empty call shows what the timing loop itself costs in each row.

    python benchmarks/call_overhead.py [--calls 20000] [--json results/call_overhead.json]

``--device`` times the same path on a real GPU instead, everything real, on a world of one
(NCCL's in-place all-reduce of one rank moves nothing, so what is left is the host's work): the
host time per call in batches of 200 calls with a synchronize between batches (best and median
batch), beside 2,000 calls back to back and one synchronize, where the device's pace and the
watchdog retiring events also count; and the runtime calls the path is made of, alone.

``--record-loop N`` only records N collectives as the communicator does, beside a heap of
300,000 live objects with the garbage collector on, and prints nothing: run it under
``valgrind --tool=callgrind`` at two values of N (and with ``--no-record`` for the loop alone) to
count the recorder's instructions per call, collector included, which load does not move.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import os
import platform
import re
import select
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from gpucoll import cuda
from gpucoll.arrays import as_ref
from gpucoll.backends.nccl import NcclBackend
from gpucoll.backends.nccl.driver import DTYPE_CODES, Buf, Calls, Driver
from gpucoll.communicator import Communicator
from gpucoll.ops import ReduceOp
from gpucoll.progress import KIND, Recorder, clock
from gpucoll.store import PrefixStore, TCPStore

TARGET_US = 10.0
RECORDER_TARGET_US = 0.5  # the flight recorder's share of one call
DEFAULT_JSON = Path(__file__).resolve().parent.parent / "results" / "call_overhead.json"
WORLD = 2  # ranks of the no-op communicator; this process is rank 0
COMPARED = "(not called) "  # a row that times another library's way, for comparison


class _DoneEvent:
    ptr = 1
    done = True

    def synchronize(self) -> None:
        pass


class _NoopComm:
    """nccl4py's Communicator, never in progress."""

    is_valid = True
    ptr = 1

    def get_async_error(self): return 0  # noqa: E704
    def abort(self): pass  # noqa: E704
    def finalize(self): pass  # noqa: E704
    def destroy(self): pass  # noqa: E704


class _NoopNccl:
    """nccl4py's ``nccl.core``, as far as a running communicator uses it."""

    def group_start(self): pass  # noqa: E704
    def group_end(self): pass  # noqa: E704


class _NoopBindings:
    """nccl4py's raw bindings whose calls return at once (as enqueueing on a GPU roughly
    does)."""

    class Comm:
        def __init__(self, handle=0): self.handle = handle  # noqa: E704

    def all_reduce(self, *args): pass  # noqa: E704
    def broadcast(self, *args): pass  # noqa: E704
    def reduce(self, *args): pass  # noqa: E704
    def all_gather(self, *args): pass  # noqa: E704
    def reduce_scatter(self, *args): pass  # noqa: E704
    def send(self, *args): pass  # noqa: E704
    def recv(self, *args): pass  # noqa: E704


class _Here:
    """``using_device`` of a runtime with one device: nothing to switch."""

    def __enter__(self): pass  # noqa: E704
    def __exit__(self, *exc): pass  # noqa: E704


class _DeviceBuffer:
    """A device array as another library would hand it over: CAI v3, no stream named.

    Its memory is real (host memory behind the pointer) but never touched: NCCL and CUDA do
    nothing here. ``ptr`` given: a block of the caller's arena instead of memory of its own.
    """

    def __init__(self, shape: tuple, dtype: Any, ptr: int | None = None):
        self.dtype, self.shape = np.dtype(dtype), tuple(shape)
        if ptr is None:
            self.host = np.zeros(shape, dtype)
            ptr = self.host.__array_interface__["data"][0]
        self.__cuda_array_interface__ = {
            "shape": self.shape, "typestr": self.dtype.str, "version": 3,
            "data": (ptr, False), "strides": None, "stream": None,
        }


class NoopRuntime:
    """The ``gpucoll.cuda`` seam with every CUDA call a no-op on device 0."""

    name = "noop"
    _event = _DoneEvent()

    def available(self): return True, "no-op CUDA"  # noqa: E704
    def device_count(self): return 1  # noqa: E704
    def set_device(self, device): pass  # noqa: E704
    def current_device(self): return 0  # noqa: E704
    def using_device(self, device): return _Here()  # noqa: E704
    def current_stream(self): return 0  # noqa: E704
    def is_capturing(self, stream): return False  # noqa: E704
    def stream_device(self, stream): return None  # noqa: E704
    def thread_local_capture(self): return True  # noqa: E704
    def stream_handle(self, stream): return 0 if stream is None else cuda.stream_handle(stream, 0)  # noqa: E501,E704
    def record_event(self, stream): return self._event  # noqa: E704
    def wait_event(self, stream, event): pass  # noqa: E704
    def memcpy_async(self, dst, src, nbytes, stream): pass  # noqa: E704
    def pointer_device(self, ptr): return 0  # noqa: E704
    _arena = np.zeros(1 << 20, np.uint8)  # every allocation's memory (never touched)
    _arena_ptr = _arena.__array_interface__["data"][0]

    def empty(self, shape, dtype, device):
        if math.prod(shape) * np.dtype(dtype).itemsize > self._arena.nbytes:
            raise ValueError("the no-op runtime's arena is too small for this benchmark")
        return _DeviceBuffer(shape, dtype, self._arena_ptr)

    def nccl(self): return _NoopNccl()  # noqa: E704

    def nccl_bindings(self): return _NoopBindings()  # noqa: E704


def _time(fn, calls: int, repeats: int = 5) -> dict[str, float]:
    """Microseconds per call over ``repeats`` runs of ``calls`` calls: the median and best run
    of wall-clock time, and the median of this process's CPU time (all its threads, user and
    system), which other jobs on a busy machine disturb far less than the wall clock."""
    for _ in range(min(calls, 1000)):
        fn()
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        for _ in range(calls):
            fn()
        cpu.append((time.process_time() - start_cpu) / calls * 1e6)
        wall.append((time.perf_counter() - start) / calls * 1e6)
    return {"us_per_call": round(statistics.median(wall), 3), "best_us": round(min(wall), 3),
            "cpu_us": round(statistics.median(cpu), 3)}


def _with_absent_peer(comm: Communicator, store: Any, fn: Any, calls: int) -> Any:
    """``fn`` (a scatter) after putting in the store, for as many calls as ``_time`` makes, what
    the absent rank 1 would contribute to each call's layout agreement: no ``out``."""
    first = comm._agreements
    keys = [f"agree/{n}/1" for n in range(first, first + min(calls, 1000) + 5 * calls + 1)]
    store.multi_set(keys, [b""] * len(keys))
    return fn


def cases(comm: Communicator, backend: NcclBackend,
          solo: Communicator) -> list[tuple[str, Any]]:
    """(name, call) for every collective, with and without ``out=``, on rank 0 of ``WORLD``
    (``solo``: a one-rank group, where scatter has no header to send)."""
    n = comm.size
    x = _DeviceBuffer((1024,), np.float32)
    slots = _DeviceBuffer((n, 1024), np.float32)  # one 1024-element slot per rank
    out_slot = _DeviceBuffer((1024,), np.float32)
    out_all = _DeviceBuffer((n, 1024), np.float32)
    slots_of_one = _DeviceBuffer((1, 1024), np.float32)
    ref = as_ref(x, "x")
    return [
        ("backend.all_reduce (ArrayRef given)",
         lambda: backend.all_reduce(ref, ReduceOp.SUM, timeout=60.0)),
        ("as_ref(CAI array)", lambda: as_ref(x, "x")),
        ("comm.all_reduce(x)", lambda: comm.all_reduce(x)),
        ("comm.all_reduce(x, op='max')", lambda: comm.all_reduce(x, "max")),
        ("comm.all_reduce(x, stream=s)", lambda: comm.all_reduce(x, stream=7)),
        ("comm.all_reduce(x, async_op=True)", lambda: comm.all_reduce(x, async_op=True)),
        ("comm.reduce(x, root=0)", lambda: comm.reduce(x, root=0)),
        ("comm.broadcast(x, root=0)", lambda: comm.broadcast(x, root=0)),
        ("comm.all_gather(x) (allocates out)", lambda: comm.all_gather(x)),
        ("comm.all_gather(x, out=)", lambda: comm.all_gather(x, out=out_all)),
        ("comm.gather(x, root=0) (allocates out)", lambda: comm.gather(x, root=0)),
        ("comm.gather(x, root=0, out=)", lambda: comm.gather(x, root=0, out=out_all)),
        ("comm.reduce_scatter(x) (allocates out)", lambda: comm.reduce_scatter(slots)),
        ("comm.reduce_scatter(x, out=)", lambda: comm.reduce_scatter(slots, out=out_slot)),
        ("comm.all_to_all(x) (allocates out)", lambda: comm.all_to_all(slots)),
        ("comm.all_to_all(x, out=)", lambda: comm.all_to_all(slots, out=out_all)),
        ("comm.scatter(x, root=0) (allocates out)", lambda: comm.scatter(slots, root=0)),
        ("comm.scatter(x, root=0, out=)", lambda: comm.scatter(slots, root=0, out=out_slot)),
        ("comm.scatter(x, root=0, out=), one rank",
         lambda: solo.scatter(slots_of_one, root=0, out=out_slot)),
        ("comm.send(x, dst=1)", lambda: comm.send(x, 1)),
        ("comm.recv(x, src=1)", lambda: comm.recv(x, 1)),
    ]


def recorder_cases() -> list[tuple[str, Any]]:
    """What the flight recorder adds to one call, as the communicator does it: the call's
    signature kept after its checks, then its start and its end kept around the backend call
    (a NumPy all_reduce on the lean path keeps both at once)."""
    rec = Recorder()
    keep = rec.keep
    ref = as_ref(np.zeros(1024, np.float32), "x")
    host = np.zeros(1024, np.float32)
    all_reduce, send = KIND["all_reduce"], KIND["send"]

    fields = {"op": ReduceOp.SUM}  # the communicator makes it for its signature in any case

    def collective() -> None:
        rec.signature(7, all_reduce, ref, fields)
        keep((rec.current, clock()))
        keep(clock())

    def point_to_point() -> None:
        rec.point_to_point(send, ref, 1)
        keep((rec.current, clock()))
        keep(clock())

    def lean() -> None:
        keep((7, all_reduce, host.dtype, host.size, -1, ReduceOp.SUM, clock()))
        keep(clock())

    return [("recorder: a collective's record", collective),
            ("recorder: a send's record", point_to_point),
            ("recorder: a NumPy all_reduce's (lean path)", lean),
            ("(an empty call: the timing loop's own cost)", lambda: None)]


@contextlib.contextmanager
def binding_cases() -> Iterator[list[tuple[str, Any]]]:
    """How NCCL is entered, NCCL's entry a no-op: the raw binding call the backend makes (the
    address, count and datatype code already worked out) beside nccl4py's
    ``Communicator.allreduce`` on the same memory as a CuPy view, which first resolves both
    buffers through nccl4py's interop and checks them. No rows without nccl4py."""
    try:
        import nccl.bindings.nccl as raw
        import nccl.core.communicator as nccl4py
    except ImportError:
        yield []
        return
    host = np.zeros(1024, np.float32)
    buf = Buf(host.__array_interface__["data"][0], host.size, DTYPE_CODES["float32"])
    view = cuda.cupy_view(buf.ptr, buf.count, host.dtype, 0)
    noop = _NoopBindings()
    calls = Calls(noop, _NoopComm(), 0)
    comm = nccl4py.Communicator.__new__(nccl4py.Communicator)  # a handle, no NCCL behind it
    comm._comm, comm._device = raw.Comm(1), types.SimpleNamespace(device_id=0)
    real, nccl4py._nccl_bindings = nccl4py._nccl_bindings, noop
    try:
        yield [("ncclAllReduce entered as the backend does", lambda: calls.allreduce(
                    buf, buf, 0, stream=0)),
               (COMPARED + "nccl4py Communicator.allreduce", lambda: comm.allreduce(
                    view, view, 0, stream=0))]
    finally:
        nccl4py._nccl_bindings = real


@contextlib.contextmanager
def store_process(timeout: float = 30.0) -> Iterator[TCPStore]:
    """A client of a store served by another process, as under ``gpucoll run`` (only
    scatter talks to the store per call; an in-process server would add its own work)."""
    env = {k: v for k, v in os.environ.items() if k != "GPUCOLL_STORE_TOKEN"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpucoll", "store", "--host", "127.0.0.1", "--port", "0"],
        stdout=subprocess.PIPE, text=True, env=env)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        line = proc.stdout.readline() if ready else ""
        match = re.search(r"tcp://127\.0\.0\.1:(\d+)", line)
        if match is None:
            raise RuntimeError(f"the store process did not start within {timeout:g} s: {line!r}")
        with TCPStore("127.0.0.1", int(match.group(1)), timeout=timeout) as client:
            yield client
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def measure(calls: int) -> list[dict[str, Any]]:
    with store_process() as client:
        return _measure(client, calls)


def _measure(client: TCPStore, calls: int) -> list[dict[str, Any]]:
    previous = cuda.set_runtime(NoopRuntime())
    try:
        store = PrefixStore("call_overhead", client)
        # rank 0 of WORLD: the NCCL communicator is given, so nobody else needs to start up
        backend = NcclBackend(store, 0, WORLD, timeout=60.0, device=0,
                              _driver=Driver(_NoopNccl(), _NoopBindings(), _NoopComm(), 0, WORLD,
                                             None))
        comm = Communicator(backend, store, timeout=60.0)
        solo_store = PrefixStore("solo", client)
        alone = NcclBackend(solo_store, 0, 1, timeout=60.0, device=0,
                            _driver=Driver(_NoopNccl(), _NoopBindings(), _NoopComm(), 0, 1, None))
        with comm, Communicator(alone, solo_store, timeout=60.0) as solo:
            rows = [{"case": name, **_time(fn, calls)} for name, fn in recorder_cases()]
            with binding_cases() as entries:
                rows += [{"case": name, **_time(fn, calls)} for name, fn in entries]
            for name, fn in cases(comm, backend, solo):
                if name.startswith("comm.scatter") and not name.endswith("one rank"):
                    fn = _with_absent_peer(comm, store, fn, calls)
                rows.append({"case": name, **_time(fn, calls)})
        return rows
    finally:
        cuda.set_runtime(previous)


def device_cases(comm: Communicator) -> list[tuple[str, Any]]:
    """(name, call) on a real device: the runtime and NCCL calls one collective is made of,
    then whole calls, on ``comm``, an NCCL world of one."""
    import cupy

    backend, rt = comm._backend, cuda.runtime()
    driver, x = backend._nc, cupy.ones(2, cupy.float32)
    side = cupy.cuda.Stream(non_blocking=True)
    h, ref, event = side.ptr, as_ref(x, "x"), rt.record_event(side.ptr)
    buf = Buf(x.data.ptr, x.size, DTYPE_CODES["float32"])

    def guard() -> None:
        with rt.using_device(backend.device):
            pass

    return [
        ("ncclAllReduce entered as the backend does",
         lambda: driver.calls.allreduce(buf, buf, 0, stream=h)),
        ("ncclCommGetAsyncError", driver.comm.get_async_error),
        ("rt.record_event(s) (an event made, recorded)", lambda: rt.record_event(h)),
        ("rt.wait_event(s, event)", lambda: rt.wait_event(h, event)),
        ("rt.is_capturing(s)", lambda: rt.is_capturing(h)),
        ("rt.current_stream()", rt.current_stream),
        ("with rt.using_device(d)", guard),
        ("as_ref(CuPy array)", lambda: as_ref(x, "x")),
        ("backend.all_reduce (ArrayRef given)",
         lambda: backend.all_reduce(ref, ReduceOp.SUM, timeout=60.0)),
        ("comm.all_reduce(x)", lambda: comm.all_reduce(x)),
        ("comm.all_reduce(x, stream=s)", lambda: comm.all_reduce(x, stream=side)),
        ("comm.broadcast(x, root=0)", lambda: comm.broadcast(x, root=0)),
        ("comm.all_gather(x) (allocates out)", lambda: comm.all_gather(x)),
    ]


def _time_device(fn: Any, sync: Any, batch: int = 200, batches: int = 20,
                 run: int = 2000) -> dict[str, float]:
    """Host microseconds per call: best and median of ``batches`` batches with the device
    synchronized between them, and ``run`` calls back to back then one synchronize."""
    for _ in range(batch):
        fn()
    per = []
    for _ in range(batches):
        sync()
        start = time.perf_counter()
        for _ in range(batch):
            fn()
        per.append((time.perf_counter() - start) / batch * 1e6)
    sync()
    start = time.perf_counter()
    for _ in range(run):
        fn()
    sync()
    back_to_back = (time.perf_counter() - start) / run * 1e6
    return {"us_per_call": round(statistics.median(per), 3), "best_us": round(min(per), 3),
            "back_to_back_us": round(back_to_back, 3)}


def measure_device() -> list[dict[str, Any]]:
    """``device_cases`` timed on this machine's CUDA device 0."""
    import cupy

    from gpucoll.default import create

    with create("nccl", rank=0, world_size=1, timeout=60.0) as comm:
        sync = cupy.cuda.Device(comm._backend.device).synchronize
        return [{"case": name, **_time_device(fn, sync)} for name, fn in device_cases(comm)]


def _report_device(rows: list[dict[str, Any]]) -> dict[str, Any]:
    import cupy

    print(f"NCCL world of one on {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}; "
          f"host us per call: batches of 200 (median, best), 2,000 back to back")
    print(f"{'case':<46} {'median':>7} {'best':>6} {'2000':>7}")
    for row in rows:
        print(f"{row['case']:<46} {row['us_per_call']:>7.2f} {row['best_us']:>6.2f} "
              f"{row['back_to_back_us']:>7.2f}")
    return {"benchmark": "call_overhead", "mode": "device", "world_size": 1, "rows": rows}


def record_loop(calls: int, record: bool = True) -> None:
    """``calls`` collectives' records, as the communicator makes them, while the program keeps a
    heap of live objects and a few recent ones (the garbage collector's work included)."""
    heap = [[i] for i in range(300_000)]  # noqa: F841 - the live objects the collector walks
    recent: collections.deque = collections.deque(maxlen=50)
    rec = Recorder()
    keep, ref, kind = rec.keep, as_ref(np.zeros(1024, np.float32), "x"), KIND["all_reduce"]
    for seq in range(calls):
        fields = {"op": ReduceOp.SUM}  # what the communicator makes for its signature anyway
        recent.append([fields])
        if record:
            rec.signature(seq, kind, ref, fields)
            keep((rec.current, clock()))
            keep(clock())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=20000, help="calls per timed run")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON,
                        help=f"where to write results (default: {DEFAULT_JSON})")
    parser.add_argument("--record-loop", type=int, metavar="N",
                        help="only record N calls, for an instruction count (see above)")
    parser.add_argument("--no-record", action="store_true",
                        help="with --record-loop: the loop without recording")
    parser.add_argument("--device", action="store_true",
                        help="time the real path on CUDA device 0 (a world of one)")
    args = parser.parse_args(argv)
    if args.record_loop is not None:
        record_loop(args.record_loop, not args.no_record)
        return 0
    if args.device:
        _write(args.json, _report_device(measure_device()))
        return 0
    rows = measure(args.calls)
    print(f"rank 0 of {WORLD}; target <= {TARGET_US:g} us per call, the recorder's share <= "
          f"{RECORDER_TARGET_US:g} us (median wall clock); "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'case':<42} {'us/call':>8} {'best':>6} {'cpu':>6}")
    for row in rows:
        target = RECORDER_TARGET_US if row["case"].startswith("recorder:") else TARGET_US
        mine = not row["case"].startswith(COMPARED)  # not gpucoll's: no target
        flag = "  over target" if mine and row["us_per_call"] > target else ""
        print(f"{row['case']:<42} {row['us_per_call']:>8.2f} {row['best_us']:>6.2f} "
              f"{row['cpu_us']:>6.2f}{flag}")
    report = {"benchmark": "call_overhead", "target_us": TARGET_US,
              "recorder_target_us": RECORDER_TARGET_US, "calls": args.calls,
              "world_size": WORLD, "python": platform.python_version(),
              "machine": platform.machine(), "cpus": os.cpu_count(),
              "load_average": list(os.getloadavg()), "rows": rows}
    _write(args.json, report)
    return 0


def _write(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
