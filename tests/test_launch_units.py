"""The launcher's parts on their own: GPU discovery, exit statuses, checks, line splitting."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from gpucoll.errors import LaunchError
from gpucoll.launch.config import (
    LaunchConfig,
    device_env,
    rank_env,
    thread_env,
    validate,
    visible_gpus,
)
from gpucoll.launch.supervisor import (
    MAX_LINE,
    TAIL_LINES,
    TAIL_WIDTH,
    Console,
    RankOutput,
    describe,
    exit_status,
    root_cause,
)


class Sink:
    """A byte stream that records what it was given, one write at a time."""

    def __init__(self):
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def flush(self) -> None:
        pass


def pump(chunks: list[bytes], stream: str = "stdout", log: str | None = None):
    """Feed ``chunks`` through a pipe into a RankOutput for rank 2; return (writes, output)."""
    out, err = Sink(), Sink()
    output = RankOutput(2, Console(out, err), log)
    r, w = os.pipe()
    output.start(stream, r)
    for chunk in chunks:
        os.write(w, chunk)
    os.close(w)
    output.join(10)
    return (out if stream == "stdout" else err).writes, output


def test_cuda_visible_devices_decides_which_gpus_are_visible():
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "3,1"}) == ["3", "1"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-aa11,GPU-bb22"}) == ["GPU-aa11", "GPU-bb22"]


@pytest.mark.parametrize("listed", ["", "-1", "-1,0"])
def test_cuda_visible_devices_can_hide_every_gpu(listed):
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": listed}) == []


def test_gpus_are_counted_from_the_driver_device_nodes(tmp_path):
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "null"):
        (tmp_path / name).touch()
    assert visible_gpus({}, dev_dir=str(tmp_path), proc_dir="/nonexistent") == ["0", "1"]


def test_no_driver_means_no_gpus(tmp_path):
    assert visible_gpus({}, dev_dir=str(tmp_path), proc_dir=str(tmp_path / "none")) == []


def test_isolated_ranks_see_only_their_own_gpu():
    assert device_env(1, ["4", "5"], isolate=True) == {"CUDA_VISIBLE_DEVICES": "5"}
    assert device_env(1, ["4", "5"], isolate=False) == {}
    assert device_env(1, [], isolate=True) == {}


def test_ranks_of_node_one_continue_the_numbering_of_node_zero():
    cfg = LaunchConfig("x.py", nproc=4, nnodes=2, node_rank=1, token="t")
    env = rank_env(cfg, 2, ("10.0.0.1", 29400), "t", 29401, [])
    assert (env["RANK"], env["GPUCOLL_RANK"], env["LOCAL_RANK"]) == ("6", "6", "2")
    assert env["WORLD_SIZE"] == "8" and env["LOCAL_WORLD_SIZE"] == "4"
    assert env["GPUCOLL_STORE"] == "tcp://10.0.0.1:29400" and env["MASTER_PORT"] == "29401"


def test_openmp_threads_are_set_as_torchrun_sets_them_by_ranks_per_node():
    assert thread_env(LaunchConfig("x.py", nproc=2), {}) == {"OMP_NUM_THREADS": "1"}
    assert thread_env(LaunchConfig("x.py", nproc=2), {"OMP_NUM_THREADS": "4"}) == {}
    assert thread_env(LaunchConfig("x.py", nproc=1, nnodes=4, token="t"), {}) == {}


@pytest.mark.parametrize("code, status, text", [
    (0, 0, "exit code 0"),
    (3, 3, "exit code 3"),
    (-signal.SIGKILL, 137, "signal SIGKILL (exit 137)"),
    (-signal.SIGSEGV, 139, "signal SIGSEGV (exit 139)"),
])
def test_exit_statuses_follow_the_shell_convention(code, status, text):
    assert exit_status(code) == status
    assert describe(code) == text


def test_the_root_cause_report_names_rank_exit_and_last_stderr():
    text = root_cause(5, 1, 2, 4242, 3, 1.25, ["Traceback", "ValueError: bad"],
                             ["rank 4: exit code 0"])
    assert "rank 5 failed first" in text and "local rank 1 on node 2, pid 4242" in text
    assert "exit code 3" in text and "ValueError: bad" in text and "rank 4: exit code 0" in text


@pytest.mark.parametrize("kwargs, message", [
    ({"nproc": 0}, "-n must be at least 1"),
    ({"nnodes": 2, "node_rank": 2, "token": "t"}, "--node-rank must be in [0, 2)"),
    ({"nnodes": 2, "node_rank": 1, "token": "t"}, "--master-port is required"),
    ({"nnodes": 2, "master_port": 29400}, "needs one store token"),
    ({"timeout": 0.0}, "--timeout must be positive"),
    ({"grace": -1.0}, "--grace must not be negative"),
])
def test_impossible_jobs_are_refused_before_anything_starts(tmp_path, kwargs, message):
    script = tmp_path / "s.py"
    script.touch()
    with pytest.raises(LaunchError, match=message.replace("[", r"\[").replace(")", r"\)")):
        validate(LaunchConfig(str(script), **kwargs), environ={})


def test_device_mode_needs_a_gpu_per_rank(tmp_path):
    script = tmp_path / "s.py"
    script.touch()
    cfg = LaunchConfig(str(script), nproc=4, device=True)
    with pytest.raises(LaunchError, match="has 2 visible GPU"):
        validate(cfg, environ={"CUDA_VISIBLE_DEVICES": "0,1"})
    assert validate(cfg, environ={"CUDA_VISIBLE_DEVICES": "0,1,2,3"}) == ["0", "1", "2", "3"]


def test_a_missing_module_is_refused():
    with pytest.raises(LaunchError, match="module not found: 'no_such_module_xyz'"):
        validate(LaunchConfig("no_such_module_xyz", module=True), environ={})


def test_pieces_of_a_line_are_written_as_one_prefixed_line():
    writes, _ = pump([b"a", b"b", b"c\nd", b"e\n"])
    assert writes == [b"[rank 2] abc\n", b"[rank 2] de\n"]


def test_a_last_line_without_newline_is_still_written():
    writes, _ = pump([b"x\ntail"])
    assert writes == [b"[rank 2] x\n", b"[rank 2] tail\n"]


def test_bytes_that_are_not_text_pass_unchanged():
    writes, _ = pump([b"\x00\xff\xfe\r\n"])
    assert writes == [b"[rank 2] \x00\xff\xfe\r\n"]


def test_an_endless_line_is_cut_at_the_limit():
    writes, _ = pump([b"z" * (MAX_LINE + 10) + b"\n"])
    assert [len(w) for w in writes] == [len("[rank 2] ") + MAX_LINE + 1, len("[rank 2] ") + 11]


def test_the_stderr_tail_keeps_the_last_lines():
    lines = [f"line {i}".encode() for i in range(TAIL_LINES + 5)]
    _, output = pump([b"\n".join(lines) + b"\n"], stream="stderr")
    assert output.last_stderr() == [f"line {i}" for i in range(5, TAIL_LINES + 5)]


def test_long_stderr_lines_are_cut_in_the_report_tail():
    _, output = pump([b"e" * (TAIL_WIDTH + 50) + b"\n"], stream="stderr")
    assert output.last_stderr() == ["e" * TAIL_WIDTH + " [...]"]


def test_tee_log_holds_the_lines_without_prefix(tmp_path):
    log = tmp_path / "rank-2.log"
    pump([b"one\ntwo\n"], log=str(log))
    assert log.read_bytes() == b"one\ntwo\n"


def test_a_closed_console_does_not_stop_the_pump():
    class Closed(Sink):
        def write(self, data):
            raise BrokenPipeError

    console = Console(Closed(), Sink())
    output = RankOutput(0, console)
    r, w = os.pipe()
    output.start("stdout", r)
    writer = threading.Thread(target=lambda: (os.write(w, b"x\n" * 50000), os.close(w)))
    writer.start()
    writer.join(30)
    output.join(10)
    assert not writer.is_alive()


def test_lines_written_to_a_terminal_first_clear_a_progress_line_drawn_there():
    master, slave = os.openpty()
    try:
        with open(slave, "wb", closefd=False) as tty:
            console = Console(Sink(), tty)
            console.write("stderr", b"[rank 0] hello\n")
        assert os.read(master, 4096).startswith(b"\r\x1b[K[rank 0] hello")
        assert console.terminal_env() == {"GPUCOLL_TTY": os.ttyname(slave)}
    finally:
        os.close(master)
        os.close(slave)


def test_lines_written_to_pipes_and_files_are_left_as_they_are():
    out, err = Sink(), Sink()
    console = Console(out, err)
    console.write("stdout", b"[rank 1] x\n")
    assert out.writes == [b"[rank 1] x\n"] and console.terminal_env() == {}


# --- --bind --------------------------------------------------------------------------------

TOPOLOGY = os.path.join(os.path.dirname(__file__), "data", "topology")


def _topology(stem: str) -> str:
    return next(os.path.join(TOPOLOGY, f) for f in sorted(os.listdir(TOPOLOGY))
                if f.startswith(stem) and f.endswith(".txt"))


def _bind(nproc, stem, gpus=(), environ=None, allowed=frozenset(range(256)), nodes=None,
          node_rank=0, nnodes=1):
    from gpucoll.launch.config import bindings

    cfg = LaunchConfig(program="x.py", nproc=nproc, nnodes=nnodes, node_rank=node_rank,
                       bind=True, topology=_topology(stem) if stem else None, token="t")
    return bindings(cfg, list(gpus), environ or {}, set(allowed), nodes or {})


def test_bind_pins_each_rank_to_its_gpus_cpus_and_exports_its_nearest_nics():
    b = _bind(2, "dgx-a100", gpus=["2", "3"])
    assert b[0].cpus == frozenset(set(range(16, 32)) | set(range(144, 160)))
    assert b[0].env == {"NCCL_IB_HCA": "=mlx5_2,mlx5_3", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert b[1].line.startswith("rank 1: GPU3, CPUs 16-31,144-159 (NUMA 1), NICs mlx5_2, "
                                "mlx5_3 (PXB); pinned to CPUs 16-31,144-159")


def test_bind_numbers_ranks_of_later_nodes_after_the_earlier_ones():
    b = _bind(2, "dgx-a100", gpus=["0", "1"], node_rank=1, nnodes=2)
    assert [x.line.split(":")[0] for x in b] == ["rank 2", "rank 3"]


def test_bind_keeps_what_the_user_set_and_says_so():
    b = _bind(1, "dgx-a100", gpus=["0"], environ={"NCCL_IB_HCA": "mlx5_9",
                                                   "CUDA_DEVICE_ORDER": "FASTEST_FIRST"})
    assert b[0].env == {} and "NCCL_IB_HCA already set, kept" in b[0].line


def test_bind_takes_a_blank_affinity_from_the_numa_node_of_this_machine():
    b = _bind(1, "hgx-h200", gpus=["1"], nodes={0: {0, 1, 2, 3}, 1: {4, 5, 6, 7}})
    assert b[0].cpus == frozenset({0, 1, 2, 3}) and b[0].env["NCCL_IB_HCA"] == "=mlx5_3"


def test_bind_does_not_pin_to_cpus_this_machine_lacks_and_says_so():
    b = _bind(1, "dgx-a100", gpus=["0"], allowed={0, 1})
    assert b[0].cpus is None
    assert "not pinned: CPUs 48-63,176-191 are not among this launcher's (0-1)" in b[0].line
    assert b[0].env["NCCL_IB_HCA"] == "=mlx5_0,mlx5_1"  # the NICs still apply


def test_bind_leaves_a_gpu_the_topology_lacks_alone():
    b = _bind(2, "gtx1080ti", gpus=["0", "GPU-0b1c"])
    assert b[0].cpus is not None
    assert (b[1].cpus, b[1].env) == (None, {})
    assert b[1].line == "rank 1: GPU 'GPU-0b1c' is not in the topology: not pinned, no NIC " \
                        "exported"


def test_bind_without_gpus_spreads_ranks_over_the_numa_nodes():
    from gpucoll.launch.config import _numa_spread

    cfg = LaunchConfig(program="x.py", nproc=4, bind=True)
    b = _numa_spread(cfg, "no GPU", {0, 1, 2, 3}, {0: {0, 1}, 1: {2, 3}})
    assert [x.cpus for x in b] == [frozenset({0, 1})] * 2 + [frozenset({2, 3})] * 2
    assert all(x.env == {} for x in b) and "pinned to NUMA node 1 (CPUs 2-3)" in b[3].line


def test_bind_on_one_numa_node_without_gpus_pins_nothing_and_says_why_once():
    from gpucoll.launch.config import _numa_spread

    cfg = LaunchConfig(program="x.py", nproc=3, bind=True)
    b = _numa_spread(cfg, "no NVIDIA GPU on this machine", {0, 1}, {0: {0, 1}})
    assert [x.cpus for x in b] == [None] * 3 and [bool(x.line) for x in b] == [True, False, False]
    assert b[0].line == ("no GPU topology here (no NVIDIA GPU on this machine); one NUMA node "
                         "(CPUs 0-1): the ranks are not pinned and no NIC is exported")


def test_numa_nodes_are_read_from_sysfs(tmp_path):
    from gpucoll.launch.config import numa_nodes

    for node, cpus in (("node0", "0-3\n"), ("node1", "4-7,12\n")):
        (tmp_path / node).mkdir()
        (tmp_path / node / "cpulist").write_text(cpus)
    (tmp_path / "possible").write_text("0-1\n")
    assert numa_nodes(str(tmp_path)) == {0: {0, 1, 2, 3}, 1: {4, 5, 6, 7, 12}}
    assert numa_nodes(str(tmp_path / "none")) == {}


def test_topology_without_bind_or_missing_is_refused(tmp_path):
    with pytest.raises(LaunchError, match="--topology is what --bind reads"):
        validate(LaunchConfig(program=__file__, topology=_topology("a10")))
    with pytest.raises(LaunchError, match="--topology: no such file"):
        validate(LaunchConfig(program=__file__, bind=True, topology=str(tmp_path / "x")))


def test_launch_errors_are_exported_in_the_one_hierarchy():
    import pickle

    import gpucoll

    with pytest.raises(gpucoll.LaunchError) as info:
        validate(LaunchConfig(program="no-such-script.py"))
    assert isinstance(info.value, gpucoll.GpucollError) and isinstance(info.value, ValueError)
    assert str(pickle.loads(pickle.dumps(info.value))) == str(info.value)


# ---- torchrun's spellings, the default number of ranks, the start line --------------------------

def _parsed(argv: list[str], gpus: list[str] | None = None):
    from gpucoll.launch.cli import config_from, parser

    return config_from(parser().parse_args([*argv, "x.py"]), gpus=gpus or [])


@pytest.mark.parametrize("spelling", ["-n", "--nproc", "--nproc-per-node", "--nproc_per_node"])
def test_every_spelling_of_the_rank_count_is_accepted(spelling):
    assert _parsed([spelling, "3"]).nproc == 3


def test_torchrun_spellings_map_onto_the_launchers_options():
    cfg = _parsed(["--nnodes", "2", "--node_rank", "1", "--master_addr", "h0",
                   "--master_port", "29400"])
    assert (cfg.nnodes, cfg.node_rank, cfg.master_addr, cfg.master_port) == (2, 1, "h0", 29400)
    cfg = _parsed(["--node-rank", "1", "--nnodes", "2", "--master-addr", "h0",
                   "--master-port", "29400"])
    assert (cfg.nnodes, cfg.node_rank, cfg.master_addr, cfg.master_port) == (2, 1, "h0", 29400)


def test_without_n_there_is_one_rank_per_gpu():
    assert _parsed([], gpus=["0", "1", "2"]).nproc == 3


def test_without_n_or_a_gpu_the_ranks_follow_the_cores_from_2_to_4(monkeypatch):
    from gpucoll.launch.cli import default_nproc

    for cores, ranks in ((1, 2), (2, 2), (3, 3), (64, 4)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, c=cores: set(range(c)))
        assert default_nproc([]) == ranks


def test_the_start_line_names_the_backend_and_why(monkeypatch):
    from gpucoll.launch.cli import backend_line

    monkeypatch.delenv("GPUCOLL_BACKEND", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert backend_line(2, False, []) == \
        "gpucoll run: 2 ranks (no -n given), backend ring (no GPU found)"
    assert backend_line(1, True, []) == "gpucoll run: 1 rank, backend ring (no GPU found)"
    assert backend_line(4, False, ["0", "1", "2", "3"]) == (
        "gpucoll run: 4 ranks (one per GPU), backend nccl where every rank can use it, else "
        "ring (4 GPUs found)")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert backend_line(2, True, []).endswith("backend ring (CUDA_VISIBLE_DEVICES hides every GPU)")
    monkeypatch.setenv("GPUCOLL_BACKEND", "ring")
    assert backend_line(2, True, ["0"]).endswith("backend ring (GPUCOLL_BACKEND=ring)")
