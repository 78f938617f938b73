"""Two hosts simulated with network namespaces (benchmarks/multinode.py): gpucoll's ranks on
each host share memory, the hosts talk TCP over a veth pair, and the all_reduce's correctness
pass holds. Needs root, ``ip`` and ``unshare``; skipped, saying why, elsewhere."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import multinode  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.mark.slow
@pytest.mark.skipif(multinode.missing_requirements() is not None,
                    reason=f"cannot simulate two hosts: {multinode.missing_requirements()}")
def test_two_simulated_hosts_run_a_checked_all_reduce_and_leave_no_namespace(tmp_path):
    out = tmp_path / "multinode.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "multinode.py"), "-b", "64K",
                           "-e", "4M", "--rounds", "1", "--iters", "3", "--warmup", "1",
                           "--libraries", "gpucoll", "--json", str(out)],
                          capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    sizes = [s["size"] for s in doc["summary"] if s["library"] == "gpucoll"]
    assert sizes == [64 << 10 << k for k in range(7)]
    assert all(s["wrong"] == 0 and s["busbw"] > 0 for s in doc["summary"])
    assert "gpucoll" in proc.stdout and "busbw" in proc.stdout
    # its own namespaces are gone (another job on this machine may hold others meanwhile)
    made = re.search(r"^# hosts: network namespaces (\S+), (\S+) at ", proc.stdout, re.M)
    assert made, proc.stdout
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not {line.split()[0] for line in left.splitlines() if line} & set(made.groups())
