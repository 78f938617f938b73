"""Scripts written the mpi4py way, without ``close()``: a process that ends closes its
communicators at exit, and the one hosting the job's store (rank 0 under mpirun and other
launchers without a store of their own) keeps it up until the other ranks have left it."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
from launch_helpers import launching, write_script

from gpucoll.store import TCPStore

# Rank 0 does nothing but meet the others, and ends at once without close(); the others come
# late to each step, then send to rank 1 and all_reduce among themselves, long after rank 0's
# script ended. Without the store (or with rank 0 dead to them) they fail.
EARLY_EXIT = """
    import time
    import numpy as np
    import gpucoll

    comm = gpucoll.init()
    rank, size = comm.rank, comm.size
    if rank != 0:
        time.sleep(0.2)
    group = comm.new_group(list(range(1, size)))
    if rank != 0:
        time.sleep(0.2)
        if rank == 1:
            data = np.empty(4, np.float64)
            for peer in range(2, size):
                comm.recv(data, src=peer)
                assert data[0] == peer, data
        else:
            comm.send(np.full(4, rank, np.float64), dst=1)
        x = np.full(3, rank, np.float64)
        group.all_reduce(x)
        assert x[0] == sum(range(1, size)), x
        print(f"rank {rank} ok", flush=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_by_hand(script: str, size: int, cwd) -> list[subprocess.CompletedProcess]:
    """``size`` ranks started by hand with torchrun's variables and no agent store, so that rank
    0 hosts the job's store at MASTER_PORT + 1, as under mpirun."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUCOLL_", "OMPI_"))}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port() - 1),
               WORLD_SIZE=str(size))
    procs = [subprocess.Popen([sys.executable, script], cwd=str(cwd), text=True,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for r in range(size)]
    done = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=60)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return done


@pytest.mark.timeout(120)
def test_ranks_go_on_after_rank_0_ends_without_closing_under_gpucoll_run(tmp_path):
    with launching(tmp_path) as launch:
        job = launch(["-n", "3", write_script(tmp_path, EARLY_EXIT)])
        assert job.finish(timeout=90) == 0, job.text()
    assert "rank 1 ok" in job.out() and "rank 2 ok" in job.out(), job.text()


@pytest.mark.timeout(120)
def test_rank_0_hosting_the_store_keeps_it_until_the_others_have_left(tmp_path):
    done = run_by_hand(write_script(tmp_path, EARLY_EXIT), 3, tmp_path)
    for r, d in enumerate(done):
        assert d.returncode == 0, f"rank {r}:\n{d.stdout}\n{d.stderr}"
    assert [d.stdout.strip() for d in done] == ["", "rank 1 ok", "rank 2 ok"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_script_without_close_passes_ten_runs_in_a_row_under_mpirun(tmp_path):
    mpirun = shutil.which("mpirun") or pytest.skip("mpirun is not installed")
    script = write_script(tmp_path, EARLY_EXIT)
    for attempt in range(10):
        done = subprocess.run([mpirun, "--allow-run-as-root", "--oversubscribe", "-n", "3",
                               sys.executable, script], cwd=tmp_path, capture_output=True,
                              text=True, timeout=50)
        assert done.returncode == 0, f"run {attempt}:\n{done.stdout}\n{done.stderr}"
        assert "rank 1 ok" in done.stdout and "rank 2 ok" in done.stdout, done.stdout


def test_the_store_host_knows_which_other_processes_are_connected():
    with TCPStore("127.0.0.1", 0, is_server=True, timeout=10) as server:
        mine = server.new_client()  # a connection of this same process does not count
        assert server.other_clients(0.01) == []
        child = subprocess.Popen(
            [sys.executable, "-c", "import sys, time; from gpucoll.store import TCPStore; "
             f"s = TCPStore('127.0.0.1', {server.port}, timeout=10); print('up', flush=True); "
             "sys.stdin.read(); s.close()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline() == "up\n"
            assert len(server.other_clients(0.2)) == 1
            start = time.monotonic()
            child.stdin.close()  # it closes its connection and ends
            assert server.other_clients(10) == []
            assert time.monotonic() - start < 5
        finally:
            child.kill()
            child.wait()
        mine.close()


def test_a_client_cannot_ask_for_the_other_clients():
    with TCPStore("127.0.0.1", 0, is_server=True, timeout=10) as server:
        with server.new_client() as client, pytest.raises(ValueError, match="is_server=True"):
            client.other_clients(1)


@pytest.mark.timeout(60)
def test_the_store_host_gives_up_on_a_process_that_never_leaves_and_says_so(tmp_path):
    # a world of one hosts its own store; another process connects to it and stays
    code = """
import subprocess, sys, time
import gpucoll
comm = gpucoll.init(timeout=1)
store = comm._owned_store
child = subprocess.Popen([sys.executable, "-c", "import time; from gpucoll.store import "
                          f"TCPStore; s = TCPStore('127.0.0.1', {store.port}, timeout=10); "
                          "print('up', flush=True); time.sleep(60)"], stdout=subprocess.PIPE,
                         text=True)
assert child.stdout.readline() == "up\\n"
start = time.monotonic()
comm.close()
print(f"closed after {time.monotonic() - start:.1f} s", flush=True)
child.kill()
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUCOLL_", "OMPI_"))}
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=50, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    seconds = float(done.stdout.split("closed after ")[1].split()[0])
    assert 0.9 <= seconds < 5, done.stdout
    assert ("gpucoll: rank 0 of 1 hosts the job's store and stops it now, although 1 other "
            "process still uses it after 1 s (127.0.0.1:") in done.stderr, done.stderr
