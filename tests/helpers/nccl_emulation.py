"""An emulated nccl4py, so that the NCCL backend runs in tests without a GPU.

``EmulatedRuntime`` is the CUDA emulation (``cuda_emulation``) plus stand-ins for nccl4py's
``nccl.core`` module (its ``Communicator`` has the methods of nccl4py's as the backend calls
them) and its raw bindings ``nccl.bindings.nccl`` (the collective and point-to-point functions,
on a communicator's handle, with addresses, counts and datatype codes as NCCL takes them). A
call reads and writes memory at those addresses from the stream it names, and data travels
between processes through a TCPStore. Unique ids, ``NCCLConfig``, ``NCCLError`` and the
version are the real library's. It is written from nccl.h and NCCL-NOTES.md, independently of
the backend, and behaves as they say NCCL does:

- A blocking communicator (the default) blocks the host in init, split, finalize and the first
  call that needs a connection (the first collective; the first send/recv between two ranks)
  until every rank it needs has entered the same call. A non-blocking one
  (``NCCLConfig(blocking=False)``) returns at once; ``get_async_error()`` says in progress until
  the work is done (forever, if a peer never comes), and any other call meanwhile is misuse.
- Collectives run on their stream, later; each waits for its peers' data as a kernel would,
  until ``abort`` ends it. One communicator's kernels run in issue order whatever their
  streams; a one-rank collective launches none (``_one_rank``); connections are made lazily
  per algorithm, so a later call can leave a non-blocking communicator in progress
  (``_algorithm``); a peer that aborts shows as ``ncclRemoteError`` only a while later, and
  only where work waits for it (``_fetch``). ``avg`` on floating types is a premultiply by
  ``fl(1/n)``, then a sum.
- ``abort`` frees the communicator: later calls of its methods raise ``NcclInvalid``, and a
  call of the bindings on its handle, or an abort while another thread is inside a call on
  it, is a use after free.
- ``revoke`` stops the work in flight and keeps the communicator: it is in progress until that
  work has stopped, then serves only ``shrink``, ``split``, ``destroy`` and ``abort`` (any other
  call is misuse; finalize too, as nccl.h says). ``shrink(exclude_ranks, config, flag)`` is
  collective over the ranks not excluded (an excluded rank that calls it is misuse, and so are
  members that exclude different ranks, or NCCL_SHRINK_DEFAULT with work outstanding);
  NCCL_SHRINK_ABORT first stops the parent's work, as revoke does.
- Arguments NCCL rejects raise ``NCCLError`` at the call. What would hang or corrupt memory on a
  GPU (ranks that disagree, unmatched sends, a split with work outstanding, a blocking call whose
  peers never come) is recorded in ``misuse``, which tests expect to stay empty.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import hashlib
import os
import pickle
import socket
import threading
import time
import types
import weakref
from typing import Any

import ml_dtypes
import nccl.core as _nc
import numpy as np
import packaging.version
from cuda_emulation import CudaEmulation, FakeDeviceArray, Misuse, host_view
from nccl.bindings.nccl import NCCLError

from gpucoll.errors import StoreTimeout
from gpucoll.store import TCPStore, parse_address

__all__ = ["EmulatedRuntime", "FakeDeviceArray", "Misuse", "NCCLError", "without_shrink"]

# nccl.h: ncclDataType_t, ncclRedOp_t and ncclResult_t, written out again here on purpose
NCCL_TYPES = {
    0: np.dtype(np.int8), 1: np.dtype(np.uint8), 2: np.dtype(np.int32), 3: np.dtype(np.uint32),
    4: np.dtype(np.int64), 5: np.dtype(np.uint64), 6: np.dtype(np.float16),
    7: np.dtype(np.float32), 8: np.dtype(np.float64), 9: np.dtype(ml_dtypes.bfloat16),
    10: np.dtype(ml_dtypes.float8_e4m3fn), 11: np.dtype(ml_dtypes.float8_e5m2),
}
NCCL_OPS = {0: np.add, 1: np.multiply, 2: np.maximum, 3: np.minimum, 4: np.add}
AVG = 4
SUCCESS, UNHANDLED_CUDA_ERROR, INVALID_ARGUMENT, INVALID_USAGE, IN_PROGRESS = 0, 1, 4, 5, 7
REMOTE_ERROR = 6
COLLECTIVES = ("allreduce", "reduce", "broadcast", "allgather", "reduce_scatter")
MANAGING = ("shrink", "split")  # what a revoked communicator still serves (nccl.h)
TREE_MAX_BYTES = 64 << 10  # all-reduces up to this size take the "tree" algorithm here
CONNECT_S = 0.02  # what making one algorithm's (or one pair's) connections takes
REMOTE_ERROR_S = 1.0  # how long a broken connection to a peer takes to become ncclRemoteError


class EmulatedRuntime(CudaEmulation):
    """The CUDA emulation with an emulated nccl4py; ``store_addr`` carries NCCL's traffic."""

    def __init__(self, store_addr: str, devices: int = 8, hang_timeout: float = 30.0,
                 nccl_version: str | None = None):
        super().__init__(devices, hang_timeout)
        self.store = TCPStore(*parse_address(store_addr), timeout=60.0)
        self.module = EmulatedNccl(self, nccl_version)
        self.bindings = EmulatedBindings(self.module)

    def nccl(self) -> EmulatedNccl:
        return self.module

    def nccl_bindings(self) -> EmulatedBindings:
        return self.bindings

    def close(self) -> None:
        super().close()
        self.store.close()


def without_shrink(rt: EmulatedRuntime) -> None:
    """Make ``rt``'s nccl4py one whose communicators have no ``revoke`` and no ``shrink``
    (as an nccl4py made before NCCL had them)."""

    def missing(self):
        raise AttributeError("this binding has no such method")

    module = rt.module
    module.Communicator = type("Communicator", (module.Communicator,),
                               {"revoke": property(missing), "shrink": property(missing)})


class EmulatedNccl:
    """Stands in for nccl4py's ``nccl.core``."""

    NCCLConfig = _nc.NCCLConfig
    CommShrinkFlag = _nc.CommShrinkFlag
    UniqueId = _nc.UniqueId
    NcclInvalid = _nc.NcclInvalid
    get_unique_id = staticmethod(_nc.get_unique_id)

    def __init__(self, rt: EmulatedRuntime, version: str | None = None):
        self.rt = rt
        self.version = version  # the NCCL it stands for; None: the installed one
        self._local = threading.local()
        self.Communicator = type("Communicator", (Communicator,), {"_rt": rt, "_module": self})
        self.handles: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._env_blocking: int | None = None

    def get_version(self) -> Any:
        """nccl4py's version report, with ``libnccl.version`` this emulation's NCCL."""
        real = _nc.get_version()
        if self.version is None:
            return real
        return types.SimpleNamespace(nccl4py=real.nccl4py, libnccl=types.SimpleNamespace(
            version=packaging.version.Version(self.version)))

    def older_than(self, major: int, minor: int) -> bool:
        """Whether the NCCL this stands for is older than ``major.minor``."""
        release = self.get_version().libnccl.version.release
        return tuple(release[:2]) < (major, minor)

    def blocking(self, config: Any, inherited: bool | None = None) -> bool:
        """Whether a communicator made with ``config`` blocks. NCCL_COMM_BLOCKING=0 or 1
        overrides the config (NCCL's src/init.cc, envConfigOverride: ``if (blockingEnv == 0 ||
        blockingEnv == 1) comm->config.blocking = blockingEnv``), read once per process and
        kept (src/include/param.h: NCCL_PARAM caches its first read). Without either, a
        communicator blocks (NCCL's default), and a split's child inherits its parent's."""
        if self._env_blocking is None:
            raw = os.environ.get("NCCL_COMM_BLOCKING", "").strip()
            self._env_blocking = int(raw) if raw.lstrip("-").isdigit() else -1
        if self._env_blocking in (0, 1):
            return bool(self._env_blocking)
        if config is not None and config.blocking is not None:
            return config.blocking is not False
        return True if inherited is None else inherited

    def group(self) -> list | None:
        """The calls of the group this thread is inside, if any."""
        return getattr(self._local, "ops", None)

    def group_start(self) -> None:
        self._local.depth = getattr(self._local, "depth", 0) + 1
        if self._local.depth == 1:
            self._local.ops = []

    def group_end(self) -> None:
        depth = getattr(self._local, "depth", 0)
        if depth == 0:
            raise NCCLError(INVALID_USAGE)  # group_end without group_start
        self._local.depth = depth - 1
        if depth == 1:
            ops, self._local.ops = self._local.ops, None
            by_comm: dict[int, list[Op]] = collections.defaultdict(list)
            for op in ops:
                by_comm[id(op.comm)].append(op)
            for group in by_comm.values():
                comm = group[0].comm
                with comm._inside_call("group_end"):
                    comm._launch(group)


class EmulatedBindings:
    """Stands in for nccl4py's raw bindings (``nccl.bindings.nccl``): the functions the backend
    calls, with their parameters in nccl.h's order. A handle (``Comm``) names a communicator of
    ``module`` by its ``ptr``; NULL is an invalid argument, and a freed one a use after free."""

    NCCLError = NCCLError

    class Comm:
        """A communicator's handle, owning nothing (as the bindings' ``Comm``)."""

        def __init__(self, handle: int = 0):
            self.handle = handle

    def __init__(self, module: EmulatedNccl):
        self._module = module

    def all_reduce(self, sendbuff, recvbuff, count, datatype, op, comm, stream) -> None:
        self._call(comm, "allreduce", stream, send=sendbuff, recv=recvbuff, count=count,
                   dtype=datatype, op=op)

    def reduce(self, sendbuff, recvbuff, count, datatype, op, root, comm, stream) -> None:
        self._call(comm, "reduce", stream, send=sendbuff, recv=recvbuff, count=count,
                   dtype=datatype, op=op, root=root)

    def broadcast(self, sendbuff, recvbuff, count, datatype, root, comm, stream) -> None:
        self._call(comm, "broadcast", stream, send=sendbuff, recv=recvbuff, count=count,
                   dtype=datatype, root=root)

    def all_gather(self, sendbuff, recvbuff, sendcount, datatype, comm, stream) -> None:
        self._call(comm, "allgather", stream, send=sendbuff, recv=recvbuff, count=sendcount,
                   dtype=datatype)

    def reduce_scatter(self, sendbuff, recvbuff, recvcount, datatype, op, comm, stream) -> None:
        self._call(comm, "reduce_scatter", stream, send=sendbuff, recv=recvbuff,
                   count=recvcount, dtype=datatype, op=op)

    def send(self, sendbuff, count, datatype, peer, comm, stream) -> None:
        self._call(comm, "send", stream, send=sendbuff, count=count, dtype=datatype, peer=peer)

    def recv(self, recvbuff, count, datatype, peer, comm, stream) -> None:
        self._call(comm, "recv", stream, recv=recvbuff, count=count, dtype=datatype, peer=peer)

    def _call(self, handle: Comm, name: str, stream: int, **args: int) -> None:
        if not isinstance(handle, self.Comm):  # the bindings' own conversion error
            raise TypeError(f"Cannot convert {type(handle).__name__} to Comm")
        comm = self._module.handles.get(handle.handle)
        if comm is None or not comm.is_valid:
            if handle.handle:
                self._module.rt.report(f"{name} on a freed communicator (use after free)")
            raise NCCLError(INVALID_ARGUMENT)
        args = {k: _c_int(v, k) if k in ("dtype", "op", "root", "peer") else _c_size(v, k)
                for k, v in args.items()}
        with comm._api(name):
            try:
                comm._submit(Op(comm, name, stream=comm._stream(stream), **args))
            except NCCLError as exc:
                # On a non-blocking communicator a refused call is also the communicator's
                # asynchronous error from then on, and NCCL refuses every later call: NVIDIA/
                # nccl src/enqueue.cc, ncclEnqueueCheck's "fail:" path ("if (info->comm &&
                # !info->comm->config.blocking) (void) ncclCommSetAsyncError(info->comm,
                # ret)"), and init.cc's ncclCommEnsureReady, which fails every call while
                # the asynchronous error is set
                if not comm._blocking:
                    comm._state = exc.status
                raise


class Op:
    """One NCCL call: what it reads and writes, on which stream."""

    __slots__ = ("comm", "name", "send", "recv", "count", "dtype", "op", "root", "peer",
                 "stream", "seq")

    def __init__(self, comm, name, send=0, recv=0, count=0, dtype=0, op=-1, root=-1, peer=-1,
                 stream=None):
        self.comm, self.name, self.send, self.recv, self.count = comm, name, send, recv, count
        self.dtype, self.op, self.root, self.peer, self.stream = dtype, op, root, peer, stream
        self.seq = -1

    def meta(self) -> tuple:
        return (self.name, self.count, self.dtype, self.op, self.root)


class _Aborted(Exception):
    """The communicator was aborted while something waited for its peers."""


class _Refused(Exception):
    """NCCL refuses what the peers agreed on (e.g. two ranks on one GPU): ``code``."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def _c_int(value: int, what: str) -> int:
    """What nccl4py's ``int(value)`` into a C int does."""
    value = int(value)
    if not -2**31 <= value < 2**31:
        raise OverflowError(f"value too large to convert to int ({what}={value})")
    return value


def _c_size(value: int, what: str) -> int:
    """What the bindings' conversion of an address or a count (intptr_t, size_t) does."""
    value = int(value)
    if value < 0:
        raise OverflowError(f"can't convert negative value to size_t ({what}={value})")
    return value


class Communicator:
    """nccl4py's ``Communicator`` (the methods the backend calls), over emulated memory."""

    _rt: EmulatedRuntime
    _module: EmulatedNccl

    def __init__(self) -> None:
        self._valid = False  # a null communicator, as nccl4py's Communicator()
        self._inside: dict[int, str] = {}
        self.abort_calls = 0
        self.revoked = False
        self.made_by = "init"  # or "split", "shrink": how this communicator came to be

    @classmethod
    def init(cls, nranks: int, rank: int, unique_id: Any, config: Any = None) -> Communicator:
        raw = bytes(unique_id)
        if len(raw) != 128 or not 0 <= rank < nranks:
            raise NCCLError(INVALID_ARGUMENT)
        comm = cls()
        comm._setup(nranks, rank, raw, cls._module.blocking(config), cls._rt.current_device())
        comm._meanwhile("init", comm._join)
        return comm

    def _setup(self, nranks: int, rank: int, uid: bytes, blocking: bool, device: int) -> None:
        self._size, self._rank, self._uid, self._device = nranks, rank, uid, device
        self._blocking = blocking
        self._prefix = "emu/" + hashlib.sha1(uid).hexdigest()[:20]
        self._valid = True
        self._module.handles[id(self)] = self
        self._state = SUCCESS
        self._aborted = threading.Event()
        self._connected: set = set()
        self._coll_seq = self._split_seq = self._shrink_seq = 0
        self._p2p: dict[tuple[str, int], int] = collections.defaultdict(int)
        self._outstanding = 0
        self._last_kernel: threading.Event | None = None  # the previous kernel's end
        self._count_lock = threading.Lock()
        self.calls: list[tuple[str, dict]] = []
        self.connections: list[tuple] = []  # the channels connected, in order

    def _join(self) -> None:
        """Init: every rank enters; NCCL refuses two ranks on one GPU unless allowed. Before
        2.30 it refuses a peer whose host hash and bus id both equal its own ("Duplicate GPU
        detected", src/init.cc), the host hash being NCCL_HOSTID's when set, else the host
        name's (src/misc/utils.cc, getHostHash); from 2.30 it refuses ranks on one GPU unless
        NCCL_MULTI_RANK_GPU_ENABLE=1."""
        host = os.environ.get("NCCL_HOSTID") or socket.gethostname()
        mine = pickle.dumps((host, self._rt.device_identity(self._device)))
        peers = [pickle.loads(v) for v in self._meet("init", range(self._size), mine)]
        if self._module.older_than(2, 30):
            if len(set(peers)) != len(peers):
                raise _Refused(INVALID_USAGE, "Duplicate GPU detected")
        elif (len({gpu for _, gpu in peers}) != len(peers)
              and os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") != "1"):
            raise _Refused(INVALID_USAGE, "Multiple Ranks are using the same GPU/Partition. Set "
                                          "NCCL_MULTI_RANK_GPU_ENABLE=1 to enable this")

    # -- meeting the peers: on the host (blocking) or in the background (non-blocking)
    def _meet(self, name: str, members: Any, value: Any = b"1") -> list[bytes]:
        """Enter rendezvous ``name`` with ``members`` and return their values once all have
        (a blocking NCCL call would wait forever: after the hang timeout this is misuse)."""
        store, members = self._rt.store, list(members)
        store.set(f"{self._prefix}/{name}/{self._rank}", value)
        keys = [f"{self._prefix}/{name}/{r}" for r in members]
        deadline = time.monotonic() + self._rt.hang_timeout
        while True:
            if self._aborted.is_set():
                raise _Aborted
            try:
                store.wait(keys, timeout=0.05)
                return store.multi_get(keys)
            except StoreTimeout:
                if time.monotonic() > deadline:
                    missing = [r for r, v in zip(members, store.peek(keys), strict=True)
                               if v is None]
                    raise Misuse(f"NCCL {name} on rank {self._rank} would block forever: "
                                 f"rank(s) {missing} never entered it") from None

    def _meanwhile(self, what: str, work: Any, also: Communicator | None = None) -> None:
        """Run ``work`` (which meets peers): on this thread for a blocking communicator; for a
        non-blocking one in the background, in progress until it is done."""
        if self._blocking:
            try:
                work()
            except _Aborted:
                raise NCCLError(INVALID_USAGE) from None
            except _Refused as exc:
                raise NCCLError(exc.code) from None
            except Misuse as exc:
                self._rt.report(str(exc))
                raise
            return
        comms = [self] + ([also] if also is not None else [])
        for c in comms:
            c._state = IN_PROGRESS

        def background() -> None:
            try:
                work()
            except _Refused as exc:
                for c in comms:
                    c._state = exc.code
                return
            except Exception:  # noqa: BLE001 - aborted, peers that never come, store closed
                return  # never completes: in progress until aborted, as NCCL would stay
            for c in comms:
                if c._state == IN_PROGRESS:
                    c._state = SUCCESS

        threading.Thread(target=background, daemon=True, name=f"emu-nccl-{what}").start()

    # -- the API
    @contextlib.contextmanager
    def _inside_call(self, name: str):
        me = threading.get_ident()
        self._inside[me] = name
        try:
            yield
        finally:
            self._inside.pop(me, None)

    def _check_valid(self, operation: str) -> None:
        if not self._valid:
            raise _nc.NcclInvalid(f"Cannot {operation}: Communicator not initialized")

    @contextlib.contextmanager
    def _api(self, name: str):
        """An NCCL call: refused on a freed communicator, misuse while one is in progress."""
        self._check_valid(name)
        if self._state == IN_PROGRESS:
            self._rt.report(f"{name} on rank {self._rank} while the communicator is in "
                            "progress (NCCL allows only get_async_error and abort then)")
            raise NCCLError(INVALID_USAGE)
        if self._state != SUCCESS:
            raise NCCLError(self._state)
        if self.revoked and name not in MANAGING:
            self._rt.report(f"{name} on rank {self._rank} on a revoked communicator (it serves "
                            "only shrink, split, destroy and abort)")
            raise NCCLError(INVALID_USAGE)
        with self._inside_call(name):
            yield

    @property
    def is_valid(self) -> bool:
        return self._valid

    @property
    def ptr(self) -> int:
        return id(self) if self._valid else 0

    @property
    def rank(self) -> int:
        self._check_valid("get rank")
        return self._rank

    @property
    def nranks(self) -> int:
        self._check_valid("get nranks")
        return self._size

    def get_async_error(self) -> int:
        self._check_valid("get async error")
        return self._state

    def inject_error(self, code: int) -> None:
        """For tests: NCCL found an asynchronous error (e.g. a network failure)."""
        self._state = code

    def abort(self) -> None:
        self.abort_calls += 1
        if not self._valid:
            return
        others = {t: n for t, n in self._inside.items() if t != threading.get_ident()}
        if others:
            self._rt.report(f"ncclCommAbort on rank {self._rank} while another thread is inside "
                            f"{', '.join(others.values())} on the same communicator (use after "
                            "free)")
        with self._inside_call("abort"):
            self._valid = False
            self._aborted.set()
        try:  # the peers' connections to this rank break (``_fetch``)
            self._rt.store.set(f"{self._prefix}/gone/{self._rank}", b"aborted")
        except Exception:  # noqa: BLE001 - the store may be closed already
            pass

    def revoke(self, flags: int = 0) -> None:
        """ncclCommRevoke: the work in flight stops; in progress until it has."""
        self._check_valid("revoke")
        if flags != 0:
            raise NCCLError(INVALID_ARGUMENT)
        others = {t: n for t, n in self._inside.items() if t != threading.get_ident()}
        if others:
            self._rt.report(f"ncclCommRevoke on rank {self._rank} while another thread is "
                            f"inside {', '.join(others.values())} on the same communicator")
        self._stop_work()

    def _stop_work(self) -> None:
        """Terminate the kernels in flight (as revoke and NCCL_SHRINK_ABORT do); the
        communicator is in progress until none is left."""
        self.revoked = True
        self._aborted.set()
        self._state = IN_PROGRESS

        def quiet() -> None:
            while self._outstanding and self._valid:
                time.sleep(0.005)
            if self._valid and self._state == IN_PROGRESS:
                self._state = SUCCESS

        threading.Thread(target=quiet, daemon=True, name="emu-nccl-revoke").start()

    def shrink(self, exclude_ranks: Any = None, config: Any = None, flag: int = 0
               ) -> Communicator:
        """ncclCommShrink: the members (ranks not excluded) meet and make a communicator of
        themselves, renumbered in order."""
        excluded = sorted({_c_int(r, "exclude_ranks") for r in (exclude_ranks or [])})
        if any(not 0 <= r < self._size for r in excluded) or int(flag) not in (0, 1):
            raise NCCLError(INVALID_ARGUMENT)
        if int(flag) == 1 and self._valid and not self.revoked:  # NCCL_SHRINK_ABORT
            self._stop_work()
            while self._state == IN_PROGRESS and self._valid:
                time.sleep(0.005)
        with self._api("shrink"):
            if self._rank in excluded:
                self._rt.report(f"ncclCommShrink on rank {self._rank}, which it excludes "
                                "(excluded ranks must not call it)")
                raise NCCLError(INVALID_USAGE)
            if int(flag) == 0 and self._outstanding:
                self._rt.report(f"ncclCommShrink (NCCL_SHRINK_DEFAULT) on rank {self._rank} "
                                "with work outstanding on the communicator (NCCL may deadlock)")
            self._shrink_seq += 1
            seq, child = self._shrink_seq, type(self)()
            members = [r for r in range(self._size) if r not in excluded]
            # the members meet through the child, which the parent's stopped work cannot end
            child._valid, child._state, child._inside = True, IN_PROGRESS, {}
            child._aborted, child.made_by = threading.Event(), "shrink"
            child._prefix, child._rank = f"{self._prefix}/shrink/{seq}", self._rank
            blocking = self._module.blocking(config, inherited=self._blocking)

            def work() -> None:
                said = child._meet("members", members, repr(excluded).encode())
                if len(set(said)) != 1:
                    message = (f"ncclCommShrink #{seq}: the members exclude different ranks "
                               f"({sorted({v.decode() for v in said})})")
                    self._rt.report(message)
                    raise _Refused(INVALID_USAGE, message)
                if not child._valid:  # aborted while the members met
                    raise _Aborted
                uid = hashlib.sha512(self._uid + f"shrink/{seq}/{excluded}".encode()).digest()
                child._setup(len(members), members.index(self._rank), uid + uid[:64], blocking,
                             self._device)
                child.made_by = "shrink"

            self._meanwhile("shrink", work, also=child)
            return child

    def finalize(self) -> None:
        if not self._valid:
            return
        if self.revoked:
            self._rt.report(f"ncclCommFinalize on rank {self._rank} after ncclCommRevoke "
                            "(nccl.h: invalid)")
            raise NCCLError(INVALID_USAGE)
        with self._api("finalize"):
            self._meanwhile("finalize", lambda: self._meet("finalize", range(self._size)))

    def destroy(self) -> None:
        if not self._valid:
            return
        if self._state == IN_PROGRESS:
            self._rt.report(f"ncclCommDestroy on rank {self._rank} while in progress")
        self._valid = False
        self._aborted.set()

    def split(self, color: int | None = None, key: int = 0, config: Any = None) -> Communicator:
        with self._api("split"):
            color = _c_int(-1 if color is None else color, "color")
            key = _c_int(key, "key")
            if color < -1:
                raise NCCLError(INVALID_ARGUMENT)
            if self._outstanding:
                self._rt.report(f"ncclCommSplit on rank {self._rank} with work outstanding on "
                                "the communicator (NCCL may deadlock)")
            self._split_seq += 1
            seq, child = self._split_seq, type(self)()
            blocking = self._module.blocking(config, inherited=self._blocking)
            if color != -1:
                child._valid, child._state, child._inside = True, IN_PROGRESS, {}
                child._aborted = threading.Event()

            def work() -> None:
                raw = self._meet(f"split/{seq}", range(self._size), f"{color} {key}".encode())
                if color == -1:
                    return
                pairs = [tuple(int(v) for v in r.split()) for r in raw]
                members = sorted((k, r) for r, (c, k) in enumerate(pairs) if c == color)
                uid = hashlib.sha512(self._uid + f"{seq}/{color}".encode()).digest()
                child._setup(len(members), [r for _, r in members].index(self._rank),
                             uid + uid[:64], blocking, self._device)

            self._meanwhile("split", work, also=child if color != -1 else None)
            return child

    def _stream(self, stream: Any) -> Any:
        """The stream a call names (None: the default stream), on the communicator's device,
        as NCCL makes its device current before it launches."""
        handle = 0 if stream is None else int(stream)
        with self._rt.using_device(self._device):
            try:
                s = self._rt.stream(handle)
            except RuntimeError as exc:
                self._rt.report(f"rank {self._rank}: {exc}")
                raise NCCLError(UNHANDLED_CUDA_ERROR) from None
        if s.device != self._device:
            self._rt.report(f"rank {self._rank}: a stream of device {s.device} on a "
                            f"communicator of device {self._device}")
            raise NCCLError(UNHANDLED_CUDA_ERROR)
        return s

    # -- what NCCL checks, and launching
    def _submit(self, op: Op) -> None:
        self._check(op)
        self.calls.append((op.name, {"count": op.count, "dtype": op.dtype,
                                     "stream": op.stream.handle}))
        group = self._module.group()
        if group is not None:
            group.append(op)
        else:
            self._launch([op])

    def _check(self, op: Op) -> None:
        if op.dtype not in NCCL_TYPES:
            self._invalid(f"{op.name}: datatype {op.dtype} is not an ncclDataType_t")
        if op.name in ("allreduce", "reduce", "reduce_scatter") and op.op not in NCCL_OPS:
            self._invalid(f"{op.name}: op {op.op} is not an ncclRedOp_t")
        if op.name in ("reduce", "broadcast") and not 0 <= op.root < self._size:
            self._invalid(f"{op.name}: root {op.root} outside [0, {self._size})")
        if op.name in ("send", "recv") and not 0 <= op.peer < self._size:
            self._invalid(f"{op.name}: peer {op.peer} outside [0, {self._size})")
        nsend, nrecv = self._extents(op)
        self._check_buffer(op, "sendbuff", op.send, nsend)
        self._check_buffer(op, "recvbuff", op.recv, nrecv)
        self._check_overlap(op, nsend, nrecv)

    def _extents(self, op: Op) -> tuple[int, int]:
        """Bytes each buffer must hold (nccl.h): 0 for a buffer the call does not use."""
        n, size = op.count * NCCL_TYPES[op.dtype].itemsize, self._size
        root = self._rank == op.root
        return {"allgather": (n, n * size), "reduce_scatter": (n * size, n),
                "reduce": (n, n if root else 0), "broadcast": (n if root else 0, n),
                "send": (n, 0), "recv": (0, n)}.get(op.name, (n, n))

    def _check_buffer(self, op: Op, what: str, ptr: int, nbytes: int) -> None:
        if nbytes == 0:
            return
        if ptr == 0:
            self._invalid(f"{op.name}: {what} is NULL")
        block = self._rt.pool.find(ptr, nbytes)
        if block is None:
            self._invalid(f"{op.name}: {what} {ptr:#x}+{nbytes} bytes is not inside one device "
                          "allocation")
        if block.kind != "device" or block.device != self._device:
            self._invalid(f"{op.name}: {what} is {block.kind} memory of device {block.device}, "
                          f"the communicator is on device {self._device}")

    def _check_overlap(self, op: Op, nsend: int, nrecv: int) -> None:
        """Overlapping buffers must be exactly nccl.h's in-place layout."""
        if not nsend or not nrecv or op.send + nsend <= op.recv or op.recv + nrecv <= op.send:
            return
        shift = self._rank * op.count * NCCL_TYPES[op.dtype].itemsize
        legal = {"allgather": op.send == op.recv + shift,
                 "reduce_scatter": op.recv == op.send + shift}.get(op.name, op.send == op.recv)
        if not legal:
            self._invalid(f"{op.name}: send and receive buffers overlap but are not NCCL's "
                          "in-place layout")

    def _invalid(self, message: str) -> None:
        self._rt.report(message)
        raise NCCLError(INVALID_ARGUMENT)

    def _launch(self, ops: list[Op]) -> None:
        """Number the calls, connect what is not yet connected (the host blocks there, or the
        communicator is in progress), then queue them on their stream."""
        if self._size == 1:
            ops = [op for op in ops if not self._one_rank(op)]
            if not ops:
                return
        for op in ops:
            if op.name in ("send", "recv"):
                key = (op.name, op.peer)
                op.seq, self._p2p[key] = self._p2p[key], self._p2p[key] + 1
            else:
                op.seq, self._coll_seq = self._coll_seq, self._coll_seq + 1
        channels = {("p2p",) + tuple(sorted((self._rank, op.peer))) if op.name in ("send", "recv")
                    else ("coll", self._algorithm(op)) for op in ops}
        new = channels - self._connected
        with self._count_lock:
            self._outstanding += 1
        if not new:
            self._enqueue(ops)
            return

        def connect() -> None:
            for chan in sorted(new):
                members = range(self._size) if chan[0] == "coll" else chan[1:]
                self._meet("connect/" + "/".join(map(str, chan)), members)
                time.sleep(CONNECT_S)
                self.connections.append(chan)
            self._connected |= new
            self._enqueue(ops)

        self._meanwhile("connect", connect)

    def _algorithm(self, op: Op) -> str:
        """The algorithm whose connections a collective needs. NCCL connects lazily, per
        algorithm: at a group's launch, ncclPrepareTasks marks ``algoNeedConnect[algo]`` for
        an algorithm whose channels are not yet connected, and the group connects them before
        it launches (NVIDIA/nccl src/group.cc, groupLaunch, and src/enqueue.cc; runtime
        connection, NCCL_RUNTIME_CONNECT, is the default since 2.22). Which algorithm a call
        gets depends on the collective and its size (ncclGetAlgoInfo's tuning); here small
        all-reduces (at most ``TREE_MAX_BYTES``) take "tree" and everything else "ring", so
        that a later call, not only the first, can need a connection."""
        nbytes = op.count * NCCL_TYPES[op.dtype].itemsize
        return "tree" if op.name == "allreduce" and nbytes <= TREE_MAX_BYTES else "ring"

    def _one_rank(self, op: Op) -> bool:
        """A collective of a one-rank communicator: NCCL launches no kernel for it and
        connects nothing (src/enqueue.cc, taskAppend: ``if (comm->nRanks == 1)`` a collective
        goes to ``ncclLaunchOneRank`` and returns). That function (src/device/onerank.cu) does
        nothing in place, and out of place one ``cudaMemcpyAsync`` of ``count`` elements on
        the caller's stream (``ncclAvg`` on floating types is a premultiply by 1/1 there, the
        same values), outside the communicator's queue of kernels. True if it was one."""
        if op.name not in COLLECTIVES:
            return False
        nbytes = op.count * NCCL_TYPES[op.dtype].itemsize
        if op.send != op.recv and nbytes:
            send, recv = op.send, op.recv
            op.stream.submit(lambda: ctypes.memmove(recv, send, nbytes))
        return True

    def _enqueue(self, ops: list[Op]) -> None:
        """Queue the kernel of ``ops`` on their stream, after this communicator's previous
        kernel, whatever stream that one was on: NCCL launches every kernel of a communicator
        after the one before it and before the one after it, through the communicator's
        internal ``deviceStream`` (NVIDIA/nccl src/enqueue.cc, ncclLaunchPrepare: "Launch
        kernel, depends on all of {deviceStream, hostStream, userStream[i]...}" and
        "{deviceStream, userStream[i]...} depend on kernel"). So a receive whose peer has not
        sent holds back every later call of the communicator, on any stream."""
        streams = {id(op.stream): op.stream for op in ops}
        first, others = ops[0].stream, [s for k, s in streams.items() if k != id(ops[0].stream)]
        done = threading.Event()
        before, self._last_kernel = self._last_kernel, done

        def run() -> None:
            try:
                if before is not None:
                    self._after(before, ops)
                self._execute(ops)
            finally:
                with self._count_lock:
                    self._outstanding -= 1
                done.set()

        first.submit(run)
        for s in others:  # a group over several streams: each waits for the whole group
            s.submit(lambda: done.wait(self._rt.hang_timeout))

    def _after(self, before: threading.Event, ops: list[Op]) -> None:
        """Wait (on the stream) until the communicator's previous kernel has ended; one that
        never does is what a GPU would hang on."""
        deadline = time.monotonic() + self._rt.hang_timeout
        while not before.wait(0.05):
            if self._aborted.is_set():
                return  # terminated: this kernel ends too (``_execute`` sees the abort)
            if time.monotonic() > deadline:
                names = ", ".join(op.name for op in ops)
                self._rt.report(f"rank {self._rank}: NCCL would hang: {names} waits behind an "
                                "earlier call of the same communicator that never completes")
                return

    # -- execution, on the stream
    def _execute(self, ops: list[Op]) -> None:
        try:
            for op in ops:
                if op.name == "send":
                    self._post(f"p2p/{self._rank}->{op.peer}/{op.seq}", op, op.send)
            for op in ops:
                if op.name in COLLECTIVES:
                    self._collective(op)
            for op in ops:
                if op.name == "recv":
                    self._receive(op)
            for op in ops:
                if op.name == "send":
                    self._fetch(f"p2p/{self._rank}->{op.peer}/{op.seq}/ack",
                                f"send #{op.seq} to rank {op.peer} never received", [op.peer])
        except _Aborted:
            return  # the kernel was terminated
        except Misuse as exc:
            self._rt.report(f"rank {self._rank}: {exc}")
            self._state = INVALID_USAGE

    def _post(self, key: str, op: Op, ptr: int, nbytes: int | None = None) -> None:
        n = op.count * NCCL_TYPES[op.dtype].itemsize if nbytes is None else nbytes
        data = host_view(ptr, n).tobytes() if ptr else b""
        self._rt.store.set(f"{self._prefix}/{key}", pickle.dumps((op.meta(), data)))

    def _fetch(self, key: str, what: str, peers: Any = ()) -> Any:
        """The value a peer posts at ``key``, waited for as a kernel waits for its peers. A
        peer of ``peers`` that aborted its communicator (or whose process ended) breaks the
        connections to it; NCCL finds that out in its proxy thread and reports it as the
        communicator's asynchronous error ``ncclRemoteError`` ("a call failed possibly due to
        a network error or a remote process exiting prematurely", nccl.h), not at once but
        when the transport notices, and only where work waits on that peer: here
        ``REMOTE_ERROR_S`` after this kernel first sees the peer gone. The kernel itself keeps
        waiting, as a GPU kernel would, until the communicator is aborted or revoked."""
        deadline = time.monotonic() + self._rt.hang_timeout
        gone_keys = [f"{self._prefix}/gone/{r}" for r in peers if r != self._rank]
        noticed = None
        while True:
            if self._aborted.is_set():
                raise _Aborted
            try:
                return pickle.loads(self._rt.store.get(f"{self._prefix}/{key}", timeout=0.05))
            except StoreTimeout:
                now = time.monotonic()
                if gone_keys and noticed is None and any(
                        v is not None for v in self._rt.store.peek(gone_keys)):
                    noticed = now
                if noticed is not None and now - noticed >= REMOTE_ERROR_S and \
                        self._state == SUCCESS:
                    self._state = REMOTE_ERROR
                if now > deadline:
                    raise Misuse(f"NCCL would hang: {what}") from None

    def _receive(self, op: Op) -> None:
        key = f"p2p/{op.peer}->{self._rank}/{op.seq}"
        meta, data = self._fetch(key, f"recv #{op.seq} from rank {op.peer} never matched",
                                 [op.peer])
        _, count, dtype = meta[:3]
        if (count, dtype) != (op.count, op.dtype):
            raise Misuse(f"recv of {op.count} x type {op.dtype} from rank {op.peer} met a send "
                         f"of {count} x type {dtype}")
        host_view(op.recv, len(data))[:] = np.frombuffer(data, np.uint8)
        self._rt.store.set(f"{self._prefix}/{key}/ack", pickle.dumps(True))

    def _collective(self, op: Op) -> None:
        base = f"coll/{op.seq}"
        nsend, _ = self._extents(op)
        self._post(f"{base}/{self._rank}", op, op.send, nsend)
        got = [self._fetch(f"{base}/{r}", f"rank {r} never called collective #{op.seq} "
                           f"({op.name})", range(self._size)) for r in range(self._size)]
        for r, (meta, _) in enumerate(got):
            if meta != op.meta():
                raise Misuse(f"collective #{op.seq}: rank {self._rank} called {op.meta()}, "
                             f"rank {r} called {meta}")
        dtype = NCCL_TYPES[op.dtype]
        result = self._combine(op, [np.frombuffer(data, dtype) for _, data in got], dtype)
        if result is not None:
            host_view(op.recv, result.nbytes, dtype)[:] = result

    def _combine(self, op: Op, parts: list[np.ndarray], dtype: np.dtype) -> np.ndarray | None:
        if op.name == "broadcast":
            return parts[op.root]
        if op.name == "allgather":
            return np.concatenate(parts)
        if op.name == "reduce" and self._rank != op.root:
            return None
        floating = dtype.kind == "f" or dtype in (NCCL_TYPES[9], NCCL_TYPES[10], NCCL_TYPES[11])
        if op.op == AVG and floating:  # ncclAvg: premultiply by fl(1/n), then sum
            scale = dtype.type(1.0 / self._size)
            parts = [(p * scale).astype(dtype) for p in parts]
        total = parts[0].copy()
        for p in parts[1:]:
            total = NCCL_OPS[op.op](total, p).astype(dtype)
        if op.op == AVG and dtype.kind in "iu":
            total = (total // self._size).astype(dtype)
        if op.name == "reduce_scatter":
            return total[self._rank * op.count:(self._rank + 1) * op.count]
        return total
