"""``gpucoll run``: start N ranks of a Python script or module on this node, like torchrun.

Usage: ``gpucoll run -n 4 train.py --lr 0.1`` (also ``python -m gpucoll run``). Everything after
the script (or ``-m module``) is passed to it unchanged.

The job's key-value store is hosted by node 0's launcher, not rank 0, so it is up before any
rank starts and outlives a rank that fails. A fresh random token keeps other jobs' ranks out of
it. In a job of several nodes the launchers also meet there: a node whose rank fails posts an
abort that stops the ranks of every other node, and node 0 keeps the store up until every node
has finished or is lost (each other launcher leaves a will there and beats: ``JobStore``).
"""

from __future__ import annotations

import argparse
import os
import queue
import secrets
import socket
import threading
import time

from gpucoll.errors import LaunchError, StoreError
from gpucoll.launch.config import LaunchConfig, bindings, thread_env, validate, visible_gpus
from gpucoll.launch.supervisor import Job, RemoteAbort, console, signals_to
from gpucoll.rendezvous import LAUNCHER_ABORT, launcher_abort, read_launcher_abort, store_url
from gpucoll.transport import shm

NO_GPU_MIN_RANKS, NO_GPU_MAX_RANKS = 2, 4  # -n's default without GPUs: the cores, within these
NO_GPU_RANKS_HELP = (f"this machine's CPU cores, at least {NO_GPU_MIN_RANKS} and at most "
                     f"{NO_GPU_MAX_RANKS}")

EPILOG = """\
Each rank gets GPUCOLL_RANK, GPUCOLL_WORLD_SIZE, GPUCOLL_LOCAL_RANK, GPUCOLL_LOCAL_WORLD_SIZE,
GPUCOLL_STORE (the job's store, hosted by this launcher on node 0) and GPUCOLL_STORE_TOKEN, plus
torchrun's RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT, and
OMP_NUM_THREADS=1 where it is unset and N > 1, as torchrun sets it.
Output lines are prefixed "[rank R] ". When a rank fails the others are stopped and the launcher
exits with the failed rank's code (128+N for signal N); 124 when --timeout passes. With
--keep-going the others go on; see docs/launcher.md for the exit status then.
Ranks write their flight-recorder dumps to GPUCOLL_TRACE_DIR: the --tee directory, else the
variable's value, else a new directory under the temporary one, named at the end if a rank
wrote there. When --timeout passes, and when the launcher gets SIGUSR1, it runs
`gpucoll doctor` on the job and prints the diagnosis.

several nodes: on every node run
  GPUCOLL_STORE_TOKEN=<shared secret> gpucoll run -n 8 --nnodes 2 --node-rank K \\
      --master-addr NODE0 --master-port 29400 train.py
"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpucoll run", description="Start N ranks of a script, one per GPU when there are "
        "GPUs, and supervise them.", epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    # torchrun's spellings (--nproc-per-node, --nproc_per_node, --node_rank, ...) work too
    p.add_argument("-n", "--nproc", "--nproc-per-node", "--nproc_per_node", type=int,
                   default=None, metavar="N", dest="nproc",
                   help="ranks on this node (default: one per GPU; without GPUs, "
                   f"{NO_GPU_RANKS_HELP})")
    p.add_argument("--nnodes", type=int, default=1, metavar="M", help="nodes in the job")
    p.add_argument("--node-rank", "--node_rank", type=int, default=0, metavar="K",
                   dest="node_rank", help="this node, 0..M-1")
    p.add_argument("--master-addr", "--master_addr", default="127.0.0.1", metavar="A",
                   dest="master_addr",
                   help="address of node 0, where the job's store listens (default 127.0.0.1)")
    p.add_argument("--master-port", "--master_port", type=int, default=0, metavar="P",
                   dest="master_port",
                   help="port of the job's store (default: any free port on one node)")
    p.add_argument("--token", default=None,
                   help="store token shared by all nodes (default: GPUCOLL_STORE_TOKEN for "
                   "several nodes, a fresh random one for one node); prefer the variable, "
                   "which other users cannot read in the process list")
    p.add_argument("--tee", metavar="DIR", help="also write each rank's output to DIR/rank-R.log")
    p.add_argument("--timeout", type=float, metavar="S",
                   help="stop the job after S seconds (after asking gpucoll doctor why it "
                   "has not finished)")
    p.add_argument("--verbose", action="store_true",
                   help="ranks' tracebacks of gpucoll errors show gpucoll's own frames too "
                        "(GPUCOLL_VERBOSE=1); by default one line says how many were left out")
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
    p.add_argument("--bind", action="store_true",
                   help="pin each rank to the CPUs of its GPU's NUMA node and export its GPU's "
                   "nearest NICs for NCCL (NCCL_IB_HCA, NCCL_SOCKET_IFNAME), from the topology "
                   "probe; without GPUs, spread the ranks over the NUMA nodes")
    p.add_argument("--topology", metavar="FILE",
                   help="with --bind: read a saved `nvidia-smi topo -m` output instead of "
                   "probing this machine")
    p.add_argument("-m", dest="module", action="store_true",
                   help="run PROGRAM as a module, like python -m")
    p.add_argument("program", metavar="PROGRAM", help="script.py (or module with -m)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to PROGRAM")
    return p


def default_nproc(gpus: list[str]) -> int:
    """Ranks when -n is not given: one per visible GPU; without GPUs, the CPU cores this
    process may use, at least 2 (so that collectives have a peer) and at most 4."""
    if gpus:
        return len(gpus)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    return min(max(cores, NO_GPU_MIN_RANKS), NO_GPU_MAX_RANKS)


def backend_line(nproc: int, given: bool, gpus: list[str], exchange: str | None = None) -> str:
    """The line the launcher prints at start: how many ranks, which backend, and why; and which
    small-message exchange the ranks load (``shm.exchange``), when given."""
    why_n = "" if given else " (one per GPU)" if gpus else " (no -n given)"
    chosen = os.environ.get("GPUCOLL_BACKEND", "").strip().lower()
    if chosen and chosen != "auto":
        backend = f"backend {chosen} (GPUCOLL_BACKEND={chosen})"
    elif not gpus:
        why = ("CUDA_VISIBLE_DEVICES hides every GPU" if "CUDA_VISIBLE_DEVICES" in os.environ
               else "no GPU found")
        backend = f"backend ring ({why})"
    else:
        backend = (f"backend nccl where every rank can use it, else ring "
                   f"({len(gpus)} GPU{'s' if len(gpus) > 1 else ''} found)")
    line = f"gpucoll run: {nproc} rank{'s' if nproc > 1 else ''}{why_n}, {backend}"
    return line if exchange is None else f"{line}, small-message exchange {exchange}"


def config_from(ns: argparse.Namespace, gpus: list[str] | None = None) -> LaunchConfig:
    token = ns.token
    if token is None and ns.nnodes > 1:
        token = os.environ.get("GPUCOLL_STORE_TOKEN") or None
    nproc = ns.nproc if ns.nproc is not None else default_nproc(
        visible_gpus() if gpus is None else gpus)
    return LaunchConfig(
        program=ns.program, args=tuple(ns.args), module=ns.module, nproc=nproc,
        nnodes=ns.nnodes, node_rank=ns.node_rank, master_addr=ns.master_addr,
        master_port=ns.master_port, tee=ns.tee, timeout=ns.timeout, grace=ns.grace,
        device=ns.device, isolate_gpus=ns.isolate_gpus, token=token, bind=ns.bind,
        topology=ns.topology, keep_going=ns.keep_going, verbose=ns.verbose)


def main(argv: list[str] | None = None) -> int:
    """Parse, check, run the job; return the exit status (the failed rank's code on failure)."""
    ns = parser().parse_args(argv)
    cfg = config_from(ns)
    out = console()
    try:
        gpus = validate(cfg)
    except LaunchError as exc:
        out.write("stderr", f"gpucoll run: error: {exc}\n".encode())
        return 2
    package = cfg.package()
    exchange, how = shm.exchange(package) if package else (None, None)
    out.write("stderr", (backend_line(cfg.nproc, ns.nproc is not None, gpus, exchange)
                         + "\n").encode())
    if how:
        out.write("stderr", f"gpucoll run: note: {how}\n".encode())
    if thread_env(cfg):
        out.write("stderr", f"gpucoll run: OMP_NUM_THREADS=1 for each rank, as torchrun sets it "
                  f"(unset, and {cfg.nproc} ranks share this node's cores); set OMP_NUM_THREADS "
                  f"to choose another value\n".encode())
    if gpus and cfg.nproc > len(gpus):
        out.write("stderr", f"gpucoll run: note: {cfg.nproc} ranks share {len(gpus)} GPU(s); "
                  "NCCL needs one GPU per rank\n".encode())
    try:
        binds = bindings(cfg, gpus) if cfg.bind else None
    except ValueError as exc:  # a --topology file that cannot be read (TopologyParseError)
        out.write("stderr", f"gpucoll run: error: --bind: {exc}\n".encode())
        return 2
    for b in binds or ():
        if b.line:
            out.write("stderr", f"gpucoll run: --bind: {b.line}\n".encode())
    job = Job(cfg, gpus, out, binds)
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
        with signals_to(job.events):  # forwarded from the first rank's start on
            job.launch((host, port), token, torch_port(cfg, port))
            status = job.supervise()
        try:
            return store.finish(status)
        except NodeLost as exc:
            job.console.write("stderr", f"gpucoll run: {exc}\n".encode())
            return status or NODE_LOST
    finally:
        store.close()


# ---- the job's store -----------------------------------------------------------------------------

JOIN_TIMEOUT = 300.0  # how long another node's launcher waits for node 0's store
BEAT = 0.5  # how often a launcher of another node says in the store that it is alive
LOST_AFTER = 5.0  # a node silent this long after its last beat is lost (its host or network)
PREFIX = "gpucoll-launch/"
ABORT = LAUNCHER_ABORT  # the ranks' start-up also watches it (gpucoll.rendezvous)
NODE_LOST = 1  # the exit status when a node was lost and every rank here succeeded


def new_token() -> str:
    return secrets.token_hex(16)


class NodeLost(Exception):
    """Another node's launcher is gone: its line for the console, naming the node."""


class JobStore:
    """The store as the launchers use it; ``address`` is what the ranks connect to.

    In a job of several nodes every launcher but node 0's leaves a will in the store, as ranks
    do (``lost/K = died`` when its connection ends), and beats there every ``BEAT`` seconds, so
    node 0 learns at once that a launcher was killed, and within ``LOST_AFTER`` seconds that
    its host or network went away. Node 0's death takes the store with it, which every other
    node sees as the store not answering.
    """

    def __init__(self, cfg: LaunchConfig, token: str):
        from gpucoll.store import TCPStore

        self.cfg = cfg
        if cfg.node_rank == 0:
            bind = cfg.master_addr if cfg.nnodes == 1 else "0.0.0.0"
            self.store = TCPStore(bind, cfg.master_port, is_server=True, token=token)
        else:
            self.store = TCPStore(cfg.master_addr, cfg.master_port, token=token,
                                  timeout=JOIN_TIMEOUT)
            self.store.set_will(f"{PREFIX}lost/{cfg.node_rank}", b"died")
            self.store.timeout = LOST_AFTER  # from now on node 0 answers by then, or is lost
        self.address = (cfg.master_addr, self.store.port)
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._store_lost: StoreError | None = None  # the watcher lost the store meanwhile
        self._store_heard = time.monotonic()  # when node 0's store last answered the watcher
        self._beats: dict[int, tuple[bytes, float]] = {}  # node: its last beat, when it came

    def watch(self, events: queue.SimpleQueue) -> None:
        """Post a :class:`RemoteAbort` on ``events`` if another node aborts the job."""
        if self.cfg.nnodes > 1:
            self._watcher = threading.Thread(target=self._watch, args=(events,), daemon=True,
                                             name="gpucoll-abort-watch")
            self._watcher.start()

    def _watch(self, events: queue.SimpleQueue) -> None:
        beat = f"{PREFIX}beat/{self.cfg.node_rank}"
        beats = [f"{PREFIX}beat/{k}" for k in range(1, self.cfg.nnodes)]
        count = 0
        while not self._stop.is_set():
            try:
                if self.cfg.node_rank != 0:
                    count += 1
                    self.store.set(beat, str(count))
                else:
                    self._heard_from(self.store.peek(beats))
                self.store.wait([ABORT], timeout=BEAT)
            except TimeoutError:
                if not self.store.stalled:  # the server's own answer: the store is there
                    self._store_heard = time.monotonic()
                continue
            except StoreError as exc:
                # node 0 closes the store only once this node said it finished: before that,
                # losing it means losing node 0
                self._store_lost = exc
                return
            status, _, reason = read_launcher_abort(self.store.get(ABORT))
            events.put(RemoteAbort(status, reason))
            return

    def _heard_from(self, beats: list[bytes | None]) -> None:
        """Node 0: note when each other node's beat last changed."""
        now = time.monotonic()
        for k, value in enumerate(beats, start=1):
            if value is not None and self._beats.get(k, (None,))[0] != value:
                self._beats[k] = (value, now)

    def _store_left(self) -> float:
        """Another node: how long node 0's store may still take to answer before it is lost
        (``LOST_AFTER`` after the last answer it gave, and at least a second)."""
        return max(LOST_AFTER - (time.monotonic() - self._store_heard), 1.0)

    def abort(self, status: int, rank: int, reason: str) -> None:
        """Tell every other node to stop its ranks, and the ranks still starting up that the
        job is over because ``rank`` failed (the first abort wins). Without the store (node 0
        lost) there is nobody to tell: ``finish`` says so."""
        if self.cfg.node_rank == 0:
            self.store.compare_set(ABORT, b"", launcher_abort(status, rank, reason))
            return
        try:
            if self._store_lost is None:
                self.store.compare_set(ABORT, b"", launcher_abort(status, rank, reason),
                                       timeout=self._store_left())
                self._store_heard = time.monotonic()
        except StoreError as exc:
            self._store_lost = exc

    def finish(self, status: int) -> int:
        """Record this node's exit status; node 0 waits for the others (the store is theirs
        too) and returns the first non-zero status among the nodes. A node found lost ends
        the wait: its line is printed by the caller (:class:`NodeLost`)."""
        self._stop.set()
        if self.cfg.nnodes == 1:
            return status
        if self.cfg.node_rank != 0:
            try:  # a round trip first: is node 0 still there to take the status?
                if self._store_lost is not None:
                    raise self._store_lost
                self.store.peek([ABORT], timeout=self._store_left())
                self.store.set(f"{PREFIX}done/{self.cfg.node_rank}", str(status))
            except StoreError as exc:
                raise NodeLost(f"node 0, which hosts the job's store, was lost (its launcher "
                               f"died or its host cannot be reached): {exc}") from None
            return status  # the will fires when this connection ends, after the status
        self.store.set(f"{PREFIX}done/0", str(status))
        others = range(1, self.cfg.nnodes)
        done = [f"{PREFIX}done/{k}" for k in others]
        lost = [f"{PREFIX}lost/{k}" for k in others]
        beats = [f"{PREFIX}beat/{k}" for k in others]
        deadline = time.monotonic() + JOIN_TIMEOUT
        while True:
            try:
                self.store.wait(done, timeout=BEAT)
                break
            except TimeoutError:
                pass
            now = time.monotonic()
            finished = self.store.peek(done)
            self._heard_from(self.store.peek(beats))
            for k, fin, will in zip(others, finished, self.store.peek(lost), strict=True):
                if fin is not None:
                    continue
                if will is not None:
                    raise NodeLost(f"node {k} was lost: its launcher died before its ranks "
                                   f"finished (killed, or its connection to the store broke)")
                if k in self._beats and now - self._beats[k][1] > LOST_AFTER:
                    raise NodeLost(f"node {k} was lost: its launcher has not been heard from "
                                   f"for {now - self._beats[k][1]:.1f} s (its host or the "
                                   f"network between the nodes went away)")
            if now >= deadline:
                missing = [k for k, fin in zip(others, finished, strict=True) if fin is None]
                raise NodeLost(f"node{'s' if len(missing) > 1 else ''} "
                               f"{', '.join(map(str, missing))} did not finish within "
                               f"{JOIN_TIMEOUT:g} s")
        statuses = [int(v) for v in self.store.multi_get([f"{PREFIX}done/0", *done])]
        return next((s for s in statuses if s), 0)

    def close(self) -> None:
        self._stop.set()
        self.store.close()  # first: it ends a wait of the watcher at once
        if self._watcher is not None:
            self._watcher.join(timeout=5)


def torch_port(cfg: LaunchConfig, store_port: int) -> int:
    """``MASTER_PORT`` for torch.distributed scripts: next to the store's port, or a free one.

    Every node must compute the same value, so a job of several nodes uses store port + 1.
    """
    if cfg.nnodes > 1 or cfg.master_port:
        return store_port + 1
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((cfg.master_addr, 0))
        return s.getsockname()[1]
