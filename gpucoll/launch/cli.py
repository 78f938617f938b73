"""``gpucoll run``: start N ranks of a Python script or module on this node, like torchrun.

Usage: ``gpucoll run -n 4 train.py --lr 0.1`` (also ``python -m gpucoll.run``). Everything after
the script (or ``-m module``) is passed to it unchanged.
"""

from __future__ import annotations

import argparse
import os

from gpucoll.errors import StoreError
from gpucoll.launch.config import LaunchConfig, LaunchError, validate
from gpucoll.launch.jobstore import JobStore, new_token, torch_port
from gpucoll.launch.supervisor import Job, console
from gpucoll.rendezvous import store_url

EPILOG = """\
Each rank gets GPUCOLL_RANK, GPUCOLL_WORLD_SIZE, GPUCOLL_LOCAL_RANK, GPUCOLL_LOCAL_WORLD_SIZE,
GPUCOLL_STORE (the job's store, hosted by this launcher on node 0) and GPUCOLL_STORE_TOKEN, plus
torchrun's RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT.
Output lines are prefixed "[rank R] ". When a rank fails the others are stopped and the launcher
exits with the failed rank's code (128+N for signal N); 124 when --timeout passes. With
--keep-going the others go on; see docs/launcher.md for the exit status then.
Ranks write their flight-recorder dumps to GPUCOLL_TRACE_DIR: the --tee directory, else the
variable's value, else a new directory under the temporary one, named at the end if a rank
wrote there. When
--timeout passes, and when the launcher gets SIGUSR1, it runs `gpucoll doctor` on the job and
prints the diagnosis.

several nodes: on every node run
  GPUCOLL_STORE_TOKEN=<shared secret> gpucoll run -n 8 --nnodes 2 --node-rank K \\
      --master-addr NODE0 --master-port 29400 train.py
"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpucoll run", description="Start N ranks of a script, one per GPU when there are "
        "GPUs, and supervise them.", epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--nproc", type=int, default=1, metavar="N",
                   help="ranks on this node (default 1)")
    p.add_argument("--nnodes", type=int, default=1, metavar="M", help="nodes in the job")
    p.add_argument("--node-rank", type=int, default=0, metavar="K", help="this node, 0..M-1")
    p.add_argument("--master-addr", default="127.0.0.1", metavar="A",
                   help="address of node 0, where the job's store listens (default 127.0.0.1)")
    p.add_argument("--master-port", type=int, default=0, metavar="P",
                   help="port of the job's store (default: any free port on one node)")
    p.add_argument("--token", default=None,
                   help="store token shared by all nodes (default: GPUCOLL_STORE_TOKEN for "
                   "several nodes, a fresh random one for one node); prefer the variable, "
                   "which other users cannot read in the process list")
    p.add_argument("--tee", metavar="DIR", help="also write each rank's output to DIR/rank-R.log")
    p.add_argument("--timeout", type=float, metavar="S",
                   help="stop the job after S seconds (after asking gpucoll doctor why it "
                   "has not finished)")
    p.add_argument("--keep-going", action="store_true",
                   help="when a rank dies, let the others go on (they may shrink their "
                   "communicator) instead of stopping them")
    p.add_argument("--grace", type=float, default=5.0, metavar="S",
                   help="seconds ranks get to end on their own after a failure or signal, "
                   "and again after SIGTERM, before SIGKILL (default 5)")
    p.add_argument("--device", action="store_true",
                   help="require one GPU per rank on this node (fail at start otherwise)")
    p.add_argument("--isolate-gpus", action="store_true",
                   help="let each rank see only its own GPU (CUDA_VISIBLE_DEVICES)")
    p.add_argument("-m", dest="module", action="store_true",
                   help="run PROGRAM as a module, like python -m")
    p.add_argument("program", metavar="PROGRAM", help="script.py (or module with -m)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to PROGRAM")
    return p


def config_from(ns: argparse.Namespace) -> LaunchConfig:
    token = ns.token
    if token is None and ns.nnodes > 1:
        token = os.environ.get("GPUCOLL_STORE_TOKEN") or None
    return LaunchConfig(
        program=ns.program, args=tuple(ns.args), module=ns.module, nproc=ns.nproc,
        nnodes=ns.nnodes, node_rank=ns.node_rank, master_addr=ns.master_addr,
        master_port=ns.master_port, tee=ns.tee, timeout=ns.timeout, grace=ns.grace,
        device=ns.device, isolate_gpus=ns.isolate_gpus, token=token, keep_going=ns.keep_going)


def main(argv: list[str] | None = None) -> int:
    """Parse, check, run the job; return the exit status (the failed rank's code on failure)."""
    cfg = config_from(parser().parse_args(argv))
    out = console()
    try:
        gpus = validate(cfg)
    except LaunchError as exc:
        out.write("stderr", f"gpucoll run: error: {exc}\n".encode())
        return 2
    if gpus and cfg.nproc > len(gpus):
        out.write("stderr", f"gpucoll run: note: {cfg.nproc} ranks share {len(gpus)} GPU(s); "
                  "NCCL needs one GPU per rank\n".encode())
    job = Job(cfg, gpus, out)
    try:
        return run_job(cfg, job)
    except (StoreError, OSError) as exc:
        out.write("stderr", f"gpucoll run: error: {exc}\n".encode())
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        job.cleanup()


def run_job(cfg: LaunchConfig, job: Job) -> int:
    """Host or join the job's store, run this node's ranks, and settle with the other nodes."""
    token = cfg.token or new_token()
    store = JobStore(cfg, token)
    try:
        host, port = store.address
        if cfg.nnodes > 1 and cfg.node_rank == 0:
            job.console.write("stderr", f"gpucoll run: store listening at "
                              f"{store_url(host, port)}\n".encode())
        job.on_failure = store.abort
        store.watch(job.events)
        job.launch((host, port), token, torch_port(cfg, port))
        status = job.supervise()
        return store.finish(status)
    finally:
        store.close()
