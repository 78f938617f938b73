"""benchmarks/store.py runs end to end (tiny sizes) and writes its table and JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "store.py"


def test_store_benchmark_measures_latency_large_values_rendezvous_and_allgather(tmp_path):
    out = tmp_path / "store.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--impls", "gpucoll", "--runs", "1", "--clients", "8",
         "--procs", "2", "--lat-ops", "50", "--big", "64K", "--gather", "4:64K",
         "--out", str(out)],
        capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr
    assert "rendezvous 8 clients (ms)" in proc.stdout and "get latency (us)" in proc.stdout
    result = json.loads(out.read_text())
    rdv = [r for r in result["records"] if r["test"] == "rendezvous"]
    assert len(rdv) == 1 and rdv[0]["errors"] == 0 and rdv[0]["wall_ms"] > 0
    ops = {r["op"] for r in result["records"] if r["test"] == "latency"}
    assert ops == {"set", "get", "add", "check"}
    assert {(r["op"], r["bytes"]) for r in result["records"] if r["test"] == "big"} == \
        {("set", 65536), ("get", 65536)}
    gather = [r for r in result["records"] if r["test"] == "allgather"]
    assert len(gather) == 1 and gather[0]["errors"] == 0 and gather[0]["wall_ms"] > 0
    assert "allgather 4 x 64 KiB (ms)" in proc.stdout and "get 64 KiB GB/s" in proc.stdout
    assert result["versions"]["gpucoll"]
