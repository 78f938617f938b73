"""``--plot FILE.png``: busbw against size, one line per library, one panel per operation.

matplotlib is imported only here, only when a plot is asked for, with the Agg backend (no
display needed). Ceilings that bound busbw are drawn as dashed horizontal lines.
"""

from __future__ import annotations

from typing import Any

from gpucoll.bench.report import best_busbw, human_size

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
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib (pip install matplotlib)") from exc
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
