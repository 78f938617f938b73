"""The compiled small-message exchange of the shared-memory rings (gpucoll/transport/_shmfast.c).

It must speak the Python rings' protocol byte for byte, fold exactly as NumPy folds in rank
order, refuse bad arguments before it sends anything, and leave the work to the Python path
(which stays, and which a rank can choose with GPUCOLL_NATIVE=0) whenever it cannot finish.
"""

from __future__ import annotations

import mmap
import os
import shutil
import sys
import sysconfig

import numpy as np
import pytest
from multiproc import spawn

from gpucoll.backends import ring_algos as algos
from gpucoll.errors import PeerFailure
from gpucoll.ops import ReduceOp, fp_quiet, fp_restore, host_ufunc
from gpucoll.transport import shm

fast = shm._shmfast
needs_fast = pytest.mark.skipif(fast is None, reason="the compiled exchange was not built")
CAP = 64 << 10


def test_the_compiled_exchange_is_built_where_a_compiler_is():
    if not (shutil.which((sysconfig.get_config_var("CC") or "cc").split()[0])
            and os.path.exists(sysconfig.get_paths()["include"] + "/Python.h")):
        pytest.skip("no C compiler or Python headers: pip installs the pure-Python path alone")
    assert fast is not None, "pip should have built gpucoll/transport/_shmfast.c"


class Pair:
    """One rank's links to ``peers`` (ranks) and, for each, the peer's own end of the link
    (pure Python), on fresh rings of CAP bytes."""

    def __init__(self, me: int, peers: list[int]):
        self.ours, self.theirs = [], []
        for peer in peers:
            fds = [shm.create_segment("gpucoll-test", CAP) for _ in range(2)]  # ours, theirs
            rings = [shm.Ring(fd) for fd in fds + fds]
            for fd in fds:
                os.close(fd)
            self.ours.append(shm.ShmLink(peer, rings[0], rings[1], -1))
            self.theirs.append(shm.ShmLink(me, rings[3], rings[2], -1))

    def peer_sends(self, i: int, hdr: bytes, values: np.ndarray) -> None:
        link = self.theirs[i]
        link.begin(True, len(hdr) + values.nbytes)
        assert link.put(hdr, memoryview(values).cast("B"))

    def close(self) -> None:
        for link in self.ours + self.theirs:
            link.close()


@pytest.fixture
def pair():
    made = []

    def make(me: int, peers: list[int]) -> Pair:
        made.append(Pair(me, peers))
        return made[-1]

    yield make
    for p in made:
        p.close()


def awkward_values(dtype: np.dtype, count: int, seed: int) -> np.ndarray:
    """Values that overflow, wrap, and (for floats) reach inf, NaN and signed zeros."""
    rng = np.random.default_rng(seed)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        x = rng.integers(info.min, info.max, size=count, endpoint=True, dtype=dtype)
        extremes = [info.min, info.max, 0, -1 if dtype.kind == "i" else 1]
        x[:4] = extremes[:count]
        return x
    scale = 10.0 ** rng.integers(-40, 300, count)
    scale[::2] = 1.0  # values alike in size: their sum's rounding depends on the order
    with np.errstate(over="ignore"):  # float32 overflows to inf: part of the point
        x = (rng.standard_normal(count) * scale).astype(dtype)
    x[:6] = [np.inf, -np.inf, np.nan, -0.0, 0.0, np.finfo(dtype).max][:count]
    return x


def numpy_fold(rank: int, x: np.ndarray, peers: dict, op: ReduceOp) -> np.ndarray:
    out = x.copy()
    token = fp_quiet()
    try:
        algos.fold_in_rank_order(rank, out, {j: v.copy() for j, v in peers.items()},
                                 host_ufunc(op))
    finally:
        fp_restore(token)
    return out


@needs_fast
@pytest.mark.parametrize("count", [33, 2 * 1024 + 33], ids=["one-block", "blocks"])
@pytest.mark.parametrize("me,peers", [(0, [1]), (1, [0]), (2, [3, 0, 1])])
@pytest.mark.parametrize("key", sorted(algos.NATIVE_FOLD, key=str), ids=str)
def test_every_compiled_fold_matches_numpy_bit_for_bit(pair, me, peers, key, count):
    op, dtype = key
    p = pair(me, peers)
    hdr = algos.frame(1, 0, dtype, count, -1, op)
    values = {j: awkward_values(dtype, count, seed=j) for j in peers}
    for i, j in enumerate(peers):
        p.peer_sends(i, hdr, values[j])
    x = awkward_values(dtype, count, seed=me)
    expected = numpy_fold(me, x, values, op)
    assert fast.swap(p.ours, p.ours, x, hdr, (me, algos.NATIVE_FOLD[key]), 0, 0) is True
    assert x.tobytes() == expected.tobytes()


@needs_fast
def test_a_fold_releases_each_message_up_to_the_next_ones_start(pair):
    p = pair(0, [1])
    x = np.arange(3, dtype=np.int32)  # 32 + 12 bytes: the next message starts at 48
    hdr = algos.frame(1, 0, x.dtype, 3, -1, ReduceOp.SUM)
    p.peer_sends(0, hdr, np.ones(3, np.int32))
    assert fast.swap(p.ours, p.ours, x, hdr, (0, algos.NATIVE_FOLD[ReduceOp.SUM, x.dtype]),
                     0, 0) is True
    assert x.tolist() == [1, 2, 3]
    assert p.ours[0].received() == 48 and p.ours[0].rx.ctl[shm.TAIL] == 48
    assert p.ours[0].sent() == 48 and p.theirs[0].unread() == 44


@needs_fast
def test_without_a_fold_it_says_where_each_payload_lies(pair):
    p = pair(1, [0, 2])
    x = np.arange(5, dtype=np.float64)
    hdr = algos.frame(2, 7, x.dtype, 5, 0)
    for i in range(2):
        p.peer_sends(i, hdr, x * (i + 2))
    found = fast.swap(p.ours, p.ours, x, hdr, None, 0, 0)
    assert [p.ours[i].rx.typed(at, x.dtype, 5).tolist() for i, at in enumerate(found)] == \
        [(x * 2).tolist(), (x * 3).tolist()]
    assert [link.received() for link in p.ours] == [0, 0]  # released by the caller


@needs_fast
def test_a_message_that_has_not_come_leaves_the_rest_to_the_caller(pair):
    p = pair(0, [1])
    x = np.ones(4, np.float32)
    hdr = algos.frame(1, 0, x.dtype, 4, -1, ReduceOp.SUM)
    code = algos.NATIVE_FOLD[ReduceOp.SUM, x.dtype]
    assert fast.swap(p.ours, p.ours, x, hdr, (0, code), 20_000, 20_000) is None
    assert x.tolist() == [1, 1, 1, 1]
    assert p.theirs[0].arrived(48) == 0  # this rank's message went out all the same
    # the caller then waits with sending done: nothing is sent twice
    p.peer_sends(0, hdr, np.full(4, 2, np.float32))
    assert fast.swap((), p.ours, x, hdr, (0, code), 0, 0) is True
    assert x.tolist() == [3, 3, 3, 3] and p.ours[0].sent() == 48


@needs_fast
def test_another_calls_header_is_left_unread_for_the_caller_to_report(pair):
    p = pair(0, [1])
    x = np.ones(4, np.int64)
    hdr = algos.frame(1, 5, x.dtype, 4, -1, ReduceOp.SUM)
    p.peer_sends(0, algos.frame(1, 6, x.dtype, 4, -1, ReduceOp.SUM), np.ones(4, np.int64))
    assert fast.swap(p.ours, p.ours, x, hdr, (0, algos.NATIVE_FOLD[ReduceOp.SUM, x.dtype]),
                     0, 0) is None
    assert x.tolist() == [1, 1, 1, 1] and p.ours[0].received() == 0


@needs_fast
def test_a_full_ring_sends_nothing_on_any_link(pair):
    p = pair(0, [1, 2])
    x = np.zeros(1000, np.uint8)
    hdr = algos.frame(1, 0, x.dtype, 1000, 0)
    while fast.swap(p.ours[1:], (), x, hdr, None, 0, 0) is not False:
        pass  # peer 2 never reads: its ring fills
    before = [link.sent() for link in p.ours]
    assert fast.swap(p.ours, (), x, hdr, None, 0, 0) is False
    assert [link.sent() for link in p.ours] == before
    assert p.theirs[0].unread() == 0  # peer 1's ring had room, yet got nothing


@needs_fast
@pytest.mark.parametrize("what,args,error", [
    ("an unknown fold code", lambda x, h: (x, h, (0, 15 * 16), 0, 0), ValueError),
    ("a float min (NumPy's NaN rules)", lambda x, h: (
        x, h, (0, 2 * 16 + 8), 0, 0), ValueError),
    ("a read-only array to fold into", lambda x, h: (
        np.frombuffer(x.tobytes(), x.dtype), h, (0, algos.NATIVE_FOLD[ReduceOp.SUM, x.dtype]),
        0, 0), ValueError),
    ("a missing argument", lambda x, h: (x, h, None, 0), TypeError),
    ("a message over half the ring", lambda x, h: (np.zeros(CAP // 2), h, None, 0, 0),
     ValueError),
    ("payloads of two sizes", lambda x, h: ([x, x[:2]], h, None, 0, 0), ValueError),
    ("one payload per link, and a fold", lambda x, h: (
        [x], h, (0, algos.NATIVE_FOLD[ReduceOp.SUM, x.dtype]), 0, 0), ValueError),
])
def test_bad_arguments_are_refused_before_anything_is_sent(pair, what, args, error):
    p = pair(0, [1])
    x = np.ones(4, np.float32)
    hdr = algos.frame(1, 0, x.dtype, 4, -1, ReduceOp.SUM)
    with pytest.raises(error):
        fast.swap(p.ours, p.ours, *args(x, hdr))
    assert p.ours[0].sent() == 0 and p.theirs[0].unread() == 0, what


@needs_fast
def test_each_link_can_carry_a_payload_of_its_own(pair):
    p = pair(0, [1, 2])
    blocks = [np.full(3, 7, np.int16), np.full(3, 9, np.int16)]
    hdr = algos.frame(9, 0, np.dtype(np.int16), 9, -1)
    for i in range(2):
        p.peer_sends(i, hdr, np.zeros(3, np.int16))
    assert fast.swap(p.ours, p.ours, blocks, hdr, None, 0, 0) == [32, 32]
    assert [link.rx.typed(32, np.int16, 3).tolist() for link in p.theirs] == [[7] * 3, [9] * 3]


@needs_fast
def test_a_mapping_cannot_be_unmapped_while_a_link_points_into_it():
    fds = [shm.create_segment("gpucoll-test", CAP) for _ in range(2)]
    maps = [mmap.mmap(fd, shm.HEADER + CAP) for fd in fds]
    link = fast.Link(*maps)
    with pytest.raises(BufferError):
        maps[0].close()
    del link
    for m, fd in zip(maps, fds, strict=True):
        m.close()
        os.close(fd)


@needs_fast
def test_a_link_needs_a_writable_ring_with_its_header():
    with pytest.raises(ValueError, match="256-byte header"):
        fast.Link(mmap.mmap(-1, shm.HEADER), mmap.mmap(-1, shm.HEADER + 64))
    with pytest.raises(BufferError, match="not writable"):
        fast.Link(b"x" * 4096, mmap.mmap(-1, 4096))


# -- ranks ------------------------------------------------------------------------------------
CASES = [(ReduceOp.SUM, "float32"), (ReduceOp.PROD, "float64"), (ReduceOp.MAX, "int64"),
         (ReduceOp.BXOR, "uint16"), (ReduceOp.AVG, "float32"), (ReduceOp.MIN, "float32"),
         (ReduceOp.SUM, "int8")]
# the last three fold with the interpreter lock released, the last through the outboxes at 3
COUNTS = [1, 7, 1000, 20_001, 70_001, 300_001]


def _mixed_ranks(rank, n, addr, pure):
    if rank in pure:
        os.environ["GPUCOLL_NATIVE"] = "0"
    import gpucoll

    digests = []
    with gpucoll.init("ring", rank=rank, world_size=n, store=addr, timeout=30) as comm:
        assert (comm._lean_backend._engine.native is None) == (rank in pure or fast is None)
        for i, (op, dtype) in enumerate(CASES * 2):
            count = COUNTS[i % len(COUNTS)]
            x = awkward_values(np.dtype(dtype), count, seed=rank + 10 * i) \
                if op is not ReduceOp.AVG else np.full(count, rank + 1, dtype)
            want = numpy_fold(rank, x, {j: awkward_values(np.dtype(dtype), count, seed=j + 10 * i)
                                        for j in range(n) if j != rank}, op) \
                if op is not ReduceOp.AVG else np.full(count, (n + 1) / 2, dtype)
            comm.all_reduce(x, op)
            assert x.tobytes() == want.tobytes(), f"call {i}: {op} {dtype} x{count}"
            y = x if rank == i % n else np.empty_like(x)
            comm.broadcast(y, root=i % n)
            digests.append(y.tobytes())
    return digests


@pytest.mark.parametrize("n,pure", [(2, ()), (2, (1,)), (3, (1,)), (3, (0, 2))],
                         ids=["2-compiled", "2-mixed", "3-mixed", "3-mostly-python"])
def test_ranks_with_and_without_the_compiled_exchange_agree_bit_for_bit(store_addr, n, pure):
    results = spawn(_mixed_ranks, n, store_addr, pure, timeout=90,
                    env={"GPUCOLL_TRANSPORT": "shm"})
    assert all(r == results[0] for r in results)


def _late_peer(rank, n, addr):
    import time

    import gpucoll
    from gpucoll.backends.ring import RingBackend

    partial = []
    compiled = RingBackend._native_all_reduce

    def counted(self, *args):
        done = compiled(self, *args)
        partial.append(done is None)
        return done

    RingBackend._native_all_reduce = counted
    wrong = 0
    with gpucoll.init("ring", rank=rank, world_size=n, store=addr, timeout=30) as comm:
        for i in range(100):
            if rank == 1 and i % 5 == 0:
                time.sleep(0.02)  # far past the compiled exchange's 50 us wait
            x = np.full(5, rank + i, np.int64)
            comm.all_reduce(x)
            wrong += int((x != 2 * i + 1).any())
    return wrong, sum(partial)


@needs_fast
def test_a_peer_later_than_the_compiled_wait_is_waited_for_without_sending_twice(store_addr):
    (wrong0, partial0), (wrong1, _) = spawn(_late_peer, 2, store_addr, timeout=60,
                                            env={"GPUCOLL_TRANSPORT": "shm"})
    assert wrong0 == wrong1 == 0
    # rank 0's compiled call gave up waiting on rank 1's late calls (20 of them; a loaded
    # machine may delay rank 0 as long now and then, never every time)
    assert partial0 >= 1


def _dead_peer(rank, n, addr):
    import gpucoll

    with gpucoll.init("ring", rank=rank, world_size=n, store=addr, timeout=20) as comm:
        x = np.ones(2, np.float32)
        for _ in range(100):
            comm.all_reduce(x)
        if rank == 1:
            sys.stdout.flush()
            os._exit(3)
        try:
            for _ in range(1000):
                comm.all_reduce(x)
        except PeerFailure as exc:
            return str(exc)
    return "no error"


def test_a_peer_that_dies_while_the_others_wait_in_the_compiled_exchange_is_named(store_addr):
    out = spawn(_dead_peer, 3, store_addr, timeout=30, check=False,
                env={"GPUCOLL_TRANSPORT": "shm"})
    assert out[1].exitcode == 3
    for o in (out[0], out[2]):
        assert o.ok and "rank 1" in o.value, o.value or o.trace
