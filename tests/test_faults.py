"""The fault suite: ranks killed, stopped, closed early or making different calls; bad input on
one rank; a forked child and a second thread using a communicator. Every case runs on both
transports and at 2 and 3 ranks (4 where the scenario needs it), asserts the exception's type,
the rank it names and how soon it came, and (through the spawn helper) that no process, socket or
shared-memory segment is left behind.

Ranks coordinate through the test's own store (``_side``): a rank that dies writes the time first,
so that its peers can measure how long they took to notice.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import numpy as np
import pytest
from multiproc import spawn
from tiers import grid

import gpucoll
from gpucoll.errors import (
    BackendUnavailable,
    CollectiveMismatch,
    GpucollError,
    PeerFailure,
    UsageError,
)

LONG = 60.0  # a deadline no passing case gets near: faults must be noticed without it
BOUND_S = 5.0  # how soon a survivor must raise after a peer dies, closes or disagrees
TRANSPORTS = grid(["shm", "tcp"], "shm")
WORLDS = grid([2, 3], 2)
WITH_PYTHON = grid(["shm", "tcp", "shm-python"], "shm")  # and the Python small exchange
SHM_KINDS = grid(["shm", "shm-python"], "shm")

pytestmark = pytest.mark.timeout(120)


def _env(transport: str, **more: str) -> dict[str, str]:
    if transport == "shm-python":  # shared memory without the compiled small exchange
        return {"GPUCOLL_TRANSPORT": "shm", "GPUCOLL_NATIVE": "0", **more}
    return {"GPUCOLL_TRANSPORT": transport, **more}


def _open(rank: int, n: int, addr: str, timeout: float = LONG):
    return gpucoll.init("ring", rank=rank, world_size=n, store=addr, timeout=timeout)


def _side(addr: str):
    """A client of the test's store, for the ranks' own coordination."""
    from gpucoll.store import TCPStore, parse_address

    host, port = parse_address(addr)
    return TCPStore(host, port, timeout=LONG)


def _die(side, key: str = "died") -> None:
    """Record the time, then die at once (SIGKILL: no clean-up, as a crash)."""
    side.set(key, repr(time.time()))
    side.close()
    os.kill(os.getpid(), signal.SIGKILL)


def _barrier_then_die(comm, side, dying: int) -> None:
    """A barrier, after which rank ``dying`` dies once every other rank has left it: its death
    falls in the call under test, never in the barrier's last messages (a socket closed by a
    kill may discard what it sent last)."""
    comm.barrier()
    if comm.rank == dying:
        side.wait([f"past/{r}" for r in range(comm.size) if r != dying], timeout=LONG)
        _die(side)
    side.set(f"past/{comm.rank}", b"")


def _outcome(exc: BaseException, side, key: str = "died") -> tuple:
    """What a survivor saw: the error's type, the rank it names, its text, and how many seconds
    after the event recorded under ``key`` it came."""
    since = time.time() - float(side.get(key, timeout=LONG))
    return type(exc).__name__, getattr(exc, "peer", None), str(exc), since


def _check(o, kind: type, peer: int | None, *words: str) -> None:
    """Rank outcome ``o`` raised ``kind`` naming ``peer`` and ``words``, within BOUND_S."""
    assert o.error is None and o.value is not None, \
        f"rank {o.rank} raised no GpucollError: {o.error!r}\n{o.trace}"
    name, named, text, since = o.value
    assert name == kind.__name__, text
    if peer is not None:
        assert named == peer, text
    for word in words:
        assert word in text, text
    assert since < BOUND_S, f"{since:.1f} s: {text}"


def _check_rank_1_killed_in_an_all_reduce(outcomes) -> None:
    """Rank 1 died of SIGKILL, and every other rank raised PeerFailure naming it in time."""
    assert outcomes[1].exitcode == -signal.SIGKILL
    for o in outcomes[:1] + outcomes[2:]:
        _check(o, PeerFailure, 1, "all_reduce #", "rank 1")


def _close_quietly(comm) -> None:
    """Close where an error has already been reported (close() may repeat it)."""
    try:
        comm.close()
    except GpucollError:
        pass


# -- 1. a peer killed while the others wait for it in a call ----------------------------------

def _root_dies_before_scatter(rank, n, addr):
    side = _side(addr)
    with _open(rank, n, addr) as comm:
        _barrier_then_die(comm, side, 0)
        try:
            comm.scatter(None, root=0)
        except GpucollError as exc:
            return _outcome(exc, side)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("n", WORLDS)
def test_a_root_killed_before_scatter_fails_the_waiting_ranks_fast(store_addr, transport, n):
    outcomes = spawn(_root_dies_before_scatter, n, store_addr, env=_env(transport), check=False)
    for o in outcomes[1:]:
        _check(o, PeerFailure, 0, "scatter #1 on rank", "rank 0")


def _rank_dies_before_split(rank, n, addr):
    side = _side(addr)
    with _open(rank, n, addr) as comm:
        _barrier_then_die(comm, side, n - 1)
        try:
            comm.split(0)
        except GpucollError as exc:
            return _outcome(exc, side)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("n", WORLDS)
def test_a_rank_killed_before_split_fails_the_others_fast(store_addr, transport, n):
    outcomes = spawn(_rank_dies_before_split, n, store_addr, env=_env(transport), check=False)
    for o in outcomes[:-1]:
        _check(o, PeerFailure, n - 1, "split #1 on rank", f"rank {n - 1}")


def _rank_dies_before_debug_check(rank, n, addr):
    side = _side(addr)
    with _open(rank, n, addr) as comm:
        _barrier_then_die(comm, side, n - 1)
        try:
            comm.all_reduce(np.ones(4))
        except GpucollError as exc:
            return _outcome(exc, side)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("n", WORLDS)
def test_a_rank_killed_before_the_debug_check_fails_the_others_fast(store_addr, transport, n):
    outcomes = spawn(_rank_dies_before_debug_check, n, store_addr, check=False,
                     env=_env(transport, GPUCOLL_DEBUG="1"))
    for o in outcomes[:-1]:
        _check(o, PeerFailure, n - 1, "all_reduce on rank", f"rank {n - 1} died")


def _rank_dies_in_set_up(rank, n, addr):
    from gpucoll.transport import mesh

    side = _side(addr)
    if rank == n - 1:  # dies after joining the group, before publishing its address
        mesh.advertised_host = lambda store: _die(side)
    try:
        _open(rank, n, addr).close()
    except GpucollError as exc:
        return _outcome(exc, side)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("n", WORLDS)
def test_a_rank_killed_during_set_up_is_named_fast(store_addr, transport, n):
    outcomes = spawn(_rank_dies_in_set_up, n, store_addr, env=_env(transport), check=False)
    for o in outcomes[:-1]:
        _check(o, PeerFailure, n - 1, "ring set-up on rank", f"rank {n - 1} died")


def _store_host_dies(rank, n, addr, port):
    side = _side(addr)
    os.environ.update(GPUCOLL_RANK=str(rank), GPUCOLL_WORLD_SIZE=str(n),
                      GPUCOLL_MASTER_ADDR="127.0.0.1", GPUCOLL_MASTER_PORT=str(port))
    comm = gpucoll.init("ring", timeout=LONG)  # rank 0 hosts the job's store
    try:
        _barrier_then_die(comm, side, 0)
        comm.all_reduce(np.ones(4))
    except GpucollError as exc:
        return _outcome(exc, side)
    finally:
        comm.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("n", WORLDS)
def test_losing_the_store_that_rank_0_hosts_names_rank_0(store_addr, transport, n):
    with socket.socket() as probe:  # a port nobody listens on, for rank 0's store
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    outcomes = spawn(_store_host_dies, n, store_addr, port, check=False,
                     env=_env(transport, GPUCOLL_DEBUG="1"))
    for o in outcomes[1:]:
        _check(o, PeerFailure, 0, "all_reduce on rank", "lost the store, which rank 0")


# elements of an all_reduce that 4 ranks on shared memory make through their outboxes, in
# float32 or float64 (800,000 or 1,600,000 bytes: more than one round of messages carries)
OUTBOXES = 200_000


def _killed_mid_all_reduce(rank, n, addr, count=1 << 20):
    side = _side(addr)
    with _open(rank, n, addr) as comm:
        x = np.ones(count, np.float32)
        for i in range(100_000):
            if rank == 1 and i == 3:
                _die(side)
            try:
                comm.all_reduce(x)
            except GpucollError as exc:
                return _outcome(exc, side)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("n", WORLDS)
def test_a_rank_killed_mid_collective_is_named_by_every_survivor(store_addr, transport, n):
    outcomes = spawn(_killed_mid_all_reduce, n, store_addr, env=_env(transport), check=False)
    _check_rank_1_killed_in_an_all_reduce(outcomes)


def _killed_before_a_small_async_call(rank, n, addr, call):
    """Rank 1 dies once past a barrier; the others issue ``call`` with async_op=True (issued
    without error) and report what its wait raised."""
    side = _side(addr)
    with _open(rank, n, addr) as comm:
        _barrier_then_die(comm, side, 1)
        x = np.ones(4, np.float32)
        work = (comm.all_reduce(x, async_op=True) if call == "all_reduce"
                else comm.broadcast(x, root=1, async_op=True))
        try:
            work.wait()
        except GpucollError as exc:
            return _outcome(exc, side)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("n", WORLDS)
def test_a_rank_killed_before_a_small_async_all_reduce_fails_its_wait_naming_it_fast(
        store_addr, transport, n):
    outcomes = spawn(_killed_before_a_small_async_call, n, store_addr, "all_reduce",
                     env=_env(transport), check=False)
    _check_rank_1_killed_in_an_all_reduce(outcomes)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("n", WORLDS)
def test_a_root_killed_before_a_small_async_broadcast_fails_its_wait_naming_it_fast(
        store_addr, transport, n):
    outcomes = spawn(_killed_before_a_small_async_call, n, store_addr, "broadcast",
                     env=_env(transport), check=False)
    assert outcomes[1].exitcode == -signal.SIGKILL
    for o in outcomes[:1] + outcomes[2:]:
        _check(o, PeerFailure, 1, "broadcast #", "rank 1")


@pytest.mark.parametrize("transport", SHM_KINDS)
def test_a_rank_killed_before_an_all_reduce_through_the_outboxes_is_named_by_every_survivor(
        store_addr, transport):
    outcomes = spawn(_killed_mid_all_reduce, 4, store_addr, OUTBOXES, env=_env(transport),
                     check=False)
    _check_rank_1_killed_in_an_all_reduce(outcomes)


# -- 2. point to point makes progress in every order MPI allows -----------------------------

BIG = 4_000_000  # float32 elements: 16 MB, far past the shared-memory ring and socket buffers


def _exchange(rank, n, addr, order):
    with _open(rank, n, addr) as comm:
        right, left = (rank + 1) % n, (rank - 1) % n
        x = np.full(BIG, rank, np.float32)
        y = np.zeros(BIG, np.float32)
        if order == "isend, then recv":
            work = comm.send(x, right, async_op=True)
            comm.recv(y, left)
            work.wait()
        elif order == "irecv, then send":
            work = comm.recv(y, left, async_op=True)
            comm.send(x, right)
            work.wait()
        else:  # each rank picks its own order of two non-blocking calls
            if rank % 2:
                works = [comm.recv(y, left, async_op=True), comm.send(x, right, async_op=True)]
            else:
                works = [comm.send(x, right, async_op=True), comm.recv(y, left, async_op=True)]
            for work in reversed(works):
                work.wait()
        return bool((y == left).all())


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("n", WORLDS)
@pytest.mark.parametrize("order", ["isend, then recv", "irecv, then send", "mixed"])
def test_neighbour_exchange_of_16_mb_never_deadlocks(store_addr, transport, n, order):
    assert all(spawn(_exchange, n, store_addr, order, env=_env(transport), timeout=90))


def _send_long_before_recv(rank, n, addr):
    side = _side(addr)
    with _open(rank, n, addr) as comm:
        if rank == 0:
            works = [comm.send(np.full(BIG // 4, k, np.float32), 1, async_op=True)
                     for k in range(4)]  # several outstanding sends to one peer
            side.set("posted", "1")
            for work in works:
                work.wait(LONG)
            return True
        if rank == 1:
            side.get("posted", timeout=LONG)
            time.sleep(0.5)  # the receives come long after the sends
            got = []
            for _ in range(4):
                y = np.zeros(BIG // 4, np.float32)
                comm.recv(y, 0)
                got.append(float(y[0]) if (y == y[0]).all() else -1.0)
            return got == [0.0, 1.0, 2.0, 3.0]
        return True


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("n", WORLDS)
def test_sends_posted_long_before_their_receives_arrive_in_order(store_addr, transport, n):
    assert all(spawn(_send_long_before_recv, n, store_addr, env=_env(transport), timeout=90))


# -- 3. nothing sent is silently lost; nobody waits on a rank that left ---------------------

def _send_after_peer_left(rank, n, addr, how, call):
    side = _side(addr)
    comm = _open(rank, n, addr)
    try:
        comm.barrier()
        if rank == 1:
            if how == "killed":
                _die(side)
            comm.close()
            side.set("died", repr(time.time()))
            return None
        side.get("died", timeout=LONG)
        time.sleep(0.2)  # let the news of rank 1 arrive: the call must not "succeed" anyway
        try:
            if call == "send":
                comm.send(np.ones(4, np.float32), 1)
            else:
                comm.broadcast(np.ones(4, np.float32), root=0)
            comm.close()
        except GpucollError as exc:
            return _outcome(exc, side)
        return None
    finally:
        comm.close() if not comm.closed else None


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("n", WORLDS)
@pytest.mark.parametrize("how", ["closed", "killed"])
@pytest.mark.parametrize("call", ["send", "broadcast"])
def test_sending_to_a_rank_that_left_is_a_peer_failure_not_a_loss(store_addr, transport, n,
                                                                  how, call):
    outcomes = spawn(_send_after_peer_left, n, store_addr, how, call, env=_env(transport),
                     check=False)
    _check(outcomes[0], PeerFailure, 1, "rank 1")


def _first_finisher_closes(rank, n, addr):
    side = _side(addr)
    comm = _open(rank, n, addr)
    comm.barrier()
    side.set("started", repr(time.time()))
    count = 5 if rank == 1 else 4  # rank 1 disagrees on the size
    try:
        comm.broadcast(np.ones(count, np.float32), root=0)
        comm.close()  # rank 0 finishes first (it only sends) and leaves
    except GpucollError as exc:
        return _outcome(exc, side, "started")
    finally:
        _close_quietly(comm)
    return None


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("n", WORLDS)
def test_a_size_disagreement_is_caught_even_when_one_side_finishes_first(store_addr,
                                                                         transport, n):
    outcomes = spawn(_first_finisher_closes, n, store_addr, env=_env(transport), check=False)
    _check(outcomes[1], CollectiveMismatch, None, "float32", "4 elements", "5 elements")
    name, _, text, _ = outcomes[0].value  # the root does not leave believing all went well
    assert name in ("CollectiveMismatch", "PeerFailure"), text


def _wait_on_a_rank_that_closed(rank, n, addr):
    side = _side(addr)
    with _open(rank, n, addr) as comm:
        comm.barrier()
        if rank == n - 1:
            comm.close()
            side.set("died", repr(time.time()))
            return None
        side.get("died", timeout=LONG)
        try:
            comm.all_reduce(np.ones(1000, np.float32))
        except GpucollError as exc:
            return _outcome(exc, side)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("n", WORLDS)
def test_a_rank_waiting_on_one_that_closed_fails_at_once(store_addr, transport, n):
    outcomes = spawn(_wait_on_a_rank_that_closed, n, store_addr, env=_env(transport),
                     check=False)
    for o in outcomes[:-1]:
        _check(o, PeerFailure, n - 1, "closed")


# -- 4. and 7. and 12. an argument error on one rank never desynchronises the others --------

def _wrong_out_in_scatter(rank, n, addr):
    with _open(rank, n, addr) as comm:
        x = np.arange(n * 4, dtype=np.float32).reshape(n, 4) if rank == 0 else None
        out = np.zeros(3 if rank == 1 else 4, np.float32)
        try:
            comm.scatter(x, root=0, out=out)
            error = None
        except CollectiveMismatch as exc:
            error = str(exc)
        # the group is still in step: the same call, now right, and another collective
        comm.scatter(x, root=0, out=(good := np.zeros(4, np.float32)))
        total = comm.all_reduce(np.ones(1))
        return error, good.tolist(), float(total[0])


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("n", WORLDS)
def test_a_wrong_out_in_scatter_is_a_mismatch_on_every_rank_before_data_moves(store_addr,
                                                                              transport, n):
    for rank, (error, good, total) in enumerate(spawn(_wrong_out_in_scatter, n, store_addr,
                                                       env=_env(transport))):
        assert error is not None and f"scatter on rank {rank} of {n}" in error
        assert "rank 1's out is float32[3]" in error and "root 0 scatters slots of float32[4]" \
            in error and "no data moved" in error
        assert good == list(range(4 * rank, 4 * rank + 4)) and total == n


def _bad_input_then_good(rank, n, addr, bad):
    with _open(rank, n, addr) as comm:
        errors = []
        if rank == 1:
            readonly = np.ones(8, np.float32)[::2]
            readonly.flags.writeable = False
            tries = {"scalar": np.float32(1), "read-only": readonly,
                     "huge view": np.broadcast_to(np.ones(1, np.float32), (1 << 42,))}
            try:
                comm.all_reduce(tries[bad])
            except (TypeError, ValueError, MemoryError) as exc:
                errors.append((type(exc).__name__, str(exc)))
        x = np.full(4, rank + 1.0, np.float32)
        comm.all_reduce(x)
        root = comm.broadcast(np.full(2, float(rank)), root=np.int64(n - 1))  # any integral root
        return errors, x.tolist(), root.tolist()


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("n", WORLDS)
@pytest.mark.parametrize("bad, kind, words", [
    ("scalar", "TypeError", "x is a NumPy scalar (float32)"),
    ("read-only", "ValueError", "x is read-only"),
    ("huge view", "MemoryError", "would need 17592186044416 bytes"),
])
def test_bad_input_on_one_rank_is_refused_there_before_anything_is_sent(store_addr, transport,
                                                                         n, bad, kind, words):
    results = spawn(_bad_input_then_good, n, store_addr, bad, env=_env(transport))
    total = float(sum(range(1, n + 1)))
    for rank, (errors, x, root) in enumerate(results):
        if rank == 1:
            (name, text), = errors
            assert name == kind and "all_reduce on rank 1 of" in text and words in text, text
        assert x == [total] * 4 and root == [float(n - 1)] * 2


# -- 5. a forked child cannot use its parent's communicator; the parent goes on -------------

def _fork_and_misuse(rank, n, addr):
    with _open(rank, n, addr) as comm:
        comm.barrier()
        pid = os.fork()
        if pid == 0:
            code = 9
            try:
                comm.all_reduce(np.ones(4))
            except UsageError as exc:
                code = 3 if "forked child" in str(exc) else 4
            except BaseException:  # noqa: BLE001 - any other outcome fails the test
                code = 5
            comm.close()  # must not touch the parent's connections
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        sums = []
        for size in (4, 1 << 18, 4):  # the parent's communicator still works, small and large
            sums.append(float(comm.all_reduce(np.full(size, rank + 1.0))[-1]))
        return os.waitstatus_to_exitcode(status), sums


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("n", WORLDS)
def test_a_forked_child_gets_a_usage_error_and_the_parent_keeps_working(store_addr,
                                                                        transport, n):
    total = sum(range(1, n + 1))
    for code, sums in spawn(_fork_and_misuse, n, store_addr, env=_env(transport)):
        assert code == 3 and sums == [total] * 3


def _fork_while_async(rank, n, addr):
    side = _side(addr)
    with _open(rank, n, addr) as comm:
        comm.barrier()
        if rank != 0:
            side.get("child-done", timeout=LONG)  # the parent's call waits for this rank
            return None, float(comm.all_reduce(np.full(4, rank + 1.0))[0])
        work = comm.all_reduce(np.full(4, rank + 1.0), async_op=True)
        pid = os.fork()
        if pid == 0:
            code = 9
            try:
                work.wait()
            except UsageError as exc:
                code = 3 if "forked child" in str(exc) else 4
            except BaseException:  # noqa: BLE001 - any other outcome fails the test
                code = 5
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        side.set("child-done", "1")
        return os.waitstatus_to_exitcode(status), float(work.wait()[0])


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_forked_child_waiting_for_its_parents_async_call_gets_a_usage_error(store_addr,
                                                                             transport):
    results = spawn(_fork_while_async, 2, store_addr, env=_env(transport))
    assert results == [(3, 3.0), (None, 3.0)]


# -- 6. two threads in one communicator at once ---------------------------------------------

def _two_threads(rank, n, addr):
    side = _side(addr)
    comm = _open(rank, n, addr)
    try:
        comm.barrier()
        if rank != 0:
            side.get("second-thread-done", timeout=LONG)  # join the all_reduce late
            result = None
            try:
                # it matches the first thread's call, so it may still complete (rightly) before
                # the abort arrives; the call after it cannot
                result = comm.all_reduce(np.ones(4)).tolist()
                comm.barrier()
            except GpucollError as exc:
                return "peer", type(exc).__name__, exc.peer, str(exc), result
            return "peer", None, None, "no error", result
        first: list = []

        def inside():
            try:
                first.append(comm.all_reduce(np.ones(4)).tolist())
            except GpucollError as exc:
                first.append(type(exc).__name__)

        thread = threading.Thread(target=inside)
        thread.start()
        time.sleep(0.3)  # the first thread is now waiting inside all_reduce
        try:
            comm.barrier()
            second = "no error"
        except UsageError as exc:
            second = str(exc)
        side.set("second-thread-done", "1")
        thread.join(LONG)
        return "rank 0", first, second
    finally:
        _close_quietly(comm)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("n", WORLDS)
def test_a_second_thread_is_refused_and_nobody_computes_on_mismatched_calls(store_addr,
                                                                           transport, n):
    results = spawn(_two_threads, n, store_addr, env=_env(transport))
    _, first, second = results[0]
    assert "barrier on rank 0" in second and "another thread is inside all_reduce" in second
    # the first thread's call matches its peers' calls: it fails once the abort reaches it, or,
    # when the peers' data came first, completes with the right result
    assert first[0] in ("PeerFailure", "GpucollError", [float(n)] * 4), first
    for _, kind, peer, text, result in results[1:]:
        assert kind == "PeerFailure" and peer == 0, text
        assert result in (None, [float(n)] * 4), result  # never a wrong result


# -- 8. calls that disagree, with GPUCOLL_DEBUG off --------------------------------------------

CALLS = {
    "size": lambda comm, odd: comm.all_reduce(np.ones(5 if odd else 4, np.float32)),
    "dtype": lambda comm, odd: comm.all_reduce(np.ones(4, np.float64 if odd else np.float32)),
    "call": lambda comm, odd: (comm.broadcast if odd else comm.all_reduce)(
        np.ones(4, np.float32)),
    "root": lambda comm, odd: comm.broadcast(np.ones(4, np.float32), root=1 if odd else 0),
    "op": lambda comm, odd: comm.all_reduce(np.ones(4, np.float32), op="max" if odd else "sum"),
    "large size": lambda comm, odd: comm.all_reduce(np.ones(300_001 if odd else 300_000,
                                                            np.float32)),
    # both read in place from the rings at 2 ranks; at 3 and 4 one side takes the general path
    "half-ring size": lambda comm, odd: comm.all_reduce(np.ones(200_000 if odd else 131_071,
                                                                np.float32)),
    # through the outboxes on both sides at 4 ranks
    "outbox size": lambda comm, odd: comm.all_reduce(
        np.ones(OUTBOXES + 4 if odd else OUTBOXES, np.float32)),
}


def _disagree(rank, n, addr, case, late=False):
    """Rank 1 calls something else (with ``late``, only after rank 2 has closed). Calls that only
    send (a broadcast's root) may return; the disagreement is then caught by the next receive
    or, here, by close(). A rank still finishing the barrier when a peer that left it first sees
    the disagreement fails in the barrier: the notice may overtake the barrier's last message,
    which comes over another connection."""
    side = _side(addr)
    comm = _open(rank, n, addr)
    try:
        comm.barrier()
        if late and rank == 1:
            side.wait(["closed/2"], timeout=LONG)
        side.set("started", repr(time.time()))
        CALLS[case](comm, rank == 1)
        comm.close()
        if late and rank == 2:
            side.set("closed/2", b"")
    except GpucollError as exc:
        return _outcome(exc, side, "started")
    finally:
        _close_quietly(comm)
    return None


@pytest.mark.parametrize("transport", WITH_PYTHON)
@pytest.mark.parametrize("n", WORLDS)
@pytest.mark.parametrize("case", sorted(CALLS))
def test_ranks_that_make_different_calls_all_raise_a_mismatch_naming_both(store_addr,
                                                                          transport, n, case):
    outcomes = spawn(_disagree, n, store_addr, case, env=_env(transport), check=False)
    for o in outcomes:
        if case == "root" and o.rank == 2:
            continue  # it only received root 0's data, as it expected: its result is right
        assert o.value is not None, f"rank {o.rank} returned without an error: {o.trace}"
        _check(o, CollectiveMismatch, None, "disagree")


@pytest.mark.parametrize("transport", WITH_PYTHON)
def test_a_root_whose_message_a_finished_and_closed_peer_cannot_take_raises_a_mismatch(
        store_addr, transport):
    # rank 2 takes root 0's data, as it expects, and closes before root 1's message can come
    outcomes = spawn(_disagree, 3, store_addr, "root", True, env=_env(transport), check=False)
    assert outcomes[2].value is None, outcomes[2].value  # it made the call it expected
    _check(outcomes[1], CollectiveMismatch, None, "disagree")
    named, text = outcomes[1].value[1:3]
    if text.startswith("close on rank 1"):
        # rank 1 put its message before its monitor read rank 2's close: the broadcast
        # completed, and close() found root 0's message that no call here received
        assert named == 0 and "broadcast #1 (float32, 4 elements, root=0)" in text, text
    else:
        assert text.startswith("broadcast #1 on rank 1"), text
        assert f"rank {named} had finished broadcast #1" in text, text
        # a socket does not show that rank 1 never read rank 0's message: rank 0's close waits
        # its grace for rank 1's close, and may have left too, so it may be the one named
        assert named == 2 or transport == "tcp" and named == 0, text
    if transport != "tcp":  # rank 0 waits in close() for rank 1 to read its message
        _check(outcomes[0], CollectiveMismatch, None, "disagree")


@pytest.mark.parametrize("transport", SHM_KINDS)
def test_ranks_that_disagree_on_an_all_reduce_through_the_outboxes_all_raise_a_mismatch(
        store_addr, transport):
    outcomes = spawn(_disagree, 4, store_addr, "outbox size", env=_env(transport),
                     check=False)
    for o in outcomes:
        assert o.value is not None, f"rank {o.rank} returned without an error: {o.trace}"
        _check(o, CollectiveMismatch, None, "disagree")


# -- 9. a stopped rank is named, with where it stopped --------------------------------------

def _one_rank_stops(rank, n, addr, count=16):
    side = _side(addr)
    victim = n - 1
    comm = _open(rank, n, addr)  # start-up may be slow on a loaded machine: only the call is short
    for _ in range(5):
        comm.all_reduce(np.ones(16))
    if rank == victim:
        side.set("victim-pid", str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)  # ... until a survivor sends SIGCONT
    outcome = None
    try:
        comm.all_reduce(np.ones(count), timeout=3.0)
        comm.close()
    except GpucollError as exc:
        outcome = type(exc).__name__, getattr(exc, "peer", None), str(exc)
    finally:
        if rank != victim:
            side.set(f"raised/{rank}", "1")
        if rank == 0:  # resume the victim once every survivor has said where the ranks are
            side.wait([f"raised/{r}" for r in range(n - 1)], timeout=LONG)
            os.kill(int(side.get("victim-pid", timeout=LONG)), signal.SIGCONT)
        try:
            comm.close()
        except GpucollError:
            pass
    return outcome


@pytest.mark.parametrize("transport", WITH_PYTHON)
@pytest.mark.parametrize("n", grid([2, 3, 4], 2))
def test_a_stopped_rank_is_named_with_where_it_stopped_by_every_other_rank(store_addr,
                                                                           transport, n):
    _check_stopped(spawn(_one_rank_stops, n, store_addr, env=_env(transport), timeout=60), n)


@pytest.mark.parametrize("transport", SHM_KINDS)
def test_a_rank_stopped_before_an_all_reduce_through_the_outboxes_is_named_by_every_other_rank(
        store_addr, transport):
    _check_stopped(spawn(_one_rank_stops, 4, store_addr, OUTBOXES, env=_env(transport),
                         timeout=60), 4)


def _check_stopped(results: list, n: int) -> None:
    victim = n - 1
    others = ", ".join(str(r) for r in range(n) if r != victim)
    for kind, peer, text in results[:-1]:
        assert kind == "CollectiveTimeout" and peer == victim, text
        assert f"rank {victim} is behind, before call #5 (after all_reduce #4) and does not " \
               f"respond (stopped?)" in text, text
        assert f"{'rank' if n == 2 else 'ranks'} {others} {'is' if n == 2 else 'are'} in " \
               f"all_reduce #5" in text, text
    # once resumed, the stopped rank learns it too (its own call may still complete: the
    # others' data was already there; then close() reports it)
    kind, _, text = results[victim]
    assert kind == "CollectiveTimeout" and "Where the ranks are" in text, text


# -- 10. a rank that gives up says why: abort(), a with block, an uncaught exception --------

def _one_rank_gives_up(rank, n, addr, how):
    """The last rank gives up (``how``: abort, an exception out of a with block, or a
    ``sys.exit(0)`` out of one, which is no giving up) while the others wait for it in an
    all_reduce; after an abort it tries a call of its own and closes."""
    side = _side(addr)
    quitter = n - 1
    comm = _open(rank, n, addr)
    if rank != quitter:
        try:
            comm.barrier()  # (the quitter may leave it first and give up before it ends here)
            comm.all_reduce(np.ones(4))
        except GpucollError as exc:
            return _outcome(exc, side, "gave up")
        finally:
            _close_quietly(comm)
        return None
    comm.barrier()
    side.set("gave up", repr(time.time()))
    if how == "abort":
        comm.abort("the checkpoint could not be written")
    else:
        try:
            with comm:
                raise ValueError("loss is NaN at step 7") if how == "with" else SystemExit(0)
        except (ValueError, SystemExit):
            return comm.closed
    try:
        comm.all_reduce(np.ones(4))
        after = None
    except GpucollError as exc:
        after = str(exc)
    comm.close()  # after an abort it only releases: no error
    return after


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_sys_exit_0_out_of_a_with_block_closes_without_aborting(store_addr, transport):
    waiting, leaving = spawn(_one_rank_gives_up, 2, store_addr, "exit", env=_env(transport),
                             check=False)
    _check(waiting, PeerFailure, 1, "rank 1 closed its communicator")
    assert "aborted" not in waiting.value[2] and leaving.value is True, (waiting, leaving)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("n", WORLDS)
@pytest.mark.parametrize("how, reason", [("abort", "the checkpoint could not be written"),
                                         ("with", "ValueError: loss is NaN at step 7")])
def test_a_rank_that_gives_up_fails_its_peers_at_once_with_its_reason(store_addr, transport, n,
                                                                      how, reason):
    outcomes = spawn(_one_rank_gives_up, n, store_addr, how, env=_env(transport), check=False)
    for o in outcomes[:-1]:
        _check(o, PeerFailure, n - 1, f"rank {n - 1}", "aborted", reason)
    after = outcomes[-1].value
    if how == "with":  # the block closed it
        assert after is True, outcomes[-1]
    else:  # its own later calls say why it is unusable
        assert after is not None and "aborted" in after and reason in after, outcomes[-1]


def _aborted_from_a_thread(rank, n, addr):
    """Rank 0 waits in an all_reduce for rank 1, which holds back; a watchdog thread of rank 0
    aborts the communicator, which ends the wait; rank 1 then finds it aborted."""
    side = _side(addr)
    comm = _open(rank, n, addr)
    comm.barrier()
    try:
        if rank == 0:
            threading.Timer(0.5, comm.abort, ("the step took too long",)).start()
            side.set("gave up", repr(time.time() + 0.5))
            comm.all_reduce(np.ones(4))
        else:
            side.wait(["raised/0"], timeout=LONG)
            # rank 0's message may have come before its abort: the call then completes, right,
            # and close() says what became of rank 0
            comm.all_reduce(np.ones(4))
            comm.close()
    except GpucollError as exc:
        return _outcome(exc, side, "gave up")
    finally:
        if rank == 0:
            side.set("raised/0", b"")
        _close_quietly(comm)
    return None


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_abort_from_another_thread_ends_the_call_this_rank_is_in(store_addr, transport):
    mine, theirs = spawn(_aborted_from_a_thread, 2, store_addr, env=_env(transport),
                         check=False)
    _check(mine, GpucollError, None, "aborted", "the step took too long")
    _check(theirs, PeerFailure, 0, "rank 0", "the step took too long")


UNCAUGHT = """
import time
import numpy as np
import gpucoll

comm = gpucoll.init()
comm.barrier()
if comm.rank == 1:
    raise RuntimeError("the data loader ran dry")
try:
    comm.all_reduce(np.ones(4))
except gpucoll.PeerFailure as exc:
    print(f"PEERFAILURE peer={exc.peer} {exc}", flush=True)
"""


def test_an_uncaught_exception_fails_the_peers_at_once_with_its_text(tmp_path):
    from launch_helpers import launching, write_script

    with launching(tmp_path) as start:
        job = start(["-n", "2", write_script(tmp_path, UNCAUGHT)])
        assert job.finish() == 1, job.text()
    line, = [t for t in job.out().splitlines() if "PEERFAILURE" in t]
    assert "peer=1" in line and "uncaught RuntimeError: the data loader ran dry" in line, line


# -- 11. weakly ordered CPUs use Unix sockets, not the shared-memory rings ------------------

def _collectives_on(rank, n, addr):
    with _open(rank, n, addr) as comm:
        x = np.arange(300_001, dtype=np.float64) * (rank + 1)
        comm.all_reduce(x)
        small = comm.all_gather(np.full(3, rank))
        return comm._backend.links, float(x[1]), small.tolist()


@pytest.mark.parametrize("n", WORLDS)
def test_on_a_weakly_ordered_cpu_ranks_on_one_host_use_unix_sockets(store_addr, n):
    results = spawn(_collectives_on, n, store_addr,
                    env={"GPUCOLL_CPU_MACHINE": "aarch64", "GPUCOLL_TRANSPORT": "auto"})
    total = float(sum(range(1, n + 1)))
    for links, value, small in results:
        assert set(links.values()) == {"unix"} and value == total
        assert small == [[r] * 3 for r in range(n)]


def _forced_shm(rank, n, addr):
    try:
        _open(rank, n, addr, timeout=10).close()
    except BackendUnavailable as exc:
        return str(exc)


def test_forcing_shared_memory_on_a_weakly_ordered_cpu_is_refused_with_the_reason(store_addr):
    for text in spawn(_forced_shm, 2, store_addr,
                      env={"GPUCOLL_CPU_MACHINE": "aarch64", "GPUCOLL_TRANSPORT": "shm"}):
        assert text is not None and "not safe on this CPU" in text


# -- 12. a rank killed, stopped or aborted in the middle of an all_reduce through the outboxes --

def _when_staged(call: int, then) -> None:
    """Run ``then()`` once this rank has staged its first slot in its ``call``-th all_reduce
    through the outboxes (counting from 0): its peers are then waiting on its counters."""
    from gpucoll.transport import shm

    real, seen = shm.Outboxes.publish, []

    def publish(self, counter, value):
        real(self, counter, value)
        if counter == shm.STAGED and self.used == 4 * call:  # 4 slots a call
            seen.append(value)
            if len(seen) == 1:
                then()
    shm.Outboxes.publish = publish


def _mid_outboxes(rank, n, addr, event):
    """Two all_reduces of 4 MiB between ranks on one host; in the third, rank 1 is killed or
    stopped once it has staged its first slot, or (``abort``) holds on there while rank 0,
    waiting for it, is aborted by a watchdog thread."""
    side = _side(addr)
    x = np.ones(1 << 20, np.float32)  # 4 slots of 1 MiB
    if rank == 1 and event == "killed":
        _when_staged(2, lambda: _die(side))
    elif rank == 1 and event == "stopped":
        _when_staged(2, lambda: (side.set("victim-pid", str(os.getpid())), side.set(
            "died", repr(time.time())), os.kill(os.getpid(), signal.SIGSTOP)))
    elif rank == 1:
        _when_staged(2, lambda: (side.set("died", repr(time.time())),
                                 side.wait(["raised/0"], timeout=LONG)))
    comm = _open(rank, n, addr)
    try:
        for _ in range(2):
            comm.all_reduce(x)
        if rank == 0 and event == "abort":  # once rank 1 holds on, inside the call
            threading.Thread(target=lambda: (_side(addr).wait(["died"], timeout=LONG),
                                             time.sleep(0.5), comm.abort(
                                                 "the step took too long")),
                             daemon=True).start()
        comm.all_reduce(x, timeout=3.0 if event == "stopped" else None)
    except GpucollError as exc:
        return _outcome(exc, side)
    finally:
        if rank == 0:
            side.set("raised/0", b"")
        if event == "stopped" and rank != 1:
            side.set(f"raised/{rank}", "1")
        if event == "stopped" and rank == 0:
            side.wait([f"raised/{r}" for r in range(n) if r != 1], timeout=LONG)
            os.kill(int(side.get("victim-pid", timeout=LONG)), signal.SIGCONT)
        _close_quietly(comm)
    return None


@pytest.mark.parametrize("transport", SHM_KINDS)
@pytest.mark.parametrize("n", grid([2, 3, 4], 2))
def test_a_rank_killed_in_the_middle_of_an_all_reduce_through_the_outboxes_is_named_fast(
        store_addr, transport, n):
    outcomes = spawn(_mid_outboxes, n, store_addr, "killed", env=_env(transport), check=False)
    _check_rank_1_killed_in_an_all_reduce(outcomes)


@pytest.mark.parametrize("transport", SHM_KINDS)
@pytest.mark.parametrize("n", grid([2, 4], 2))
def test_a_rank_stopped_in_the_middle_of_an_all_reduce_through_the_outboxes_is_named(
        store_addr, transport, n):
    outcomes = spawn(_mid_outboxes, n, store_addr, "stopped", env=_env(transport), check=False,
                     timeout=60)
    for o in outcomes[:1] + outcomes[2:]:  # at their 3 s deadline, not at once
        assert o.value is not None, o.trace
        name, named, text, since = o.value
        assert name == "CollectiveTimeout" and named == 1 and since < 3 + BOUND_S, text
        assert "rank 1 is in all_reduce #2 and does not respond (stopped?)" in text, text


@pytest.mark.parametrize("transport", SHM_KINDS)
@pytest.mark.parametrize("n", grid([2, 3], 2))
def test_abort_ends_a_wait_in_the_outboxes_and_its_peers_learn_why(store_addr, transport, n):
    outcomes = spawn(_mid_outboxes, n, store_addr, "abort", env=_env(transport), check=False)
    _check(outcomes[0], GpucollError, None, "aborted", "the step took too long")
    for o in outcomes[1:]:
        _check(o, PeerFailure, 0, "rank 0", "the step took too long")
