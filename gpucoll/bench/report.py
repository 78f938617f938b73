"""Results as people and programs read them: nccl-tests' table, JSON, CSV and the plot.

The table keeps nccl-tests' layout exactly (column widths, out-of-place then in-place, ``#``
comment lines, the two-line footer), so tools that parse nccl-tests logs read it unchanged.
A placement a library does not offer prints ``N/A`` in its columns, never a stand-in number.

``--plot FILE.png`` draws busbw against size, one line per library, one panel per operation;
matplotlib is imported only then, with the Agg backend (no display needed). Ceilings that bound
busbw are drawn as dashed horizontal lines.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable
from typing import Any

from gpucoll.bench.engine import Measurement, Result
from gpucoll.bench.options import BenchOptions

SIZE_UNITS = ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"))


def float_str(value: float, width: int) -> str:
    """A number in ``width`` columns with as many decimals as fit (as nccl-tests prints)."""
    if value is None or math.isnan(value):
        return f"{'nan':>{width}}"
    power, bound = 0, 1
    while value >= bound:
        power += 1
        bound *= 10
    if power < width - 2:
        return f"{value:{width}.2f}"
    if power < width - 1:
        return f"{value:{width}.1f}"
    if power < width + 1:
        return f"{value:{width}.0f}"
    return f"{value:{width}.1e}"


def human_size(nbytes: int) -> str:
    for unit, name in SIZE_UNITS:
        if nbytes >= unit and nbytes % unit == 0:
            return f"{nbytes // unit} {name}"
    return f"{nbytes} B"


def config_line(opts: BenchOptions, nranks: int) -> str:
    step = (f"{opts.stepfactor}(factor)" if opts.stepfactor > 1 else f"{opts.stepbytes}(bytes)")
    return (f"# nThread 1 nGpus {nranks} minBytes {opts.minbytes} maxBytes {opts.maxbytes} "
            f"step: {step} warmup iters: {opts.warmup} iters: {opts.iters or 'auto'} "
            f"agg iters: 1 validation: {min(opts.check, 1)} graph: 0")


def timing_line(opts: BenchOptions) -> str:
    """How each cell's time was taken: how many loops, how long, and what the column means."""
    if opts.iters is None:
        per = (f"as many calls as fill {opts.time / opts.loops * 1e3:.0f} ms (pace from a "
               f"warm-up of {opts.warmup_time:g} s, at least {opts.warmup} calls)")
    else:
        per = f"{opts.iters} calls after {opts.warmup} warm-up calls"
    return (f"# Timing: {opts.loops} loops per cell of {per}; time = mean over all loops, "
            "median and spread over loops in --json/--csv")


def run_header(run: dict[str, Any]) -> list[str]:
    """The lines naming a library's run: backend, transport, versions and each rank."""
    vers = ", ".join(f"{k} {v}" for k, v in run.get("versions", {}).items() if v)
    lines = [f"# Library {run['library']}: backend {run.get('backend', '?')}, transport "
             f"{run.get('transport', '?')}, {run['ranks']} ranks, {run.get('memory', 'host')} "
             "memory", f"# Versions: {vers}", "#", "# Using devices"]
    for rank, info in enumerate(run.get("devices", [])):
        pid, _, rest = info.partition(" ")
        host, _, device = rest.partition(" ")
        lines.append(f"#  Rank {rank:2d} Group  0 Pid {pid:>6} on {host:>10} device {device}")
    return lines


def machine_lines(machine: dict[str, Any], ceilings: list[dict[str, Any]]) -> list[str]:
    gpus = ", ".join(machine.get("gpus") or []) or "none"
    lines = [f"# Machine: {machine.get('host', '?')}: {machine.get('cpu', '?')}, "
             f"{machine.get('cores', '?')} cores, {machine.get('memory_gib', '?')} GiB; "
             f"{machine.get('system', '')}; GPUs: {gpus}"]
    lines += [ceiling_line(c) for c in ceilings]
    return lines


def ceiling_line(c: dict[str, Any]) -> str:
    return (f"# Ceiling {c['name']:<22}: {c['GBps']:8.2f} GB/s  ({c['what']}, "
            f"{human_size(c['bytes'])})")


def table_head() -> list[str]:
    pad = f"# {'':>10}  {'':>12}  {'':>8}  {'':>6}  {'':>6}"
    cols = ("  {:>7}  {:>6}  {:>6}  {:>6}" * 2)
    return [
        f"{pad}           out-of-place                       in-place          ",
        f"# {'size':>10}  {'count':>12}  {'type':>8}  {'redop':>6}  {'root':>6}"
        + cols.format("time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong"),
        f"# {'(B)':>10}  {'(elements)':>12}  {'':>8}  {'':>6}  {'':>6}"
        + cols.format("(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", ""),
    ]


def _cells(m: Measurement | None) -> str:
    if m is None:
        return f"  {'N/A':>7}  {'N/A':>6}  {'N/A':>6}  {'N/A':>6}"
    wrong = "N/A" if m.wrong is None else f"{m.wrong:g}"
    return (f"  {float_str(m.time_us, 7)}  {float_str(m.algbw, 6)}  {float_str(m.busbw, 6)}"
            f"  {wrong:>6}")


def table_row(r: Result) -> str:
    return (f"{r.size:12d}  {r.count:12d}  {r.type:>8}  {r.redop:>6}  {r.root:6d}"
            + _cells(r.out_of_place) + _cells(r.in_place))


def summary(results: Iterable[Result]) -> dict[str, Any]:
    """nccl-tests' footer figures: lines with wrong values, and the mean busbw of all cells."""
    bad, bws = 0, []
    for r in results:
        for m in (r.out_of_place, r.in_place):
            if m is None:
                continue
            bws.append(m.busbw)
            bad += bool(m.wrong)
    avg = sum(bws) / len(bws) if bws else 0.0
    return {"out_of_bounds": {"count": bad, "okay": bad == 0},
            "average_bus_bandwidth": {"bandwidth": avg, "okay": "unchecked"}}


def table_footer(results: list[Result]) -> list[str]:
    s = summary(results)
    bad = s["out_of_bounds"]["count"]
    lines = [f"# {'Out of bounds values':<20} : {bad} {'FAILED' if bad else 'OK'}",
             f"# {'Avg bus bandwidth':<20} : {s['average_bus_bandwidth']['bandwidth']:g} "]
    spread = spread_line(results)
    return lines + ([spread] if spread else []) + ["#"]


def spread_line(results: list[Result]) -> str | None:
    """The widest loop-to-loop spread of a table, so an unsteady figure does not go unseen."""
    cells = [(m.spread, r.size) for r in results for m in (r.out_of_place, r.in_place)
             if m is not None and m.spread is not None]
    if not cells:
        return None
    spread, size = max(cells)
    return (f"# {'Widest loop spread':<20} : {100 * spread:.0f}% of the median "
            f"(at {human_size(size)}; (slowest - fastest loop) / median)")


def peak_line(results: list[Result], ceilings: list[dict[str, Any]],
              memory: str = "host") -> str | None:
    """The best busbw of a table beside the host copy ceiling. None without either, for a
    table on device memory (which the host copy does not bound), or when the best busbw is 0
    (one rank: nothing crosses a link)."""
    cells = [(m.busbw, r.size) for r in results for m in (r.out_of_place, r.in_place) if m]
    host = next((c["GBps"] for c in ceilings if c["name"] == "host memcpy"), None)
    if not cells or not host or memory == "device" or max(cells)[0] <= 0:
        return None
    busbw, size = max(cells)
    return (f"# Peak busbw: {busbw:.2f} GB/s at {human_size(size)}, {100 * busbw / host:.0f}% "
            f"of the host memcpy ceiling ({host:.2f} GB/s)")


def best_busbw(r: dict[str, Any]) -> float | None:
    """The in-place busbw where measured, else out-of-place (None when neither ran)."""
    for key in ("in_place", "out_of_place"):
        if r.get(key):
            return r[key]["bus_bw"]
    return None


def best_time(r: dict[str, Any]) -> float | None:
    for key in ("in_place", "out_of_place"):
        if r.get(key):
            return r[key]["time"]
    return None


def comparison(runs: list[dict[str, Any]], op: str) -> list[str]:
    """Libraries side by side per size: time (us) and busbw (GB/s), in place where offered."""
    libs = [run for run in runs if any(d["op"] == op for d in run["results"])]
    if len(libs) < 2:
        return []
    keyed = [{(d["size"], d["type"], d["redop"], d["root"]): d for d in run["results"]
              if d["op"] == op} for run in libs]
    head = f"# {'size':>10}" + "".join(f"  {run['library'][:10]:>10} {'':>7}" for run in libs)
    unit = f"# {'(B)':>10}" + "  {:>10} {:>7}".format("(us)", "(GB/s)") * len(libs)
    lines = [f"# Comparison: {op}, {libs[0]['ranks']} ranks (in place where offered)", head,
             unit]
    for key in keyed[0]:
        cells = []
        for table_ in keyed:
            d = table_.get(key)
            t, bw = (best_time(d), best_busbw(d)) if d else (None, None)
            cells.append(f"  {_opt(t, 10)} {_opt(bw, 7)}")
        lines.append(f"  {key[0]:>10}" + "".join(cells))
    return lines + ["#"]


def _opt(value: float | None, width: int) -> str:
    return f"{'N/A':>{width}}" if value is None else float_str(value, width)


def write_json(path: str, doc: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


CSV_FIELDS = ("library", "backend", "transport", "ranks", "memory", "op", "size", "count",
              "type", "redop", "root", "placement", "time_us", "algbw_GBps", "busbw_GBps",
              "wrong", "time_median_us", "time_min_us", "time_max_us", "iters", "loops")


def csv_rows(runs: list[dict[str, Any]]) -> Iterable[dict[str, Any]]:
    """One row per measured cell: (library, size, ...) x (out_of_place, in_place)."""
    for run in runs:
        for d in run["results"]:
            for placement in ("out_of_place", "in_place"):
                m = d.get(placement)
                if m is None:
                    continue
                yield {"library": run["library"], "backend": run.get("backend"),
                       "transport": run.get("transport"), "ranks": run["ranks"],
                       "memory": run.get("memory"), "op": d["op"], "size": d["size"],
                       "count": d["count"], "type": d["type"], "redop": d["redop"],
                       "root": d["root"], "placement": placement, "time_us": m["time"],
                       "algbw_GBps": m["alg_bw"], "busbw_GBps": m["bus_bw"],
                       "wrong": m["nwrong"], "time_median_us": m.get("time_median"),
                       "time_min_us": m.get("time_min"), "time_max_us": m.get("time_max"),
                       "iters": m.get("iters"), "loops": m.get("loops")}


def write_csv(path: str, runs: list[dict[str, Any]]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        w.writerows(csv_rows(runs))


# ---- the plot ------------------------------------------------------------------------------------

HOST_CEILING = "host memcpy"


def label(run: dict[str, Any]) -> str:
    if run["library"] == "gpucoll":
        return f"gpucoll ({run.get('backend')}/{run.get('transport')})"
    if run.get("backend") in (None, run["library"]):
        torch = run.get("versions", {}).get("torch")
        return f"{run['library']} (torch {torch})" if torch else run["library"]
    return f"{run['library']} ({run.get('backend')})"


def plot(path: str, runs: list[dict[str, Any]], ceilings: list[dict[str, Any]],
         title: str = "") -> None:
    """Write the figure to ``path``; one panel per (operation, rank count)."""
    fig = figure(runs, ceilings, title)
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)


def figure(runs: list[dict[str, Any]], ceilings: list[dict[str, Any]], title: str = "") -> Any:
    """The matplotlib figure ``plot`` writes (the caller closes it)."""
    from gpucoll.errors import require

    matplotlib = require("matplotlib", "--plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(d["op"], run["ranks"]) for run in runs for d in run["results"]})
    if not panels:
        raise RuntimeError("--plot: there are no results to draw")
    # constrained layout keeps room for the title above the first panel (tight_layout does not
    # count a suptitle, which then overlaps the first panel's title)
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 4.2 * len(panels)), squeeze=False,
                             layout="constrained")
    for ax, (op, ranks) in zip(axes[:, 0], panels, strict=True):
        _panel(ax, op, ranks, runs, ceilings)
    if title:
        fig.suptitle(title, fontsize=10)
        fig.get_layout_engine().set(h_pad=0.1)  # inches: air between title and first panel
    return fig


def _panel(ax: Any, op: str, ranks: int, runs: list[dict[str, Any]],
           ceilings: list[dict[str, Any]]) -> None:
    sizes: set[int] = set()
    for run in runs:
        if run["ranks"] != ranks:
            continue
        points = [(d["size"], best_busbw(d)) for d in run["results"] if d["op"] == op]
        points = [(s, bw) for s, bw in points if bw and s > 0]  # log axes: no zeros
        if points:
            xs, ys = zip(*points, strict=True)
            sizes.update(xs)
            ax.plot(xs, ys, marker="o", markersize=3, label=label(run))
    for c in ceilings:
        if c["name"] == HOST_CEILING or c["name"].startswith(("D2H", "H2D")):
            ax.axhline(c["GBps"], linestyle="--", linewidth=0.8, color="grey")
            ax.annotate(f"{c['name']} {c['GBps']:.1f} GB/s", (0.01, c["GBps"]),
                        xycoords=("axes fraction", "data"), fontsize=7, color="grey",
                        va="bottom")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    if sizes:
        ticks = sorted(sizes)[:: max(1, len(sizes) // 8)]
        ax.set_xticks(ticks, [human_size(t) for t in ticks], fontsize=7)
    ax.set_xlabel("size (bytes; nccl-tests' size column)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(f"{op}, {ranks} ranks", fontsize=9)
    ax.grid(True, which="both", linewidth=0.3)
    ax.legend(fontsize=8)
