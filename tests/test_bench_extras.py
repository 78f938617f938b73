"""The pieces around the table: progress bar, ceilings, plot."""

from __future__ import annotations

import io

import pytest

from gpucoll.bench import ceilings
from gpucoll.bench.plot import plot
from gpucoll.bench.progress import Progress


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_stays_silent_when_stderr_is_not_a_terminal():
    stream = io.StringIO()
    bar = Progress(3, None, stream)
    bar.step("all_reduce 8 B")
    bar.close()
    assert stream.getvalue() == ""


def test_progress_draws_on_a_terminal_and_when_forced():
    for stream, flag in ((Tty(), None), (io.StringIO(), True)):
        bar = Progress(4, flag, stream)
        bar.step("all_reduce 8 B")
        assert "[#######.....................] 1/4 all_reduce 8 B" in stream.getvalue()


def test_progress_can_be_turned_off_on_a_terminal():
    stream = Tty()
    Progress(4, False, stream).step("x")
    assert stream.getvalue() == ""


def test_host_ceilings_name_what_they_count():
    found = ceilings.host_ceilings(1 << 20)
    assert [c["name"] for c in found] == ["host memcpy", "host add (reduce step)"]
    assert all(c["GBps"] > 0 and c["bytes"] == 1 << 20 for c in found)


@pytest.mark.gpu
def test_device_ceilings_cover_both_directions_pinned_and_pageable():
    names = [c["name"] for c in ceilings.device_ceilings(1 << 20)]
    assert names == ["H2D pinned", "D2H pinned", "H2D pageable", "D2H pageable"]


def _run(library, ranks, busbw):
    rows = [{"op": "all_reduce", "size": s, "count": s // 4, "type": "float", "redop": "sum",
             "root": -1, "out_of_place": None,
             "in_place": {"time": 1.0, "alg_bw": bw, "bus_bw": bw, "nwrong": 0}}
            for s, bw in zip((8, 1024, 1 << 20), busbw, strict=True)]
    return {"library": library, "backend": "ring", "transport": "shm", "ranks": ranks,
            "versions": {}, "results": rows}


def test_plot_writes_a_png_with_one_panel_per_op_and_rank_count(tmp_path):
    path = tmp_path / "bw.png"
    runs = [_run("gpucoll", 2, (0.001, 0.5, 5.0)), _run("gloo", 2, (0.0, 0.01, 1.0)),
            _run("gpucoll", 4, (0.001, 0.4, 4.0))]
    plot(str(path), runs, [{"name": "host memcpy", "GBps": 20.0, "what": "", "bytes": 1}])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_results_says_so(tmp_path):
    with pytest.raises(RuntimeError, match="no results"):
        plot(str(tmp_path / "x.png"), [], [])
