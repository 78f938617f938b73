"""`gpucoll run` and the flight recorder: the doctor's diagnosis when --timeout passes and on
SIGUSR1, the ranks' dumps in the trace directory, and --keep-going."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from launch_helpers import launching, write_script

pytestmark = pytest.mark.timeout(180)

# Three all_reduces and a barrier; then the last rank stops itself and the others hang in
# all_reduce #4 (their own timeout is far away: the launcher's --timeout comes first).
HANG = """
    import os, signal
    import numpy as np
    import gpucoll
    comm = gpucoll.init("ring", timeout=600)
    x = np.ones(4, np.float32)
    for _ in range(3):
        comm.all_reduce(x)
    comm.barrier()
    if comm.rank == comm.size - 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    print("entering all_reduce #4", flush=True)
    comm.all_reduce(x)
"""

# Every rank works, then waits (outside any call) until the file "go" exists.
IDLE = """
    import os, time
    import numpy as np
    import gpucoll
    with gpucoll.init("ring", timeout=600) as comm:
        x = np.ones(4, np.float32)
        for _ in range(5):
            comm.all_reduce(x)
        print("idle", flush=True)
        while not os.path.exists("go"):
            time.sleep(0.05)
"""


@pytest.fixture
def launch(tmp_path):
    with launching(tmp_path) as start:
        yield start


@pytest.mark.slow
def test_a_timed_out_job_gets_the_doctors_diagnosis_under_the_ranks_output(launch, tmp_path):
    script = write_script(tmp_path, HANG)
    tee = tmp_path / "logs"
    job = launch(["-n", "3", "--timeout", "30", "--grace", "1", "--tee", str(tee), script])
    assert job.finish(timeout=120) == 124, job.text()
    err = job.err()
    _, diagnosis = err.split("what gpucoll doctor found when the job timed out:\n", 1)
    assert "gpucoll doctor: 1 communicator(s) in store, job 'anonymous': 1 with a problem" \
        in diagnosis
    headline = diagnosis.splitlines()[1]
    assert headline == ("  rank 2 is behind: before call #4 (after barrier #3), is stopped "
                        "(process state T: SIGSTOP, or a debugger); ranks 0, 1 are in "
                        "all_reduce #4"), err
    assert "diverged: #4 (all_reduce): ranks 0, 1 entered it, rank 2 did not" in diagnosis
    # the ranks that answered also wrote their dumps where --tee puts the logs, and the
    # launcher its facts: the doctor reads them again later
    names = sorted(os.listdir(tee))
    assert [n for n in names if n.endswith(".trace.jsonl")] == ["rank-0.trace.jsonl",
                                                                "rank-1.trace.jsonl"]
    facts = json.loads((tee / "launcher.json").read_text())["ranks"]
    assert facts["2"]["state"] in ("stopped", "exited")
    later = subprocess.run([sys.executable, "-m", "gpucoll", "doctor", str(tee)],
                           capture_output=True, text=True, timeout=60)
    assert later.returncode == 1, later.stdout + later.stderr
    assert "rank 2 is behind: before call #4 (after barrier #3)" in later.stdout


def test_sigusr1_to_the_launcher_prints_a_diagnosis_and_the_job_goes_on(launch, tmp_path):
    script = write_script(tmp_path, IDLE)
    job = launch(["-n", "2", "--timeout", "150", script], env={"TMPDIR": str(tmp_path)})
    job.wait_for_lines(r"\] idle$", 2)
    job.send(signal.SIGUSR1)
    found = job.wait_for_lines(r"no problem found: ranks", 1, stream="stderr")
    assert "ranks 0, 1 are before call #5 (after all_reduce #4)" in found[0]
    (tmp_path / "go").touch()
    assert job.finish(timeout=120) == 0, job.text()
    assert "received SIGUSR1: asking gpucoll doctor about the job" in job.err()


# Rank 1 dies once every rank has said (a file) that its first all_reduce is done.
KILLED = """
    import os, signal, sys, time
    import numpy as np
    import gpucoll
    comm = gpucoll.init("ring", timeout=60)
    x = np.ones(4)
    comm.all_reduce(x)
    if comm.rank == 1:
        while not all(os.path.exists(f"done-{r}") for r in (0, 2)):
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)
    open(f"done-{comm.rank}", "w").close()
    try:
        comm.all_reduce(x)
    except gpucoll.PeerFailure:
        comm = comm.shrink()
    x = np.full(4, 3.0)  # what the failed call did to x is undefined
    comm.all_reduce(x)
    print(f"finished as rank {comm.rank} of {comm.size} with {x[0]:g}", flush=True)
    comm.close()
    sys.exit(int(os.environ.get("EXIT_CODE", "0")) if comm.rank == 0 else 0)
"""


def test_keep_going_lets_the_survivors_finish_and_the_job_succeed(launch, tmp_path):
    script = write_script(tmp_path, KILLED)
    job = launch(["-n", "3", "--keep-going", "--timeout", "100", "--tee", str(tmp_path / "t"),
                  script])
    assert job.finish(timeout=120) == 0, job.text()
    assert "[rank 0] finished as rank 0 of 2 with 6" in job.out()
    assert "[rank 2] finished as rank 1 of 2 with 6" in job.out()
    err = job.err()
    assert "rank 1 failed (signal SIGKILL (exit 137)); the other ranks go on (--keep-going)" \
        in err
    assert "--keep-going: rank 1 lost, ranks 0, 2 finished; the job succeeds" in err
    later = subprocess.run([sys.executable, "-m", "gpucoll", "doctor", str(tmp_path / "t")],
                           capture_output=True, text=True, timeout=60)
    assert "rank 1 died (signal SIGKILL (exit 137))" in later.stdout.splitlines()[1]


def test_keep_going_still_fails_the_job_when_a_survivor_exits_with_an_error(launch, tmp_path):
    script = write_script(tmp_path, KILLED)
    job = launch(["-n", "3", "--keep-going", "--timeout", "100", script],
                 env={"EXIT_CODE": "3", "TMPDIR": str(tmp_path)})
    assert job.finish(timeout=120) == 3, job.text()


def test_a_job_clears_the_dumps_an_earlier_job_left_in_its_directory(launch, tmp_path):
    tee = tmp_path / "logs"
    tee.mkdir()
    for name in ("rank-5.trace.jsonl", "launcher.json", "notes.txt"):
        (tee / name).write_text("{}")
    script = write_script(tmp_path, "print('ok')")
    job = launch(["-n", "1", "--tee", str(tee), script])
    assert job.finish(timeout=60) == 0, job.text()
    assert sorted(os.listdir(tee)) == ["notes.txt", "rank-0.log"]


def test_a_clean_job_leaves_no_trace_directory_behind(launch, tmp_path):
    script = write_script(tmp_path, """
        import gpucoll, numpy as np
        with gpucoll.init("ring") as comm:
            comm.all_reduce(np.ones(2))
    """)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    job = launch(["-n", "2", "--timeout", "100", script], env={"TMPDIR": str(scratch),
                                                               "GPUCOLL_TRACE_DIR": ""})
    assert job.finish(timeout=120) == 0, job.text()
    assert os.listdir(scratch) == []
