#!/usr/bin/env python3
"""The host ring beside gloo and Open MPI, nccl-tests style, on 2 and 4 ranks of this machine.

A thin sweep over ``gpucoll bench`` (the package's one benchmark engine): for each rank count it
runs float32 all_reduce (and any other ops asked for) from 8 B to 128 MiB with ``--peers``,
``--rounds`` times (fresh processes each round; a shared machine is noisy), prints nccl-tests'
tables, then the median over rounds of each cell side by side, writes
``OUT/collectives-<N>ranks.{json,csv,png}`` (medians; each round's JSON beside them), and
checks the host ring's targets (``TARGETS``) against those medians (and says in how many of the
rounds each was met on its own: a target near its line flips between rounds):

  2 ranks, all_reduce: 8 B in <= 8x Open MPI's time and <= 0.03x gloo's; 64 KiB-4 MiB in
           <= 1.3x Open MPI's time; from 16 MiB >= 1.3x Open MPI's busbw and >= 5x gloo's
  4 ranks, all_reduce: up to 1 MiB in <= 3x Open MPI's time; from 4 MiB >= its busbw; never
           slower than gloo. all_gather, broadcast, reduce_scatter, all_to_all at 1 MiB in
           <= 1.5x Open MPI's time (run with --ops to measure them)

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

KiB, MiB = 1 << 10, 1 << 20

# (ranks, op, sizes, metric, peer, factor): "time" targets hold when ours <= factor x the
# peer's time; "busbw" targets when ours >= factor x the peer's busbw. Sizes are a (low, high)
# range in bytes, both ends included.
TARGETS = [
    (2, "all_reduce", (8, 8), "time", "mpi", 8.0),
    (2, "all_reduce", (8, 8), "time", "gloo", 0.03),
    (2, "all_reduce", (64 * KiB, 4 * MiB), "time", "mpi", 1.3),
    (2, "all_reduce", (16 * MiB, 1 << 40), "busbw", "mpi", 1.3),
    (2, "all_reduce", (16 * MiB, 1 << 40), "busbw", "gloo", 5.0),
    (4, "all_reduce", (0, 1 * MiB), "time", "mpi", 3.0),
    (4, "all_reduce", (4 * MiB, 1 << 40), "busbw", "mpi", 1.0),
    (4, "all_reduce", (0, 1 << 40), "time", "gloo", 1.0),
    *[(4, op, (1 * MiB, 1 * MiB), "time", "mpi", 1.5)
      for op in ("all_gather", "broadcast", "reduce_scatter", "all_to_all")],
]
NAMES = {"mpi": "Open MPI", "gloo": "gloo"}


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


def float_sum_by_size(doc: dict[str, Any], library: str, op: str) -> dict[int, dict[str, Any]]:
    """The library's float (sum where reducing) results of ``op`` keyed by size."""
    for run in doc["runs"]:
        if run["library"] == library:
            return {d["size"]: d for d in run["results"] if d["op"] == op
                    and d["type"] == "float" and d["redop"] in ("sum", "none", None)}
    return {}


def check_targets(doc: dict[str, Any], ranks: int,
                  rounds: list[dict[str, Any]] | None = None) -> list[str]:
    """One line per target of this rank count: the sizes it covers, the worst ratio, met or not
    (on ``doc``, the medians), and in how many of ``rounds`` (each round's own document) it was
    met: a target near its line is met in some rounds and not in others."""
    lines = []
    for target in TARGETS:
        n, op, (low, high), metric, peer, factor = target
        if n != ranks:
            continue
        want = f"{op} {_span(low, high)}: {metric} {'<=' if metric == 'time' else '>='} " \
               f"{factor:g}x {NAMES[peer]}'s"
        judged = _judge(doc, target)
        if judged is None:
            lines.append(f"{want}: not measured")
            continue
        ratios, worst, missed = judged
        where = f" (missed at {', '.join(_size(s) for s in missed)})" if missed else ""
        line = f"{want}: worst {ratios[worst]:.2f}x at {_size(worst)}, " \
               f"{len(ratios) - len(missed)}/{len(ratios)} sizes{where}: {verdict(not missed)}"
        per_round = [_judge(d, target) for d in rounds or []]
        if len(per_round) > 1 and None not in per_round:
            met = sum(not r[2] for r in per_round)
            line += f" (met in {met} of {len(per_round)} rounds)"
        lines.append(line)
    return lines


def _judge(doc: dict[str, Any], target: tuple) -> tuple[dict[int, float], int, list[int]] | None:
    """A target on one document: our ratio to the peer at each size it covers, the worst size,
    and the sizes that miss it; None where nothing was measured."""
    _, op, (low, high), metric, peer, factor = target
    ours, theirs = float_sum_by_size(doc, "gpucoll", op), float_sum_by_size(doc, peer, op)
    pick = best_time if metric == "time" else best_busbw
    ratios = {s: pick(ours[s]) / pick(theirs[s]) for s in sorted(set(ours) & set(theirs))
              if low <= s <= high and pick(ours[s]) and pick(theirs[s])}
    if not ratios:
        return None
    worst = max(ratios, key=ratios.get) if metric == "time" else min(ratios, key=ratios.get)
    missed = [s for s, r in ratios.items() if (r > factor if metric == "time" else r < factor)]
    return ratios, worst, missed


def _size(b: int) -> str:
    for unit, scale in (("MiB", MiB), ("KiB", KiB)):
        if b >= scale and b % scale == 0:
            return f"{b // scale} {unit}"
    return f"{b} B"


def _span(low: int, high: int) -> str:
    if low == high:
        return f"at {_size(low)}"
    if low == 0 and high >= 1 << 40:
        return "at every size"
    return f"from {_size(low)}" if high >= 1 << 40 else (
        f"up to {_size(high)}" if low == 0 else f"{_size(low)}-{_size(high)}")


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


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
        targets += [f"{ranks} ranks: {line}" for line in check_targets(doc, ranks, docs)]
    print("#\n# Targets (float32, SUM, in place where offered; medians of the rounds above)")
    for line in targets:
        print(f"#   {line}")
    return status


if __name__ == "__main__":
    sys.exit(main())
