#!/usr/bin/env python3
"""The host ring beside gloo and Open MPI, nccl-tests style, on 2 and 4 ranks of this machine.

A thin sweep over ``gpucoll bench`` (the package's one benchmark engine): for each rank count it
runs float32 all_reduce (and any other ops asked for) from 8 B to 128 MiB with ``--peers``,
prints nccl-tests' tables, writes ``OUT/collectives-<N>ranks.{json,csv,png}``, then checks the
host ring's targets against the numbers just measured:

  2 ranks, all_reduce float32: busbw at 32 MiB >= 5x gloo's and >= Open MPI's;
                               time at 8 B <= a tenth of gloo's
  4 ranks, all_reduce float32: faster than gloo at every size

  python benchmarks/collectives.py                       # 2 and 4 ranks, results/
  python benchmarks/collectives.py --ranks 2 --out /tmp/r -- -n 50 -w 10
Everything after ``--`` goes to ``gpucoll bench`` unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from gpucoll.bench import cli
from gpucoll.bench.report import best_busbw, best_time

TARGET_SIZE = 32 << 20
LATENCY_SIZE = 8


def bench_argv(ops: list[str], ranks: int, out: str, extra: list[str]) -> list[str]:
    stem = os.path.join(out, f"collectives-{ranks}ranks")
    return [*ops, "-b", "8", "-e", "128M", "-f", "2", "-d", "float", "-g", str(ranks),
            "--peers", "--json", f"{stem}.json", "--csv", f"{stem}.csv", "--plot",
            f"{stem}.png", *extra]


def all_reduce_by_size(doc: dict[str, Any], library: str) -> dict[int, dict[str, Any]]:
    """The library's float sum all_reduce results keyed by size (empty when it did not run)."""
    for run in doc["runs"]:
        if run["library"] == library:
            return {d["size"]: d for d in run["results"]
                    if d["op"] == "all_reduce" and d["type"] == "float" and d["redop"] == "sum"}
    return {}


def verdict(ok: bool | None) -> str:
    return "not measured" if ok is None else ("met" if ok else "NOT met")


def two_rank_targets(doc: dict[str, Any]) -> list[str]:
    ours, gloo, mpi = (all_reduce_by_size(doc, lib) for lib in ("gpucoll", "gloo", "mpi"))
    lines = []
    bw = {name: best_busbw(t[TARGET_SIZE]) if TARGET_SIZE in t else None
          for name, t in (("gpucoll", ours), ("gloo", gloo), ("mpi", mpi))}
    if bw["gpucoll"] is not None and bw["gloo"]:
        ratio = bw["gpucoll"] / bw["gloo"]
        lines.append(f"32 MiB busbw vs gloo: {bw['gpucoll']:.2f} vs {bw['gloo']:.2f} GB/s = "
                     f"{ratio:.1f}x (target >= 5x): {verdict(ratio >= 5)}")
    if bw["gpucoll"] is not None and bw["mpi"]:
        lines.append(f"32 MiB busbw vs Open MPI: {bw['gpucoll']:.2f} vs {bw['mpi']:.2f} GB/s "
                     f"(target >=): {verdict(bw['gpucoll'] >= bw['mpi'])}")
    t = {name: best_time(tab[LATENCY_SIZE]) if LATENCY_SIZE in tab else None
         for name, tab in (("gpucoll", ours), ("gloo", gloo), ("mpi", mpi))}
    if t["gpucoll"] is not None and t["gloo"]:
        lines.append(f"8 B time vs gloo: {t['gpucoll']:.1f} vs {t['gloo']:.1f} us = "
                     f"{t['gpucoll'] / t['gloo']:.3f} (target <= 0.1): "
                     f"{verdict(t['gpucoll'] <= t['gloo'] / 10)}")
    if t["gpucoll"] is not None and t["mpi"]:
        lines.append(f"8 B time vs Open MPI (for reference): {t['gpucoll']:.1f} vs "
                     f"{t['mpi']:.1f} us")
    return lines


def four_rank_targets(doc: dict[str, Any]) -> list[str]:
    ours, gloo = all_reduce_by_size(doc, "gpucoll"), all_reduce_by_size(doc, "gloo")
    sizes = sorted(set(ours) & set(gloo))
    if not sizes:
        return ["ahead of gloo at every size: not measured"]
    behind = [s for s in sizes if best_time(ours[s]) >= best_time(gloo[s])]
    where = "" if not behind else f" (behind at {', '.join(map(str, behind))} B)"
    return [f"ahead of gloo at every size: {len(sizes) - len(behind)}/{len(sizes)} sizes"
            f"{where}: {verdict(not behind)}"]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        extra = argv[argv.index("--") + 1:]
        argv = argv[:argv.index("--")]
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="2,4", help="rank counts to sweep (default 2,4)")
    p.add_argument("--ops", default="all_reduce", help="operations (default all_reduce)")
    p.add_argument("--out", default="results", help="folder for JSON, CSV and plots")
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    status, targets = 0, []
    for ranks in (int(r) for r in a.ranks.split(",")):
        args = bench_argv(a.ops.split(","), ranks, a.out, extra)
        print(f"# gpucoll bench {' '.join(args)}", flush=True)
        status |= cli.main(args)
        with open(os.path.join(a.out, f"collectives-{ranks}ranks.json")) as f:
            doc = json.load(f)
        found = two_rank_targets(doc) if ranks == 2 else four_rank_targets(doc)
        targets += [f"{ranks} ranks: {line}" for line in found]
    print("#\n# Targets (float32 all_reduce SUM, in place; numbers from the runs above)")
    for line in targets:
        print(f"#   {line}")
    return status


if __name__ == "__main__":
    sys.exit(main())
