"""The store under bad input and failures: tokens, garbage frames, lost and silent servers."""

from __future__ import annotations

import itertools
import os
import pickle
import socket
import struct
import subprocess
import sys
import threading

import pytest
from store_wire import closed_by_server, hello, raw_connect, read_frame

from gpucoll import StoreError, StoreTimeout, TCPStore
from gpucoll.store.protocol import HEADER, Op, Status, decode_args, encode


def still_serves(port: int) -> bool:
    with TCPStore("127.0.0.1", port, timeout=10) as c:
        c.set("alive", b"yes")
        return c.get("alive") == b"yes"


# ----------------------------------------------------------------------------- token
def test_token_protected_store_accepts_the_right_token():
    with TCPStore("127.0.0.1", 0, is_server=True, timeout=10, token="s3cret") as s:
        with TCPStore("127.0.0.1", s.port, timeout=10, token="s3cret") as c:
            c.set("k", b"v")
            assert s.get("k") == b"v"


def test_wrong_token_is_refused_naming_the_store():
    with TCPStore("127.0.0.1", 0, is_server=True, timeout=10, token="s3cret") as s:
        with pytest.raises(StoreError, match=f"127.0.0.1:{s.port} refused.*token"):
            TCPStore("127.0.0.1", s.port, timeout=10, token="guess")


def test_missing_token_is_refused(monkeypatch):
    monkeypatch.delenv("GPUCOLL_STORE_TOKEN", raising=False)
    with TCPStore("127.0.0.1", 0, is_server=True, timeout=10, token="s3cret") as s:
        with pytest.raises(StoreError, match="token"):
            TCPStore("127.0.0.1", s.port, timeout=10)


def test_token_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("GPUCOLL_STORE_TOKEN", "from-env")
    with TCPStore("127.0.0.1", 0, is_server=True, timeout=10) as s:
        with TCPStore("127.0.0.1", s.port, timeout=10) as c:
            assert c.add("n", 1) == 1
        monkeypatch.setenv("GPUCOLL_STORE_TOKEN", "other")
        with pytest.raises(StoreError, match="token"):
            TCPStore("127.0.0.1", s.port, timeout=10)


def test_stray_client_cannot_write_without_hello():
    with TCPStore("127.0.0.1", 0, is_server=True, timeout=10, token="s3cret") as s:
        sock = raw_connect(s.port)
        sock.sendall(encode(Op.SET, 7, [b"intruder", b"x"])[0])
        reply = read_frame(sock)
        assert reply.code == Status.ERROR and b"hello" in decode_args(reply)[0]
        assert closed_by_server(sock)
        sock.close()
        assert not s.check(["intruder"])


def test_stray_client_cannot_read_with_a_wrong_token():
    with TCPStore("127.0.0.1", 0, is_server=True, timeout=10, token="s3cret") as s:
        s.set("secret", b"x")
        sock = raw_connect(s.port)
        assert hello(sock, "nope").code == Status.ERROR
        try:
            sock.sendall(encode(Op.GET, 2, [struct.pack("<d", 1.0), b"secret"])[0])
        except OSError:  # the server may already have reset the connection
            pass
        assert read_frame(sock) is None
        sock.close()


# ----------------------------------------------------------------------------- bad frames
def test_garbage_bytes_close_that_connection_only(store_server):
    sock = raw_connect(store_server.port)
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 4)
    assert closed_by_server(sock)
    sock.close()
    assert still_serves(store_server.port)


def test_oversized_length_gets_an_error_and_a_closed_connection(store_server):
    sock = raw_connect(store_server.port)
    assert hello(sock).code == Status.OK
    sock.sendall(HEADER.pack(0xFFFFFFF0, Op.SET, 9, 2))
    reply = read_frame(sock)
    assert reply.code == Status.ERROR and reply.rid == 9
    assert b"exceeds the limit" in decode_args(reply)[0]
    assert closed_by_server(sock)
    sock.close()
    assert still_serves(store_server.port)


def test_oversized_hello_is_refused_before_reading_it(store_server):
    sock = raw_connect(store_server.port)
    sock.sendall(HEADER.pack(1 << 20, Op.HELLO, 1, 2))
    reply = read_frame(sock)
    assert reply.code == Status.ERROR
    assert closed_by_server(sock)
    sock.close()


def test_truncated_frame_then_disconnect_leaves_the_server_serving(store_server):
    sock = raw_connect(store_server.port)
    assert hello(sock).code == Status.OK
    frame = encode(Op.SET, 0, [b"half", b"x" * 100])[0]
    sock.sendall(frame[: len(frame) // 2])
    sock.close()
    assert still_serves(store_server.port)
    assert not store_server.check(["half"])


def test_truncated_large_frame_then_disconnect_leaves_the_server_serving(store_server):
    sock = raw_connect(store_server.port)
    assert hello(sock).code == Status.OK
    sock.sendall(HEADER.pack(8 << 20, Op.SET, 0, 2) + b"\0" * (2 << 20))
    sock.close()
    assert still_serves(store_server.port)


def test_argument_lengths_that_do_not_add_up_get_an_error_reply(store_server):
    sock = raw_connect(store_server.port)
    assert hello(sock).code == Status.OK
    payload = struct.pack("<2I", 5, 500) + b"hello"
    sock.sendall(HEADER.pack(len(payload), Op.SET, 4, 2) + payload)
    reply = read_frame(sock)
    assert reply.code == Status.ERROR and reply.rid == 4
    # the framing was intact, so the same connection keeps working
    sock.sendall(encode(Op.ADD, 5, [b"n", b"2"])[0])
    reply = read_frame(sock)
    assert (reply.code, reply.rid, decode_args(reply)) == (Status.OK, 5, [b"2"])
    sock.close()


def test_unknown_operation_gets_an_error_reply(store_server):
    sock = raw_connect(store_server.port)
    assert hello(sock).code == Status.OK
    sock.sendall(encode(200, 3, [b"x"])[0])
    reply = read_frame(sock)
    assert reply.code == Status.ERROR and b"unknown operation" in decode_args(reply)[0]
    sock.close()


def test_value_over_the_server_limit_from_a_raw_client_is_refused():
    with TCPStore("127.0.0.1", 0, is_server=True, timeout=10, max_value_bytes=100) as s:
        sock = raw_connect(s.port)
        assert hello(sock).code == Status.OK
        sock.sendall(encode(Op.COMPARE_SET, 6, [b"k", b"", b"x" * 101])[0])
        reply = read_frame(sock)
        assert reply.code == Status.ERROR and b"limit of 100" in decode_args(reply)[0]
        sock.close()
        assert not s.check(["k"])


def test_frame_error_is_an_exported_store_error_that_pickles_with_its_fields():
    import gpucoll

    err = pickle.loads(pickle.dumps(gpucoll.FrameError("bad frame", rid=7, fatal=False)))
    assert isinstance(err, gpucoll.StoreError) and isinstance(err, ValueError)
    assert (str(err), err.rid, err.fatal) == ("bad frame", 7, False)


def test_failed_fire_and_forget_set_breaks_the_connection_visibly(store_server):
    # a raw set with reply id 0 that the server cannot apply closes the connection
    sock = raw_connect(store_server.port)
    assert hello(sock).code == Status.OK
    sock.sendall(encode(Op.SET, 0, [b"only-a-key"])[0])
    reply = read_frame(sock)
    assert reply.code == Status.ERROR and reply.rid == 0
    assert closed_by_server(sock)
    sock.close()


# ----------------------------------------------------------------------------- failures
def test_lost_server_is_a_store_error_naming_the_address():
    server = TCPStore("127.0.0.1", 0, is_server=True, timeout=10)
    client = TCPStore("127.0.0.1", server.port, timeout=30)
    errors = []

    def parked():
        try:
            client.get("never", timeout=30)
        except StoreError as exc:
            errors.append(exc)

    t = threading.Thread(target=parked)
    t.start()
    server.close()
    t.join(20)
    client.close()
    assert not t.is_alive()
    assert len(errors) == 1 and not isinstance(errors[0], StoreTimeout)
    assert f"127.0.0.1:{server.port}" in str(errors[0])


def test_calls_after_the_server_is_gone_fail_fast():
    server = TCPStore("127.0.0.1", 0, is_server=True, timeout=10)
    client = TCPStore("127.0.0.1", server.port, timeout=30)
    server.close()
    with pytest.raises(StoreError, match=f"127.0.0.1:{server.port}"):
        client.add("n", 1)
    with pytest.raises(StoreError, match="127.0.0.1"):
        client.check(["n"])
    client.close()


def test_silent_server_hits_the_connect_deadline():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)  # accepts (kernel backlog) but never answers the hello
    port = listener.getsockname()[1]
    try:
        with pytest.raises(StoreTimeout, match=f"127.0.0.1:{port}"):
            TCPStore("127.0.0.1", port, timeout=0.3)
    finally:
        listener.close()


def test_nothing_listening_times_out_naming_the_address():
    reserved = socket.socket()
    reserved.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
    port = reserved.getsockname()[1]
    try:
        with pytest.raises(StoreTimeout, match=f"could not connect to store at 127.0.0.1:{port}"):
            TCPStore("127.0.0.1", port, timeout=0.3)
    finally:
        reserved.close()


def test_both_ends_of_a_connection_probe_a_silent_peer_with_keepalives(store_server):
    from gpucoll.store.protocol import KEEPALIVE

    with TCPStore("127.0.0.1", store_server.port, timeout=10) as c:
        c.add("sync", 1)  # the server has accepted it by now
        server_side = [conn.sock for conn in store_server._server._conns.values()]
        for sock in [c._conn._sock, *server_side]:
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == KEEPALIVE[0]
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == KEEPALIVE[2]


def test_connection_that_never_says_hello_is_dropped():
    from gpucoll.store import StoreLimits
    from gpucoll.store.server import StoreServer

    server = StoreServer("127.0.0.1", 0, limits=StoreLimits(hello_timeout=0.2))
    try:
        sock = raw_connect(server.port)
        assert closed_by_server(sock)  # nothing sent: dropped at the hello deadline
        sock.close()
    finally:
        server.close()


def test_a_scanners_connections_do_not_disturb_clients_at_work(store_server):
    """Silent connections held open, garbage and connect-and-close, hammered while two clients
    wait on each other's keys: their calls neither fail nor wait on the scanner."""
    stop = threading.Event()
    silent = []

    def scan():
        for i in itertools.count():
            if stop.is_set():
                return
            sock = raw_connect(store_server.port)
            if i % 3 == 0 and len(silent) < 50:
                silent.append(sock)
                continue
            if i % 3 == 1:
                sock.sendall(b"\x16\x03\x01\x02\x00" + os.urandom(300))  # a TLS probe
            sock.close()

    scanner = threading.Thread(target=scan, daemon=True)
    scanner.start()
    try:
        # a call held up by the scanner would wait for its silent connections' 60 s hello
        # deadline: each call's own deadline (10 s) would end it with StoreTimeout first
        with TCPStore("127.0.0.1", store_server.port, timeout=10) as a, \
                TCPStore("127.0.0.1", store_server.port, timeout=10) as b:
            for i in range(200):
                a.set(f"ping/{i}", str(i).encode())
                assert b.get(f"ping/{i}") == str(i).encode()
                assert b.add("count", 1) == i + 1
    finally:
        stop.set()
        scanner.join(10)
        for sock in silent:
            sock.close()
    assert len(silent) == 50  # the scanner did hold connections open meanwhile
    assert still_serves(store_server.port)


# ----------------------------------------------------------------------------- open to the network
@pytest.fixture
def fresh_warning(monkeypatch):
    """Forget that this process already warned about a store without a token."""
    monkeypatch.setattr("gpucoll.store.server._warned_open", False)


def test_a_store_without_a_token_on_every_interface_warns_once(fresh_warning, monkeypatch):
    monkeypatch.delenv("GPUCOLL_STORE_TOKEN", raising=False)
    with pytest.warns(UserWarning, match=r"store on 0\.0\.0\.0:\d+ has no token.*"
                                         r"GPUCOLL_STORE_TOKEN") as record:
        with TCPStore("0.0.0.0", 0, is_server=True, timeout=10):
            with TCPStore("0.0.0.0", 0, is_server=True, timeout=10):
                pass
    assert len([w for w in record if "no token" in str(w.message)]) == 1


@pytest.mark.parametrize("host, token", [("127.0.0.1", None), ("0.0.0.0", "s3cret")])
def test_a_loopback_store_or_one_with_a_token_does_not_warn(fresh_warning, monkeypatch, host,
                                                              token):
    import warnings

    monkeypatch.delenv("GPUCOLL_STORE_TOKEN", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with TCPStore(host, 0, is_server=True, timeout=10, token=token):
            pass


def test_the_store_command_warns_when_open_without_a_token():
    env = {k: v for k, v in os.environ.items() if k != "GPUCOLL_STORE_TOKEN"}
    proc = subprocess.Popen([sys.executable, "-m", "gpucoll", "store", "--host", "0.0.0.0",
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        assert "serving" in proc.stdout.readline()
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=20)
    assert "has no token" in err
