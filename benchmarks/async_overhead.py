"""What ``async_op=True`` costs a small all_reduce and broadcast on the host ring, against the
same call made synchronously.

Forms timed, float32 NumPy arrays of each size, in place:

  sync                  comm.all_reduce(x)
  async, wait           comm.all_reduce(x, async_op=True).wait(): one call issued and waited for
  async x8, wait        eight calls issued, then each waited for in turn (gradient hooks'
                        pattern: buckets reduced while the backward pass goes on, waited for
                        before the step)
  broadcast sync        comm.broadcast(x, root=0)
  broadcast async, wait comm.broadcast(x, root=0, async_op=True).wait()

Each round times every form at every size, interleaved, so a busy spell of the machine falls on
all of them alike; a form's time in a round is the slowest rank's mean per call; the table shows
the median over rounds and the ratio of each async form to its synchronous call.

    gpucoll run -n 2 benchmarks/async_overhead.py [--rounds 15] [--calls 400]
                                                  [--json results/async_overhead.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import gpucoll

DEFAULT_JSON = Path(__file__).resolve().parent.parent / "results" / "async_overhead.json"
SIZES = (8, 2048, 65536)  # bytes
TARGET = 2.0  # an async call (issue and wait) at most this many synchronous ones


def _forms(comm, x: np.ndarray) -> dict:
    def many() -> None:
        for w in [comm.all_reduce(x, async_op=True) for _ in range(8)]:
            w.wait()

    return {
        "sync": (1, lambda: comm.all_reduce(x)),
        "async, wait": (1, lambda: comm.all_reduce(x, async_op=True).wait()),
        "async x8, wait": (8, many),
        "broadcast sync": (1, lambda: comm.broadcast(x, root=0)),
        "broadcast async, wait": (1, lambda: comm.broadcast(x, root=0, async_op=True).wait()),
    }


def _per_call(comm, fn, calls: int, batch: int) -> float:
    """The slowest rank's mean seconds per call over ``calls`` calls (in batches)."""
    comm.barrier()
    start = time.perf_counter()
    for _ in range(calls // batch):
        fn()
    took = np.array([(time.perf_counter() - start) / calls])
    return float(comm.all_reduce(took, op="max")[0])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=400, help="calls per form, size and round")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    a = p.parse_args(argv)
    comm = gpucoll.init("ring", timeout=120)
    arrays = {n: np.ones(max(1, n // 4), np.float32) for n in SIZES}
    forms = {n: _forms(comm, x) for n, x in arrays.items()}
    times: dict = {n: {f: [] for f in forms[n]} for n in SIZES}
    for n in SIZES:  # warm up: the worker thread, the first calls' paths
        for batch, fn in forms[n].values():
            _per_call(comm, fn, 8 * batch, batch)
    for _ in range(a.rounds):
        for n in SIZES:
            for form, (batch, fn) in forms[n].items():
                times[n][form].append(_per_call(comm, fn, a.calls, batch))
    if comm.rank == 0:
        _report(comm.size, a, times, comm.backend_reason)
    comm.close()
    return 0


def _baseline(form: str) -> str:
    """The synchronous form an async one is compared with."""
    return "broadcast sync" if form.startswith("broadcast") else "sync"


def _report(size: int, a: argparse.Namespace, times: dict, reason: str) -> None:
    rows = []
    print(f"# all_reduce, float32, in place, {size} ranks on the host ring; median over "
          f"{a.rounds} rounds of {a.calls} calls (slowest rank's mean per call)")
    print(f"# {'bytes':>7}  {'form':<22} {'us/call':>8}  {'x sync':>6}")
    for n in SIZES:
        for form, got in times[n].items():
            sync = statistics.median(times[n][_baseline(form)])
            med = statistics.median(got)
            rows.append({"bytes": n, "form": form, "us": med * 1e6, "ratio": med / sync,
                         "rounds_us": [t * 1e6 for t in got]})
            print(f"  {n:>7}  {form:<22} {med * 1e6:8.1f}  {med / sync:6.2f}")
    worst = max(r["ratio"] for r in rows if r["form"].endswith("async, wait"))
    print(f"# async issue+wait at most {worst:.2f}x a synchronous call (target {TARGET:g}x)")
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps({
        "command": f"gpucoll run -n {size} benchmarks/async_overhead.py --rounds {a.rounds} "
                   f"--calls {a.calls}",
        "ranks": size, "backend": reason, "host": platform.node(),
        "python": platform.python_version(), "target": TARGET, "rows": rows}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
