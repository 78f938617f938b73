"""How torch.distributed's ranks meet, as gpucoll stores: ``init_process_group``'s
``init_method``, ``MASTER_ADDR``/``MASTER_PORT``, ``RANK``/``WORLD_SIZE`` (gpucoll.distributed).

``meet()`` turns what the script passed and set into what ``gpucoll.init`` needs, the way torch
reads them:

- ``env://`` (or no ``init_method``): the launcher's store when gpucoll's launcher or torchrun's
  agent provides one; else ``MASTER_ADDR:MASTER_PORT``, where rank 0 hosts the store (torch's
  TCPStore does the same, so the ``MASTER_PORT`` that ``torch.distributed`` would bind is the one
  bound here); else the other launchers' environments (Slurm, MPI) as ``gpucoll.init`` reads them.
  ``rank``/``world_size`` not passed come from ``RANK``/``WORLD_SIZE``, else from that launcher.
- ``tcp://HOST:PORT``: rank 0 hosts the store there; the others connect.
- ``file:///PATH``: rank 0 hosts the store on a free port and writes its address, with a fresh
  token, to PATH under a temporary name that it then renames (a reader sees all of it or
  nothing); the others poll PATH until the deadline, and retry while what they read leads
  nowhere (a file left by an earlier job). Rank 0 removes PATH once every rank has joined, so
  the same path serves the next job (torch's FileStore needs a fresh file each time).

Every error names ``init_process_group`` and what the script passed or set; nothing is sent
before the arguments and variables are checked.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import socket
import time
from collections.abc import Mapping
from typing import Any

from gpucoll import rendezvous
from gpucoll.errors import CollectiveTimeout, GpucollError, StoreError, StoreTimeout

FN = "init_process_group"
_LAUNCHER_STORE = ("GPUCOLL_STORE", "GPUCOLL_MASTER_ADDR", "GPUCOLL_MASTER_PORT")
_POLL = 0.05  # seconds between looks (a file:// file, a store rank 0 is closing), bounded
_RELEASE_WAIT = 5.0  # seconds the hosting rank keeps its store up for the others at the end
_STORE_ID = "gpucoll/init_process_group/store"  # the id of a store rank 0 hosts (host_or_join)
_met: dict[Any, Any] = {}  # address or file -> the id (token) of the store last met there


@dataclasses.dataclass
class Meeting:
    """What ``gpucoll.init`` is given: ``rank``/``world_size`` None to read them (and the store)
    from the launcher's environment; ``store`` None for gpucoll.init to find or make its own.
    ``owned``: the store made here, closed with the group; ``published``: the file:// path
    rank 0 wrote, removed by ``joined()``."""

    rank: int | None
    world_size: int | None
    store: Any = None
    owned: Any = None
    published: str | None = None

    def joined(self) -> None:
        """Every rank has joined the group (or this one gave up): the published file has served
        its purpose; removing it lets the next job use the same path."""
        path, self.published = self.published, None
        if path is not None:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass


def meet(init_method: str | None, store: Any, rank: int, world_size: int,
         timeout: float) -> Meeting:
    """Where and as whom this rank joins, from ``init_process_group``'s arguments (``rank`` and
    ``world_size`` -1 when not passed, as in torch) and the environment. Hosts or connects to
    the store where torch would."""
    method = init_method or "env://"
    if type(store).__module__.startswith("torch"):
        raise ValueError(f"{FN}: store={type(store).__name__} is torch's; pass a gpucoll "
                         f"TCPStore (gpucoll.store.TCPStore), or init_method='tcp://HOST:PORT' "
                         f"or MASTER_ADDR and MASTER_PORT instead")
    if store is not None:
        return Meeting(*ranks(rank, world_size, "store= is passed"), store=store)
    if method.startswith("tcp://"):
        host, port = _address(method)
        r, n = ranks(rank, world_size, f"init_method={method!r}")
        made = host_or_join(host, port, r, n, timeout, f"init_method={method!r}")
        return Meeting(r, n, made, made)
    if method.startswith("file://"):
        path = _file_path(method)
        r, n = ranks(rank, world_size, f"init_method={method!r}")
        return _through_file(path, r, n, timeout)
    if method != "env://":
        raise ValueError(f"{FN}: init_method={init_method!r} is not supported; use env:// "
                         f"(MASTER_ADDR and MASTER_PORT), tcp://HOST:PORT or file:///PATH")
    return _from_env(rank, world_size, timeout)


def _from_env(rank: int, world_size: int, timeout: float) -> Meeting:
    env = os.environ
    if any(env.get(v) for v in _LAUNCHER_STORE) or _torchrun_agent(env):
        if rank == -1 and world_size == -1:  # gpucoll.init reads the launcher's variables
            return Meeting(None, None)
        return Meeting(*ranks(rank, world_size, "env://"))
    if env.get("MASTER_ADDR") or env.get("MASTER_PORT"):
        host, port = master_address(env)
        r, n = ranks(rank, world_size, "env://")
        made = host_or_join(host, port, r, n, timeout, "MASTER_ADDR:MASTER_PORT")
        return Meeting(r, n, made, made)
    if rendezvous.launcher_named():  # Slurm, MPI: gpucoll.init finds where they meet
        if rank == -1 and world_size == -1:
            return Meeting(None, None)
        return Meeting(*ranks(rank, world_size, "env://"))
    r, n = ranks(rank, world_size, "env://")
    if n > 1:
        raise ValueError(f"{FN}: rank={r}, world_size={n}, but nothing says where the ranks "
                         f"meet: set MASTER_ADDR and MASTER_PORT (rank 0 hosts the store there), "
                         f"or pass init_method='tcp://HOST:PORT' or 'file:///PATH'")
    return Meeting(r, n)  # a world of one: gpucoll.init makes it a private store


def _torchrun_agent(env: Mapping[str, str]) -> bool:
    """Under torchrun, whose agent already serves MASTER_ADDR:MASTER_PORT (gpucoll.init meets
    through it; see gpucoll.default)."""
    return env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def ranks(rank: Any, world_size: Any, how: str) -> tuple[int, int]:
    """``rank`` and ``world_size`` as passed, or where -1 from ``RANK``/``WORLD_SIZE`` (torch's
    env://), else from a launcher's variables; checked."""
    got = {"rank": rank, "world_size": world_size}
    env = os.environ
    for name, var in (("rank", "RANK"), ("world_size", "WORLD_SIZE")):
        value = got[name]
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{FN}: {name} must be an int, got {type(value).__name__}")
        if value == -1 and env.get(var):
            try:
                got[name] = int(env[var])
            except ValueError:
                raise ValueError(f"{FN}: {var}={env[var]!r} is not an integer") from None
    missing = [name for name, value in got.items() if value == -1]
    if missing and rendezvous.launcher_named():
        try:
            found = rendezvous.from_env()
        except rendezvous.RendezvousError as exc:
            raise rendezvous.RendezvousError(f"{FN}: {exc}") from None
        got.update({name: getattr(found, name) for name in missing})
        missing = []
    if missing:
        names = " and ".join(missing)
        variables = " and ".join(("RANK", "WORLD_SIZE")[name == "world_size"] for name in missing)
        raise ValueError(f"{FN}: {names} not passed and {variables} not set ({how}); pass "
                         f"rank= and world_size=, set RANK and WORLD_SIZE, or start the script "
                         f"with gpucoll run or torchrun")
    r, n = got["rank"], got["world_size"]
    if n < 1 or not 0 <= r < n:
        raise ValueError(f"{FN}: need 0 <= rank < world_size, got rank={r}, world_size={n}")
    return r, n


def master_address(env: Mapping[str, str]) -> tuple[str, int]:
    """(MASTER_ADDR, MASTER_PORT), both required as torch's env:// requires them."""
    host, raw = env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", "")
    if not host or not raw:
        have, lack = ("MASTER_ADDR", "MASTER_PORT") if host else ("MASTER_PORT", "MASTER_ADDR")
        raise ValueError(f"{FN}: {have} is set but {lack} is not; env:// needs both (rank 0 "
                         f"hosts the store at MASTER_ADDR:MASTER_PORT)")
    try:
        port = int(raw)
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise ValueError(f"{FN}: MASTER_PORT={raw!r} is not a port number (an integer from 1 "
                         f"to 65535)")
    return host, port


def _address(method: str) -> tuple[str, int]:
    from gpucoll.store import parse_address

    try:
        return parse_address(method)
    except ValueError:
        raise ValueError(f"{FN}: init_method={method!r} must look like tcp://HOST:PORT (a port "
                         f"from 1 to 65535)") from None


def host_or_join(host: str, port: int, rank: int, size: int, timeout: float, named: str) -> Any:
    """Rank 0 hosts the store at ``host:port`` (``named``: how the script said where); the
    others connect, retrying until ``timeout`` while rank 0 starts. Each store rank 0 hosts is
    marked with a fresh id: a rank that meets again at the same address (a job that starts
    again after ``destroy_process_group``) waits until the store there is not the one it met
    in last time, which rank 0 may not have closed yet."""
    rdv = rendezvous.Rendezvous(rank, size, rank, size, host, port, False,
                                os.environ.get("GPUCOLL_STORE_TOKEN") or None, FN)
    if rank == 0:
        try:
            store = rendezvous.connect_store(rdv, timeout)
        except StoreError as exc:
            raise StoreError(f"{FN} on rank 0 of {size}: cannot host the store at {named} "
                             f"({host}:{port}): {exc}") from None
        store.set(_STORE_ID, secrets.token_hex(8))
        return store
    deadline = time.monotonic() + timeout
    last = _met.get((host, port))
    while True:
        store = rendezvous.connect_store(rdv, max(deadline - time.monotonic(), 0.01))
        try:
            ident = store.get(_STORE_ID, timeout=max(deadline - time.monotonic(), 0.01))
        except StoreTimeout:
            store.close()
            raise CollectiveTimeout(f"{FN} on rank {rank} of {size}: rank 0 hosts no new store "
                                    f"at {named} ({host}:{port}) within {timeout:g} s") from None
        except StoreError:  # the last store, closed under this rank as it looked
            ident = last
        if ident != last:
            _met[(host, port)] = ident
            return store
        store.close()
        if time.monotonic() >= deadline:
            raise CollectiveTimeout(f"{FN} on rank {rank} of {size}: rank 0 hosts no new store "
                                    f"at {named} ({host}:{port}) within {timeout:g} s: the one "
                                    f"there is the job's last, which it did not close")
        time.sleep(_POLL)  # rank 0 is closing the last store: a poll bounded by the deadline


def release(store: Any) -> None:
    """Close a store ``meet()`` made, at the end of the group. The rank hosting it first waits,
    at most ``_RELEASE_WAIT`` seconds, until no other rank is connected: the others may still
    be finishing the start-up (a program that ends its group as soon as it has it), and
    closing the store under them would fail it."""
    if store.is_server:
        store.other_clients(_RELEASE_WAIT, what="destroy_process_group on the rank hosting the "
                                                "store")
    store.close()


# ---- file:// -------------------------------------------------------------------------------------

def _file_path(method: str) -> str:
    path = method[len("file://"):]
    if not path.startswith("/") or "?" in path:
        raise ValueError(f"{FN}: init_method={method!r} must look like file:///ABSOLUTE/PATH")
    folder = os.path.dirname(path)
    if not os.path.isdir(folder):
        raise ValueError(f"{FN}: init_method={method!r}: the directory {folder} does not exist "
                         f"(the ranks meet through a file there; create it, or name a file in a "
                         f"directory every rank can reach)")
    return path


def _through_file(path: str, rank: int, size: int, timeout: float) -> Meeting:
    from gpucoll.store import TCPStore

    if rank == 0:
        token = secrets.token_hex(16)
        made = TCPStore("0.0.0.0", 0, is_server=True, timeout=timeout, token=token)
        made.host = socket.gethostname()  # what the others connect to (and routes are picked by)
        try:
            _publish(path, f"{made.host} {made.port} {token}\n")
        except OSError as exc:
            made.close()
            raise OSError(f"{FN} on rank 0 of {size}: cannot write {path}: {exc}") from None
        return Meeting(rank, size, made, made, published=path)
    made = _read_and_join(path, rank, size, timeout)
    made.hosted_by = 0  # losing the store means losing rank 0
    return Meeting(rank, size, made, made)


def _publish(path: str, text: str) -> None:
    """Write ``text`` to ``path`` whole: to a private temporary name first, then renamed."""
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())  # a shared filesystem shows the others every byte
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise


def _read_and_join(path: str, rank: int, size: int, timeout: float) -> Any:
    """Poll ``path`` until rank 0's address is there and a store answers at it."""
    from gpucoll.progress import Waiting
    from gpucoll.store import TCPStore

    what = f"{FN} on rank {rank} of {size}"
    deadline = time.monotonic() + timeout
    notice = Waiting(what, timeout)
    seen = None
    while True:
        found = _read_published(path)
        if found is not None and found[2] != _met.get(path):  # not the store met last time
            seen = found
            host, port, token = found
            here = host == socket.gethostname()
            try:
                made = TCPStore("127.0.0.1" if here else host, port, token=token,
                                timeout=max(min(2.0, deadline - time.monotonic()), 0.1))
                _met[path] = token
                return made
            except (GpucollError, OSError):
                pass  # a file an earlier job left: rank 0 will replace it
        now = time.monotonic()
        if now >= deadline:
            found = "nothing there" if seen is None else \
                f"tcp://{seen[0]}:{seen[1]}, where no store answered (left by an earlier job?)"
            raise CollectiveTimeout(f"{what}: rank 0 never published its store's address in "
                                    f"{path} within {timeout:g} s (found {found})")
        notice.tick(lambda: f"for rank 0 to publish its store's address in {path}", now)
        time.sleep(_POLL)


def _read_published(path: str) -> tuple[str, int, str] | None:
    """(host, port, token) from a file rank 0 published, None while absent or unlike one."""
    try:
        with open(path) as f:
            parts = f.read().split()
    except (OSError, UnicodeDecodeError):
        return None
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    return parts[0], int(parts[1]), parts[2]
