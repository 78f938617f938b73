#!/usr/bin/env python3
"""The host ring beside gloo and Open MPI, nccl-tests style, on 2 and 4 ranks of this machine.

A thin sweep over ``gpucoll bench`` (the package's one benchmark engine): for each rank count it
runs float32 all_reduce (and any other ops asked for) from 8 B to 128 MiB with ``--peers``,
``--rounds`` times (fresh processes each round; a shared machine is noisy), prints nccl-tests'
tables, then the median over rounds of each cell side by side, writes
``OUT/collectives-<N>ranks.{json,csv,png}`` (medians; each round's JSON beside them), and
checks the host ring's targets against those medians:

  2 ranks, all_reduce float32: busbw at 32 MiB >= 5x gloo's and >= Open MPI's;
                               time at 8 B <= a tenth of gloo's
  4 ranks, all_reduce float32: faster than gloo at every size

  python benchmarks/collectives.py                       # 2 and 4 ranks, 3 rounds, results/
  python benchmarks/collectives.py --ranks 2 --rounds 1 --out /tmp/r -- -n 50 -w 10
Everything after ``--`` goes to ``gpucoll bench`` unchanged.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
from typing import Any

from gpucoll.bench import cli, report
from gpucoll.bench.options import bandwidths
from gpucoll.bench.report import best_busbw, best_time, plot

TARGET_SIZE = 32 << 20
LATENCY_SIZE = 8


def bench_argv(ops: list[str], ranks: int, json_path: str, extra: list[str]) -> list[str]:
    return [*ops, "-b", "8", "-e", "128M", "-f", "2", "-d", "float", "-g", str(ranks),
            "--peers", "--json", json_path, *extra]


def median_doc(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The first round's document with each measured time replaced by its median over the
    rounds (bandwidths recomputed from it with nccl-tests' formulas; wrong counts summed)."""
    merged = copy.deepcopy(docs[0])
    for run in merged["runs"]:
        for row in run["results"]:
            for placement in ("out_of_place", "in_place"):
                cells = _same_cells(docs, run["library"], row, placement)
                if row.get(placement) is None or not cells:
                    continue
                t = statistics.median(c["time"] for c in cells)
                algbw, busbw = bandwidths(row["op"], row["size"], t / 1e6, run["ranks"])
                wrong = sum(c["nwrong"] or 0 for c in cells)
                row[placement].update(time=t, alg_bw=algbw, bus_bw=busbw, nwrong=wrong)
    merged["rounds"] = len(docs)
    return merged


def _same_cells(docs: list[dict[str, Any]], library: str, row: dict[str, Any],
                placement: str) -> list[dict[str, Any]]:
    """The cell of ``row`` measured for ``library`` in every round that has it."""
    key = ("op", "size", "type", "redop", "root")
    cells = []
    for doc in docs:
        for run in doc["runs"]:
            if run["library"] != library:
                continue
            for other in run["results"]:
                if all(other[k] == row[k] for k in key) and other.get(placement):
                    cells.append(other[placement])
    return cells


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


def write_medians(doc: dict[str, Any], stem: str, ops: list[str]) -> None:
    """Print the medians side by side; write them as JSON, CSV and a plot."""
    print(f"#\n# Median over {doc['rounds']} rounds")
    for op in ops:
        for line in report.comparison(doc["runs"], op):
            print(line)
    report.write_json(f"{stem}.json", doc)
    report.write_csv(f"{stem}.csv", doc["runs"])
    plot(f"{stem}.png", doc["runs"], doc["ceilings"],
         title=f"gpucoll bench, median of {doc['rounds']} rounds")
    print(f"# Wrote {stem}.json, {stem}.csv, {stem}.png", flush=True)


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
    p.add_argument("--rounds", type=int, default=3, help="runs per rank count (default 3)")
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    status, targets = 0, []
    for ranks in (int(r) for r in a.ranks.split(",")):
        stem = os.path.join(a.out, f"collectives-{ranks}ranks")
        docs = []
        for r in range(1, a.rounds + 1):
            args = bench_argv(a.ops.split(","), ranks, f"{stem}.round{r}.json", extra)
            print(f"# round {r}/{a.rounds}: gpucoll bench {' '.join(args)}", flush=True)
            status |= cli.main(args)
            with open(f"{stem}.round{r}.json") as f:
                docs.append(json.load(f))
        doc = median_doc(docs)
        write_medians(doc, stem, a.ops.split(","))
        found = two_rank_targets(doc) if ranks == 2 else four_rank_targets(doc)
        targets += [f"{ranks} ranks: {line}" for line in found]
    print("#\n# Targets (float32 all_reduce SUM, in place; medians of the rounds above)")
    for line in targets:
        print(f"#   {line}")
    return status


if __name__ == "__main__":
    sys.exit(main())
