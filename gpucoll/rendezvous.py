"""Rendezvous: who am I, how many are we, and where do we meet -- read from the launcher.

``from_env()`` reads the environment once into a frozen ``Rendezvous``. Launchers are tried in
this order, the first whose rank variables are present wins: gpucoll's own (``gpucoll run``),
torchrun, Open MPI, MPICH/Intel MPI, Slurm. MPI comes before Slurm because ``mpirun`` inside an
``sbatch`` script leaves the batch step's ``SLURM_PROCID=0`` in every rank's environment.

The store address, from the first of these that is set:
  1. ``GPUCOLL_STORE=tcp://host:port``  a store that is already running (the launcher's);
  2. ``GPUCOLL_MASTER_ADDR`` / ``GPUCOLL_MASTER_PORT``  rank 0 hosts the store there;
  3. ``MASTER_ADDR`` / ``MASTER_PORT + 1``  (torch.distributed owns ``MASTER_PORT`` itself);
  4. under Slurm, the first host of ``SLURM_JOB_NODELIST`` (the loopback address on one node);
  5. ``127.0.0.1`` when every rank is on this host (local world size == world size).
A port that no variable names is derived from the job id, so two jobs on one host do not
collide, else ``DEFAULT_PORT``; a world of one rank uses a free port.

``job_id()`` is what every rank of a job shares and other jobs do not (``GPUCOLL_JOB_ID``,
torchrun's run id and restart count, Slurm's job and step, the MPI job). ``join_group()`` gives
each new communicator a namespace of its own in the store, under its job's, that every rank of
the group agrees on, so one long-lived store serves job after job, even after a job that crashed.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import threading
import time
import uuid
import zlib
from collections.abc import Mapping
from typing import Any

from gpucoll.errors import (
    CollectiveTimeout,
    GpucollError,
    PeerFailure,
    RendezvousError,
    StoreTimeout,
)

DEFAULT_PORT = 29510
# Ranks meet through one store, each reading every other's keys: beyond this a world size is a
# mistake (a garbled variable), refused before any key is made rather than waited on
MAX_WORLD_SIZE = 1 << 16
_JOB_PORT_BASE, _JOB_PORT_SPAN = 20000, 12000  # below Linux's ephemeral range (32768+)


@dataclasses.dataclass(frozen=True)
class Rendezvous:
    """One rank's place in the job and the address of the job's store."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    store_host: str
    store_port: int
    store_is_running: bool  # True: connect to a running store; False: rank 0 hosts it
    token: str | None
    source: str  # which launcher's variables were read: gpucoll torchrun openmpi mpich slurm
    job_id: str | None = None  # what every rank of this job shares (see job_id())

    @property
    def store_address(self) -> str:
        return store_url(self.store_host, self.store_port)


def store_url(host: str, port: int) -> str:
    """The address as ``GPUCOLL_STORE`` gives it: ``tcp://host:port``, an IPv6 host in [...]."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


@dataclasses.dataclass(frozen=True)
class _Source:
    name: str
    rank: str
    size: str
    local_rank: tuple[str, ...]
    local_size: tuple[str, ...]


_SOURCES = (
    _Source("gpucoll", "GPUCOLL_RANK", "GPUCOLL_WORLD_SIZE", ("GPUCOLL_LOCAL_RANK",),
            ("GPUCOLL_LOCAL_WORLD_SIZE",)),
    _Source("torchrun", "RANK", "WORLD_SIZE", ("LOCAL_RANK",), ("LOCAL_WORLD_SIZE",)),
    _Source("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
            ("OMPI_COMM_WORLD_LOCAL_RANK",), ("OMPI_COMM_WORLD_LOCAL_SIZE",)),
    _Source("mpich", "PMI_RANK", "PMI_SIZE", ("MPI_LOCALRANKID", "SLURM_LOCALID"),
            ("MPI_LOCALNRANKS",)),
    _Source("slurm", "SLURM_PROCID", "SLURM_NTASKS", ("SLURM_LOCALID",), ()),
)


def from_env(environ: Mapping[str, str] | None = None) -> Rendezvous:
    """This rank's Rendezvous from ``environ`` (default ``os.environ``); RendezvousError if
    no launcher's variables are present, naming every variable looked for."""
    env = os.environ if environ is None else environ
    for src in _SOURCES:
        if src.rank in env or src.size in env:
            return _read(env, src)
    looked = [f"{s.rank}/{s.size}" for s in _SOURCES] + ["SLURM_NPROCS"]
    raise RendezvousError(
        "cannot tell this process's rank and world size: none of "
        f"{', '.join(looked)} is set. Start the job with `gpucoll run`, torchrun, srun or "
        "mpirun, or set GPUCOLL_RANK and GPUCOLL_WORLD_SIZE (and GPUCOLL_STORE or "
        "GPUCOLL_MASTER_ADDR/GPUCOLL_MASTER_PORT for several hosts).")


def launcher_named(environ: Mapping[str, str] | None = None) -> bool:
    """Whether any launcher's rank or world-size variable is set (``from_env`` reads them)."""
    env = os.environ if environ is None else environ
    return any(var in env for src in _SOURCES for var in (src.rank, src.size)) or (
        "SLURM_NPROCS" in env)


def local_rank(rank: int, environ: Mapping[str, str] | None = None) -> int:
    """This process's rank on its host, as ``from_env()`` reports it; where the environment
    names no launcher, the first local-rank variable of any launcher that is set, else
    ``rank`` (one host)."""
    env = os.environ if environ is None else environ
    try:
        return from_env(env).local_rank
    except RendezvousError:
        pass
    for src in _SOURCES:
        for var in src.local_rank:
            value = env.get(var, "").strip()
            if value.isdigit():
                return int(value)
    return rank


def _read(env: Mapping[str, str], src: _Source) -> Rendezvous:
    size_var = src.size if src.size in env or src.name != "slurm" else "SLURM_NPROCS"
    rank = _int(env, src.rank, src.name)
    size = _int(env, size_var, src.name)
    local_rank, local_size = _local(env, src, rank, size)
    _check_ranks(src, rank, size, local_rank, local_size)
    host, port, running = _store_address(env, src.name, size, local_size)
    return Rendezvous(rank, size, local_rank, local_size, host, port, running,
                      env.get("GPUCOLL_STORE_TOKEN") or None, src.name, job_id(env))


def _local(env: Mapping[str, str], src: _Source, rank: int, size: int) -> tuple[int, int]:
    """Local rank and local world size; a launcher that names neither means one host."""
    rank_var = next((v for v in src.local_rank if v in env), None)
    size_var = next((v for v in src.local_size if v in env), None)
    if size_var:
        local_size = _int(env, size_var, src.name)
    else:  # srun starts MPICH ranks with PMI_* and SLURM_* but no MPI_LOCALNRANKS
        local_size = _slurm_local_size(env) if src.name in ("slurm", "mpich") else None
    if rank_var is None and local_size is None:
        return rank, size
    local_rank = _int(env, rank_var, src.name) if rank_var else rank % (local_size or size)
    return local_rank, local_size if local_size is not None else size


def _check_ranks(src: _Source, rank: int, size: int, local_rank: int, local_size: int) -> None:
    if size > MAX_WORLD_SIZE:
        raise RendezvousError(f"{src.name} environment: {src.size}={size} is more ranks than "
                              f"gpucoll supports ({MAX_WORLD_SIZE})")
    if size < 1 or not 0 <= rank < size:
        raise RendezvousError(f"{src.name} environment: rank {rank} is not in a world of "
                              f"{size} ({src.rank}, {src.size})")
    if local_size < 1 or local_size > size or not 0 <= local_rank < local_size:
        raise RendezvousError(f"{src.name} environment: local rank {local_rank} is not in a "
                              f"local world of {local_size} (world size {size})")


def _int(env: Mapping[str, str], var: str, source: str) -> int:
    raw = env.get(var)
    if raw is None:
        raise RendezvousError(f"{source} environment: {var} is not set")
    try:
        return int(raw.strip())
    except ValueError:
        raise RendezvousError(f"{source} environment: {var}={raw!r} is not an integer") from None


# --------------------------------------------------------------------------- store address
def _store_address(env: Mapping[str, str], source: str, size: int,
                   local_size: int) -> tuple[str, int, bool]:
    if env.get("GPUCOLL_STORE"):
        from gpucoll.store.client import parse_address

        try:
            host, port = parse_address(env["GPUCOLL_STORE"])
        except ValueError as exc:
            raise RendezvousError(f"GPUCOLL_STORE: {exc}") from None
        return host, port, True
    host = env.get("GPUCOLL_MASTER_ADDR") or env.get("MASTER_ADDR") or _slurm_master(env)
    if not host and local_size == size:
        host = "127.0.0.1"
    if not host:
        raise RendezvousError(
            f"{source} environment: rank and world size found ({size} ranks on several "
            "hosts) but not where they meet: set GPUCOLL_STORE=tcp://HOST:PORT (a running "
            "store) or GPUCOLL_MASTER_ADDR (and GPUCOLL_MASTER_PORT) for rank 0 to host it; "
            "also looked for MASTER_ADDR and SLURM_JOB_NODELIST")
    return host, _store_port(env, size), False


def _store_port(env: Mapping[str, str], size: int) -> int:
    if env.get("GPUCOLL_MASTER_PORT"):
        return _port(env, "GPUCOLL_MASTER_PORT", 0)
    if env.get("MASTER_PORT"):
        return _port(env, "MASTER_PORT", 1)
    job = job_id(env)
    if job is not None:
        return _JOB_PORT_BASE + zlib.crc32(job.encode()) % _JOB_PORT_SPAN
    return 0 if size == 1 else DEFAULT_PORT


def _port(env: Mapping[str, str], var: str, offset: int) -> int:
    port = _int(env, var, "store address") + offset
    if not 0 < port < 65536:
        raise RendezvousError(f"{var}={env[var]!r} does not give a usable store port ({port})")
    return port


def job_id(environ: Mapping[str, str] | None = None) -> str | None:
    """A string every rank of this job (step) shares and other jobs do not, from the first of
    ``GPUCOLL_JOB_ID``, torchrun's ``TORCHELASTIC_RUN_ID`` (with its restart count), Slurm's
    ``SLURM_JOB_ID`` and ``SLURM_STEP_ID``, ``PMIX_NAMESPACE`` and Open MPI's job id; None when
    none is set."""
    env = os.environ if environ is None else environ
    if env.get("GPUCOLL_JOB_ID"):
        return env["GPUCOLL_JOB_ID"]
    if env.get("TORCHELASTIC_RUN_ID"):
        return f"torchrun:{env['TORCHELASTIC_RUN_ID']}.{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if env.get("SLURM_JOB_ID"):
        return f"slurm:{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', '')}"
    for var in ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid"):
        if env.get(var):
            return f"{var}:{env[var]}"
    return None


# --------------------------------------------------------------------------- Slurm
def _slurm_master(env: Mapping[str, str]) -> str | None:
    """The first node of the step (or job); the loopback address when it has one node only, so
    that a one-node job's store is reachable from that node alone."""
    for var in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        if env.get(var):
            try:
                hosts = expand_hostlist(env[var])
            except ValueError as exc:
                raise RendezvousError(f"{var}: {exc}") from None
            return "127.0.0.1" if len(hosts) == 1 else hosts[0]
    return None


def _slurm_local_size(env: Mapping[str, str]) -> int | None:
    """Tasks on this node, from SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE ("2(x3),1")."""
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not spec:
        return None
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise RendezvousError(f"SLURM_TASKS_PER_NODE={spec!r} is not like '2(x3),1'")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    node = int(env.get("SLURM_NODEID", "0") or 0)
    return counts[node] if node < len(counts) else counts[-1]


def expand_hostlist(spec: str) -> list[str]:
    """Expand a Slurm hostlist: ``"gpu[01-03,07],cpu3"`` -> gpu01 gpu02 gpu03 gpu07 cpu3.

    Keeps zero padding (the width of each range's lower bound) and expands several bracket
    groups in one name (``r[1-2]n[1-2]`` -> r1n1 r1n2 r2n1 r2n2).
    """
    hosts = [h for item in _split_top(spec) for h in _expand_one(item)]
    if not hosts:
        raise ValueError(f"empty hostlist {spec!r}")
    return hosts


def _split_top(spec: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(spec):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth not in (0, 1):
            raise ValueError(f"unbalanced brackets in hostlist {spec!r}")
        if ch == "," and depth == 0:
            items.append(spec[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced brackets in hostlist {spec!r}")
    items.append(spec[start:])
    return [s.strip() for s in items if s.strip()]


def _expand_one(item: str) -> list[str]:
    m = re.match(r"([^\[]*)\[([^\]]*)\](.*)", item)
    if m is None:
        return [item]
    prefix, ranges, rest = m.groups()
    tails = _expand_one(rest) if rest else [""]
    return [prefix + n + t for n in _expand_ranges(ranges, item) for t in tails]


def _expand_ranges(ranges: str, item: str) -> list[str]:
    out = []
    for part in ranges.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", part)
        if m is None or (m.group(2) and int(m.group(2)) < int(m.group(1))):
            raise ValueError(f"bad range {part!r} in hostlist item {item!r}")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        out += [str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1)]
    return out


# --------------------------------------------------------------------------- connecting
def connect_store(rdv: Rendezvous, timeout: float = 300.0):
    """The job's store for this rank: rank 0 hosts it (unless it is already running), every
    other rank connects, retrying until ``timeout`` while rank 0 starts up."""
    from gpucoll.store import TCPStore

    if rdv.store_is_running:
        return TCPStore(rdv.store_host, rdv.store_port, timeout=timeout, token=rdv.token)
    if rdv.rank != 0:
        try:
            store = TCPStore(rdv.store_host, rdv.store_port, timeout=timeout, token=rdv.token)
        except StoreTimeout as exc:
            raise CollectiveTimeout(
                f"start-up on rank {rdv.rank} of {rdv.world_size}: rank 0 never arrived (it "
                f"hosts the job's store at {rdv.store_address}, where nothing accepted a "
                f"connection within {timeout:g} s; last error: {exc})") from None
        store.hosted_by = 0  # losing the store means losing rank 0 (store_host_rank)
        return store
    if _is_loopback(rdv.store_host):
        return TCPStore(rdv.store_host, rdv.store_port, is_server=True, timeout=timeout,
                        token=rdv.token)
    # Listen on every interface (a host name may resolve to a loopback address locally), but
    # report the address the other ranks use, as their stores do.
    store = TCPStore("0.0.0.0", rdv.store_port, is_server=True, timeout=timeout,
                     token=rdv.token)
    store.host = rdv.store_host
    return store


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# --------------------------------------------------------------------------- a group's namespace
_next_slot: dict[tuple, int] = {}  # (store, job) -> the first slot this process tries next
_slot_lock = threading.Lock()


def join_group(store: Any, rank: int, size: int, *, job: str | None, timeout: float) -> Any:
    """The namespace (a PrefixStore) of a new communicator of ``size`` ranks; collective.

    Communicators live in slots ``gpucoll/jobs/<job>/<n>`` of the store. Every rank of a group
    walks the slots from the one after its last group's and joins the first one fit for it: one
    where no rank has died or closed yet (a finished group deletes its slot when its last rank
    closes; a crashed one leaves its keys, marked by the wills of the ranks that died there).
    Ranks of one job have the same history, so they meet in the same slot. In a slot a rank
    leaves its will (``Liveness``), claims its rank and waits for the others: a rank that dies
    meanwhile is a PeerFailure, one that never comes a CollectiveTimeout at ``timeout``. Jobs
    that use one store at the same time need job ids of their own (``job_id()``).
    """
    from gpucoll.store import Liveness, PrefixStore, wait_for_ranks

    deadline = time.monotonic() + timeout
    root = "gpucoll/jobs/" + (job.replace("/", "_") if job else "anonymous")
    ident = (_identity(store), root)
    what = f"start-up of job {job!r}" if job else "start-up"
    with _slot_lock:
        n = _next_slot.get(ident, 0)
    skipped = []
    space = PrefixStore(f"{root}/{n}", store)
    try:
        while not _fit(space, rank, size, what):
            skipped.append(n)
            n += 1
            space = PrefixStore(f"{root}/{n}", store)
    except PeerFailure:
        with _slot_lock:  # a later attempt of this process starts past the failed group's slot
            _next_slot[ident] = max(_next_slot.get(ident, 0), n + 1)
        raise
    live = Liveness(space, rank, size)  # the will first: no claim outlives its process
    try:
        theirs = space.compare_set("size", "", str(size))
        if int(theirs) != size:
            raise _refuse_size(space, rank, size, int(theirs))
        claim = f"{uuid.uuid4().hex}@{time.time():.3f}"  # when: see _fit
        if space.compare_set(f"member/{rank}", "", claim) != claim.encode():
            raise _rank_taken(space, rank, size)
        wait_for_ranks(space, [f"member/{r}" for r in range(size)],
                       max(deadline - time.monotonic(), 0.0), rank=rank, liveness=live,
                       what=what, absent="never arrived (not started, or not yet at "
                                         "gpucoll.init or init_process_group)",
                       stopped=lambda: _start_up_stopped(store, space, what, rank, size))
    except CollectiveTimeout as exc:
        live.leave()
        if not skipped:
            raise
        raise CollectiveTimeout(
            f"{exc}; this rank joined {space.prefix} after skipping {len(skipped)} slot(s) of "
            f"groups in which a rank died or left (a rank of this group that died before the "
            f"others arrived looks the same)") from None
    except BaseException:
        live.leave()
        with _slot_lock:  # a later attempt of this process starts past this slot
            _next_slot[ident] = max(_next_slot.get(ident, 0), n + 1)
        raise
    with _slot_lock:
        _next_slot[ident] = max(_next_slot.get(ident, 0), n + 1)
    if rank == 0:  # every rank has moved past the skipped slots: clear what nobody uses
        for s in skipped:
            _clear_if_abandoned(PrefixStore(f"{root}/{s}", store))
    return space


# set by ``gpucoll run`` in the job's store when a rank fails and it stops the job
LAUNCHER_ABORT = "gpucoll-launch/abort"


def launcher_abort(status: int, rank: int, reason: str) -> bytes:
    """The value of ``LAUNCHER_ABORT``: the job's exit status, the rank that failed, and why."""
    return f"{status}:{rank}:{reason}".encode()


def read_launcher_abort(value: bytes) -> tuple[int, int, str]:
    """(status, rank, reason) from a ``launcher_abort`` value."""
    status, rank, reason = value.decode("utf-8", "replace").split(":", 2)
    return int(status), int(rank), reason


def _start_up_stopped(store: Any, space: Any, what: str, rank: int,
                      size: int) -> GpucollError | None:
    """Why ``rank``, waiting for its group in slot ``space`` of ``store``, must stop before its
    deadline, from one look at the store: a PeerFailure when the launcher is stopping the job
    because a rank failed (one that never reached gpucoll.init, say, whom the others would wait
    for until the launcher kills them); a RendezvousError when a rank that came with another
    world size refused the group (``_refuse_size``); None while neither."""
    try:
        abort, refused = store.peek([LAUNCHER_ABORT, f"{space.prefix}/refused"])
    except (GpucollError, OSError):
        return None  # a store that cannot answer: the wait's own checks report it
    if abort is not None:
        _, culprit, reason = read_launcher_abort(abort)
        return PeerFailure(f"{what} on rank {rank} of {size}: the launcher is stopping the job: "
                           f"{reason}", peer=culprit)
    if refused is not None:
        them, _, theirs = refused.decode("utf-8", "replace").partition(":")
        return RendezvousError(f"rank {rank} was given world size {size}, but rank {them}, "
                               f"joining {space.prefix}, was given world size {theirs}")
    return None


def _fit(space: Any, rank: int, size: int, what: str) -> bool:
    """Whether ``rank`` may join the group forming in slot ``space``: False for the leftovers
    of a group a rank died in or closed; RendezvousError where a live process holds this rank
    or the group has another size; PeerFailure naming the rank that died (or aborted) where
    that group is this rank's own, formed while this process ran (``_this_run``): its ranks
    came, one died before this rank arrived, and the others will not come to another slot."""
    *gone, theirs, mine = space.peek([f"gone/{r}" for r in range(size)] +
                                     ["size", f"member/{rank}"])
    if theirs is not None and int(theirs) != size:
        if _abandoned(space, int(theirs)):
            return False
        raise _refuse_size(space, rank, size, int(theirs))
    if any(g is not None for g in gone):
        if mine is None and _this_run(space, size, gone):
            from gpucoll.store import gone_failure

            raise gone_failure({r: g.decode("utf-8", "replace") for r, g in enumerate(gone)
                                if g is not None}, what, rank, size)
        return False
    if mine is not None:
        raise _rank_taken(space, rank, size)
    return True


def _this_run(space: Any, size: int, gone: list) -> bool:
    """True when slot ``space``, where ranks are ``gone``, holds a group that failed while this
    process ran: a rank died or aborted there, and a rank claimed its place after this process
    started (a crashed earlier job's leftovers are older than every process of a new one)."""
    if not any(g is not None and g != b"closed" for g in gone):
        return False
    since = _process_start()
    for claim in space.peek([f"member/{r}" for r in range(size)]):
        _, at, when = (claim or b"").decode("utf-8", "replace").partition("@")
        try:
            if at and float(when) >= since:
                return True
        except ValueError:
            continue
    return False


def _process_start() -> float:
    """The wall-clock time this process started (Linux's /proc; else the time of this
    module's import, which is no earlier)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rpartition(")")[2].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return _IMPORTED


_IMPORTED = time.time()


def _refuse_size(space: Any, rank: int, size: int, theirs: int) -> RendezvousError:
    """The error for a rank whose world size is not the group's; it is also left in the slot,
    so that the ranks waiting there learn of the disagreement at once, not at their deadline."""
    try:
        space.compare_set("refused", "", f"{rank}:{size}")
    except (GpucollError, OSError):
        pass  # a store that cannot answer: the waiting ranks' own checks report it
    return RendezvousError(f"rank {rank} was given world size {size}, but the group forming in "
                           f"{space.prefix} has world size {theirs}")


def _rank_taken(space: Any, rank: int, size: int) -> RendezvousError:
    return RendezvousError(
        f"rank {rank} of {size}: another live process already joined {space.prefix} as rank "
        f"{rank} (jobs using one store at the same time need job ids of their own: set "
        f"GPUCOLL_JOB_ID)")


def _abandoned(space: Any, size: int) -> bool:
    """True when no live rank is in slot ``space``: every rank that joined has died or left."""
    states = space.peek([f"member/{r}" for r in range(size)] +
                        [f"gone/{r}" for r in range(size)])
    return all(m is None or g is not None for m, g in zip(states[:size], states[size:],
                                                            strict=True))


def _clear_if_abandoned(space: Any) -> None:
    """Delete a skipped slot's leftovers once no live rank is in it (a crashed job's keys)."""
    size = space.peek(["size"])[0]
    if size is None or _abandoned(space, int(size)):
        space.delete_prefix("")


def _identity(store: Any) -> tuple:
    """Which store this is, for this process's slot counters: its address and prefixes."""
    prefixes = []
    while hasattr(store, "prefix") and hasattr(store, "store"):
        prefixes.append(store.prefix)
        store = store.store
    where = (store.host, store.port) if hasattr(store, "port") else id(store)
    return (where, *prefixes)


__all__ = ["DEFAULT_PORT", "MAX_WORLD_SIZE", "Rendezvous", "RendezvousError", "connect_store",
           "expand_hostlist", "from_env", "job_id", "join_group", "launcher_named", "local_rank",
           "store_url"]
