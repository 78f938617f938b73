"""Every example runs under `gpucoll run` with 1, 2 and 4 ranks (some with 3 too), checks its own
result and says so."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
from launch_helpers import launching

pytestmark = pytest.mark.slow  # the examples, and under torchrun, mpirun and srun

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
NAMES = ["quickstart", "train_mlp", "train_epochs", "normalize", "softmax_argmax",
         "ring_allreduce", "hierarchical", "spmd", "shrink"]
LAUNCH_FLAGS = {"shrink": ["--keep-going"]}  # it loses a rank on purpose and carries on


@pytest.fixture
def launch(tmp_path):
    with launching(tmp_path) as start:
        yield start


def example(name: str) -> str:
    return os.path.join(EXAMPLES, f"{name}.py")


def check_line(out: str, name: str) -> str:
    lines = [line for line in out.splitlines() if line.startswith(f"[rank 0] CHECK {name}:")]
    assert len(lines) == 1, out
    return lines[0]


def test_every_example_is_listed():
    found = {f[:-3] for f in os.listdir(EXAMPLES) if f.endswith(".py") and f[0] != "_"}
    assert found == set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_example_passes_its_own_check_on_4_ranks(launch, name):
    job = launch(["-n", "4", "--timeout", "100", *LAUNCH_FLAGS.get(name, []), example(name)])
    assert job.finish(timeout=110) == 0, job.text()
    assert "passed" in check_line(job.out(), name)


@pytest.mark.parametrize("name", ["quickstart", "ring_allreduce", "hierarchical", "spmd"])
def test_example_also_passes_on_an_odd_number_of_ranks(launch, name):
    job = launch(["-n", "3", "--timeout", "100", *LAUNCH_FLAGS.get(name, []), example(name)])
    assert job.finish(timeout=110) == 0, job.text()
    assert "passed" in check_line(job.out(), name)


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("name", NAMES)
def test_example_passes_on_one_and_two_ranks(launch, name, ranks):
    job = launch(["-n", str(ranks), "--timeout", "100", *LAUNCH_FLAGS.get(name, []),
                  example(name)])
    assert job.finish(timeout=110) == 0, job.text()
    assert "passed" in check_line(job.out(), name)


def test_training_example_reports_a_falling_loss_and_identical_parameters(launch):
    job = launch(["-n", "4", "--timeout", "100", example("train_mlp"), "--steps", "40"])
    assert job.finish(timeout=110) == 0, job.text()
    line = check_line(job.out(), "train_mlp")
    assert "over 40 steps" in line and "parameters identical on 4 ranks: True" in line


def test_epoch_example_shows_uneven_last_batches_and_identical_parameters(launch):
    job = launch(["-n", "4", "--timeout", "100", example("train_epochs"), "--epochs", "4"])
    assert job.finish(timeout=110) == 0, job.text()
    line = check_line(job.out(), "train_epochs")
    assert "over 4 epochs, last batch of each split 10/10/9/9 rows" in line
    assert "parameters bit-identical on 4 ranks: True" in line
    assert "rank 0's checkpoint matches every rank: True" in line


def test_a_wrong_result_on_one_rank_fails_every_rank(launch, tmp_path):
    script = tmp_path / "verdict.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {EXAMPLES!r})\n"
        "import numpy as np\n"
        "from _example import finish, start\n"
        "comm, xp = start(False)\n"
        "sys.exit(finish(comm, xp, 'verdict', comm.rank != 1, f'checked on rank {comm.rank}'))\n")
    job = launch(["-n", "3", "--timeout", "100", str(script)])
    assert job.finish(timeout=110) == 1, job.text()
    assert "FAILED" in check_line(job.out(), "verdict")
    assert "[rank 1] rank 1: wrong result: checked on rank 1" in job.err()
    assert job.err().count("exit code 1") == 3  # every rank: the failed one and the others


def test_device_flag_without_a_gpu_is_a_clear_error(launch):
    from conftest import cuda_available

    if cuda_available():
        pytest.skip("this machine has a GPU")
    job = launch(["-n", "2", "--grace", "1", "--timeout", "100", example("quickstart"),
                  "--device"])
    assert job.finish(timeout=110) == 1, job.text()
    assert "--device needs a CUDA GPU, and CuPy finds none here" in job.err()


@pytest.mark.parametrize("env, gpu", [
    ({"GPUCOLL_RANK": "3", "GPUCOLL_WORLD_SIZE": "4", "GPUCOLL_LOCAL_RANK": "3"}, 1),
    ({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "2"}, 0),
    ({}, 0),
])
def test_device_flag_gives_each_local_rank_its_own_gpu(env, gpu):
    # in a fresh interpreter, as an example starts: nothing of gpucoll imported but the package
    clean = {k: v for k, v in os.environ.items() if not k.startswith(
        ("GPUCOLL_", "RANK", "WORLD_SIZE", "LOCAL_", "OMPI_", "PMI_", "SLURM_", "MPI_"))}
    code = f"import sys; sys.path.insert(0, {EXAMPLES!r}); import _example; " \
           "print(_example.local_gpu(2))"
    run = subprocess.run([sys.executable, "-c", code], env={**clean, **env},
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(gpu)


def run_other_launcher(argv: list[str], tmp_path) -> subprocess.CompletedProcess:
    """Run another launcher in its own session; at the deadline kill all of it and fail."""
    proc = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=110)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{argv[0]} did not finish in 110 s:\n{out}\n{err}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything it left behind
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


@pytest.mark.slow
def test_an_example_runs_unchanged_under_torchrun(tmp_path):
    torchrun = shutil.which("torchrun") or pytest.skip("torchrun is not installed")
    # --standalone: torchrun picks a free port instead of its fixed default (29500)
    argv = [torchrun, "--standalone", "--nproc-per-node", "2", example("spmd")]
    done = run_other_launcher(argv, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "CHECK spmd: passed" in done.stdout


def _port_pair() -> tuple[int, socket.socket]:
    """A free port P for torchrun's store, and a socket listening on P + 1 (held by the
    caller): the port gpucoll would take without torchrun's store is busy."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        busy = socket.socket()
        try:
            busy.bind(("127.0.0.1", port + 1))
        except OSError:
            busy.close()
            continue
        busy.listen()
        return port, busy
    pytest.fail("no free pair of neighbouring ports")


@pytest.mark.slow
def test_under_torchrun_a_busy_port_after_master_port_does_not_matter(tmp_path):
    torchrun = shutil.which("torchrun") or pytest.skip("torchrun is not installed")
    port, busy = _port_pair()
    with busy:
        argv = [torchrun, "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{port}", example("spmd")]
        done = run_other_launcher(argv, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "CHECK spmd: passed" in done.stdout


@pytest.mark.slow
def test_under_torchrun_a_job_that_starts_again_meets_in_its_new_store(tmp_path):
    torchrun = shutil.which("torchrun") or pytest.skip("torchrun is not installed")
    script = tmp_path / "twice.py"
    script.write_text(textwrap.dedent("""
        import sys
        import numpy as np
        import gpucoll
        for start in range(3):  # each start-up's store is new: none may reach the last one's
            comm = gpucoll.init("ring", timeout=30)
            x = np.array([comm.rank + 1.0])
            comm.all_reduce(x)
            sys.stdout.write(f"start {start} {x.item()}\\n")  # one write: lines never mix
            gpucoll.close()
    """))
    done = run_other_launcher([torchrun, "--standalone", "--nproc-per-node", "2", str(script)],
                              tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert [done.stdout.count(f"start {k} 3.0\n") for k in range(3)] == [2, 2, 2], done.stdout


def test_an_example_runs_unchanged_under_mpirun(tmp_path):
    mpirun = shutil.which("mpirun") or pytest.skip("mpirun is not installed")
    argv = [mpirun, "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable,
            example("spmd")]
    done = run_other_launcher(argv, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "CHECK spmd: passed" in done.stdout


SLURM_CONF = """\
ClusterName=gpucolltest
SlurmctldHost={host}(127.0.0.1)
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def slurm(tmp_path):
    """A one-node Slurm cluster of this machine (Debian's slurm-wlm; root), private to the
    test: its own configuration, ports, state and daemons, all gone afterwards. Yields the
    environment that points srun at it."""
    daemons = [shutil.which(d) for d in ("slurmctld", "slurmd", "srun", "sinfo")]
    if not all(daemons) or os.geteuid() != 0:
        pytest.skip("needs root and Slurm (apt-get install slurm-wlm)")
    ctld, slurmd, _, sinfo = daemons
    for sub in ("state", "spool"):
        (tmp_path / sub).mkdir()
    conf = tmp_path / "slurm.conf"
    conf.write_text(SLURM_CONF.format(host=socket.gethostname().split(".")[0], dir=tmp_path,
                                      ctld_port=_free_port(), d_port=_free_port(),
                                      cpus=os.cpu_count()))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    procs = [subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
             for argv in ([ctld, "-D", "-i"], [slurmd, "-D"])]
    try:
        deadline = time.monotonic() + 60
        while "idle" not in subprocess.run([sinfo, "-h", "-o", "%T"], env=env, text=True,
                                           capture_output=True, timeout=30).stdout:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                logs = "".join(f.read_text() for f in tmp_path.glob("*.log"))
                pytest.fail(f"the private Slurm cluster did not come up:\n{logs[-3000:]}")
            time.sleep(0.2)
        yield env
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
        _kill_with_env(f"SLURM_CONF={conf}")  # job steps outlive the daemons that started them


def _kill_with_env(entry: str) -> None:
    """SIGKILL every process whose environment holds ``entry`` (``NAME=value``)."""
    want = entry.encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if want in f.read().split(b"\0"):
                    os.kill(int(pid), signal.SIGKILL)
        except (OSError, ValueError):
            pass


@pytest.mark.slow
def test_an_example_runs_unchanged_under_srun(slurm, tmp_path):
    argv = ["srun", "-n", "2", "--time=2", sys.executable, example("spmd")]
    proc = subprocess.run(argv, env=slurm, cwd=tmp_path, capture_output=True, text=True,
                          timeout=110)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "CHECK spmd: passed" in proc.stdout
    assert "has no token" not in proc.stderr  # a one-node job's store listens on loopback


def test_the_quickstart_runs_without_n_and_says_which_backend(launch):
    job = launch(["--timeout", "100", example("quickstart")])
    assert job.finish(timeout=110) == 0, job.text()
    first = job.err().splitlines()[0]
    assert first.startswith("gpucoll run: ") and " backend " in first, job.text()
    assert "passed" in check_line(job.out(), "quickstart")
