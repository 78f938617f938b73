"""`gpucoll run` end to end: the launcher runs as a subprocess on small scripts of its ranks."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest
from launch_helpers import alive, launching, write_script

ENV_DUMP = """
    import json, os
    names = ["GPUCOLL_RANK", "GPUCOLL_WORLD_SIZE", "GPUCOLL_LOCAL_RANK",
             "GPUCOLL_LOCAL_WORLD_SIZE", "GPUCOLL_STORE", "GPUCOLL_STORE_TOKEN", "RANK",
             "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]
    print("ENV " + json.dumps({n: os.environ.get(n) for n in names}))
"""

# Ranks print their pid and "ready" (and leave a file ready-RANK), then wait to be stopped;
# SIGTERM ends them with code 7. FAILING_RANK (if set) first waits for the others to be ready.
WAITER = """
    import os, signal, sys, time
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    failing = {failing}
    if rank == failing:
        others = [f"ready-{{r}}" for r in range(world) if r != rank]
        deadline = time.monotonic() + 60
        while not all(os.path.exists(f) for f in others) and time.monotonic() < deadline:
            time.sleep(0.01)
        print("boom: rank", rank, "gives up", file=sys.stderr)
        sys.exit({code})
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))
    print(f"pid={{os.getpid()}} ready", flush=True)
    open(f"ready-{{rank}}", "w").close()
    while True:
        time.sleep(1)
"""


def waiter(failing: int = -1, code: int = 0) -> str:
    return WAITER.format(failing=failing, code=code)


@pytest.fixture
def launch(tmp_path):
    with launching(tmp_path) as start:
        yield start


def pids(launcher) -> list[int]:
    return [int(p) for p in re.findall(r"pid=(\d+)", launcher.out())]


def envs(launcher) -> dict[int, dict]:
    found = [json.loads(line.split("ENV ", 1)[1]) for line in launcher.out().splitlines()
             if "ENV " in line]
    return {int(e["RANK"]): e for e in found}


def test_every_rank_gets_gpucoll_and_torchrun_variables(launch, tmp_path):
    job = launch(["-n", "3", write_script(tmp_path, ENV_DUMP)])
    assert job.finish() == 0, job.text()
    by_rank = envs(job)
    assert sorted(by_rank) == [0, 1, 2]
    for rank, env in by_rank.items():
        assert env["GPUCOLL_RANK"] == env["LOCAL_RANK"] == env["GPUCOLL_LOCAL_RANK"] == str(rank)
        assert env["GPUCOLL_WORLD_SIZE"] == env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "3"
        assert env["GPUCOLL_STORE"].startswith("tcp://127.0.0.1:")
        assert env["MASTER_ADDR"] == "127.0.0.1"
        # torch.distributed hosts its own store at MASTER_PORT: it must not be gpucoll's port
        assert not env["GPUCOLL_STORE"].endswith(":" + env["MASTER_PORT"])
    assert len({e["GPUCOLL_STORE_TOKEN"] for e in by_rank.values()}) == 1


def test_each_job_gets_a_fresh_store_token(launch, tmp_path):
    script = write_script(tmp_path, ENV_DUMP)
    first, second = launch(["-n", "1", script]), launch(["-n", "1", script])
    assert first.finish() == 0 and second.finish() == 0
    token = lambda job: envs(job)[0]["GPUCOLL_STORE_TOKEN"]
    assert len(token(first)) >= 32 and token(first) != token(second)


def test_ranks_meet_in_the_store_the_launcher_hosts(launch, tmp_path):
    script = write_script(tmp_path, """
        import os
        from gpucoll.store import TCPStore
        host, port = os.environ["GPUCOLL_STORE"][len("tcp://"):].rsplit(":", 1)
        store = TCPStore(host, int(port), token=os.environ["GPUCOLL_STORE_TOKEN"], timeout=30)
        store.add("arrived", 1)
        store.wait(["go"]) if os.environ["RANK"] != "0" else None
        if os.environ["RANK"] == "0":
            while store.add("arrived", 0) < 3:
                pass
            store.set("go", b"1")
        print("met", store.add("arrived", 0))
    """)
    job = launch(["-n", "3", script])
    assert job.finish() == 0, job.text()
    assert job.out().count("met 3") == 3


def test_output_lines_carry_their_rank_and_streams_stay_apart(launch, tmp_path):
    script = write_script(tmp_path, """
        import os, sys
        print("to stdout")
        print("to stderr", file=sys.stderr)
    """)
    job = launch(["-n", "2", script])
    assert job.finish() == 0, job.text()
    for rank in (0, 1):
        assert f"[rank {rank}] to stdout\n" in job.out()
        assert f"[rank {rank}] to stderr\n" in job.err()
    assert "to stderr" not in job.out() and "to stdout" not in job.err()


def test_partial_writes_join_into_whole_lines_and_bytes_pass_unchanged(launch, tmp_path):
    script = write_script(tmp_path, """
        import sys
        out = sys.stdout.buffer
        for piece in (b"hel", b"lo\\nwor", b"ld\\n", b"\\xff\\xfe binary\\n", b"no newline"):
            out.write(piece)
            out.flush()
    """)
    job = launch(["-n", "1", script])
    assert job.finish() == 0, job.text()
    raw = b"".join(job.stdout)
    assert raw == (b"[rank 0] hello\n[rank 0] world\n[rank 0] \xff\xfe binary\n"
                   b"[rank 0] no newline\n")


def test_lines_of_ranks_writing_at_once_never_mix(launch, tmp_path):
    script = write_script(tmp_path, """
        import os, sys
        rank = os.environ["RANK"]
        for i in range(300):
            # many small writes per line: a line is only whole once its newline arrives
            for part in (rank * 2000, " line ", str(i), "\\n"):
                sys.stdout.write(part)
    """)
    job = launch(["-n", "3", script])
    assert job.finish() == 0, job.text()
    lines = job.out().splitlines()
    assert len(lines) == 900
    for line in lines:
        m = re.fullmatch(r"\[rank (\d)\] (\d{2000}) line \d+", line)
        assert m and m.group(2) == m.group(1) * 2000, line[:80]


def test_tee_writes_one_log_per_rank(launch, tmp_path):
    script = write_script(tmp_path, """
        import os, sys
        print("out of", os.environ["RANK"])
        print("err of", os.environ["RANK"], file=sys.stderr)
    """)
    job = launch(["-n", "2", "--tee", str(tmp_path / "logs"), script])
    assert job.finish() == 0, job.text()
    for rank in (0, 1):
        log = (tmp_path / "logs" / f"rank-{rank}.log").read_text()
        assert sorted(log.splitlines()) == [f"err of {rank}", f"out of {rank}"]


def test_a_successful_job_exits_zero(launch, tmp_path):
    job = launch(["-n", "2", write_script(tmp_path, "print('done')\n")])
    assert job.finish() == 0, job.text()
    assert job.out().count("done") == 2


def test_launcher_exits_with_the_failed_ranks_code(launch, tmp_path):
    script = write_script(tmp_path, "import os, sys\nsys.exit(5 if os.environ['RANK'] == '1'"
                                    " else 0)\n")
    job = launch(["-n", "2", script])
    assert job.finish() == 5, job.text()
    assert "rank 1 failed first" in job.err() and "exit code 5" in job.err()


def test_a_rank_killed_by_a_signal_gives_128_plus_the_signal(launch, tmp_path):
    script = write_script(tmp_path, """
        import os, signal
        if os.environ["RANK"] == "0":
            os.kill(os.getpid(), signal.SIGSEGV)
    """)
    job = launch(["-n", "2", script])
    assert job.finish() == 128 + signal.SIGSEGV, job.text()
    assert "SIGSEGV" in job.err()


def test_first_failure_is_reported_and_the_others_are_stopped(launch, tmp_path):
    script = write_script(tmp_path, waiter(failing=2, code=3))
    job = launch(["-n", "4", "--grace", "0.5", script])
    # the others stop with code 7 (their SIGTERM handler): the report must still say 3
    assert job.finish() == 3, job.text()
    err = job.err()
    assert "rank 2 failed first" in err and "exit code 3" in err
    assert "boom: rank 2 gives up" in err.split("root cause", 1)[1]
    for rank in (0, 1, 3):
        assert f"rank {rank}: stopped by the launcher (SIGTERM), exit code 7" in err
    assert pids(job) and not any(alive(pid) for pid in pids(job))


DIES_IN_A_CALL = """
    import os, numpy as np, gpucoll
    with gpucoll.init() as comm:
        comm.all_reduce(np.ones(4))
        if comm.rank == 1:
            os._exit(3)
        comm.all_reduce(np.ones(4))
"""


@pytest.mark.parametrize("verbose", [False, True], ids=["default", "verbose"])
def test_a_survivors_traceback_shows_its_own_frames_and_one_line_for_gpucolls(
        launch, tmp_path, verbose):
    script = write_script(tmp_path, DIES_IN_A_CALL)
    job = launch(["-n", "2", *(["--verbose"] if verbose else []), script])
    assert job.finish() == 3, job.text()
    mine = [line for line in job.err().splitlines() if line.startswith("[rank 0]")]
    text = "\n".join(mine)
    assert 'job.py", line' in text and "PeerFailure: " in text and "rank 1" in text, text
    if verbose:
        assert "gpucoll/transport/engine.py" in text and "left out" not in text
    else:
        assert "gpucoll/" not in text.replace("gpucoll.errors", "") and len(mine) <= 6, text
        assert "frames inside gpucoll left out; GPUCOLL_VERBOSE=1" in text


def test_a_rank_stopped_when_another_fails_is_named_as_the_likely_cause(launch, tmp_path):
    # rank 1 stops itself; once it is stopped, rank 0 fails as a rank waiting for it would
    script = write_script(tmp_path, f"""
        import os, pathlib, signal, sys, time
        pid_file = pathlib.Path({str(tmp_path / "pid")!r})
        if os.environ["RANK"] == "1":
            pid_file.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)
            sys.exit(0)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                stat = pathlib.Path(f"/proc/{{pid_file.read_text()}}/stat").read_text()
                if stat.rsplit(")", 1)[1].split()[0] == "T":
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.05)
        sys.exit(3)
    """)
    job = launch(["-n", "2", "--grace", "0.5", script])
    assert job.finish() == 3, job.text()
    err = job.err()
    assert "rank 0 failed first, while rank 1 was stopped (SIGSTOP or a debugger): " \
           "likely the root cause" in err
    assert "rank 1: stopped (SIGSTOP or a debugger) when the job failed; then stopped by " \
           "the launcher" in err
    assert not any(alive(pid) for pid in pids(job))


def test_ranks_starting_up_fail_on_their_own_when_a_rank_dies_before_init(launch, tmp_path):
    # rank 2 never reaches gpucoll.init; the others must not wait for the launcher's SIGTERM
    script = write_script(tmp_path, """
        import os, sys
        if os.environ["RANK"] == "2":
            raise ImportError("no module named mymodel")
        import gpucoll
        try:
            gpucoll.init(timeout=100)
        except gpucoll.PeerFailure as exc:
            print(f"caught {exc.peer}: {exc}", flush=True)
            sys.exit(9)
    """)
    job = launch(["-n", "4", "--grace", "60", script])
    assert job.finish(timeout=50) == 1, job.text()
    out = job.out()
    for rank in (0, 1, 3):
        assert f"[rank {rank}] caught 2: start-up on rank {rank} of 4: the launcher is stopping " \
               "the job: rank 2 on node 0 failed (exit code 1)" in out, job.text()
    assert "rank 2 failed first" in job.err()
    assert "stopped by the launcher" not in job.err()  # they ended on their own


def test_ranks_ignoring_sigterm_are_killed_after_the_grace_period(launch, tmp_path):
    script = write_script(tmp_path, waiter(failing=1, code=4).replace(
        "lambda *a: sys.exit(7)", "signal.SIG_IGN"))
    job = launch(["-n", "2", "--grace", "0.5", script])
    assert job.finish() == 4, job.text()
    assert "rank 0: stopped by the launcher (SIGKILL)" in job.err()
    assert not any(alive(pid) for pid in pids(job))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_launcher_reaches_every_rank(launch, tmp_path, sig):
    script = write_script(tmp_path, f"""
        import os, signal, sys, time
        signal.signal({int(sig)}, lambda *a: (print("rank got", signal.Signals({int(sig)}).name,
                                                    flush=True), sys.exit(0)))
        print("ready", flush=True)
        while True:
            time.sleep(1)
    """)
    job = launch(["-n", "3", script])
    job.wait_for_lines(r"\] ready$", 3)
    job.send(sig)
    assert job.finish() == 128 + sig, job.text()
    assert job.out().count(f"rank got {sig.name}") == 3


def test_a_second_sigint_kills_ranks_that_ignore_the_first(launch, tmp_path):
    script = write_script(tmp_path, """
        import os, signal, time
        signal.signal(signal.SIGINT, lambda *a: print("ignoring SIGINT", flush=True))
        print(f"pid={os.getpid()} ready", flush=True)
        while True:
            time.sleep(1)
    """)
    job = launch(["-n", "2", "--grace", "600", script])
    job.wait_for_lines(r"ready$", 2)
    job.send(signal.SIGINT)
    job.wait_for_lines(r"ignoring SIGINT", 2)
    job.send(signal.SIGINT)
    assert job.finish() == 128 + signal.SIGINT, job.text()
    assert "second SIGINT" in job.err() and "interrupted by SIGINT" in job.err()
    assert not any(alive(pid) for pid in pids(job))


@pytest.mark.slow
def test_a_hung_rank_is_stopped_at_the_job_timeout(launch, tmp_path):
    script = write_script(tmp_path, """
        import os, sys, time
        print(f"pid={os.getpid()}", flush=True)
        if os.environ["RANK"] == "1":
            print("rank 1 is stuck", file=sys.stderr, flush=True)
            time.sleep(3600)
    """)
    job = launch(["-n", "2", "--timeout", "5", "--grace", "0.5", script])
    assert job.finish() == 124, job.text()
    err = job.err()
    assert "timed out after 5 s" in err and "rank 1: stopped by the launcher" in err
    assert "rank 1 is stuck" in err.split("timed out after 5 s (--timeout)", 1)[1]
    assert not any(alive(pid) for pid in pids(job))


def test_children_a_rank_leaves_behind_are_stopped(launch, tmp_path):
    script = write_script(tmp_path, """
        import subprocess, sys
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(f"pid={child.pid}", flush=True)
    """)
    job = launch(["-n", "1", script])
    assert job.finish() == 0, job.text()
    assert pids(job) and not alive(pids(job)[0])


def test_a_missing_script_is_a_clear_error(launch, tmp_path):
    job = launch(["-n", "2", "no_such_script.py"])
    assert job.finish() == 2
    assert "script not found: 'no_such_script.py'" in job.err()
    assert job.out() == ""


def test_a_module_runs_with_dash_m(launch, tmp_path):
    write_script(tmp_path, "import os\nprint('module rank', os.environ['RANK'])\n",
                 name="mymod.py")
    job = launch(["-n", "2", "-m", "mymod"])
    assert job.finish() == 0, job.text()
    assert "[rank 1] module rank 1" in job.out()


def test_script_arguments_pass_through_unchanged(launch, tmp_path):
    script = write_script(tmp_path, "import sys\nprint(sys.argv[1:])\n")
    job = launch(["-n", "1", script, "--lr", "0.1", "-n", "7"])
    assert job.finish() == 0, job.text()
    assert "[rank 0] ['--lr', '0.1', '-n', '7']" in job.out()


def test_a_torchrun_style_script_runs_unchanged(launch, tmp_path):
    script = write_script(tmp_path, """
        import os
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ["LOCAL_RANK"])
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        assert 0 <= rank < world == 2 and local == rank and port > 0, (rank, world, port)
        print(f"torchrun-style rank {rank}/{world} master {addr}:{port}")
    """)
    job = launch(["-n", "2", script])
    assert job.finish() == 0, job.text()
    assert job.out().count("torchrun-style rank") == 2


OMP_DUMP = """
    import os
    print("OMP", os.environ["RANK"], repr(os.environ.get("OMP_NUM_THREADS")))
"""
OMP_LINE = "gpucoll run: OMP_NUM_THREADS=1 for each rank, as torchrun sets it"


def test_ranks_sharing_a_node_get_one_openmp_thread_each_and_the_launcher_says_so(
        launch, tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    job = launch(["-n", "2", write_script(tmp_path, OMP_DUMP)])
    assert job.finish() == 0, job.text()
    assert sorted(re.findall(r"OMP \d '1'", job.out())) == ["OMP 0 '1'", "OMP 1 '1'"]
    assert job.err().count(OMP_LINE) == 1
    assert f"{OMP_LINE} (unset, and 2 ranks share this node's cores); set OMP_NUM_THREADS " \
           f"to choose another value" in job.err()


@pytest.mark.parametrize("value", ["3", ""])
def test_an_omp_num_threads_the_user_set_is_left_alone(launch, tmp_path, value):
    job = launch(["-n", "2", write_script(tmp_path, OMP_DUMP)], env={"OMP_NUM_THREADS": value})
    assert job.finish() == 0, job.text()
    assert job.out().count(f"'{value}'") == 2, job.text()
    assert OMP_LINE not in job.err()


def test_a_single_rank_keeps_openmps_own_default(launch, tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    job = launch(["-n", "1", write_script(tmp_path, OMP_DUMP)])
    assert job.finish() == 0, job.text()
    assert "OMP 0 None" in job.out()
    assert OMP_LINE not in job.err()


@pytest.mark.slow
def test_a_torch_distributed_script_runs_unchanged(launch, tmp_path):
    pytest.importorskip("torch.distributed")
    script = write_script(tmp_path, """
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")  # env:// reads MASTER_ADDR/PORT, RANK, WORLD_SIZE
        t = torch.tensor([dist.get_rank() + 1.0])
        dist.all_reduce(t)
        print("torch all_reduce", t.item())
        dist.destroy_process_group()
    """)
    job = launch(["-n", "2", script])
    assert job.finish(timeout=110) == 0, job.text()
    assert job.out().count("torch all_reduce 3.0") == 2


def test_two_nodes_form_one_job(launch, tmp_path):
    script = write_script(tmp_path, ENV_DUMP)
    env = {"GPUCOLL_STORE_TOKEN": "shared-secret-for-this-test"}
    common = ["-n", "2", "--nnodes", "2", "--master-addr", "127.0.0.1"]
    node0 = launch([*common, "--node-rank", "0", "--master-port", "0", script], env=env)
    [line] = node0.wait_for_lines(r"store listening at tcp://127\.0\.0\.1:\d+$", 1,
                                  stream="stderr")
    port = line.rsplit(":", 1)[1]
    node1 = launch([*common, "--node-rank", "1", "--master-port", port, script], env=env)
    assert node1.finish() == 0, node1.text()
    assert node0.finish() == 0, node0.text()
    ranks = {**envs(node0), **envs(node1)}
    assert sorted(ranks) == [0, 1, 2, 3]
    assert {e["GPUCOLL_STORE"] for e in ranks.values()} == {f"tcp://127.0.0.1:{port}"}
    assert {e["MASTER_PORT"] for e in ranks.values()} == {str(int(port) + 1)}
    assert [ranks[r]["LOCAL_RANK"] for r in range(4)] == ["0", "1", "0", "1"]


def test_a_failure_on_one_node_stops_the_ranks_of_the_other(launch, tmp_path):
    # each node's ranks wait for their own node's files only: the failing rank 3 (node 1) waits
    # for rank 2, and node 0's ranks are stopped whenever the abort arrives
    script = write_script(tmp_path, waiter(failing=3, code=6).replace(
        "if r != rank]", "if r != rank and r // 2 == rank // 2]"))
    env = {"GPUCOLL_STORE_TOKEN": "shared-secret-for-this-test"}
    common = ["-n", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--grace", "0.5"]
    node0 = launch([*common, "--node-rank", "0", "--master-port", "0", script], env=env)
    [line] = node0.wait_for_lines(r"store listening at tcp://127\.0\.0\.1:\d+$", 1,
                                  stream="stderr")
    node1 = launch([*common, "--node-rank", "1", "--master-port", line.rsplit(":", 1)[1],
                    script], env=env)
    assert node1.finish() == 6, node1.text()
    assert node0.finish() == 6, node0.text()
    assert "rank 3 failed first" in node1.err()
    assert "stopping this node's ranks: rank 3 on node 1 failed (exit code 6)" in node0.err()
    assert not any(alive(pid) for pid in pids(node0) + pids(node1))


def test_ranks_die_with_a_launcher_that_is_killed(launch, tmp_path):
    job = launch(["-n", "2", write_script(tmp_path, waiter())])
    job.wait_for_lines(r"ready$", 2)
    job.proc.kill()  # the launcher alone: it gets no chance to clean up
    job.finish()
    ranks = pids(job)
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(pid) for pid in ranks)


GPU_ENV = "import os\nprint('CVD', os.environ.get('CUDA_VISIBLE_DEVICES'))\n"


def test_isolated_ranks_each_see_one_gpu_of_the_visible_ones(launch, tmp_path):
    job = launch(["-n", "2", "--isolate-gpus", "--device", write_script(tmp_path, GPU_ENV)],
                 env={"CUDA_VISIBLE_DEVICES": "3,5"})
    assert job.finish() == 0, job.text()
    assert "[rank 0] CVD 3" in job.out() and "[rank 1] CVD 5" in job.out()


def test_without_isolation_ranks_see_every_gpu(launch, tmp_path):
    job = launch(["-n", "2", write_script(tmp_path, GPU_ENV)], env={"CUDA_VISIBLE_DEVICES": "3,5"})
    assert job.finish() == 0, job.text()
    assert job.out().count("CVD 3,5") == 2


BIND_DUMP = """
import json, os, threading
seen = {}
t = threading.Thread(target=lambda: seen.setdefault("thread", sorted(os.sched_getaffinity(0))))
t.start(); t.join()
print("BIND " + json.dumps({"rank": os.environ["RANK"], "cpus": sorted(os.sched_getaffinity(0)),
      "thread": seen["thread"], "hca": os.environ.get("NCCL_IB_HCA"),
      "order": os.environ.get("CUDA_DEVICE_ORDER")}))
"""


def test_bind_pins_each_rank_and_its_threads_and_exports_its_nic(launch, tmp_path):
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs to pin two ranks apart")
    topo = tmp_path / "topo.txt"  # a saved output whose GPUs sit on two of this machine's CPUs
    topo.write_text("\tGPU0\tGPU1\tNIC0\tNIC1\tCPU Affinity\tNUMA Affinity\n"
                    f"GPU0\t X \tNV4\tPIX\tSYS\t{cpus[0]}\t0\n"
                    f"GPU1\tNV4\t X \tSYS\tPIX\t{cpus[1]}\t1\n"
                    "NIC0\tPIX\tSYS\t X \tSYS\nNIC1\tSYS\tPIX\tSYS\t X \n\n"
                    "NIC Legend:\n\n  NIC0: mlx5_0\n  NIC1: mlx5_1\n")
    job = launch(["-n", "2", "--bind", "--topology", str(topo),
                  write_script(tmp_path, BIND_DUMP)], env={"CUDA_VISIBLE_DEVICES": "0,1"})
    assert job.finish() == 0, job.text()
    seen = {int(d["rank"]): d for d in (json.loads(line.split("BIND ", 1)[1])
                                        for line in job.out().splitlines() if "BIND " in line)}
    for rank in (0, 1):
        assert seen[rank]["cpus"] == seen[rank]["thread"] == [cpus[rank]]
        assert seen[rank]["hca"] == f"=mlx5_{rank}" and seen[rank]["order"] == "PCI_BUS_ID"
    assert f"--bind: rank 1: GPU1, CPUs {cpus[1]} (NUMA 1), NICs mlx5_1 (PIX); pinned to " \
           f"CPUs {cpus[1]}" in job.err()


def test_bind_without_a_gpu_says_what_it_does_and_runs_the_job(launch, tmp_path):
    job = launch(["-n", "2", "--bind", write_script(tmp_path, BIND_DUMP)],
                 env={"CUDA_VISIBLE_DEVICES": ""})
    assert job.finish() == 0, job.text()
    assert "gpucoll run: --bind: no GPU topology here" in job.err()
    assert job.out().count("BIND ") == 2


def test_bind_with_an_unreadable_topology_starts_nothing(launch, tmp_path):
    (tmp_path / "bad.txt").write_text("not a topology\n")
    job = launch(["-n", "2", "--bind", "--topology", "bad.txt",
                  write_script(tmp_path, BIND_DUMP)])
    assert job.finish() == 2
    assert "gpucoll run: error: --bind: bad.txt: no header line found" in job.err()
    assert "BIND" not in job.out()


# Ranks that meet in gpucoll and all_reduce until a peer is lost (then they fail, code 1).
ALL_REDUCING = """
    import os, time
    import numpy as np
    import gpucoll
    comm = gpucoll.init()
    x = np.ones(4, np.float32)
    comm.all_reduce(x)
    print(f"pid={os.getpid()} ready", flush=True)
    while True:
        comm.all_reduce(x)
        time.sleep(0.01)
"""


def two_nodes(launch, script: str, grace: str = "0.5"):
    """Node 0's and node 1's launchers of one job of 2 x 2 ranks on this machine."""
    env = {"GPUCOLL_STORE_TOKEN": "shared-secret-for-this-test"}
    common = ["-n", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--grace", grace]
    node0 = launch([*common, "--node-rank", "0", "--master-port", "0", script], env=env)
    [line] = node0.wait_for_lines(r"store listening at tcp://127\.0\.0\.1:\d+$", 1,
                                  stream="stderr")
    node1 = launch([*common, "--node-rank", "1", "--master-port", line.rsplit(":", 1)[1],
                    script], env=env)
    return node0, node1


def test_a_launcher_outlives_another_node_whose_launcher_is_killed_by_a_few_seconds(
        launch, tmp_path):
    node0, node1 = two_nodes(launch, write_script(tmp_path, ALL_REDUCING))
    node0.wait_for_lines(r"ready$", 2)
    node1.wait_for_lines(r"ready$", 2)
    node1.proc.kill()  # the launcher alone: its ranks die with it
    killed = time.monotonic()
    assert node0.finish(timeout=30) == 1, node0.text()
    assert time.monotonic() - killed < 10, node0.text()
    assert "gpucoll run: node 1 was lost: its launcher died" in node0.err()
    node1.finish()
    assert not any(alive(pid) for pid in pids(node0) + pids(node1))


def test_a_launcher_whose_store_host_node_is_killed_names_node_0(launch, tmp_path):
    node0, node1 = two_nodes(launch, write_script(tmp_path, ALL_REDUCING))
    node0.wait_for_lines(r"ready$", 2)
    node1.wait_for_lines(r"ready$", 2)
    node0.proc.kill()
    killed = time.monotonic()
    assert node1.finish(timeout=30) == 1, node1.text()
    assert time.monotonic() - killed < 10, node1.text()
    assert "gpucoll run: node 0, which hosts the job's store, was lost" in node1.err(), node1.err()
    node0.finish()
    assert not any(alive(pid) for pid in pids(node0) + pids(node1))
