"""The pieces around the table: progress bar, ceilings, plot."""

from __future__ import annotations

import io
import os

import pytest

from gpucoll.bench import cli, engine
from gpucoll.bench.cli import Progress
from gpucoll.bench.report import plot


class Tty(io.StringIO):
    def isatty(self):
        return True


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = Clock()
    monkeypatch.setattr(cli.time, "monotonic", fake)
    return fake


def test_progress_stays_silent_when_stderr_is_not_a_terminal():
    stream = io.StringIO()
    bar = Progress(3, None, stream)
    bar.step("all_reduce 8 B")
    bar.close()
    assert stream.getvalue() == ""


def test_a_forced_bar_draws_at_once_on_a_terminal_and_as_lines_elsewhere():
    tty, pipe = Tty(), io.StringIO()
    for stream in (tty, pipe):
        Progress(4, True, stream).step("all_reduce 8 B")
    assert tty.getvalue().startswith("\r\x1b[K[#######.....................] 1/4 all_reduce 8 B")
    assert pipe.getvalue().startswith("[#######.....................] 1/4 all_reduce 8 B")
    assert pipe.getvalue().endswith("\n") and "\r" not in pipe.getvalue()


def test_on_a_terminal_the_bar_appears_only_once_the_sweep_runs_a_few_seconds(clock):
    stream = Tty()
    bar = Progress(4, None, stream)
    bar.step("all_reduce 8 B")
    assert stream.getvalue() == ""  # a short sweep never shows a bar
    clock.now += cli.AUTO_DELAY
    bar.tick()
    assert "1/4 all_reduce 8 B" in stream.getvalue()


def test_a_bar_started_with_no_total_still_draws_once_the_total_is_known(clock):
    stream = Tty()
    bar = Progress(0, True, stream)  # what the driver builds before it knows the sweep
    bar.restart(3)
    bar.step("gpucoll all_reduce 8 B")
    assert "1/3 gpucoll all_reduce 8 B" in stream.getvalue()


def test_tick_redraws_the_elapsed_time_between_table_lines(clock):
    stream = Tty()
    bar = Progress(2, True, stream)
    bar.step("all_reduce 1 GiB")
    clock.now += cli.REDRAW / 2
    bar.tick()
    assert stream.getvalue().count("1/2") == 1  # not redrawn at once
    clock.now += 7
    bar.tick()
    assert stream.getvalue().count("1/2") == 2 and "    7s" in stream.getvalue()


def test_clear_erases_the_bar_before_other_output_and_only_when_drawn(clock):
    stream = Tty()
    bar = Progress(2, True, stream)
    bar.clear()
    assert stream.getvalue() == ""
    bar.step("x")
    bar.clear()
    assert stream.getvalue().endswith("\r\x1b[K") and not bar.shown


def test_progress_can_be_turned_off_on_a_terminal():
    stream = Tty()
    Progress(4, False, stream).step("x")
    assert stream.getvalue() == ""


def test_the_bar_is_drawn_on_the_terminal_the_launcher_names(monkeypatch):
    master, slave = os.openpty()
    try:
        monkeypatch.setenv("GPUCOLL_TTY", os.ttyname(slave))
        bar = Progress(2, True)
        assert bar.live and bar.stream is not __import__("sys").stderr
        bar.step("all_gather 64 KiB")
        bar.close()
        assert b"1/2 all_gather 64 KiB" in os.read(master, 4096)
    finally:
        os.close(master)
        os.close(slave)


def test_a_terminal_that_cannot_be_opened_falls_back_to_stderr(monkeypatch, tmp_path):
    monkeypatch.setenv("GPUCOLL_TTY", str(tmp_path / "no-such-tty"))
    assert cli.terminal() == (__import__("sys").stderr, False)


def test_host_ceilings_name_what_they_count():
    found = engine.host_ceilings(1 << 20)
    assert [c["name"] for c in found] == ["host memcpy", "host add (reduce step)"]
    assert all(c["GBps"] > 0 and c["bytes"] == 1 << 20 for c in found)


@pytest.mark.gpu
def test_device_ceilings_cover_both_directions_pinned_and_pageable():
    names = [c["name"] for c in engine.device_ceilings(1 << 20)]
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


@pytest.mark.parametrize("panels", [1, 3])
def test_the_title_sits_above_the_first_panel_without_touching_it(panels):
    import matplotlib.pyplot as plt

    from gpucoll.bench.report import figure

    runs = [_run("gpucoll", ranks, (0.001, 0.5, 5.0)) for ranks in (2, 3, 4)[:panels]]
    fig = figure(runs, [], title="gpucoll bench on a-long-host-name (AMD EPYC 7B13, 2 cores)")
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        title = fig._suptitle.get_window_extent(renderer)
        first = fig.axes[0]
        below = [first.title.get_window_extent(renderer), first.get_window_extent(renderer)]
        air = title.height / 2  # a clear gap, not titles touching
        assert all(title.y0 >= box.y1 + air for box in below), (title, below)
    finally:
        plt.close(fig)
