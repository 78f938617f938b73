"""Last wills: a key the server sets when a client's connection ends, however it ends."""

from __future__ import annotations

import os
import signal
import threading

import pytest
from multiproc import spawn
from store_wire import closed_by_server, hello, raw_connect, read_frame

from gpucoll import PrefixStore, StoreError, TCPStore
from gpucoll.store.protocol import HEADER, Op, Status, encode


def test_a_will_is_set_when_its_client_closes(store_server):
    with TCPStore("127.0.0.1", store_server.port, timeout=10) as c:
        c.set_will("gone/3", b"died")
        assert not store_server.check(["gone/3"])
    assert store_server.get("gone/3", timeout=10) == b"died"


def test_a_will_wakes_a_client_waiting_for_its_key(store_server):
    got = []
    waiter = threading.Thread(target=lambda: got.append(store_server.get("gone/0", timeout=30)))
    waiter.start()
    with TCPStore("127.0.0.1", store_server.port, timeout=10) as c:
        c.set_will("gone/0", "died")
    waiter.join(40)
    assert got == [b"died"]


def _will_then_die(rank: int, n: int, port: int) -> None:
    store = TCPStore("127.0.0.1", port, timeout=30)
    store.set_will(f"gone/{rank}", b"died")
    store.set_will(f"also/{rank}", b"x")
    os.kill(os.getpid(), signal.SIGKILL)  # no close(), no exit handlers


def test_wills_are_set_when_the_process_is_killed(store_server):
    outcomes = spawn(_will_then_die, 2, store_server.port, timeout=60, check=False)
    assert [o.exitcode for o in outcomes] == [-9, -9]
    assert store_server.multi_get(["gone/0", "gone/1", "also/0", "also/1"], timeout=20) == \
        [b"died", b"died", b"x", b"x"]


def test_a_cleared_will_is_not_set(store_server):
    with TCPStore("127.0.0.1", store_server.port, timeout=10) as c:
        c.set_will("gone/1", b"died")
        assert c.clear_will("gone/1") is True
        assert c.clear_will("gone/1") is False
        c.set_will("sync", b"1")  # a later will of the same connection still fires
    assert store_server.get("sync", timeout=10) == b"1"
    assert not store_server.check(["gone/1"])


def test_a_second_will_for_the_same_key_replaces_the_first(store_server):
    with TCPStore("127.0.0.1", store_server.port, timeout=10) as c:
        c.set_will("k", b"first")
        c.set_will("k", b"second")
    assert store_server.get("k", timeout=10) == b"second"


def test_a_will_overwrites_a_value_set_meanwhile(store_server):
    with TCPStore("127.0.0.1", store_server.port, timeout=10) as c:
        c.set_will("state", b"died")
        c.set_will("fired", b"1")  # a connection's wills fire together, in order
        store_server.set("state", b"running")
        assert store_server.get("state") == b"running"  # the set is applied, not in flight
    assert store_server.get("fired", timeout=10) == b"1"
    assert store_server.get("state") == b"died"


def test_wills_belong_to_their_connection_only(store_server):
    with TCPStore("127.0.0.1", store_server.port, timeout=10) as mine:
        mine.set_will("mine", b"x")
        with TCPStore("127.0.0.1", store_server.port, timeout=10) as other:
            assert other.clear_will("mine") is False
        assert not store_server.check(["mine"])


def test_a_will_of_a_connection_dropped_for_a_bad_frame_still_fires(store_server):
    sock = raw_connect(store_server.port)
    assert hello(sock).code == Status.OK
    sock.sendall(encode(Op.SET_WILL, 2, [b"gone/9", b"died"])[0])
    assert read_frame(sock).code == Status.OK
    sock.sendall(HEADER.pack(0xFFFFFFF0, Op.SET, 0, 2))  # the server drops this connection
    assert store_server.get("gone/9", timeout=10) == b"died"
    assert closed_by_server(sock)
    sock.close()


def test_a_will_value_over_the_limit_is_refused_before_sending():
    with TCPStore("127.0.0.1", 0, is_server=True, timeout=10, max_value_bytes=10) as s:
        with pytest.raises(ValueError, match="set_will.*exceeds the store's limit of 10"):
            s.set_will("k", b"x" * 11)


def test_set_will_on_a_lost_store_is_a_store_error():
    server = TCPStore("127.0.0.1", 0, is_server=True, timeout=10)
    client = TCPStore("127.0.0.1", server.port, timeout=10)
    server.close()
    with pytest.raises(StoreError, match="set_will"):
        client.set_will("k", b"v")
    client.close()


def test_prefix_store_wills_are_namespaced(store_server):
    with TCPStore("127.0.0.1", store_server.port, timeout=10) as c:
        space = PrefixStore("job/comm0", c)
        space.set_will("gone/1", b"died")
        space.set_will("gone/2", b"died")
        assert space.clear_will("gone/2") is True
    assert store_server.get("job/comm0/gone/1", timeout=10) == b"died"
    assert not store_server.check(["job/comm0/gone/2"])
