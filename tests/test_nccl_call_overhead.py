"""benchmarks/call_overhead.py runs end to end (few calls) and writes its table and JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks" / "call_overhead.py"
COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "gather", "scatter",
               "reduce_scatter", "all_to_all", "send", "recv")


@pytest.mark.slow
def test_call_overhead_benchmark_times_every_collective_with_and_without_out(tmp_path):
    out = tmp_path / "call_overhead.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--calls", "20", "--json", str(out)],
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["rows"]
    cases = [row["case"] for row in rows]
    for name in COLLECTIVES:
        assert any(f"comm.{name}(" in case for case in cases), name
    for name in ("all_gather", "gather", "scatter", "reduce_scatter", "all_to_all"):
        assert any(f"comm.{name}(" in case and "out=" in case for case in cases), name
    assert all(row["us_per_call"] > 0 for row in rows)
    assert "comm.all_gather(x) (allocates out)" in proc.stdout
    assert {"ncclAllReduce entered as the backend does",
            "(not called) nccl4py Communicator.allreduce"} <= set(cases)


def test_call_overhead_benchmark_writes_under_results_by_default():
    proc = subprocess.run([sys.executable, str(BENCH), "--help"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    # argparse wraps the help, also inside a path at a hyphen: compare without whitespace
    path = "".join(str(ROOT / "results" / "call_overhead.json").split())
    assert path in "".join(proc.stdout.split())
