"""`gpucoll bench` end to end: it starts its ranks (and its peers'), or uses a job's ranks.

Every run here is a few tiny sizes with few iterations: these check plumbing and output, not
speed.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys

import pytest
from test_bench_report import parse_log

from gpucoll.bench import cli, libraries
from gpucoll.bench.cli import Console
from gpucoll.bench.options import parse_args

TINY = ["-b", "8", "-e", "4K", "-f", "8", "-n", "3", "-w", "1"]


def _run(argv, timeout=150):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "gpucoll", *argv], capture_output=True,
                          text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL)


def _tables(text):
    """Rows per library, from the '# Collective test starting: OP (LIB)' sections."""
    out, lib, chunk = {}, None, []
    for line in text.splitlines() + ["# Collective test starting: end (end)"]:
        m = re.match(r"# Collective test starting: (\w+) \((\S+)\)", line)
        if m:
            if lib:
                out.setdefault(lib, []).extend(parse_log("\n".join(chunk))["rows"])
            lib, chunk = m.group(2), []
        else:
            chunk.append(line)
    return out


def test_help_names_the_nccl_tests_flags(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in ("-b", "-e", "-f", "-n", "-w", "-c", "-o", "-d", "-g", "--peers", "--plot"):
        assert f" {flag}" in text, flag


@pytest.mark.slow
def test_bench_starts_two_ranks_and_each_peer_and_writes_every_file(tmp_path):
    files = {k: str(tmp_path / f"bench.{k}") for k in ("json", "csv", "png")}
    proc = _run(["bench", "all_reduce", "all_gather", *TINY, "-g", "2", "--peers",
                 "--json", files["json"], "--csv", files["csv"], "--plot", files["png"]])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tables = _tables(proc.stdout)
    expected = ["gpucoll"] + [p for p in ("gloo", "mpi") if libraries.peer_available(p) is None]
    assert sorted(tables) == sorted(expected)
    for rows in tables.values():
        assert len(rows) == 2 * 4  # two ops x sizes 8, 64, 512, 4096
        assert all(r[p]["wrong"] in (0, None) for r in rows for p in ("out_of_place",
                                                                       "in_place"))
    assert "# Ceiling host memcpy" in proc.stdout
    doc = json.load(open(files["json"]))
    assert [run["library"] for run in doc["runs"] if run["error"] is None] == expected
    missing = {run["library"]: run["error"] for run in doc["runs"] if run["error"] is not None}
    assert missing == {p: libraries.peer_available(p) for p in ("gloo", "mpi") if p not in expected}
    assert doc["runs"][0]["ranks"] == 2 and doc["runs"][0]["backend"] == "ring"
    assert open(files["png"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert open(files["csv"]).readline().startswith("library,backend,transport,ranks")


@pytest.mark.slow
def test_inside_gpucoll_run_bench_uses_the_jobs_four_ranks():
    proc = subprocess.run([sys.executable, "-m", "gpucoll", "run", "-n", "4", "--timeout", "120",
                           "-m", "gpucoll", "bench", "all_reduce", "broadcast", *TINY,
                           "--no-ceilings"], capture_output=True, text=True, timeout=150,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = "\n".join(line.removeprefix("[rank 0] ") for line in proc.stdout.splitlines())
    assert "nGpus 4 " in text and "4 ranks" in text
    rows = _tables(text)["gpucoll"]
    assert len(rows) == 8 and all(r["in_place"]["wrong"] == 0 for r in rows)
    assert "[rank 1]" not in proc.stdout  # only rank 0 reports


def _console(argv):
    out = io.StringIO()
    return Console(parse_args(argv), argv, out=out), out


def test_a_job_that_stops_reporting_is_stopped_and_reported(monkeypatch):
    monkeypatch.setattr(cli, "STARTUP_S", 0.5)
    monkeypatch.setattr(cli, "command", lambda *a: [sys.executable, "-c",
                                                       "import time; time.sleep(120)"])
    console, out = _console(["--timeout", "1"])
    cli.run_job("gpucoll", 2, console.opts, console)
    assert "Library gpucoll: not run: no result for 2 s; stopped" in out.getvalue()
    assert console.close() == 1


def test_ranks_that_fail_before_reporting_fail_the_run(monkeypatch):
    monkeypatch.setattr(cli, "command", lambda *a: [sys.executable, "-c",
                                                       "raise SystemExit(3)"])
    console, out = _console([])
    cli.run_job("gpucoll", 2, console.opts, console)
    assert "not run: the ranks exited with status 3" in out.getvalue()
    assert console.close() == 1


def test_a_peer_that_is_not_installed_is_named_not_fatal(monkeypatch):
    monkeypatch.setattr(cli, "peer_available", lambda name: f"{name} is not installed")
    monkeypatch.setattr(cli, "run_job", lambda lib, n, opts, console: console.start(
        {"library": lib, "ranks": n, "devices": []}))
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    assert cli.drive(parse_args(["--peers", "--no-ceilings", "-g", "2"]), []) == 0
    text = out.getvalue()
    assert "# Library gloo: not run: gloo is not installed" in text
    assert "# Library mpi: not run: mpi is not installed" in text


@pytest.mark.slow
def test_mpi_ranks_are_started_by_mpirun_and_the_others_by_the_launcher():
    opts = parse_args(["-g", "3"])
    mpi = cli.command("mpi", 3, opts, "/tmp/ev")
    assert mpi[0] == "mpirun" and "--oversubscribe" in mpi and mpi[mpi.index("-n") + 1] == "3"
    assert ("--allow-run-as-root" in mpi) == (os.geteuid() == 0)
    ours = cli.command("gloo", 3, opts, "/tmp/ev")
    assert ours[1:6] == ["-m", "gpucoll", "run", "-n", "3"]
    assert ours[-4:] == ["--library", "gloo", "--results", "/tmp/ev"]


def test_ctrl_c_while_following_stops_the_job(monkeypatch):
    started = []

    class Recording(subprocess.Popen):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            started.append(self)

    def interrupt(*_args):  # Ctrl-C arrives while the driver follows the job's output
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.subprocess, "Popen", Recording)
    monkeypatch.setattr(cli, "_follow", interrupt)
    monkeypatch.setattr(cli, "command", lambda *a: [sys.executable, "-c",
                                                       "import time; time.sleep(120)"])
    console, _ = _console([])
    with pytest.raises(KeyboardInterrupt):
        cli.run_job("gpucoll", 2, console.opts, console)
    assert started and started[0].poll() is not None  # ended, not left running


@pytest.mark.slow
@pytest.mark.skipif(libraries.peer_available("mpi") is not None, reason="needs mpi4py and mpirun")
def test_under_mpirun_bench_measures_gpucoll_and_mpi_in_the_same_ranks():
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    proc = subprocess.run(["mpirun", *root, "--oversubscribe", "-n", "2", sys.executable, "-m",
                           "gpucoll", "bench", "all_reduce", *TINY, "--peers", "--no-ceilings"],
                          capture_output=True, text=True, timeout=150, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tables = _tables(proc.stdout)
    assert sorted(tables) == ["gpucoll", "mpi"] and len(tables["mpi"]) == 4
    assert "# Library gloo: not run: gloo needs torchrun's environment" in proc.stdout


@pytest.mark.slow
def test_under_gpucoll_run_rank_zero_draws_its_bar_on_the_launchers_terminal(tmp_path):
    """The ranks' stderr is a pipe: the bar goes straight to the terminal the launcher names,
    not through the pipe (where it would arrive prefixed, at the end)."""
    master, slave = os.openpty()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpucoll", "run", "-n", "2", "--timeout", "120", "-m",
             "gpucoll", "bench", *TINY, "--progress", "--no-ceilings"],
            stdout=subprocess.PIPE, stderr=slave, stdin=subprocess.DEVNULL, cwd=tmp_path,
            env=dict(os.environ, PYTHONUNBUFFERED="1"))
        os.close(slave)
        slave = None
        tty = b""
        while True:  # read the terminal until the launcher (its last writer) is gone
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not chunk:
                break
            tty += chunk
        out, _ = proc.communicate(timeout=150)
    finally:
        os.close(master)
        if slave is not None:
            os.close(slave)
    assert proc.returncode == 0, out.decode() + tty.decode(errors="replace")
    text = tty.decode(errors="replace")
    assert re.search(r"\r\x1b\[K\[#*\.*\] \d/4 gpucoll all_reduce", text), text
    assert "[rank 0] [#" not in text and b"[#" not in out
    assert "# Out of bounds values : 0 OK" in out.decode()
