"""Rank bodies for the calls mpi4py programs port to: object messages with tags, any source and
a status, non-blocking object sends and receives, all_reduce_object and reduce_object.

Each body takes ``backend``: "shm" or "tcp" (the host ring over that transport) or "nccl" (the
NCCL backend on the emulation, no GPU needed), and returns what the test checks.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

import numpy as np

import gpucoll

TIMEOUT = 30.0


@contextlib.contextmanager
def world(rank: int, n: int, addr: str, backend: str):
    """A communicator of ``n`` ranks on ``backend`` ("shm", "tcp" or "nccl")."""
    if backend != "nccl":
        os.environ["GPUCOLL_TRANSPORT"] = backend
        with gpucoll.init("ring", rank=rank, world_size=n, store=addr, timeout=TIMEOUT) as comm:
            yield comm
        return
    from nccl_ranks import emulated

    with emulated(addr, rank, n, timeout=TIMEOUT, hang_timeout=20) as (_, comm):
        yield comm


def outcome(fn) -> tuple[str, str]:
    """("ok", repr of the value) or (exception type, its text and notes)."""
    try:
        return "ok", repr(fn())
    except Exception as exc:  # noqa: BLE001 - the test reads the kind and the message
        return type(exc).__name__, " ".join([str(exc), *getattr(exc, "__notes__", [])])


def big(rank: int, n: int = 70_000) -> np.ndarray:
    """An array large enough to travel out of band (beside the pickle stream)."""
    return np.arange(n, dtype=np.float64) + rank


# -- tags --------------------------------------------------------------------------------------

def tags_reorder_objects(rank: int, n: int, addr: str, backend: str) -> list:
    """Rank 0 sends tags 1, 2, 1, 0; rank 1 receives tag 0 first, then 1, 2, 1."""
    with world(rank, n, addr, backend) as comm:
        if rank == 0:
            for i, tag in enumerate((1, 2, 1, 0)):
                comm.send_object({"i": i, "a": big(i)}, 1, tag=tag)
            return []
        if rank != 1:
            return []
        got = []
        for tag in (0, 1, 2, 1):
            obj = comm.recv_object(0, tag=tag)
            assert np.array_equal(obj["a"], big(obj["i"]))
            got.append((tag, obj["i"]))
        return got


def non_blocking_receives_match_in_posting_order(rank: int, n: int, addr: str,
                                                 backend: str) -> list:
    """Rank 1 posts receives for tags 7, 7, 3 before anything is sent; rank 0 sends 3, 7, 7."""
    with world(rank, n, addr, backend) as comm:
        if rank == 1:
            works = [comm.irecv_object(0, tag=t) for t in (7, 7, 3)]
            early = [w.is_completed() for w in works]
            comm.send_object("posted", 0)
            return [early, [w.wait() for w in works]]
        if rank == 0:
            assert comm.recv_object(1) == "posted"
            for i, tag in enumerate((3, 7, 7)):
                comm.send_object(f"{tag}:{i}", 1, tag=tag)
        return []


# -- non-blocking objects -------------------------------------------------------------------------

def isend_irecv_exchange(rank: int, n: int, addr: str, backend: str) -> list:
    """Every rank sends a large object to the next and receives from the previous, both posted
    before either is waited for (the exchange that blocking sends could not do)."""
    with world(rank, n, addr, backend) as comm:
        nxt, prv = (rank + 1) % n, (rank - 1) % n
        payload = {"from": rank, "a": big(rank, 300_000)}
        req = comm.irecv_object(prv, tag=11)
        sent = comm.isend_object(payload, nxt, tag=11)
        payload["from"] = "changed after isend_object"  # pickled at the call: not sent
        got = req.wait()
        assert sent.wait() is None and sent.is_completed() and req.is_completed()
        assert np.array_equal(got["a"], big(prv, 300_000))
        return [got["from"], req.result()["from"]]


def isend_object_result_and_order(rank: int, n: int, addr: str, backend: str) -> list:
    """isend_objects to one rank with one tag arrive in order; result() of a receive is its
    object, of a send None."""
    with world(rank, n, addr, backend) as comm:
        if rank == 0:
            works = [comm.isend_object(i, 1) for i in range(5)]
            return [w.result() for w in works]
        if rank == 1:
            return [comm.irecv_object(0).result() for _ in range(5)]
        return []


def objects_in_small_pieces(rank: int, n: int, addr: str, backend: str) -> list:
    """Messages cut into many pieces (on the ring's links) or parts (in the store, on NCCL),
    with the limits made small: they arrive whole, in order, tags still matched."""
    from gpucoll import messages, objects

    objects.MESSAGE_BYTES, messages.STORE_PART_BYTES = 4096, 3000
    with world(rank, n, addr, backend) as comm:
        if rank == 0:
            works = [comm.isend_object({"i": i, "a": big(i, 50_000)}, 1, tag=i % 2)
                     for i in range(3)]
            comm.send_object(b"x" * 20_000, 1, tag=5)
            for w in works:
                w.wait()
            return []
        got = [comm.recv_object(0, tag=5)[-3:]]
        for tag in (1, 0, 0):
            obj = comm.recv_object(0, tag=tag)
            assert np.array_equal(obj["a"], big(obj["i"], 50_000))
            got.append(obj["i"])
        return got


# -- any source ---------------------------------------------------------------------------------

def any_source_with_status(rank: int, n: int, addr: str, backend: str) -> list:
    """Every other rank sends (rank, tag=10 + rank) to rank 0, which receives from ANY_SOURCE."""
    with world(rank, n, addr, backend) as comm:
        if rank != 0:
            comm.send_object({"rank": rank, "a": big(rank)}, 0, tag=10 + rank)
            return []
        got = []
        for _ in range(n - 1):
            st = gpucoll.Status()
            obj = comm.recv_object(gpucoll.ANY_SOURCE, tag=gpucoll.ANY_TAG, status=st)
            assert np.array_equal(obj["a"], big(obj["rank"]))
            got.append((obj["rank"], st.Get_source(), st.Get_tag()))
        return sorted(got)


def any_source_keeps_each_senders_order(rank: int, n: int, addr: str, backend: str) -> list:
    """Every other rank sends three messages with one tag to rank 0, whose receives from
    ANY_SOURCE were all posted first: each sender's messages arrive in its order."""
    with world(rank, n, addr, backend) as comm:
        if rank != 0:
            assert comm.recv_object(0, tag=1) == "go"
            works = [comm.isend_object((rank, i), 0, tag=5) for i in range(3)]
            return [w.wait() for w in works]
        works = [comm.irecv_object(tag=5) for _ in range(3 * (n - 1))]
        for r in range(1, n):
            comm.send_object("go", r, tag=1)
        return [w.wait() for w in works]


def timed_out_receives(rank: int, n: int, addr: str, backend: str) -> list:
    """Receives that only read counted messages (from any source; ``wait`` with a timeout)
    time out naming source and tag and leave the communicator as it was."""
    with world(rank, n, addr, backend) as comm:
        out = []
        if rank == 1:
            comm.send_object("other tag", 0, tag=1)
        if rank == 0:
            out.append(outcome(lambda: comm.recv_object(tag=2, timeout=0.5)))
            out.append(outcome(lambda: comm.irecv_object(tag=3, timeout=0.3).wait()))
            early = comm.irecv_object(1, tag=4)
            out.append(outcome(lambda: early.wait(timeout=0.2)))  # not cancelled by it
            out.append(outcome(lambda: comm.recv_object(1, tag=1)))
        comm.barrier()
        if rank == 1:
            comm.send_object("late", 0, tag=4)
        if rank == 0:
            out.append(outcome(early.wait))
        comm.barrier()
        return out


def any_source_receive_whose_senders_are_gone(rank: int, n: int, addr: str,
                                              backend: str) -> tuple:
    """Rank 1 dies without sending: rank 0's receive from any source says so within seconds,
    long before its 30 s deadline."""
    with world(rank, n, addr, backend) as comm:
        if rank == 1:
            os._exit(3)
        t = time.monotonic()
        result = outcome(lambda: comm.recv_object(tag=4, timeout=30))
        return result, time.monotonic() - t


def named_source_receive_that_times_out_ends_the_group(rank: int, n: int, addr: str,
                                                       backend: str) -> tuple:
    """A blocking receive from a named rank waits on that rank's channel: its timeout is the
    group's end, as every blocking call's is."""
    with world(rank, n, addr, backend) as comm:
        if rank == 0:
            first = outcome(lambda: comm.recv_object(1, timeout=0.5))
            return first, outcome(comm.barrier)
        return outcome(lambda: comm.recv_object(0, timeout=5)), ("", "")


# -- bad input --------------------------------------------------------------------------------

def bad_object_arguments(rank: int, n: int, addr: str, backend: str) -> list:
    """Each bad argument raises on the rank that passed it, before anything is sent: the next
    good message is the first the peer sees."""
    with world(rank, n, addr, backend) as comm:
        out = []
        if rank == 0:
            out.append(outcome(lambda: comm.send_object(1, 1, tag="7")))
            out.append(outcome(lambda: comm.send_object(1, 1, tag=-2)))
            out.append(outcome(lambda: comm.isend_object(1, 1, tag=1.5)))
            out.append(outcome(lambda: comm.isend_object(1, n)))
            out.append(outcome(lambda: comm.send_object(1, 0)))
            out.append(outcome(lambda: comm.recv_object(n + 3)))
            out.append(outcome(lambda: comm.irecv_object(-5)))
            out.append(outcome(lambda: comm.recv_object(1, tag=-4)))
            out.append(outcome(lambda: comm.irecv_object(1, tag=None)))
            out.append(outcome(lambda: comm.send_object(threading.Lock(), 1)))
            out.append(outcome(lambda: comm.isend_object(lambda: 0, 1, tag=2)))
            out.append(outcome(lambda: comm.irecv_object(1, status={})))
            comm.send_object("good", 1)
        elif rank == 1:
            out.append(outcome(lambda: comm.recv_object(0)))
            out.append(outcome(lambda: comm.recv_object(0, tag=2)))
            out.append(outcome(lambda: comm.recv_object(0)))
        return out


# -- tags on arrays ------------------------------------------------------------------------------

def array_tags(rank: int, n: int, addr: str, backend: str) -> list:
    """Arrays with tags through send/recv, isend/irecv and a batch; then bad tags, raised
    before anything is sent."""
    with world(rank, n, addr, backend) as comm:
        got = []
        if rank == 0:
            comm.send(np.arange(4, dtype=np.int32), 1, tag=77)
            comm.isend(np.full(3, 2.5), 1, tag=5).wait()
            with comm.batch():
                comm.isend(np.ones(2, np.int64), 1, tag=9)
            comm.batch_isend_irecv([gpucoll.P2POp("isend", np.zeros(2), 1, tag=3)])[0].wait()
        elif rank == 1:
            a, b = np.empty(4, np.int32), np.empty(3)
            got.append(comm.recv(a, 0, tag=77).tolist())
            got.append(comm.irecv(b, 0, tag=5).wait().tolist())
            c = np.empty(2, np.int64)
            with comm.batch() as step:
                comm.irecv(c, 0, tag=9)
            step.wait()
            got.append(c.tolist())
            d = np.empty(2)
            comm.batch_isend_irecv([gpucoll.P2POp(gpucoll.irecv, d, 0, tag=3)])[0].wait()
            got.append(d.tolist())
        x = np.zeros(2)
        got.append(outcome(lambda: comm.send(x, 1 - rank, tag=-1)))
        got.append(outcome(lambda: comm.recv(x, 1 - rank, tag="a")))
        got.append(outcome(lambda: comm.isend(x, 1 - rank, tag=2.0)))
        got.append(outcome(lambda: gpucoll.P2POp("isend", x, 1, tag=-3) and
                           comm.batch_isend_irecv([gpucoll.P2POp("isend", x, 1 - rank,
                                                                 tag=-3)])))
        got.append(outcome(lambda: comm.send(x, 1 - rank, tag=2**31)))  # frames hold 32 bits
        comm.barrier()  # nothing of the bad calls was sent: the group is still in step
        return got


def array_tags_that_disagree(rank: int, n: int, addr: str, backend: str) -> tuple:
    """Rank 0 sends with tag 4, rank 1 receives with tag 6: what each call gives (the
    communicator's close may then report the failure too, which is not what is checked)."""
    got = None
    try:
        with world(rank, n, addr, backend) as comm:
            x = np.zeros(3)
            if rank == 0:
                got = outcome(lambda: comm.send(x, 1, tag=4))
            else:
                got = outcome(lambda: comm.recv(x, 0, tag=6))
    except gpucoll.GpucollError:
        pass
    return got


# -- reductions of objects ------------------------------------------------------------------------

def object_reductions(rank: int, n: int, addr: str, backend: str) -> dict:
    with world(rank, n, addr, backend) as comm:
        return {
            "sum": comm.all_reduce_object(rank + 1),
            "default": comm.all_reduce_object(rank + 0.5),
            "prod": comm.all_reduce_object(rank + 2, op="prod"),
            "min": comm.all_reduce_object((rank - 1) ** 2, op=gpucoll.ReduceOp.MIN),
            "max": comm.all_reduce_object(f"r{rank}", op="max"),
            "lists": comm.all_reduce_object([rank]),  # + on lists: the order shows the fold's
            "callable": comm.all_reduce_object({rank}, op=lambda a, b: a | {max(b) * 10}),
            "dicts": comm.all_reduce_object({rank: rank}, op=lambda a, b: {**a, **b}),
            "reduce": comm.reduce_object([rank], root=n - 1),
            "reduce_max": comm.reduce_object(rank, 0, op="max"),
        }


def bad_reduce_ops(rank: int, n: int, addr: str, backend: str) -> list:
    with world(rank, n, addr, backend) as comm:
        out = [outcome(lambda: comm.all_reduce_object(1, op="avg")),
               outcome(lambda: comm.all_reduce_object(1, op="mean")),
               outcome(lambda: comm.all_reduce_object(1, op=3)),
               outcome(lambda: comm.reduce_object(1, root=n, op="sum"))]
        out.append(outcome(lambda: comm.all_reduce_object(rank, op=lambda a, b: a / 0)))
        out.append(outcome(lambda: comm.all_reduce_object(threading.Lock() if rank else 1)))
        out.append(("ok", repr(comm.all_reduce_object(rank))))  # still in step
        return out


def timed(rank: int, n: int, addr: str, backend: str, rounds: int) -> float:
    """Seconds a round trip of a small object takes (rank 0's view)."""
    with world(rank, n, addr, backend) as comm:
        comm.barrier()
        t = time.perf_counter()
        for i in range(rounds):
            if rank == 0:
                comm.send_object(i, 1)
                comm.recv_object(1)
            elif rank == 1:
                comm.send_object(comm.recv_object(0), 0)
        return (time.perf_counter() - t) / rounds
