#!/usr/bin/env python3
"""Two hosts on one machine: the host ring across a network beside gloo and Open MPI.

Each simulated host is a network namespace with an address and a host name of its own (a UTS
namespace), the two joined by a veth pair; ranks on one host share its memory, ranks on
different hosts talk TCP over the veth. Every library runs float32 all_reduce, in place, with
``--per-node`` ranks on each host, through ``gpucoll bench``'s engine (its correctness pass
included): gpucoll and gloo started by ``gpucoll run`` on each host (gloo bound to the veth
with GLOO_SOCKET_IFNAME), Open MPI by ``mpirun`` on the first host, which reaches the second
through an rsh agent that enters its namespace. It prints a table of time and busbw per size
and library, and writes JSON.

Needs root, ``ip`` (iproute2) and ``unshare`` (util-linux); peers that are not installed are
listed as skipped.

  sudo python benchmarks/multinode.py                        # 32 MiB, 3 rounds, results/
  python benchmarks/multinode.py -b 1M -e 32M --rounds 1 --libraries gpucoll,mpi
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator

from gpucoll.bench.engine import Result
from gpucoll.bench.libraries import peer_available

SUBNET = "10.213.{}.{}"
LIBRARIES = ("gpucoll", "gloo", "mpi")
JOB_TIMEOUT_S = 600


def missing_requirements() -> str | None:
    """Why two hosts cannot be simulated here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    return None


class Hosts:
    """Two network namespaces (``node0``, ``node1``) joined by a veth pair; removed on exit."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.ns = [f"gcb{tag}{i}" for i in range(2)]
        self.dev = [f"gcv{tag}{i}" for i in range(2)]
        net = int(tag[:2], 16) % 200 + 20  # a /24 of its own, so parallel runs do not clash
        self.addr = [SUBNET.format(net, i + 1) for i in range(2)]
        self.names = ["node0", "node1"]

    def __enter__(self) -> Hosts:
        try:
            for ns in self.ns:
                _ip("netns", "add", ns)
            _ip("link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1])
            for ns, dev, addr in zip(self.ns, self.dev, self.addr, strict=True):
                _ip("link", "set", dev, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for ns in self.ns:  # deleting a namespace deletes its end of the veth, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def command(self, node: int, argv: list[str]) -> list[str]:
        """``argv`` run inside host ``node``: its network namespace, under its host name."""
        return ["ip", "netns", "exec", self.ns[node], "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', self.names[node], *argv]

    def rsh_agent(self, folder: str) -> str:
        """A script Open MPI's launcher runs as ``agent HOST COMMAND`` to start its daemon on
        HOST: it enters that host's namespaces and runs the command in a shell."""
        cases = "\n".join(f"  {a}) exec ip netns exec {ns} unshare --uts sh -c "
                          f"\"hostname {name}; $*\" ;;"
                          for a, ns, name in zip(self.addr, self.ns, self.names, strict=True))
        path = os.path.join(folder, "rsh-agent")
        with open(path, "w") as f:
            f.write(f'#!/bin/sh\nhost=$1; shift\ncase $host in\n{cases}\n'
                    f'  *) echo "no host $host" >&2; exit 1 ;;\nesac\n')
        os.chmod(path, 0o755)
        return path


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def bench_args(minbytes: str, maxbytes: str, iters: int, warmup: int) -> list[str]:
    """The rank side of ``gpucoll bench``: float32 all_reduce (sum), sizes doubling."""
    return ["all_reduce", "-d", "float", "-o", "sum", "-n", str(iters), "-w", str(warmup),
            "-c", "1", "--timeout", "120", "-b", minbytes, "-e", maxbytes, "-f", "2"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_library(hosts: Hosts, library: str, per_node: int, args: list[str],
                folder: str) -> list[Result]:
    """One job of ``library`` over both hosts; the rows its rank 0 measured."""
    results = os.path.join(folder, f"{library}-{uuid.uuid4().hex[:6]}.jsonl")
    rank = ["-m", "gpucoll", "bench", *args, "--library", library, "--results", results]
    env = dict(os.environ, OMP_NUM_THREADS="1", GPUCOLL_STORE_TOKEN=uuid.uuid4().hex)
    if library == "mpi":
        agent = hosts.rsh_agent(folder)
        net = hosts.addr[0].rsplit(".", 1)[0] + ".0/24"
        argv = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", str(2 * per_node),
                "--host", ",".join(f"{a}:{per_node}" for a in hosts.addr),
                "--mca", "plm_rsh_agent", agent, "--mca", "btl_tcp_if_include", net,
                "--mca", "oob_tcp_if_include", net, "-x", "PATH", "-x", "OMP_NUM_THREADS",
                *_forward("PYTHONPATH", "VIRTUAL_ENV"), sys.executable, *rank]
        jobs = [subprocess.Popen(hosts.command(0, argv), env=env)]
    else:
        port = free_port()
        jobs = []
        for node in range(2):
            launch = [sys.executable, "-m", "gpucoll", "run", "-n", str(per_node), "--nnodes",
                      "2", "--node-rank", str(node), "--master-addr", hosts.addr[0],
                      "--master-port", str(port), *rank]
            node_env = dict(env, GLOO_SOCKET_IFNAME=hosts.dev[node])
            jobs.append(subprocess.Popen(hosts.command(node, launch), env=node_env))
    _wait(jobs, library)
    return _read(results, library)


def _forward(*names: str) -> list[str]:
    return [arg for n in names if n in os.environ for arg in ("-x", n)]


def _wait(jobs: list[subprocess.Popen], library: str) -> None:
    deadline = time.monotonic() + JOB_TIMEOUT_S
    try:
        for job in jobs:
            code = job.wait(max(deadline - time.monotonic(), 1))
            if code != 0:
                raise RuntimeError(f"{library} job exited with status {code}")
    finally:
        for job in jobs:
            if job.poll() is None:
                job.kill()
                job.wait()


def _read(path: str, library: str) -> list[Result]:
    rows, error = [], None
    with open(path) as f:
        for line in f:
            event = json.loads(line)
            if event["kind"] == "result":
                rows.append(Result.from_json(event["result"]))
            elif event["kind"] == "finish":
                error = event.get("error")
    if error:
        raise RuntimeError(f"{library}: {error}")
    return rows


def sweep(libraries: list[str], per_node: int, args: list[str], rounds: int) -> Iterator[dict]:
    """Every (round, library) job, rounds interleaving the libraries; one dict per row."""
    with Hosts() as hosts, tempfile.TemporaryDirectory() as folder:
        print(f"# hosts: network namespaces {', '.join(hosts.ns)} at {', '.join(hosts.addr)} "
              f"(removed at the end)", flush=True)
        for rnd in range(rounds):
            for lib in libraries:
                for r in run_library(hosts, lib, per_node, args, folder):
                    m = r.in_place
                    yield {"round": rnd, "library": lib, "size": r.size, "time_us": m.time_us,
                           "busbw": m.busbw, "wrong": m.wrong}


def summarize(rows: list[dict], libraries: list[str]) -> list[dict]:
    """Median time and busbw over rounds, per library and size."""
    out = []
    for lib in libraries:
        for size in sorted({r["size"] for r in rows if r["library"] == lib}):
            cells = [r for r in rows if r["library"] == lib and r["size"] == size]
            out.append({"library": lib, "size": size, "rounds": len(cells),
                        "time_us": statistics.median(c["time_us"] for c in cells),
                        "busbw": statistics.median(c["busbw"] for c in cells),
                        "wrong": sum(c["wrong"] or 0 for c in cells)})
    return out


def table(summary: list[dict], per_node: int, skipped: dict[str, str]) -> str:
    lines = [f"# float32 all_reduce, 2 hosts x {per_node} ranks (network namespaces, veth); "
             f"medians over rounds",
             f"# {'library':<10} {'size (B)':>12} {'time (us)':>12} {'busbw (GB/s)':>13} "
             f"{'#wrong':>7}"]
    for s in summary:
        lines.append(f"  {s['library']:<10} {s['size']:>12} {s['time_us']:>12.1f} "
                     f"{s['busbw']:>13.3f} {s['wrong']:>7}")
    lines += [f"# {lib}: skipped ({why})" for lib, why in skipped.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-b", "--minbytes", default="32M", help="smallest size (default 32M)")
    p.add_argument("-e", "--maxbytes", default="32M", help="largest size, doubling from the "
                   "smallest (default 32M)")
    p.add_argument("--per-node", type=int, default=2, help="ranks on each host (default 2)")
    p.add_argument("--rounds", type=int, default=3, help="jobs per library (default 3)")
    p.add_argument("--iters", type=int, default=20, help="timed iterations (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations (default 5)")
    p.add_argument("--libraries", default=",".join(LIBRARIES),
                   help="any of gpucoll, gloo, mpi (default all)")
    p.add_argument("--json", default=os.path.join("results", "multinode.json"))
    ns = p.parse_args(argv)
    why = missing_requirements()
    if why:
        print(f"multinode: cannot simulate two hosts here: {why}", file=sys.stderr)
        return 2
    wanted = [lib.strip() for lib in ns.libraries.split(",") if lib.strip()]
    unknown = [lib for lib in wanted if lib not in LIBRARIES]
    if unknown:
        p.error(f"unknown libraries {unknown}; expected some of {', '.join(LIBRARIES)}")
    skipped = {lib: peer_available(lib) for lib in wanted if lib != "gpucoll"}
    skipped = {lib: why for lib, why in skipped.items() if why}
    libraries = [lib for lib in wanted if lib not in skipped]
    args = bench_args(ns.minbytes, ns.maxbytes, ns.iters, ns.warmup)
    rows = list(sweep(libraries, ns.per_node, args, ns.rounds))
    summary = summarize(rows, libraries)
    print(table(summary, ns.per_node, skipped))
    os.makedirs(os.path.dirname(os.path.abspath(ns.json)), exist_ok=True)
    with open(ns.json, "w") as f:
        json.dump({"per_node": ns.per_node, "hosts": 2, "command": sys.argv, "rounds": ns.rounds,
                   "skipped": skipped, "summary": summary, "runs": rows}, f, indent=1)
    print(f"# wrote {ns.json}")
    return 1 if any(s["wrong"] for s in summary) else 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
