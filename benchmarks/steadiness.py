#!/usr/bin/env python3
"""Does ``gpucoll bench`` give the same answer twice? Runs in a row, compared size by size.

Each round runs the same ``gpucoll bench`` sweep twice back to back (fresh processes each time)
and, with ``--harness PATH``, an independent harness once (``collbench.py --impl gpucoll``: its
own time-boxed loop around ``gpucoll.init()`` and ``comm.all_reduce``, the median of its
per-call times). Rounds interleave the runs, so a machine growing busier affects them alike.
Printed per size: the figure of each run (the table's mean time, and the median over loops),
the largest difference between the two runs of a round, and our median against the
harness's. ``--fixed`` measures nccl-tests' fixed counts instead (``-n 20 -w 5``), for a
before/after comparison.

  python benchmarks/steadiness.py                                  # 2 ranks, 64 KiB..16 MiB
  python benchmarks/steadiness.py --rounds 3 --harness ../collbench.py --out results/steady.json
  python benchmarks/steadiness.py --fixed                          # the fixed counts
Everything after ``--`` goes to ``gpucoll bench`` unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

FIXED = ["-n", "20", "-w", "5"]  # nccl-tests' defaults: what gpucoll bench timed before


def bench(ranks: int, low: str, high: str, extra: list[str]) -> dict[int, tuple[float, float]]:
    """One ``gpucoll bench`` all_reduce sweep: size -> (mean us, median us), in place."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "r.json")
        argv = [sys.executable, "-m", "gpucoll", "bench", "all_reduce", "-b", low, "-e", high,
                "-f", "4", "-g", str(ranks), "--no-ceilings", "--no-progress", "--json", path,
                *extra]
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, timeout=1800)
        with open(path) as f:
            doc = json.load(f)
    cells = {}
    for row in doc["runs"][0]["results"]:
        m = row["in_place"]
        cells[row["size"]] = (m["time"], m.get("time_median") or m["time"])
    return cells


def harness(path: str, ranks: int, low: str, high: str) -> dict[int, tuple[float, float]]:
    """The harness's figures for the same sizes: size -> (mean us, median us)."""
    proc = subprocess.run([sys.executable, path, "--impl", "gpucoll", "--world", str(ranks),
                           "--runs", "1", "--plan", f"all_reduce={low}:{high}:x4"],
                          check=True, capture_output=True, text=True, timeout=1800)
    cells = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            if rec.get("kind") == "run":
                cells[rec["bytes"]] = (rec["time_us_mean"], rec["time_us"])
    return cells


def differ(a: float, b: float) -> float:
    """|a - b| relative to their mean."""
    return abs(a - b) / ((a + b) / 2)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--low", default="64K")
    p.add_argument("--high", default="16M")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--harness", metavar="PATH", help="collbench.py, to compare with")
    p.add_argument("--fixed", action="store_true", help="nccl-tests' -n 20 -w 5 instead")
    p.add_argument("--out", metavar="FILE", help="write every figure as JSON")
    a = p.parse_args(argv)
    extra = (FIXED if a.fixed else []) + extra
    rounds: list[dict[str, Any]] = []
    for r in range(a.rounds):
        first, second = (bench(a.ranks, a.low, a.high, extra) for _ in range(2))
        ref = harness(a.harness, a.ranks, a.low, a.high) if a.harness else {}
        rounds.append({"first": first, "second": second, "harness": ref})
        print(f"# round {r + 1} of {a.rounds} done", file=sys.stderr)
    print(f"# gpucoll bench all_reduce -b {a.low} -e {a.high} -f 4 -g {a.ranks} "
          f"{' '.join(extra)}: {a.rounds} round(s) of two runs in a row"
          + (" and the harness" if a.harness else ""))
    print(f"# {'size':>10}  {'mean us (run 1 / run 2 per round)':<40} {'worst':>6}  "
          f"{'median us':<30} {'worst':>6}" + ("  median/harness" if a.harness else ""))
    worst_mean = worst_median = 0.0
    for size in sorted(rounds[0]["first"]):
        means = [(rd["first"][size][0], rd["second"][size][0]) for rd in rounds]
        meds = [(rd["first"][size][1], rd["second"][size][1]) for rd in rounds]
        dm = max(differ(x, y) for x, y in means)
        dd = max(differ(x, y) for x, y in meds)
        worst_mean, worst_median = max(worst_mean, dm), max(worst_median, dd)
        line = (f"  {size:>10}  {' '.join(f'{x:.0f}/{y:.0f}' for x, y in means):<40} "
                f"{100 * dm:5.1f}%  {' '.join(f'{x:.0f}/{y:.0f}' for x, y in meds):<30} "
                f"{100 * dd:5.1f}%")
        if a.harness:
            ratios = [statistics.median([rd["first"][size][1], rd["second"][size][1]])
                      / rd["harness"][size][1] for rd in rounds if size in rd["harness"]]
            line += "  " + " ".join(f"{x:.2f}" for x in ratios)
        print(line)
    print(f"# worst difference between two runs in a row: mean {100 * worst_mean:.1f}%, "
          f"median {100 * worst_median:.1f}%")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"argv": sys.argv, "extra": extra, "rounds": [
                {k: {str(s): v for s, v in d.items()} for k, d in rd.items()} for rd in rounds]},
                f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
