"""A script started without any launcher (``python script.py``) runs as a world of one, as under
mpi4py, and says so in one line on stderr."""

from __future__ import annotations

import os
import subprocess
import sys

LAUNCHER_VARS = ("GPUCOLL_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                 "MASTER_ADDR", "MASTER_PORT", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL", "SLURM_",
                 "TORCHELASTIC_")

SCRIPT = """
import numpy as np
import gpucoll
comm = gpucoll.init()
x = np.arange(4.0)
comm.all_reduce(x)
print(comm.rank, comm.size, comm.backend, x.tolist(), comm.all_gather(x).shape)
comm.close()
"""


def bare_env(**extra: str) -> dict[str, str]:
    """This process's environment without any launcher's variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VARS)}
    return {**env, **extra}


def run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=60)


def test_a_script_without_a_launcher_runs_as_a_world_of_one():
    from gpucoll.backends.nccl.backend import local_verdict

    done = run(SCRIPT, bare_env())
    assert done.returncode == 0, done.stderr
    auto = "nccl" if local_verdict()["ok"] else "ring"  # NumPy arrays work on either
    assert done.stdout.split("\n")[0] == f"0 1 {auto} [0.0, 1.0, 2.0, 3.0] (1, 4)"


def test_a_world_of_one_without_a_launcher_says_so_in_one_line():
    done = run(SCRIPT, bare_env())
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert "no launcher found" in lines[0] and "world of 1 rank" in lines[0]
    assert "gpucoll run -n N" in lines[0]


def test_a_half_given_launcher_environment_is_still_an_error():
    done = run(SCRIPT, bare_env(RANK="1"))
    assert done.returncode == 1
    assert "torchrun environment: WORLD_SIZE is not set" in done.stderr
    assert "no launcher found" not in done.stderr


def test_explicit_rank_and_world_size_print_no_notice():
    done = run("import gpucoll; c = gpucoll.init(rank=0, world_size=1); print(c.size); "
               "c.close()", bare_env())
    assert (done.returncode, done.stdout.strip(), done.stderr) == (0, "1", "")
