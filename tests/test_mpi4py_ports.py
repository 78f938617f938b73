"""The mpi4py tutorial's programs, ported to gpucoll (``tests/ports/mpi4py``), run under
``gpucoll run`` (and one under Open MPI's ``mpirun``) and print what they computed: every rank
must say ``rank R: ok NAME``."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
from launch_helpers import launching

pytestmark = pytest.mark.timeout(150)

PORTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ports", "mpi4py")
NAMES = ["p2p_objects", "p2p_arrays", "collectives_objects", "collectives_arrays", "matvec",
         "cpi"]
# what rank 0 prints after "ok NAME" on 2 ranks (4 ranks: checked inside the programs)
ON_TWO = {"p2p_objects": "10", "p2p_arrays": "[0.0, 1.0, 2.0]", "collectives_objects": "total=1",
          "collectives_arrays": "sum=1", "matvec": "[55.0, 70.0, 85.0]"}


@pytest.fixture
def launch(tmp_path):
    with launching(tmp_path) as start:
        yield start


def run_port(launch, name: str, ranks: int) -> dict[int, str]:
    """Each rank's "ok" line (what follows ``ok NAME``) of one ported program."""
    job = launch(["-n", str(ranks), "--timeout", "100", os.path.join(PORTS, f"{name}.py")])
    assert job.finish(timeout=110) == 0, job.text()
    found = dict(re.findall(rf"^\[rank \d+\] rank (\d+): ok {name}(.*)$", job.out(), re.M))
    assert sorted(map(int, found)) == list(range(ranks)), job.text()
    return {int(r): rest.strip() for r, rest in found.items()}


def test_every_port_is_listed():
    assert sorted(NAMES) == sorted(f[:-3] for f in os.listdir(PORTS) if f.endswith(".py"))


@pytest.mark.parametrize("name", NAMES)
def test_a_ported_tutorial_program_runs_on_two_ranks(launch, name):
    lines = run_port(launch, name, 2)
    if name == "cpi":
        assert lines[0].startswith("3.14160") and lines[1].startswith("3.14160")
    else:
        assert lines[0] == ON_TWO[name], lines


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_a_ported_tutorial_program_runs_on_four_ranks(launch, name):
    run_port(launch, name, 4)


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs Open MPI's mpirun")
def test_a_ported_program_runs_under_mpirun_from_open_mpis_environment():
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    proc = subprocess.run(["mpirun", *root, "--oversubscribe", "-n", "2", sys.executable,
                           os.path.join(PORTS, "cpi.py")], capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(re.findall(r"rank (\d): ok cpi 3\.14160", proc.stdout)) == ["0", "1"], \
        proc.stdout
