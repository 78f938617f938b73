"""Faults between hosts: two hosts simulated with network namespaces joined by a veth pair
(benchmarks/multinode.py's ``Hosts``), a launcher of one job on each, then the network between
them cut (every packet from the other host dropped, with iptables). Needs root, ``ip``,
``unshare`` and ``iptables``; skipped, saying why, elsewhere."""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest
from launch_helpers import write_script

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import multinode  # noqa: E402


def _missing() -> str | None:
    return multinode.missing_requirements() or (
        None if shutil.which("iptables") else "iptables is not installed")


pytestmark = [pytest.mark.slow, pytest.mark.timeout(180),
              pytest.mark.skipif(_missing() is not None,
                                 reason=f"cannot simulate two hosts: {_missing()}")]

@contextlib.contextmanager
def _two_nodes(tmp_path, script: str, nproc: int, grace: str, **env: str):
    """A launcher of one job on each simulated host, ``nproc`` ranks each, writing
    ``node{k}.out`` and ``node{k}.err`` in ``tmp_path``; yields (hosts, launchers) and kills every
    launcher's process group on the way out."""
    env = dict(os.environ, GPUCOLL_STORE_TOKEN="shared-secret-for-this-test", TMPDIR=str(tmp_path),
               **env)
    with multinode.Hosts() as hosts:
        port = multinode.free_port()
        launchers = []
        try:
            for k in range(2):
                argv = [sys.executable, "-m", "gpucoll", "run", "-n", str(nproc), "--nnodes",
                        "2", "--node-rank", str(k), "--master-addr", hosts.addr[0],
                        "--master-port", str(port), "--grace", grace, script]
                with open(tmp_path / f"node{k}.out", "wb") as out, \
                        open(tmp_path / f"node{k}.err", "wb") as err:
                    launchers.append(subprocess.Popen(hosts.command(k, argv), env=env,
                                                      cwd=tmp_path, stdout=out, stderr=err,
                                                      start_new_session=True))
            yield hosts, launchers
        finally:
            for proc in launchers:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(10)


# Each rank all_reduces until a peer is lost (then it fails, code 1).
ALL_REDUCING = """
    import time
    import numpy as np
    import gpucoll
    comm = gpucoll.init()
    x = np.ones(4, np.float32)
    comm.all_reduce(x)
    print("ready", flush=True)
    while True:
        comm.all_reduce(x)
        time.sleep(0.01)
"""


def cut(hosts: multinode.Hosts) -> None:
    """Drop every packet that reaches either host over the veth: a partition, no resets."""
    for ns, dev in zip(hosts.ns, hosts.dev, strict=True):
        subprocess.run(["ip", "netns", "exec", ns, "iptables", "-A", "INPUT", "-i", dev, "-j",
                        "DROP"], check=True, capture_output=True)


def wait_for(path: pathlib.Path, text: str, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while path.read_text(errors="replace").count(text) < count:
        if time.monotonic() > deadline:
            pytest.fail(f"{count} x {text!r} not in {path} within {timeout} s:\n"
                        f"{path.read_text(errors='replace')}")
        time.sleep(0.05)


def test_launchers_cut_apart_each_end_within_seconds_naming_the_other_node(tmp_path):
    script = write_script(tmp_path, ALL_REDUCING)
    # the ranks name the lost host at their link timeout (5 s here, 15 by default); each
    # launcher must then end within seconds of its ranks
    with _two_nodes(tmp_path, script, 2, "0.5", GPUCOLL_LINK_TIMEOUT="5") as (hosts, launchers):
        for k in range(2):
            wait_for(tmp_path / f"node{k}.out", "ready", 2, 60)
        cut(hosts)
        start = time.monotonic()
        codes, took = [], []
        for proc in launchers:
            codes.append(proc.wait(timeout=60))
            took.append(time.monotonic() - start)
    text = [f"{(tmp_path / f'node{k}.out').read_text(errors='replace')}"
            f"{(tmp_path / f'node{k}.err').read_text(errors='replace')}" for k in range(2)]
    assert codes == [1, 1], text
    assert "gpucoll run: node 1 was lost: its launcher has not been heard from" in text[0], text[0]
    assert "gpucoll run: node 0, which hosts the job's store, was lost" in text[1], text[1]
    assert max(took) < 12, (took, text)


# One rank per host, four communicators (the world and three splits); each rank says when its
# error came and when it had left every communicator.
LEAVING = """
    import time
    import numpy as np
    import gpucoll
    from gpucoll import PeerFailure
    try:
        with gpucoll.init() as comm:
            subs = [comm.split(0, comm.rank) for _ in range(3)]
            x = np.ones(4, np.float32)
            comm.all_reduce(x)
            print("ready", flush=True)
            try:
                while True:
                    for c in [comm, *subs]:
                        c.all_reduce(x)
                    time.sleep(0.01)
            except PeerFailure:
                raised = time.monotonic()
                raise
    except PeerFailure:
        print(f"left {time.monotonic() - raised:.3f} s after the error", flush=True)
"""


def test_a_rank_cut_off_from_the_store_leaves_four_communicators_within_a_second(tmp_path):
    script = write_script(tmp_path, LEAVING)
    out = tmp_path / "node1.out"
    with _two_nodes(tmp_path, script, 1, "5") as (hosts, _):
        for k in range(2):
            wait_for(tmp_path / f"node{k}.out", "ready", 1, 60)
        cut(hosts)
        wait_for(out, "after the error", 1, 30)
    seconds = float(out.read_text().split("left ")[1].split()[0])
    assert seconds < 1.0, out.read_text()
