"""gpucoll.distributed.init_process_group meets the way torch.distributed does: the tutorial's
MASTER_ADDR/MASTER_PORT template, RANK/WORLD_SIZE, tcp:// and file:// init methods; each wrong
setting refused in one line naming what the script passed or set, before anything is sent;
``dist.reduce_op`` as torch's."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import warnings

import numpy as np
import pytest
from multiproc import spawn

import gpucoll.distributed as dist
from gpucoll.errors import StoreError
from gpucoll.store import TCPStore

pytestmark = pytest.mark.timeout(120)

_LAUNCHER_PREFIXES = ("GPUCOLL_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "SLURM_", "OMPI_",
                      "PMI_", "PMIX_", "MPI_", "TORCHELASTIC_", "GROUP_RANK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def bare_env(monkeypatch):
    """No launcher's variables: what a script started by hand sees."""
    for var in list(os.environ):
        if var.startswith(_LAUNCHER_PREFIXES):
            monkeypatch.delenv(var)
    return monkeypatch


def _refusal(**kw) -> str:
    """The message of the ValueError init_process_group raises (it must raise one)."""
    with pytest.raises(ValueError) as info:
        dist.init_process_group("gloo", timeout=5, **kw)
    assert not dist.is_initialized()
    message = str(info.value)
    assert message.startswith("init_process_group: "), message
    assert "gpucoll.init" not in message and "GPUCOLL_" not in message, message
    assert "\n" not in message
    return message


# -- ranks that meet ---------------------------------------------------------------------------

def _tutorial(rank: int, n: int, port: int) -> tuple:
    """The tutorial's template: MASTER_ADDR/MASTER_PORT set in the process, rank and world
    size passed."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=n, timeout=30)
    try:
        x = np.array([rank + 1.0])
        dist.all_reduce(x)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            most = dist.reduce_op.MAX
        y = np.array([float(rank)])
        dist.all_reduce(y, op=most)
        answered = None
        if rank == 1:  # rank 0 hosts the job's store at MASTER_ADDR:MASTER_PORT itself
            probe = TCPStore("127.0.0.1", port, timeout=5)
            answered = probe.port
            probe.close()
        return x.item(), y.item(), answered
    finally:
        dist.destroy_process_group()


def test_the_tutorial_template_meets_at_master_addr_and_master_port(bare_env):
    port = _free_port()
    got = spawn(_tutorial, 2, port, timeout=90)
    assert got == [(3.0, 1.0, None), (3.0, 1.0, port)]


def _again(rank: int, n: int, port: int) -> list:
    """The tutorial's start-up, three times over in each process, at the same MASTER_PORT."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    got = []
    for start in range(3):
        dist.init_process_group("gloo", rank=rank, world_size=n, timeout=30)
        x = np.array([float(rank + start)])
        dist.all_reduce(x)
        got.append(x.item())
        dist.destroy_process_group()  # on rank 0 this closes the store the others just left
    return got


def test_a_job_that_starts_again_at_the_same_master_port_meets_in_the_new_store(bare_env):
    assert spawn(_again, 2, _free_port(), timeout=90) == [[1.0, 3.0, 5.0]] * 2


def _from_env(rank: int, n: int, port: int) -> tuple:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(n))
    dist.init_process_group("gloo", init_method="env://", timeout=30)
    try:
        return dist.get_rank(), dist.get_world_size()
    finally:
        dist.destroy_process_group()


def test_env_init_reads_rank_and_world_size_when_not_passed(bare_env):
    assert spawn(_from_env, 2, _free_port(), timeout=90) == [(0, 2), (1, 2)]


def _at(rank: int, n: int, init_method: str) -> float:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=n, timeout=30)
    try:
        x = np.array([2.0 ** rank])
        dist.all_reduce(x)
        return x.item()
    finally:
        dist.destroy_process_group()


def test_tcp_init_method_meets_where_it_says(bare_env):
    got = spawn(_at, 3, f"tcp://127.0.0.1:{_free_port()}", timeout=90)
    assert got == [7.0, 7.0, 7.0]


def _through_file(rank: int, n: int, path: str) -> tuple:
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=n,
                            timeout=30)
    try:
        x = np.array([rank + 1.0])
        dist.all_reduce(x)
        gone = not os.path.exists(path)  # every rank joined: rank 0 removed it
        dist.barrier()
        return x.item(), gone
    finally:
        dist.destroy_process_group()


def test_file_init_method_meets_through_the_file_and_leaves_nothing_there(bare_env, tmp_path):
    path = str(tmp_path / "rendezvous")
    got = spawn(_through_file, 2, path, timeout=90)
    assert got[0] == (3.0, True) and got[1][0] == 3.0
    assert os.listdir(tmp_path) == []
    assert spawn(_through_file, 2, path, timeout=90)[0] == (3.0, True)  # the path serves again


def _through_file_again(rank: int, n: int, path: str) -> list:
    got = []
    for _ in range(3):
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=n,
                                timeout=30)
        got.append(dist.get_world_size())
        dist.destroy_process_group()  # at once: rank 0 may not have removed the file yet
    return got


def test_file_init_method_starts_again_in_the_same_processes(bare_env, tmp_path):
    assert spawn(_through_file_again, 2, str(tmp_path / "rdv"), timeout=90) == [[2, 2, 2]] * 2


def test_file_init_method_gets_past_a_file_an_earlier_job_left(bare_env, tmp_path):
    path = tmp_path / "rendezvous"
    path.write_text(f"{socket.gethostname()} {_free_port()} 0123456789abcdef\n")  # nobody there
    got = spawn(_through_file, 2, str(path), timeout=90)
    assert [x for x, _ in got] == [3.0, 3.0]


def _wrong_size(rank: int, n: int, port: int) -> str:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=n + rank, timeout=20)
    except ValueError as e:
        return f"{type(e).__name__}: {e}"
    dist.destroy_process_group()
    return "joined"


def test_ranks_given_different_world_sizes_are_both_told_so(bare_env):
    got = spawn(_wrong_size, 2, _free_port(), timeout=90)
    for message in got:
        assert message.startswith("RendezvousError: init_process_group: "), message
        assert "world size 2" in message and "world size 3" in message, message


# -- refused in one line, before anything is sent ------------------------------------------------

def test_master_port_that_is_not_a_number_is_refused(bare_env):
    bare_env.setenv("MASTER_ADDR", "127.0.0.1")
    bare_env.setenv("MASTER_PORT", "29500a")
    assert _refusal(rank=0, world_size=2) == (
        "init_process_group: MASTER_PORT='29500a' is not a port number (an integer from 1 to "
        "65535)")


def test_master_addr_without_master_port_is_refused(bare_env):
    bare_env.setenv("MASTER_ADDR", "127.0.0.1")
    assert _refusal(rank=0, world_size=2) == (
        "init_process_group: MASTER_ADDR is set but MASTER_PORT is not; env:// needs both (rank "
        "0 hosts the store at MASTER_ADDR:MASTER_PORT)")


def test_file_init_method_in_a_missing_directory_is_refused(bare_env, tmp_path):
    where = tmp_path / "no" / "such"
    message = _refusal(init_method=f"file://{where}/rdv", rank=1, world_size=2)
    assert f"the directory {where} does not exist" in message


def test_without_rank_and_world_size_anywhere_the_variables_are_named(bare_env):
    assert _refusal() == (
        "init_process_group: rank and world_size not passed and RANK and WORLD_SIZE not set "
        "(env://); pass rank= and world_size=, set RANK and WORLD_SIZE, or start the script "
        "with gpucoll run or torchrun")


def test_world_size_alone_not_passed_names_world_size(bare_env):
    bare_env.setenv("MASTER_ADDR", "127.0.0.1")
    bare_env.setenv("MASTER_PORT", str(_free_port()))
    assert "world_size not passed and WORLD_SIZE not set" in _refusal(rank=0)


def test_ranks_that_do_not_say_where_they_meet_are_told_the_ways(bare_env):
    message = _refusal(rank=0, world_size=2)
    for way in ("MASTER_ADDR", "MASTER_PORT", "init_method='tcp://HOST:PORT'", "file:///PATH"):
        assert way in message


@pytest.mark.parametrize("method", ["mpi://x", "tcp://127.0.0.1", "file://relative/path"])
def test_an_init_method_torch_does_not_document_or_a_malformed_one_is_refused(bare_env, method):
    assert f"init_method={method!r}" in _refusal(init_method=method, rank=0, world_size=2)


def test_a_rank_outside_the_world_is_refused(bare_env):
    assert _refusal(init_method="tcp://127.0.0.1:1", rank=2, world_size=2) == (
        "init_process_group: need 0 <= rank < world_size, got rank=2, world_size=2")


def test_a_port_rank_0_cannot_bind_names_master_port(bare_env):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        bare_env.setenv("MASTER_ADDR", "127.0.0.1")
        bare_env.setenv("MASTER_PORT", str(taken.getsockname()[1]))
        with pytest.raises(Exception, match="init_process_group on rank 0 of 2: cannot host the "
                                             "store at MASTER_ADDR:MASTER_PORT"):
            dist.init_process_group("gloo", rank=0, world_size=2, timeout=5)
    assert not dist.is_initialized()


# -- reduce_op ---------------------------------------------------------------------------------

def test_reduce_op_is_reduce_op_with_torchs_deprecation_warning():
    torch_dist = pytest.importorskip("torch.distributed")
    for name in ("SUM", "PRODUCT", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR"):
        with pytest.warns(FutureWarning, match="reduce_op` is deprecated"):
            ours = getattr(dist.reduce_op, name)
        with pytest.warns(FutureWarning, match="reduce_op` is deprecated"):
            theirs = getattr(torch_dist.reduce_op, name)
        assert ours is getattr(dist.ReduceOp, name)
        assert theirs == getattr(torch_dist.ReduceOp, name)


def test_a_store_of_torchs_is_refused_naming_gpucolls(bare_env):
    torch_dist = pytest.importorskip("torch.distributed")
    message = _refusal(store=torch_dist.HashStore(), rank=0, world_size=1)
    assert message.startswith("init_process_group: store=HashStore is torch's; pass a gpucoll "
                              "TCPStore"), message


# -- get_node_local_rank -----------------------------------------------------------------------

def test_node_local_rank_comes_from_the_launcher_else_the_fallback_else_an_error(bare_env):
    with pytest.raises(RuntimeError, match="LOCAL_RANK is not set .* pass fallback_rank="):
        dist.get_node_local_rank()
    assert dist.get_node_local_rank(fallback_rank=3) == 3
    bare_env.setenv("LOCAL_RANK", "1")
    assert dist.get_node_local_rank(fallback_rank=3) == 1


# -- the end of a group --------------------------------------------------------------------------

def _client_process(port: int) -> subprocess.Popen:
    """Another process connected to the store at ``port``: it adds to a key and leaves once it
    reads a line (an add: it waits for the store's answer)."""
    code = ("import sys; from gpucoll import TCPStore\n"
            f"s = TCPStore('127.0.0.1', {port}, timeout=10)\n"
            "print('in', flush=True); sys.stdin.readline(); s.add('still', 1); s.close()")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout.readline().strip() == "in"
    return proc


def test_the_hosting_rank_keeps_its_store_up_until_the_others_have_left():
    from gpucoll import init_methods

    hosted = TCPStore("127.0.0.1", 0, is_server=True, timeout=10)
    other = _client_process(hosted.port)
    try:
        closing = threading.Thread(target=init_methods.release, args=(hosted,))
        closing.start()
        closing.join(0.3)
        assert closing.is_alive()  # waiting for the other rank, up to 5 s
        other.communicate("go\n", timeout=20)
        assert other.returncode == 0
        closing.join(10)
        assert not closing.is_alive()
        with pytest.raises(StoreError):
            TCPStore("127.0.0.1", hosted.port, timeout=0.5)  # closed once the other left
    finally:
        other.kill()


def test_the_hosting_rank_closes_its_store_at_the_bound_when_a_rank_stays(monkeypatch):
    from gpucoll import init_methods

    monkeypatch.setattr(init_methods, "_RELEASE_WAIT", 0.2)
    hosted = TCPStore("127.0.0.1", 0, is_server=True, timeout=10)
    stays = _client_process(hosted.port)
    try:
        start = time.monotonic()
        init_methods.release(hosted)
        assert time.monotonic() - start < 3
        stays.communicate("go\n", timeout=20)
        assert stays.returncode != 0  # its store went at the bound
    finally:
        stays.kill()
