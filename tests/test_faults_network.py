"""Faults of the network between two simulated hosts (benchmarks/multinode.py's network
namespaces joined by a veth pair, 2 ranks on each): a lossy link and a short outage are ridden
through with exact results, and a host that stops answering altogether is named within
GPUCOLL_LINK_TIMEOUT. Packets are dropped by iptables on both ends of the veth. Needs root,
``ip``, ``iptables`` and ``unshare``; skipped, saying why, elsewhere."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import time
import uuid

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import multinode  # noqa: E402

RANK_SCRIPT = ROOT / "tests" / "helpers" / "lossy_ranks.py"
PER_NODE = 2


def _missing() -> str | None:
    if shutil.which("iptables") is None:
        return "iptables is not installed"
    return multinode.missing_requirements()


pytestmark = [pytest.mark.slow, pytest.mark.timeout(180),
              pytest.mark.skipif(_missing() is not None,
                                 reason=f"cannot simulate two hosts: {_missing()}")]


class Job:
    """2 x ``PER_NODE`` ranks of ``lossy_ranks.py`` over the two hosts; killed on exit."""

    def __init__(self, hosts: multinode.Hosts, folder: pathlib.Path, seconds: float,
                 **env: str):
        self.folder = folder
        port = multinode.free_port()
        base = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",
                    GPUCOLL_BACKEND="ring", GPUCOLL_WORLD_SIZE=str(2 * PER_NODE),
                    GPUCOLL_LOCAL_WORLD_SIZE=str(PER_NODE), GPUCOLL_MASTER_ADDR=hosts.addr[0],
                    GPUCOLL_MASTER_PORT=str(port), GPUCOLL_STORE_TOKEN=uuid.uuid4().hex,
                    GPUCOLL_JOB_ID=uuid.uuid4().hex, **env)
        self.procs = []
        for rank in range(2 * PER_NODE):
            node = rank // PER_NODE
            rank_env = dict(base, GPUCOLL_RANK=str(rank), GPUCOLL_LOCAL_RANK=str(rank % PER_NODE),
                            GPUCOLL_NODE_RANK=str(node), GPUCOLL_HOST_ADDR=hosts.addr[node])
            log = open(folder / f"rank-{rank}.log", "w")  # noqa: SIM115 - closed with the job
            argv = [sys.executable, str(RANK_SCRIPT), str(seconds), str(folder)]
            self.procs.append((subprocess.Popen(hosts.command(node, argv), env=rank_env,
                                                stdout=log, stderr=subprocess.STDOUT), log))

    def wait_ready(self, timeout: float = 60) -> None:
        """Until every rank has made its first call (its ready file is there)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all((self.folder / f"ready-{r}").exists() for r in range(2 * PER_NODE)):
                return
            time.sleep(0.1)
        raise AssertionError("the ranks did not start:\n" + self.logs())

    def reports(self, timeout: float, killed: int | None = None) -> list[dict]:
        """Every rank's report (but ``killed``'s) once all have exited (AssertionError with
        their logs if one exits badly or they run past ``timeout``)."""
        deadline = time.monotonic() + timeout
        for rank, (proc, _) in enumerate(self.procs):
            try:
                code = proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                raise AssertionError("the ranks ran past the deadline:\n" + self.logs()) from None
            assert code == 0 or rank == killed, f"a rank exited with {code}:\n" + self.logs()
        return [json.loads((self.folder / f"rank-{r}.json").read_text())
                for r in range(2 * PER_NODE) if r != killed]

    def logs(self) -> str:
        return "\n".join(f"--- rank {r}\n" + (self.folder / f"rank-{r}.log").read_text()[-3000:]
                         for r in range(2 * PER_NODE))

    def kill(self) -> None:
        for proc, log in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            log.close()


def drop(hosts: multinode.Hosts, probability: float | None) -> None:
    """Drop each packet leaving either host over the veth with ``probability`` (1: every one);
    None: drop none again. (iptables' statistic match: netem is missing from some kernels.)"""
    for ns, dev in zip(hosts.ns, hosts.dev, strict=True):
        if probability is None:
            args = ["-F", "OUTPUT"]
        elif probability >= 1:
            args = ["-A", "OUTPUT", "-o", dev, "-j", "DROP"]
        else:
            args = ["-A", "OUTPUT", "-o", dev, "-m", "statistic", "--mode", "random",
                    "--probability", str(probability), "-j", "DROP"]
        subprocess.run(["ip", "netns", "exec", ns, "iptables", *args], check=True,
                       capture_output=True)


def _run(tmp_path, seconds: float, fault, timeout: float, killed: int | None = None,
         **env: str) -> tuple[list[dict], float]:
    """Start a job, let ``fault(hosts, job)`` act once every rank is calling (it returns when
    its fault began), and return the reports and that time."""
    with multinode.Hosts() as hosts:
        job = Job(hosts, tmp_path, seconds, **env)
        try:
            job.wait_ready()
            began = fault(hosts, job)
            return job.reports(timeout, killed), began
        finally:
            job.kill()


def _assert_exact_and_whole(reports: list[dict]) -> None:
    for r in reports:
        assert r["error"] is None, r
        assert r["exact"], r
    assert len({r["calls"] for r in reports}) == 1 and reports[0]["calls"] > 0, reports


def test_a_job_rides_through_ten_percent_packet_loss_with_exact_results(tmp_path):
    def loss(hosts, job):
        drop(hosts, 0.1)
        return time.time()

    reports, _ = _run(tmp_path, 25, loss, timeout=120)
    _assert_exact_and_whole(reports)


def test_a_job_rides_through_a_five_second_outage_with_exact_results(tmp_path):
    def outage(hosts, job):
        drop(hosts, 1)
        began = time.time()
        time.sleep(5)
        drop(hosts, None)
        return began

    reports, _ = _run(tmp_path, 12, outage, timeout=120)
    _assert_exact_and_whole(reports)


@pytest.mark.parametrize("link_timeout", [None, 5])
def test_a_host_that_stops_answering_is_named_within_the_link_timeout(tmp_path, link_timeout):
    bound = 15.0 if link_timeout is None else link_timeout
    env = {} if link_timeout is None else {"GPUCOLL_LINK_TIMEOUT": str(link_timeout)}

    def unplug(hosts, job):
        drop(hosts, 1)
        return time.time()

    reports, began = _run(tmp_path, 300, unplug, timeout=bound + 60, **env)
    for r in reports:
        assert r["kind"] == "PeerFailure", r
        other_host = range(PER_NODE, 2 * PER_NODE) if r["rank"] < PER_NODE else range(PER_NODE)
        assert r["peer"] in other_host, r
        assert bound - 3 <= r["at"] - began <= bound + 0.5, (r, began)


def test_a_rank_killed_on_the_other_host_is_named_at_once(tmp_path):
    victim = 2 * PER_NODE - 1

    def kill(hosts, job):
        job.procs[victim][0].kill()  # ip netns exec, unshare and sh exec it: this is the rank
        return time.time()

    reports, began = _run(tmp_path, 300, kill, timeout=60, killed=victim)
    for r in reports:
        assert r["kind"] == "PeerFailure" and r["peer"] == victim, r
        assert r["at"] - began < 1.0, (r, began)
