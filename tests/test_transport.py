"""The transports on their own, inside one process: shared-memory rings, TCP links, the engine
that drives them, and the monitor that notices dead or aborting peers."""

from __future__ import annotations

import errno
import os
import socket

import ml_dtypes
import numpy as np
import pytest

from gpucoll.errors import CollectiveMismatch, CollectiveTimeout, PeerFailure
from gpucoll.progress import Progress
from gpucoll.transport import mesh, shm
from gpucoll.transport.engine import Engine, Recv, RecvReduce, Send, State
from gpucoll.transport.mesh import Monitor, encode_abort, encode_close

H = b"h" * 32  # a frame header: the engine only compares it with the expected one


@pytest.fixture
def bell():
    fd = os.eventfd(0, os.EFD_NONBLOCK)
    yield fd
    os.close(fd)


def _ring(cap: int) -> shm.Ring:
    fd = shm.create_segment("gpucoll-test-ring", cap)
    try:
        return shm.Ring(fd)
    finally:
        os.close(fd)


@pytest.fixture
def shm_pair(bell):
    """Two ends (rank 0 and rank 1) of a shared-memory link with 4 KiB rings."""
    ab, ba = _ring(4096), _ring(4096)
    a = shm.ShmLink(1, ab, ba, os.dup(bell))
    b = shm.ShmLink(0, ba, ab, os.dup(bell))
    yield a, b
    a.close()
    b.close()


@pytest.fixture
def tcp_pair():
    """Two ends of a loopback TCP connection."""
    listener = mesh.listen_tcp(1)
    client = socket.create_connection(("127.0.0.1", listener.getsockname()[1]))
    server, _ = listener.accept()
    listener.close()
    for sock in (client, server):
        mesh.tune(sock)
    a, b = mesh.TcpLink(1, client), mesh.TcpLink(0, server)
    yield a, b
    a.close()
    b.close()


@pytest.fixture(params=["shm", "tcp"])
def pair(request, shm_pair, tcp_pair):
    return shm_pair if request.param == "shm" else tcp_pair


def _engine(bell, state=None) -> Engine:
    return Engine(0, [], bell, state or State(), oversubscribed=False)


def test_a_message_many_times_the_ring_size_arrives_intact(shm_pair, bell):
    a, b = shm_pair
    x = np.random.default_rng(0).integers(0, 255, 100_003, dtype=np.uint8)
    y = np.zeros_like(x)
    _engine(bell).run([Send(a, x, H), Recv(b, y, H)], deadline=_soon(10), opname="test")
    np.testing.assert_array_equal(x, y)


def test_messages_of_mixed_itemsizes_stay_aligned_and_reduce_correctly(pair, bell):
    a, b = pair
    eng = _engine(bell)
    for dtype, count in ((np.float16, 1001), (np.complex128, 333), (ml_dtypes.bfloat16, 7),
                         (np.int8, 5), (np.float64, 2049)):
        x = np.arange(count).astype(dtype)
        acc = np.ones(count, dtype)
        eng.run([Send(a, x, H), RecvReduce(b, acc, np.add, H)], deadline=_soon(10), opname="test")
        np.testing.assert_array_equal(acc, np.arange(count).astype(dtype) + np.ones(1, dtype))


def test_reduce_into_a_separate_accumulator_keeps_the_source(pair, bell):
    a, b = pair
    src = np.full(5000, 2.0, np.float32)
    acc = np.zeros(5000, np.float32)
    x = np.full(5000, 3.0, np.float32)
    _engine(bell).run([Send(a, x, H), RecvReduce(b, acc, np.multiply, H, src=src)], _soon(10),
                      "test")
    assert (acc == 6.0).all() and (src == 2.0).all()


def test_both_directions_at_once_never_deadlock_on_large_messages(tcp_pair, bell):
    a, b = tcp_pair
    big = 32 << 20  # well past both socket buffers
    xa, xb = np.full(big, 1, np.uint8), np.full(big, 2, np.uint8)
    ya, yb = np.zeros(big, np.uint8), np.zeros(big, np.uint8)
    ops = [Send(a, xa, H), Send(b, xb, H), Recv(a, ya, H), Recv(b, yb, H)]
    _engine(bell).run(ops, _soon(30), "test")
    assert (ya == 2).all() and (yb == 1).all()


def test_a_gated_send_forwards_only_what_has_arrived(pair, bell):
    a, b = pair
    x = np.arange(50_000, dtype=np.int32)
    relay = np.zeros_like(x)
    incoming = Recv(b, relay, H)
    forward = Send(b, relay, H, gate=incoming)
    back = np.zeros_like(x)
    _engine(bell).run([Send(a, x, H), incoming, forward, Recv(a, back, H)], _soon(10), "test")
    np.testing.assert_array_equal(back, x)


class _Dribbling(mesh.TcpLink):
    """A TCP link that takes at most 5 bytes per receive, so elements arrive in parts."""

    def recv_reduce(self, acc, src, ufunc, off, end):
        return super().recv_reduce(acc, src, ufunc, off, min(end, off + 5))


def test_a_gated_send_forwards_only_finished_elements_of_a_reduction(tcp_pair, bell):
    a, b = tcp_pair
    slow = _Dribbling(0, b.sock)
    x = np.arange(3000, dtype=np.int64)
    acc = np.zeros_like(x)
    incoming = RecvReduce(slow, acc, np.add, H, src=np.full_like(x, 10))
    back = np.zeros_like(x)
    ops = [Send(a, x, H), incoming, Send(slow, acc, H, gate=incoming), Recv(a, back, H)]
    _engine(bell).run(ops, _soon(10), "test")
    np.testing.assert_array_equal(back, x + 10)


def test_receive_with_no_sender_times_out_naming_op_and_peer(pair, bell):
    _, b = pair
    with pytest.raises(CollectiveTimeout, match=r"all_reduce on rank 0 .* receive from rank 0"):
        _engine(bell).run([Recv(b, np.zeros(4, np.uint8), H)], _soon(0.2), "all_reduce")


def test_a_failure_reported_by_the_monitor_wakes_a_waiting_receive(pair, bell):
    _, b = pair
    state = State()
    state.failure = PeerFailure("rank 3 died", peer=3)
    os.eventfd_write(bell, 1)
    with pytest.raises(PeerFailure, match="rank 3 died"):
        _engine(bell, state).run([Recv(b, np.zeros(4, np.uint8), H)], _soon(10), "test")


def test_a_closed_tcp_peer_is_a_peer_failure(tcp_pair, bell):
    a, b = tcp_pair
    a.sock.close()
    state = State()
    state.ended.add(0)  # the monitor has seen the peer's control connection end, no failure
    with pytest.raises(PeerFailure) as info:
        _engine(bell, state).run([Recv(b, np.zeros(4, np.uint8), H)], _soon(10), "test")
    assert info.value.peer == 0


@pytest.fixture
def control():
    """Rank 0's monitor watching a control connection from rank 1 (``peer_end``)."""
    mine, peer_end = socket.socketpair()
    bell = os.eventfd(0, os.EFD_NONBLOCK)
    state = State()
    mon = Monitor(0, {1: mine}, bell, state)
    yield mon, state, peer_end, bell
    mon.stop()
    mine.close()
    peer_end.close()
    os.close(bell)


def _wait_for(pred, bell, seconds=10.0):
    import select

    deadline = _soon(seconds)
    while not pred():
        assert _now() < deadline, "the monitor did not react"
        select.select([bell], [], [], 0.05)


@pytest.mark.parametrize("env, user_ms", [(None, 14_000), ("5", 4_000), ("60", 59_000)])
def test_tcp_connections_give_a_silent_host_the_link_timeout_before_giving_up(monkeypatch, env,
                                                                             user_ms):
    # unacknowledged data and unanswered keepalive probes both end the connection a second
    # before GPUCOLL_LINK_TIMEOUT (default 15 s) has passed, so the peer is named within it;
    # a few lost packets alone never end it (tests/test_faults_network.py drops real ones)
    if env is not None:
        monkeypatch.setenv("GPUCOLL_LINK_TIMEOUT", env)
    with socket.socket() as sock:
        mesh.tune(sock)
        get = lambda name: sock.getsockopt(socket.IPPROTO_TCP, getattr(socket, name))  # noqa: E731
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert get("TCP_USER_TIMEOUT") == user_ms
        assert (get("TCP_KEEPIDLE"), get("TCP_KEEPINTVL")) == (mesh.KEEPIDLE, 1)
        assert get("TCP_KEEPIDLE") + get("TCP_KEEPCNT") * get("TCP_KEEPINTVL") == user_ms // 1000


def test_a_connection_ended_by_the_link_timeout_says_the_host_did_not_answer(monkeypatch):
    monkeypatch.setenv("GPUCOLL_LINK_TIMEOUT", "8")
    message = mesh.broken(TimeoutError(errno.ETIMEDOUT, "Connection timed out"))
    assert "no answer from its host for 8 s, GPUCOLL_LINK_TIMEOUT" in message
    assert mesh.broken(ConnectionResetError(errno.ECONNRESET, "reset")) == "[Errno 104] reset"


def test_monitor_reports_a_vanished_peer(control):
    mon, state, peer_end, bell = control
    peer_end.close()
    _wait_for(lambda: state.failure is not None, bell)
    assert isinstance(state.failure, PeerFailure) and state.failure.peer == 1
    assert "rank 1 died" in str(state.failure)


def test_monitor_accepts_a_clean_close(control):
    mon, state, peer_end, bell = control
    peer_end.sendall(encode_close(0))
    peer_end.close()
    _wait_for(lambda: 1 in state.ended, bell)
    assert state.failure is None and state.closed_peers == {1: 0}


def test_a_peer_that_closes_before_consuming_what_we_sent_is_a_failure(control):
    mon, state, peer_end, bell = control
    mon.unconsumed = lambda peer, consumed: 4096 - consumed
    peer_end.sendall(encode_close(1024))
    _wait_for(lambda: state.failure is not None, bell)
    assert isinstance(state.failure, PeerFailure) and state.failure.peer == 1
    assert "without receiving 3072 bytes" in str(state.failure)


def test_monitor_blames_the_culprit_an_abort_names(control):
    mon, state, peer_end, bell = control
    message = encode_abort(PeerFailure("rank 2 died", peer=2), culprit=2)
    peer_end.sendall(message[:3])  # split messages are reassembled
    peer_end.sendall(message[3:])
    _wait_for(lambda: state.failure is not None, bell)
    assert isinstance(state.failure, PeerFailure) and state.failure.peer == 2
    assert "rank 1 reported a failure caused by rank 2" in str(state.failure)


@pytest.mark.parametrize("error", [CollectiveTimeout("barrier timed out"),
                                   CollectiveMismatch("ranks disagree")])
def test_a_peers_timeout_or_mismatch_is_raised_here_as_the_same_kind(control, error):
    mon, state, peer_end, bell = control
    peer_end.sendall(encode_abort(error, culprit=1))
    _wait_for(lambda: state.failure is not None, bell)
    assert type(state.failure) is type(error) and state.failure.peer == 1
    assert f"rank 1 failed: {type(error).__name__}: {error}" in str(state.failure)


def test_an_interrupted_peer_is_a_peer_failure(control):
    mon, state, peer_end, bell = control
    peer_end.sendall(encode_abort(KeyboardInterrupt(), culprit=1))
    _wait_for(lambda: state.failure is not None, bell)
    assert isinstance(state.failure, PeerFailure) and "KeyboardInterrupt" in str(state.failure)


def test_monitor_answers_where_its_rank_is(control):
    mon, state, peer_end, bell = control
    mon.progress.enter(17, 1)
    peer_end.sendall(b"Q")
    reply = peer_end.recv(1 + 64)
    assert reply[:1] == b"P"
    pos = Progress.decode(0, reply[1:])
    assert (pos.seq, pos.kind) == (17, 1) and "in all_reduce #17" in pos.where()


def test_a_frame_that_differs_from_the_expected_one_is_a_mismatch_naming_both(pair, bell):
    a, b = pair
    eng = Engine(0, [], bell, State(), oversubscribed=False, describe=lambda h: h[:4].decode())
    with pytest.raises(CollectiveMismatch, match="rank 0 sent a message of them where this rank "
                                                 "expects one of mine"):
        eng.run([Send(a, np.zeros(4, np.uint8), b"them" + H[4:]),
                 Recv(b, np.zeros(4, np.uint8), b"mine" + H[4:])], _soon(10), "test")


def test_a_send_to_a_peer_that_closed_is_a_peer_failure(pair, bell):
    a, _ = pair
    state = State()
    state.closed_peers[1] = 0
    with pytest.raises(PeerFailure, match="rank 1 closed its communicator.*cannot be delivered"):
        _engine(bell, state).run([Send(a, np.zeros(4, np.uint8), H)], _soon(10), "test")


def test_a_receive_from_a_peer_that_closed_fails_at_once_unless_its_data_is_there(
        shm_pair, bell):
    a, b = shm_pair
    state = State()
    eng = _engine(bell, state)
    eng.run([Send(a, np.arange(4, dtype=np.uint8), H)], _soon(10), "test")
    state.closed_peers[0] = 0
    got = np.zeros(4, np.uint8)
    eng.run([Recv(b, got, H)], _soon(10), "test")  # sent before the close: still delivered
    assert got.tolist() == [0, 1, 2, 3]
    with pytest.raises(PeerFailure, match="rank 0 closed its communicator.*expected data"):
        eng.run([Recv(b, got, H)], _soon(10), "test")


def test_non_blocking_messages_move_while_a_call_runs(shm_pair, bell):
    a, b = shm_pair  # 4 KiB rings: each 100 KB message needs the other side to keep reading
    eng = _engine(bell)
    x, y = np.arange(100_000, dtype=np.uint8), np.zeros(100_000, np.uint8)
    done = []
    eng.submit(Send(a, x, H), _soon(10), "isend", done.append)
    eng.run([Recv(b, y, H)], _soon(10), "recv")
    assert done == [None] and (x == y).all() and not eng.has_background


def test_transport_comes_from_the_environment_when_auto(monkeypatch):
    monkeypatch.setenv("GPUCOLL_TRANSPORT", "TCP")
    assert mesh.resolve_transport("auto") == "tcp"
    assert mesh.resolve_transport("shm") == "shm"


def test_an_unknown_transport_is_a_value_error_naming_the_source(monkeypatch):
    monkeypatch.setenv("GPUCOLL_TRANSPORT", "infiniband")
    with pytest.raises(ValueError, match="GPUCOLL_TRANSPORT='infiniband'"):
        mesh.resolve_transport("auto")
    with pytest.raises(ValueError, match="transport='udp'"):
        mesh.resolve_transport("udp")


def test_ring_size_shrinks_with_many_local_peers_and_obeys_the_environment(monkeypatch):
    assert shm.ring_bytes(1) == 2 << 20
    assert shm.ring_bytes(63) < shm.ring_bytes(3)
    monkeypatch.setenv("GPUCOLL_SHM_RING_BYTES", "5000")
    assert shm.ring_bytes(1) % 16 == 0 and shm.ring_bytes(1) >= 5000


def test_segments_have_no_name_in_dev_shm():
    fd = shm.create_segment("gpucoll-test-anonymous", 4096)
    try:  # only its own name is looked for: a suite running beside this one may make others
        assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:gpucoll-test-anonymous")
        assert not [n for n in os.listdir("/dev/shm") if "gpucoll-test-anonymous" in n]
    finally:
        os.close(fd)


def _now() -> float:
    import time

    return time.monotonic()


def _soon(seconds: float) -> float:
    return _now() + seconds


def test_an_unreachable_same_host_peer_is_named_with_a_way_out(store_server):
    import json

    from gpucoll.store import PrefixStore

    store = PrefixStore("mesh", store_server)
    store.set("ring/addr/0", json.dumps({
        "host": "127.0.0.1", "port": 9, "unix": "gpucoll-test-nobody-listens",
        "id": mesh.host_identity(), "nonce": "00" * 16}))
    with pytest.raises(PeerFailure, match="rank 0 over its Unix socket.*GPUCOLL_HOST_ID") as info:
        mesh.Mesh(store, 1, 2, timeout=5)
    assert info.value.peer == 0


def test_forced_shm_refuses_ranks_on_another_host(store_server, monkeypatch):
    import json

    from gpucoll.errors import BackendUnavailable
    from gpucoll.store import PrefixStore

    store = PrefixStore("mesh", store_server)
    store.set("ring/addr/0", json.dumps({
        "host": "10.0.0.1", "port": 9, "unix": "x", "id": "elsewhere/boot", "nonce": "00" * 16}))
    with pytest.raises(BackendUnavailable, match="transport='shm' needs every rank on one host"):
        mesh.Mesh(store, 1, 2, timeout=5, transport="shm")


def test_runnable_tasks_counts_at_least_this_process():
    from gpucoll.transport.engine import runnable_tasks

    assert runnable_tasks() >= 1
