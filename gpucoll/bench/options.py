"""`gpucoll bench` flags: nccl-tests' short flags with their meaning, plus gpucoll's own; and what
each benchmarked operation moves, with its bandwidths as nccl-tests defines them.

Parsing is pure (no environment, no imports of CUDA or the communicator), so the driver and
every rank read the same command line into the same ``BenchOptions``.

nccl-tests (doc/PERFORMANCE.md) reports ``algbw = S / t`` and ``busbw = algbw * factor(n)``,
where the factor turns the rate into what each rank's link carried, so numbers stay comparable
across rank counts. ``S`` is the reported size: the whole buffer for all_reduce, broadcast,
reduce and sendrecv; the total of all ranks' slots for all_gather (output) and reduce_scatter
(input); the whole per-rank send buffer for all_to_all. GB are 1e9 bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Callable

import numpy as np

from gpucoll.backends import NAMES
from gpucoll.ops import parse_op
from gpucoll.transport.mesh import TRANSPORTS

# ---- what each operation moves, and its bandwidths -----------------------------------------------

@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One benchmarked operation: its names, what it reduces and roots, and its bus factor."""

    name: str
    binary: str  # the nccl-tests program measuring the same thing
    reduces: bool  # takes a reduction operator (the redop column)
    rooted: bool  # takes a root rank (the root column)
    slotted: bool  # the buffer is split into one slot per rank (count rounds to n)
    factor: Callable[[int], float]

    def counts(self, nbytes: int, itemsize: int, nranks: int) -> tuple[int, int]:
        """Elements of (send buffer, receive buffer) per rank for a requested size in bytes.

        Like nccl-tests, a size that does not divide evenly is rounded down: to whole
        elements, and for slotted operations to a whole number of elements per rank.
        """
        count = nbytes // itemsize
        if not self.slotted:
            return count, count
        slot = count // nranks
        if self.name == "all_gather":
            return slot, slot * nranks
        if self.name == "reduce_scatter":
            return slot * nranks, slot
        return slot * nranks, slot * nranks  # all_to_all

    def size_bytes(self, nbytes: int, itemsize: int, nranks: int) -> int:
        """The ``size`` column: the larger of the send and receive buffers, in bytes."""
        send, recv = self.counts(nbytes, itemsize, nranks)
        return max(send, recv) * itemsize


def _ring(n: int) -> float:
    return 2.0 * (n - 1) / n


def _share(n: int) -> float:
    return (n - 1) / n


def _one(n: int) -> float:
    return 1.0


OPS: dict[str, OpSpec] = {
    spec.name: spec
    for spec in (
        OpSpec("all_reduce", "all_reduce_perf", True, False, False, _ring),
        OpSpec("all_gather", "all_gather_perf", False, False, True, _share),
        OpSpec("reduce_scatter", "reduce_scatter_perf", True, False, True, _share),
        OpSpec("broadcast", "broadcast_perf", False, True, False, _one),
        OpSpec("reduce", "reduce_perf", True, True, False, _one),
        OpSpec("all_to_all", "alltoall_perf", False, False, True, _share),
        OpSpec("sendrecv", "sendrecv_perf", False, False, False, _one),
    )
}


def bus_factor(op: str, nranks: int) -> float:
    """busbw / algbw for ``op`` on ``nranks`` ranks (nccl-tests' correction factor)."""
    if nranks < 1:
        raise ValueError(f"nranks={nranks} must be at least 1")
    return OPS[op].factor(nranks)


def bandwidths(op: str, size_bytes: int, seconds: float, nranks: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s for ``size_bytes`` (the size column) moved in ``seconds``."""
    if seconds <= 0:
        return 0.0, 0.0
    algbw = size_bytes / seconds / 1e9
    return algbw, algbw * bus_factor(op, nranks)


# ---- the flags -----------------------------------------------------------------------------------

# nccl-tests' datatype names (its -d values) and the NumPy dtype each one is
NCCL_TYPES = {
    "int8": "int8",
    "uint8": "uint8",
    "int32": "int32",
    "uint32": "uint32",
    "int64": "int64",
    "uint64": "uint64",
    "half": "float16",
    "float": "float32",
    "double": "float64",
    "bfloat16": "bfloat16",
}
TYPE_ALIASES = {"char": "int8", "int": "int32", "float16": "half", "float32": "float",
                "float64": "double", "fp16": "half", "fp32": "float", "fp64": "double",
                "bf16": "bfloat16"}
NCCL_REDOPS = ("sum", "prod", "max", "min", "avg")
OP_ALIASES = {"allreduce": "all_reduce", "allgather": "all_gather",
              "reducescatter": "reduce_scatter", "alltoall": "all_to_all", "bcast": "broadcast",
              "send_recv": "sendrecv"}
LIBRARIES = ("gpucoll", "gloo", "mpi")
PEERS = ("gloo", "mpi")
AVERAGE_MODES = {0: "rank0", 1: "avg", 2: "min", 3: "max"}
_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


@dataclasses.dataclass(frozen=True)
class BenchOptions:
    """One benchmark run, as every rank and the driver understand it."""

    ops: tuple[str, ...] = ("all_reduce",)
    minbytes: int = 32 << 20
    maxbytes: int = 32 << 20
    stepbytes: int = 1 << 20
    stepfactor: int = 1
    iters: int | None = None  # -n: calls per timed loop; None: as many as fill the loop time
    warmup: int = 5  # -w: untimed calls before timing (at least this many when time-boxed)
    time: float = 0.3  # seconds of timed calls per table cell, split over the loops
    loops: int = 5  # timed loops per cell: the mean over them is printed, median and spread
    warmup_time: float = 0.1  # seconds of warm-up per cell (time-boxed mode)
    check: int = 1
    redops: tuple[str, ...] = ("sum",)
    dtypes: tuple[str, ...] = ("float",)
    roots: tuple[int, ...] | None = (0,)  # None: every rank ("-r all")
    average: int = 1
    ranks: int | None = None  # -g; None: every visible GPU, else 2
    backend: str = "auto"
    transport: str = "auto"
    memory: str = "auto"  # host | device | auto (device when the backend is nccl)
    peers: tuple[str, ...] = ()
    json: str | None = None
    csv: str | None = None
    plot: str | None = None
    progress: bool | None = None  # None: only when stderr is a terminal
    ceilings: bool = True
    timeout: float = 300.0
    # internal: set by the driver for the ranks it starts
    library: str = "gpucoll"
    results: str | None = None
    gloo_init: str | None = None

    def sizes(self) -> list[int]:
        """The requested sizes in bytes, as nccl-tests walks them from -b to -e."""
        out, size = [], self.minbytes
        while size <= self.maxbytes:
            out.append(size)
            nxt = size * self.stepfactor if self.stepfactor > 1 else size + self.stepbytes
            if nxt <= size:  # -b 0 with a factor: nccl-tests would loop forever
                nxt = size + 1 if self.stepfactor > 1 else size + max(self.stepbytes, 1)
            size = nxt
        return out


def parse_size(text: str) -> int:
    """``"8"``, ``"64K"``, ``"128M"``, ``"1G"`` -> bytes (binary units, as nccl-tests)."""
    match = _SIZE.match(str(text))
    if not match:
        raise argparse.ArgumentTypeError(
            f"size {text!r} is not a byte count such as 8, 64K, 128M or 1G")
    return int(match.group(1)) * _UNITS[match.group(2).lower()]


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype for an nccl-tests type name or a NumPy dtype name."""
    if name == "bfloat16":
        from gpucoll.errors import require

        return np.dtype(require("ml_dtypes", "datatype bfloat16").bfloat16)
    return np.dtype(NCCL_TYPES.get(name, name))


def type_name(dtype: np.dtype) -> str:
    """The name the type column shows: nccl-tests' where it has one, else NumPy's."""
    numpy_name = np.dtype(dtype).name
    for nccl, np_name in NCCL_TYPES.items():
        if np_name == numpy_name:
            return nccl
    return numpy_name


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _op_names(values: list[str]) -> tuple[str, ...]:
    names: list[str] = []
    for value in values:
        for part in _split(value):
            part = part.lower().removesuffix("_perf")
            if part == "all":
                names.extend(OPS)
                continue
            part = OP_ALIASES.get(part, part)
            if part not in OPS:
                raise ValueError(f"operation {part!r} is not benchmarked; expected one of "
                                 f"{', '.join(OPS)} or 'all'")
            names.append(part)
    return tuple(dict.fromkeys(names)) or ("all_reduce",)


def _dtypes(text: str) -> tuple[str, ...]:
    if text == "all":
        for name in NCCL_TYPES:  # a missing ml_dtypes is said now, before any rank starts
            numpy_dtype(name)
        return tuple(NCCL_TYPES)
    names = []
    for part in _split(text):
        name = TYPE_ALIASES.get(part.lower(), part.lower())
        try:
            numpy_dtype(name)
        except TypeError as exc:
            raise ValueError(f"datatype {part!r} is not known; nccl-tests names are "
                             f"{', '.join(NCCL_TYPES)} (or 'all'), or any NumPy dtype") from exc
        names.append(name)
    return tuple(names)


def _redops(text: str) -> tuple[str, ...]:
    if text == "all":
        return NCCL_REDOPS
    return tuple(parse_op(part).value for part in _split(text))


def _roots(text: str) -> tuple[int, ...] | None:
    if text == "all":
        return None
    try:
        roots = tuple(int(part) for part in _split(text))
    except ValueError as exc:
        raise ValueError(f"root {text!r} is not a rank number or 'all'") from exc
    if not roots or min(roots) < 0:
        raise ValueError(f"root {text!r} must name ranks >= 0")
    return roots


def _peers(every: bool, values: list[str] | None) -> tuple[str, ...]:
    names = [p.lower() for v in values or () for p in _split(v)]
    if every:
        names = list(PEERS) + names
    for name in names:
        if name not in PEERS:
            raise ValueError(f"--peer {name!r}: expected {' or '.join(PEERS)}")
    return tuple(dict.fromkeys(names))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpucoll bench",
        description="Measure collective bandwidth the way nccl-tests does: out of place, then "
                    "in place, algbw and busbw per size, a correctness pass, averaged over ranks.",
        epilog="Example: gpucoll bench all_reduce -b 8 -e 128M -f 2 -g 2 --peers --plot bw.png")
    p.add_argument("ops", nargs="*", default=[],
                   help=f"operations ({', '.join(OPS)}, or all); default all_reduce")
    _add_nccl_tests_flags(p)
    _add_gpucoll_flags(p)
    p.add_argument("--library", default="gpucoll", choices=LIBRARIES, help=argparse.SUPPRESS)
    p.add_argument("--results", help=argparse.SUPPRESS)
    p.add_argument("--gloo-init", help=argparse.SUPPRESS)
    return p


def _add_nccl_tests_flags(p: argparse.ArgumentParser) -> None:
    """The flags nccl-tests' all_reduce_perf takes, with its defaults where they apply."""
    g = p.add_argument_group("nccl-tests flags")
    g.add_argument("-b", "--minbytes", type=parse_size, default=BenchOptions.minbytes,
                   help="smallest size (default 32M)")
    g.add_argument("-e", "--maxbytes", type=parse_size, default=BenchOptions.maxbytes,
                   help="largest size (default 32M)")
    g.add_argument("-i", "--stepbytes", type=parse_size, default=BenchOptions.stepbytes,
                   help="fixed increment between sizes (default 1M)")
    g.add_argument("-f", "--stepfactor", type=int, default=BenchOptions.stepfactor,
                   help="multiplication factor between sizes (default: off)")
    g.add_argument("-n", "--iters", type=int, default=BenchOptions.iters,
                   help="timed iterations per loop (default: as many as fill --time/--loops "
                        "seconds, at the pace the warm-up measured)")
    g.add_argument("-w", "--warmup_iters", dest="warmup", type=int,
                   default=BenchOptions.warmup, help="untimed iterations before timing, at "
                   "least (default 5)")
    g.add_argument("-c", "--check", type=int, default=BenchOptions.check,
                   help="correctness passes per size after timing; 0 skips (default 1)")
    g.add_argument("-o", "--op", dest="redop", default="sum",
                   help="reduction: sum prod min max avg band bor bxor, or all (default sum)")
    g.add_argument("-d", "--datatype", default="float",
                   help="int8 uint8 int32 uint32 int64 uint64 half float double bfloat16, "
                        "any NumPy dtype, or all (default float)")
    g.add_argument("-r", "--root", default="0", help="root rank(s) for broadcast and reduce, "
                   "or all (default 0)")
    g.add_argument("-a", "--average", type=int, default=1, choices=sorted(AVERAGE_MODES),
                   help="time reported: 0 rank 0, 1 average, 2 min, 3 max over ranks")
    g.add_argument("-g", "--ngpus", dest="ranks", type=int, default=None,
                   help="ranks to start (default: every visible GPU, else 2 on the host ring); "
                        "inside `gpucoll run` the ranks given are used")
    g.add_argument("-t", "--nthreads", type=int, default=1, help="only 1 (one rank a process)")


def _add_gpucoll_flags(p: argparse.ArgumentParser) -> None:
    """What to run on (backend, transport, memory), what to compare with, where results go."""
    m = p.add_argument_group("gpucoll")
    m.add_argument("--backend", default="auto", choices=NAMES)
    m.add_argument("--transport", default="auto", choices=TRANSPORTS)
    m.add_argument("--memory", default="auto", choices=("auto", "host", "device"),
                   help="NumPy host arrays or CuPy device arrays (auto: device with nccl)")
    m.add_argument("--peers", action="store_true",
                   help="also run the sweep through gloo (torch.distributed) and mpi (mpi4py), "
                        "each when installed")
    m.add_argument("--peer", action="append", metavar="LIB",
                   help="run the sweep through this peer too (gloo or mpi; repeatable)")
    m.add_argument("--time", type=float, default=BenchOptions.time, metavar="S",
                   help="seconds of timed calls per size and placement, split over --loops "
                        f"(default {BenchOptions.time:g}); more gives steadier figures")
    m.add_argument("--loops", type=int, default=BenchOptions.loops, metavar="K",
                   help="timed loops per size: the table's time is the mean over all of "
                        "them, JSON and CSV add the median and the fastest and slowest loop "
                        f"(default {BenchOptions.loops})")
    m.add_argument("--warmup-time", type=float, default=BenchOptions.warmup_time,
                   metavar="S", help="seconds of warm-up per size and placement, at least -w "
                   f"calls (default {BenchOptions.warmup_time:g}; ignored with -n)")
    m.add_argument("--json", metavar="FILE", help="write every result as JSON")
    m.add_argument("--csv", metavar="FILE", help="write every result as CSV")
    m.add_argument("--plot", metavar="FILE.png", help="plot busbw against size per library")
    m.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar on stderr (default: when stderr is a terminal)")
    m.add_argument("--no-ceilings", dest="ceilings", action="store_false",
                   help="skip the host memory and device copy ceilings")
    m.add_argument("--timeout", type=float, default=BenchOptions.timeout,
                   help="seconds any one collective may take (default 300)")


def parse_args(argv: list[str]) -> BenchOptions:
    """Parse a command line; bad values exit with argparse's usage message (status 2)."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        return _to_options(ns)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: error() exits


def _to_options(ns: argparse.Namespace) -> BenchOptions:
    for flag, value, low in (("-n/--iters", ns.iters, 1), ("-w/--warmup_iters", ns.warmup, 0),
                             ("-c/--check", ns.check, 0), ("-f/--stepfactor", ns.stepfactor, 1),
                             ("--loops", ns.loops, 1)):
        if value is not None and value < low:
            raise ValueError(f"{flag} {value}: must be at least {low}")
    for flag, value in (("--time", ns.time), ("--warmup-time", ns.warmup_time)):
        if not value >= 0 or (flag == "--time" and value == 0):
            raise ValueError(f"{flag} {value}: must be a positive number of seconds")
    if ns.minbytes > ns.maxbytes:
        raise ValueError(f"-b {ns.minbytes} is larger than -e {ns.maxbytes}")
    if ns.ranks is not None and ns.ranks < 1:
        raise ValueError(f"-g {ns.ranks}: at least one rank")
    if ns.nthreads != 1:
        raise ValueError(f"-t {ns.nthreads}: gpucoll runs one rank per process; use -g N")
    if ns.timeout <= 0:
        raise ValueError(f"--timeout {ns.timeout}: must be positive")
    if ns.stepbytes < 1 and ns.stepfactor == 1:
        raise ValueError("-i 0 without -f never advances; give -i >= 1 or -f >= 2")
    return BenchOptions(
        ops=_op_names(ns.ops), minbytes=ns.minbytes, maxbytes=ns.maxbytes,
        stepbytes=ns.stepbytes, stepfactor=ns.stepfactor, iters=ns.iters, warmup=ns.warmup,
        time=ns.time, loops=ns.loops, warmup_time=ns.warmup_time,
        check=ns.check, redops=_redops(ns.redop.lower()), dtypes=_dtypes(ns.datatype.lower()),
        roots=_roots(ns.root.lower()), average=ns.average, ranks=ns.ranks,
        backend=ns.backend, transport=ns.transport, memory=ns.memory,
        peers=_peers(ns.peers, ns.peer),
        json=ns.json, csv=ns.csv, plot=ns.plot, progress=ns.progress, ceilings=ns.ceilings,
        timeout=ns.timeout, library=ns.library, results=ns.results, gloo_init=ns.gloo_init)


def rank_argv(opts: BenchOptions) -> list[str]:
    """The flags that make ranks started by the driver run exactly this sweep."""
    roots = "all" if opts.roots is None else ",".join(map(str, opts.roots))
    argv = [*opts.ops, "-b", str(opts.minbytes), "-e", str(opts.maxbytes),
            "-i", str(opts.stepbytes), "-f", str(opts.stepfactor), "-w", str(opts.warmup),
            "--time", repr(opts.time), "--loops", str(opts.loops),
            "--warmup-time", repr(opts.warmup_time), "-c", str(opts.check),
            "-o", ",".join(opts.redops),
            "-d", ",".join(opts.dtypes), "-r", roots, "-a", str(opts.average),
            "--backend", opts.backend, "--transport", opts.transport, "--memory", opts.memory,
            "--timeout", str(opts.timeout)]
    if opts.iters is not None:
        argv += ["-n", str(opts.iters)]
    return argv


def check_outputs(opts: BenchOptions) -> None:
    """Fail before measuring anything when a result could not be written at the end."""
    import importlib.util
    import os

    for flag, path in (("--json", opts.json), ("--csv", opts.csv), ("--plot", opts.plot)):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise SystemExit(f"gpucoll bench: error: {flag} {path}: no such directory")
    if opts.plot and importlib.util.find_spec("matplotlib") is None:
        from gpucoll.errors import missing

        raise SystemExit(f"gpucoll bench: error: {missing('matplotlib', '--plot')}")
