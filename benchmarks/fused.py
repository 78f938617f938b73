"""Fused all_reduce of many small arrays against one all_reduce of the same bytes.

The target: 1000 float32 arrays of 100 elements reduced at 2 ranks in at most 2x the time of
one 100,000-element all_reduce. Forms timed, host ring, NumPy arrays:

  one all_reduce        one array of arrays x elements (the reference)
  bucket                all_reduce_many of a gpucoll.Bucket of the arrays: one all_reduce of
                        its flat buffer, no copies
  list, 1-D             all_reduce_many of separate arrays of shape (elements,): packed with
                        one concatenate, reduced, copied back
  list, 2-D             the same with arrays of shape (10, elements / 10)
  one call per array    all_reduce of each array in turn (what fusion saves)

Every rank times every form in each round, the forms interleaved so that a slow spell of the
machine falls on all of them; a form's time in a round is the slowest rank's mean per call; the
table shows the median over rounds, the ratio to the reference, and the median CPU time per
call of the busiest rank's process (what the form costs the rank itself, load aside).

    python benchmarks/fused.py [--ranks 2] [--arrays 1000] [--elements 100] [--rounds 7]
                               [--transport shm] [--json results/fused.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import signal
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import gpucoll
from gpucoll.store import TCPStore

DEFAULT_JSON = Path(__file__).resolve().parent.parent / "results" / "fused.json"
TARGET = 2.0
BUDGET_S = 0.15  # seconds of calls per form and round


def _forms(comm, arrays: int, elements: int) -> dict:
    rank = comm.rank
    big = np.full(arrays * elements, rank, np.float32)
    bucket = gpucoll.Bucket([(elements,)] * arrays, np.float32)
    for a in bucket:
        a[...] = rank
    flat = [np.full(elements, rank, np.float32) for _ in range(arrays)]
    square = [np.full((10, elements // 10), rank, np.float32) for _ in range(arrays)]
    return {
        "one all_reduce": lambda: comm.all_reduce(big),
        "bucket": lambda: comm.all_reduce_many(bucket),
        "list, 1-D": lambda: comm.all_reduce_many(flat),
        "list, 2-D": lambda: comm.all_reduce_many(square),
        "one call per array": lambda: [comm.all_reduce(a) for a in flat],
    }


def _time(comm, fn, calls: int) -> tuple[float, float]:
    """The slowest rank's mean seconds per call over ``calls`` calls: wall-clock time, and the
    CPU time of the rank's process (which other jobs on the machine disturb far less)."""
    comm.barrier()
    start, start_cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        fn()
    mine = np.array([time.perf_counter() - start, time.process_time() - start_cpu]) / calls
    wall, cpu = comm.all_reduce(mine, "max")
    return float(wall), float(cpu)


def _rank(rank: int, size: int, port: int, transport: str, args: dict, results) -> None:
    os.environ["GPUCOLL_TRANSPORT"] = transport
    with gpucoll.init("ring", rank=rank, world_size=size, store=f"tcp://127.0.0.1:{port}",
                      timeout=120) as comm:
        forms = _forms(comm, args["arrays"], args["elements"])
        calls = {}
        for name, fn in forms.items():  # warm up, and size each form's loop to the budget
            for _ in range(3):
                fn()
            once, _ = _time(comm, fn, 3)
            calls[name] = max(1, min(2000, int(BUDGET_S / max(once, 1e-7))))
        times: dict[str, list[float]] = {name: [] for name in forms}
        cpu: dict[str, list[float]] = {name: [] for name in forms}
        for _ in range(args["rounds"]):
            for name, fn in forms.items():
                wall, used = _time(comm, fn, calls[name])
                times[name].append(wall)
                cpu[name].append(used)
        if rank == 0:
            results.put({"times": times, "cpu": cpu, "calls": calls,
                         "links": sorted(set(comm._backend.links.values()))})


def measure(size: int, transport: str, args: dict) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with TCPStore("127.0.0.1", 0, is_server=True, timeout=60) as server:
        procs = [ctx.Process(target=_rank, args=(r, size, server.port, transport, args,
                                                 results)) for r in range(size)]
        for p in procs:
            p.start()
        try:
            return results.get(timeout=900)
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    os.kill(p.pid, signal.SIGKILL)
                    p.join()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--arrays", type=int, default=1000)
    parser.add_argument("--elements", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--transport", choices=("shm", "tcp"), default="shm")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args(argv)
    if args.elements % 10:
        parser.error("--elements must be a multiple of 10 (the 2-D form is 10 rows)")
    got = measure(args.ranks, args.transport, vars(args) | {"json": None})
    times = got["times"]
    reference = statistics.median(times["one all_reduce"])
    print(f"# all_reduce of {args.arrays} float32 arrays of {args.elements} elements, "
          f"{args.ranks} ranks, host ring over {'+'.join(got['links'])}; medians of "
          f"{args.rounds} interleaved rounds, slowest rank")
    print(f"# machine: {platform.node()}, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f}; python {platform.python_version()}, numpy "
          f"{np.__version__}")
    print(f"# {'form':<20}{'time (us)':>12}{'range (us)':>18}{'x reference':>13}"
          f"{'cpu (us)':>10}")
    rows = []
    for name, samples in times.items():
        med = statistics.median(samples)
        row = {"form": name, "median_us": round(med * 1e6, 1),
               "min_us": round(min(samples) * 1e6, 1), "max_us": round(max(samples) * 1e6, 1),
               "ratio": round(med / reference, 2),
               "cpu_us": round(statistics.median(got["cpu"][name]) * 1e6, 1),
               "calls_per_round": got["calls"][name]}
        rows.append(row)
        span = f"{row['min_us']:.0f}-{row['max_us']:.0f}"
        print(f"  {name:<20}{row['median_us']:>12.1f}{span:>18}{row['ratio']:>13.2f}"
              f"{row['cpu_us']:>10.1f}")
    bucket = next(r for r in rows if r["form"] == "bucket")["ratio"]
    listed = next(r for r in rows if r["form"] == "list, 1-D")["ratio"]
    print(f"# target (at most {TARGET:g}x): bucket {bucket:.2f}x "
          f"{'met' if bucket <= TARGET else 'missed'}; separate arrays {listed:.2f}x "
          f"{'met' if listed <= TARGET else 'missed'}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"rows": rows, "argv": sys.argv[1:] if argv is None else argv,
                                     "ranks": args.ranks, "links": got["links"]}, indent=1))
    print(f"# wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
