"""The sweep every rank runs: per case, timed loops out of place and in place, then a check.

Timing follows nccl-tests, with the iteration count chosen by time as nccl-tests' users (and
the peer harness) do by hand: a time-boxed warm-up (at least ``-w`` calls), whose measured
pace sets how many back-to-back calls fill one loop of ``--time``/``--loops`` seconds; ``-n``
fixes that count instead. Every rank agrees on the counts (the slowest rank's estimate wins),
so all call the collective equally often. Each of ``--loops`` loops starts at a barrier and
gives one time per call (loop time / iterations); each loop's time is combined over ranks
(``-a``: rank 0, average, min or max). The table's time is the mean over all loops (what
nccl-tests prints); the median and the spread over loops go beside it in JSON and CSV.
The correctness pass is separate and comes after the timed loops: known inputs, one call,
every element compared, wrong elements summed over ranks. The engine knows nothing of any
library: a ``Library`` adapter turns buffers into a call.

Also here, what the engine works with:

- the correctness pass's values: known inputs per rank, the exact expected output,
  wrong-element counts. Inputs are small integers chosen per operator so that every rank's
  result is exact in any dtype (sums of 1..5, products of 1s and 2s, bit patterns below 128);
  floating results are still compared with a tolerance of a few units in the last place of the
  dtype, because ``avg`` divides. Expected values are computed chunk by chunk, so checking a
  large buffer needs little memory;
- where buffers live (NumPy host arrays or CuPy device arrays) and how loops are timed: host
  loops with the monotonic clock around the calls, which return once done; device loops with
  CUDA events recorded on the current stream around the enqueued calls, then one synchronize:
  the time the GPU took, as nccl-tests measures it, not the time to enqueue;
- the ceilings printed beside the results, so bandwidths can be judged: one NumPy copy of a
  large array (bytes read + written, as STREAM counts) and an in-place add (the ring's reduce
  step, read twice + written once), which a host ring moving data through shared memory cannot
  beat per core; on GPUs, device-to-host and host-to-device copies from pinned and from
  pageable memory, the ceiling of anything staged through the host. Each figure is the best of
  a few timed repetitions after a warm-up.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np

from gpucoll import cuda
from gpucoll.bench.options import (
    AVERAGE_MODES,
    OPS,
    BenchOptions,
    bandwidths,
    numpy_dtype,
    type_name,
)
from gpucoll.ops import ReduceOp, check_op_dtype, host_ufunc, is_floating, parse_op

RANK_INFO_BYTES = 256
MAX_WARMUP = 10_000  # calls: a bound on the time-boxed warm-up of tiny messages
MAX_ITERS = 100_000  # calls in one timed loop


class Library(Protocol):
    """What the engine needs of a collectives library (gpucoll, gloo, mpi)."""

    name: str
    rank: int
    size: int

    def describe(self) -> dict[str, Any]: ...

    def prepare(self, op: str, send: Any, recv: Any, redop: str, root: int,
                in_place: bool) -> Callable[[], None] | None: ...

    def barrier(self) -> None: ...

    def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class Case:
    """One line of the table: an operation on one size, type, operator and root."""

    op: str
    nbytes: int
    dtype: str
    redop: str  # "none" for operations that do not reduce
    root: int  # -1 for operations without a root


@dataclasses.dataclass(frozen=True)
class Timing:
    """One placement's timed loops: seconds per call of each loop (combined over ranks)."""

    loops: tuple[float, ...]
    iters: int  # calls in each loop

    @property
    def mean(self) -> float:
        """Seconds per call over every timed call (all loops have ``iters`` calls)."""
        return sum(self.loops) / len(self.loops)

    @property
    def median(self) -> float:
        return statistics.median(self.loops)


@dataclasses.dataclass(frozen=True)
class Measurement:
    time_us: float  # mean over every timed call: nccl-tests' time column
    algbw: float
    busbw: float
    wrong: int | None  # None: no check was run
    median_us: float | None = None  # median over the loops
    min_us: float | None = None  # fastest and slowest loop: the spread
    max_us: float | None = None
    iters: int | None = None  # calls per loop
    loops: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"time": self.time_us, "alg_bw": self.algbw, "bus_bw": self.busbw,
                "nwrong": self.wrong, "time_median": self.median_us,
                "time_min": self.min_us, "time_max": self.max_us, "iters": self.iters,
                "loops": self.loops}

    @classmethod
    def from_json(cls, d: dict[str, Any] | None) -> Measurement | None:
        if d is None:
            return None
        return cls(d["time"], d["alg_bw"], d["bus_bw"], d["nwrong"], d.get("time_median"),
                   d.get("time_min"), d.get("time_max"), d.get("iters"), d.get("loops"))

    @property
    def spread(self) -> float | None:
        """(slowest - fastest loop) / median, the loops' relative spread; None if unknown."""
        if None in (self.min_us, self.max_us) or not self.median_us:
            return None
        return (self.max_us - self.min_us) / self.median_us


@dataclasses.dataclass(frozen=True)
class Result:
    """One table line: the sizes and both placements (None where the library has no such form)."""

    op: str
    size: int
    count: int
    type: str
    redop: str
    root: int
    out_of_place: Measurement | None
    in_place: Measurement | None

    def to_json(self) -> dict[str, Any]:
        return {"op": self.op, "size": self.size, "count": self.count, "type": self.type,
                "redop": self.redop, "root": self.root,
                "out_of_place": self.out_of_place and self.out_of_place.to_json(),
                "in_place": self.in_place and self.in_place.to_json()}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Result:
        return cls(d["op"], d["size"], d["count"], d["type"], d["redop"], d["root"],
                   Measurement.from_json(d["out_of_place"]), Measurement.from_json(d["in_place"]))


def cases(opts: BenchOptions, nranks: int) -> Iterator[Case | str]:
    """Every case of the sweep in order; a string instead names a combination skipped and why."""
    for op in opts.ops:
        spec = OPS[op]
        if op == "sendrecv" and nranks < 2:
            yield "skipped sendrecv: a ring of sends needs at least 2 ranks"
            continue
        for dtype in opts.dtypes:
            for redop in opts.redops if spec.reduces else ("none",):
                if redop != "none":
                    try:
                        check_op_dtype(parse_op(redop), numpy_dtype(dtype), op)
                    except TypeError as exc:
                        yield f"skipped {exc}"
                        continue
                roots = range(nranks) if opts.roots is None else opts.roots
                for root in roots if spec.rooted else (-1,):
                    if root >= nranks:
                        yield f"skipped {op} root {root}: only {nranks} ranks"
                        continue
                    for nbytes in opts.sizes():
                        yield Case(op, nbytes, dtype, redop, root)


def case_total(opts: BenchOptions, nranks: int) -> int:
    """How many table lines the sweep has (for the progress bar)."""
    return sum(1 for c in cases(opts, nranks) if isinstance(c, Case))


class Engine:
    """Runs cases on one rank through ``lib`` with buffers from ``mem``.

    ``tick`` is called between timed loops, outside the timed region (rank 0 redraws its
    progress line there).
    """

    def __init__(self, lib: Library, mem: Any, opts: BenchOptions,
                 tick: Callable[[], None] | None = None):
        self.lib, self.mem, self.opts = lib, mem, opts
        self.tick = tick or (lambda: None)

    def run(self, case: Case) -> Result:
        spec, dtype = OPS[case.op], numpy_dtype(case.dtype)
        n, rank = self.lib.size, self.lib.rank
        send_n, recv_n = spec.counts(case.nbytes, dtype.itemsize, n)
        send, recv = self.mem.empty(send_n, dtype), self.mem.empty(recv_n, dtype)
        timing_data = values(rank, np.arange(send_n), dtype, case.redop)
        measured = []
        for in_place in (False, True):
            s, r = placed(case.op, send, recv, rank, n, in_place)
            self.mem.write(s, timing_data[: _len(s)])
            fn = self.lib.prepare(case.op, s, r, case.redop, case.root, in_place)
            measured.append(None if fn is None else self._measure(case, fn, s, r, dtype))
        size = spec.size_bytes(case.nbytes, dtype.itemsize, n)
        return Result(case.op, size, case.nbytes // dtype.itemsize, type_name(dtype),
                      case.redop, case.root, measured[0], measured[1])

    def _measure(self, case: Case, fn: Callable[[], None], send: Any, recv: Any,
                 dtype: np.dtype) -> Measurement:
        timing = self.time(fn)
        size = OPS[case.op].size_bytes(case.nbytes, dtype.itemsize, self.lib.size)
        algbw, busbw = bandwidths(case.op, size, timing.mean, self.lib.size)
        wrong = self._check(case, fn, send, recv, dtype) if self.opts.check else None
        return Measurement(timing.mean * 1e6, algbw, busbw, wrong, timing.median * 1e6,
                           min(timing.loops) * 1e6, max(timing.loops) * 1e6, timing.iters,
                           len(timing.loops))

    def time(self, fn: Callable[[], None]) -> Timing:
        """Warm up, then ``--loops`` timed loops of the agreed number of calls (collective)."""
        iters = self._warm_up(fn)
        mine = []
        for _ in range(self.opts.loops):
            mine.append(self._loop(fn, iters) / iters)
            self.tick()
        per_rank = self.gather_rows(np.array(mine))  # (ranks, loops)
        loops = tuple(combine(per_rank[:, k], self.opts.average) for k in range(len(mine)))
        return Timing(loops, iters)

    def _warm_up(self, fn: Callable[[], None]) -> int:
        """Run the warm-up; return the calls per timed loop, the same on every rank.

        With ``-n`` both counts are fixed (nccl-tests). Otherwise one call measures the pace,
        the warm-up runs for ``--warmup-time`` (at least ``-w`` calls) and its pace sets the
        calls that fill one loop. Each estimate is the slowest rank's.
        """
        opts = self.opts
        if opts.iters is not None:
            for _ in range(opts.warmup):
                fn()
            self.mem.synchronize()
            return opts.iters
        first = self.agree_max(self._loop(fn, 1))
        warm = _clamp(math.ceil(opts.warmup_time / max(first, 1e-9)), opts.warmup, MAX_WARMUP)
        pace = self.agree_max(self._loop(fn, warm) / warm) if warm else first
        self.tick()
        return _clamp(math.ceil(opts.time / opts.loops / max(pace, 1e-9)), 1, MAX_ITERS)

    def _loop(self, fn: Callable[[], None], calls: int) -> float:
        """Seconds for ``calls`` back-to-back calls started together at a barrier."""
        self.mem.synchronize()
        self.lib.barrier()
        timer = self.mem.timer()
        timer.start()
        for _ in range(calls):
            fn()
        return timer.stop()

    def _check(self, case: Case, fn: Callable[[], None], send: Any, recv: Any,
               dtype: np.dtype) -> int:
        rank, n = self.lib.rank, self.lib.size
        wrong = 0
        for _ in range(self.opts.check):
            self.mem.fill(recv, SENTINEL)
            self.mem.write(send, inputs(case.op, rank, case.root, case.redop,
                                              _len(send), dtype))
            fn()
            self.mem.synchronize()
            got = self.mem.read(recv)
            wrong += wrong_elements(case.op, rank, n, case.root, case.redop, got)
        return int(self.all_sum(np.array([wrong], np.float64))[0])

    def gather(self, value: float) -> np.ndarray:
        """Every rank's ``value``, in rank order, on every rank."""
        return self.gather_rows(np.array([value]))[:, 0]

    def gather_rows(self, values: np.ndarray) -> np.ndarray:
        """Every rank's 1-D float array (all the same length): row r is rank r's."""
        slots = np.zeros((self.lib.size, values.size), np.float64)
        slots[self.lib.rank] = values
        return self.all_sum(slots.reshape(-1)).reshape(self.lib.size, values.size)

    def agree_max(self, value: float) -> float:
        """The largest of every rank's ``value``, on every rank (collective)."""
        return float(self.gather(value).max())

    def all_sum(self, values: np.ndarray) -> np.ndarray:
        """Element-wise sum over ranks of a small host array, through the library itself."""
        buf = self.mem.empty(values.size, values.dtype)
        self.mem.write(buf, values)
        fn = self.lib.prepare("all_reduce", buf, buf, "sum", -1, True)
        if fn is None:
            raise RuntimeError(f"{self.lib.name} cannot all_reduce in place")
        fn()
        self.mem.synchronize()
        return self.mem.read(buf).copy()

    def rank_info(self) -> list[str]:
        """One line per rank naming its pid, host and device, as nccl-tests' header does."""
        line = f"{os.getpid()} {socket.gethostname()} {self.mem.label()}".encode()
        slots = np.zeros((self.lib.size, RANK_INFO_BYTES), np.uint8)
        raw = np.frombuffer(line[:RANK_INFO_BYTES], np.uint8)
        slots[self.lib.rank, : raw.size] = raw
        gathered = self.all_sum(slots.reshape(-1)).reshape(self.lib.size, -1)
        return [bytes(row).rstrip(b"\0").decode(errors="replace") for row in gathered]


def placed(op: str, send: Any, recv: Any, rank: int, n: int, in_place: bool) -> tuple[Any, Any]:
    """The (send, recv) pair of one placement; in place they alias as NCCL defines it."""
    if not in_place:
        return send, recv
    if op == "all_gather":
        slot = _len(recv) // n
        return recv[rank * slot:(rank + 1) * slot], recv
    if op == "reduce_scatter":
        slot = _len(send) // n
        return send, send[rank * slot:(rank + 1) * slot]
    return recv, recv


def combine(times: np.ndarray, mode: int) -> float:
    """One time from every rank's, as nccl-tests' ``-a``: rank 0, average, min or max."""
    how = AVERAGE_MODES[mode]
    if how == "rank0":
        return float(times[0])
    return float(getattr(np, "mean" if how == "avg" else how)(times))


def _clamp(value: int, low: int, high: int) -> int:
    return max(low, min(high, value))


def _len(buf: Any) -> int:
    return int(buf.shape[0])


# ---- the correctness pass ------------------------------------------------------------------------

CHUNK = 1 << 20  # elements compared at a time
SENTINEL = 121  # written to outputs before a check; never an expected value's only source


def values(rank, index: np.ndarray, dtype: np.dtype, redop: str) -> np.ndarray:
    """The input element ``index`` of ``rank`` (either may be an array) for this operator."""
    index = np.asarray(index, dtype=np.int64)
    if redop in ("sum", "avg", "min", "max"):
        v = (index + rank) % 5 + 1
    elif redop == "prod":
        v = (index + rank) % 2 + 1
    elif redop in ("band", "bor", "bxor"):
        v = (index * 31 + np.asarray(rank) * 17 + 5) & 0x7F
    else:  # data movement: values that tell ranks and positions apart
        v = ((index % 61) * 3 + np.asarray(rank) * 7) % 113 + 1
    return v.astype(dtype)


def reduced(nranks: int, index: np.ndarray, dtype: np.dtype, redop: str) -> np.ndarray:
    """The reduction over all ranks of ``values(r, index)``, exactly as the dtype holds it."""
    op = ReduceOp(redop)
    work = _work_dtype(dtype)
    acc = values(0, index, dtype, redop).astype(work)
    ufunc = host_ufunc(op)
    for r in range(1, nranks):
        ufunc(acc, values(r, index, dtype, redop).astype(work), out=acc)
    if op is ReduceOp.AVG:
        acc = acc / nranks
    return acc


def _work_dtype(dtype: np.dtype) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype.kind == "c":
        return np.dtype(np.complex128)
    if is_floating(dtype):
        return np.dtype(np.float64)
    return dtype  # integers wrap the same way in any order


def tolerance(dtype: np.dtype) -> float:
    """Relative error allowed for a floating dtype (0 for integers)."""
    dtype = np.dtype(dtype)
    if not (is_floating(dtype) or dtype.kind == "c"):
        return 0.0
    return {2: 1e-2, 4: 1e-5, 8: 1e-12, 16: 1e-5}.get(dtype.itemsize, 1e-12)


def count_wrong(got: np.ndarray, expected: np.ndarray, dtype: np.dtype) -> int:
    """Elements of ``got`` that differ from ``expected`` beyond the dtype's tolerance."""
    tol = tolerance(dtype)
    if tol == 0.0:
        return int(np.count_nonzero(got != expected))
    work = _work_dtype(dtype)
    g = got.astype(work)
    e = np.asarray(expected).astype(work)
    bad = ~(np.abs(g - e) <= tol * np.maximum(1.0, np.abs(e)))
    return int(np.count_nonzero(bad))


def inputs(op: str, rank: int, root: int, redop: str, count: int, dtype: np.dtype) -> np.ndarray:
    """The send buffer rank ``rank`` starts the check with (``count`` elements)."""
    if op == "broadcast":
        rank = root if rank == root else rank + 1000  # only root's data may arrive
    return values(rank, np.arange(count), dtype, redop)


def expected(op: str, rank: int, nranks: int, root: int, redop: str, dtype: np.dtype,
             recv_count: int, start: int, count: int) -> np.ndarray | None:
    """Elements ``start:start+count`` of rank ``rank``'s output; None where none is defined."""
    idx = np.arange(start, start + count, dtype=np.int64)
    slot = recv_count // nranks if op in ("all_gather", "all_to_all") else recv_count
    if op == "all_reduce":
        return reduced(nranks, idx, dtype, redop)
    if op == "reduce":
        return reduced(nranks, idx, dtype, redop) if rank == root else None
    if op == "reduce_scatter":
        return reduced(nranks, rank * recv_count + idx, dtype, redop)
    if op == "broadcast":
        return values(root, idx, dtype, redop)
    if op == "all_gather":
        return values(idx // slot, idx % slot, dtype, redop)
    if op == "all_to_all":
        return values(idx // slot, rank * slot + idx % slot, dtype, redop)
    if op == "sendrecv":
        return values((rank - 1) % nranks, idx, dtype, redop)
    raise ValueError(f"no expected output for operation {op!r}")


def wrong_elements(op: str, rank: int, nranks: int, root: int, redop: str,
                   got: np.ndarray) -> int:
    """Count wrong elements of one rank's whole output buffer ``got`` (a host array)."""
    wrong = 0
    for start in range(0, got.size, CHUNK):
        count = min(CHUNK, got.size - start)
        want = expected(op, rank, nranks, root, redop, got.dtype, got.size, start, count)
        if want is not None:
            wrong += count_wrong(got[start:start + count], want, got.dtype)
    return wrong


# ---- buffers and timers --------------------------------------------------------------------------

class HostMemory:
    """NumPy buffers; operations complete when the call returns."""

    kind = "host"

    def empty(self, count: int, dtype: np.dtype) -> np.ndarray:
        return np.empty(count, dtype)

    def write(self, dst: np.ndarray, src: np.ndarray) -> None:
        np.copyto(dst, src)

    def fill(self, dst: np.ndarray, value: float) -> None:
        dst.fill(value)

    def read(self, src: np.ndarray) -> np.ndarray:
        return np.asarray(src)

    def synchronize(self) -> None:
        pass

    def label(self) -> str:
        return "cpu"

    def timer(self) -> HostTimer:
        return HostTimer()


class HostTimer:
    """Wall time of a loop of calls that finish before they return."""

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def stop(self) -> float:
        """Seconds since ``start()``."""
        return time.perf_counter() - self._t0


class DeviceMemory:
    """CuPy buffers on the current device; work is ordered on the current stream."""

    kind = "device"

    def __init__(self) -> None:
        import cupy

        self.cupy = cupy

    def empty(self, count: int, dtype: np.dtype) -> Any:
        if np.dtype(dtype).name == "bfloat16":
            raise ValueError("datatype bfloat16: CuPy has no bfloat16 arrays; use --memory host")
        return self.cupy.empty(count, dtype)

    def write(self, dst: Any, src: np.ndarray) -> None:
        dst.set(np.ascontiguousarray(src))

    def fill(self, dst: Any, value: float) -> None:
        dst.fill(value)

    def read(self, src: Any) -> np.ndarray:
        return self.cupy.asnumpy(src)

    def synchronize(self) -> None:
        self.cupy.cuda.get_current_stream().synchronize()

    def label(self) -> str:
        dev = self.cupy.cuda.Device()
        name = self.cupy.cuda.runtime.getDeviceProperties(dev.id)["name"]
        return f"cuda:{dev.id} [{dev.pci_bus_id}] {name.decode(errors='replace')}"

    def timer(self) -> CudaEventTimer:
        return CudaEventTimer(self.cupy)


class CudaEventTimer:
    """GPU time between two events on the current stream."""

    def __init__(self, cupy: Any) -> None:
        self.cupy = cupy
        self._start = cupy.cuda.Event()
        self._end = cupy.cuda.Event()

    def start(self) -> None:
        self._start.record(self.cupy.cuda.get_current_stream())

    def stop(self) -> float:
        """Seconds of GPU time since ``start()``; waits for the recorded work to finish."""
        self._end.record(self.cupy.cuda.get_current_stream())
        self._end.synchronize()
        return self.cupy.cuda.get_elapsed_time(self._start, self._end) / 1e3


def device_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device (never raises)."""
    return cuda.runtime().available()[0]


def memory_for(kind: str) -> HostMemory | DeviceMemory:
    """The buffers for ``--memory host|device``."""
    if kind == "device":
        if not device_available():
            raise ValueError("--memory device needs CuPy and a CUDA device; none is visible")
        return DeviceMemory()
    return HostMemory()


# ---- ceilings ------------------------------------------------------------------------------------

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


def measure_ceilings(device: bool) -> list[dict[str, Any]]:
    """Every ceiling that applies here: host always, device copies when ``device``."""
    found = host_ceilings()
    if device:
        try:
            found += device_ceilings()
        except Exception as exc:  # a broken driver must not lose the host figures
            found.append({"name": "device copies", "what": f"not measured: {exc}",
                          "bytes": 0, "GBps": float("nan")})
    return found
