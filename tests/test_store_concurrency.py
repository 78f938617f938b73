"""Many clients at once: threads sharing one store object, threads with their own, processes,
the start-up race, and clients killed in the middle of a request."""

from __future__ import annotations

import socket
import threading

import pytest
from multiproc import spawn

from gpucoll import TCPStore
from gpucoll.store.protocol import HEADER, VERSION, Op, encode


def reserve_port() -> socket.socket:
    """A bound, not listening socket: its port refuses connections until a server takes it."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def rendezvous(store: TCPStore, rank: int, n: int, tag: str) -> list[bytes]:
    """Every client publishes its key, gathers all keys, then passes an add-counter barrier."""
    store.set(f"{tag}/{rank}", str(rank).encode())
    keys = [f"{tag}/{r}" for r in range(n)]
    store.wait(keys, timeout=60)
    values = store.multi_get(keys, timeout=60)
    if store.add(f"{tag}/count", 1) == n:
        store.set(f"{tag}/done", b"1")
    store.wait([f"{tag}/done"], timeout=60)
    return values


# ----------------------------------------------------------------------------- threads
def test_threads_share_one_store_object(store_server):
    n = 16
    results = [None] * n

    def worker(i):
        results[i] = rendezvous(store_server, i, n, "shared")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    expected = [str(r).encode() for r in range(n)]
    assert results == [expected] * n


def test_a_parked_get_does_not_block_a_set_on_the_same_object(store_server):
    got = []
    t = threading.Thread(target=lambda: got.append(store_server.get("same-obj", timeout=30)))
    t.start()
    store_server.set("same-obj", b"v")  # same connection as the parked get
    t.join(40)
    assert got == [b"v"]


def test_64_threads_with_their_own_connections_rendezvous(store_server):
    n = 64
    clients = [TCPStore("127.0.0.1", store_server.port, timeout=60) for _ in range(n)]
    results = [None] * n
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(
        i, rendezvous(clients[i], i, n, "t64"))) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    for c in clients:
        c.close()
    assert all(r == [str(k).encode() for k in range(n)] for r in results)


def test_threads_each_get_their_own_replies(store_server):
    for i in range(32):
        store_server.set(f"own/{i}", str(i).encode() * (i + 1))
    bad = []

    def worker(i):
        for _ in range(50):
            if store_server.get(f"own/{i}") != str(i).encode() * (i + 1):
                bad.append(i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert bad == []


# ----------------------------------------------------------------------------- processes
def _rank_rendezvous(rank: int, n: int, port: int, threads: int) -> list[bytes]:
    total = n * threads
    out = [None] * threads

    def one(t):
        with TCPStore("127.0.0.1", port, timeout=60) as c:
            out[t] = rendezvous(c, rank * threads + t, total, "procs")

    workers = [threading.Thread(target=one, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(90)
    return out


def test_processes_rendezvous_through_the_store(store_server):
    results = spawn(_rank_rendezvous, 4, store_server.port, 8, timeout=90)
    expected = [str(r).encode() for r in range(32)]
    assert all(v == expected for rank in results for v in rank)


@pytest.mark.slow
def test_1024_clients_rendezvous(store_server):
    results = spawn(_rank_rendezvous, 4, store_server.port, 256, timeout=110)
    assert sum(len(r) for r in results) == 1024
    assert all(v[1023] == b"1023" for rank in results for v in rank)


def _late_client(rank: int, n: int, port: int) -> bytes:
    with TCPStore("127.0.0.1", port, timeout=60) as c:
        c.add("arrived", 1)
        return c.get("from-server")


def test_clients_started_before_the_server_connect_once_it_is_up():
    reserved = reserve_port()
    port = reserved.getsockname()[1]
    results = []
    runner = threading.Thread(target=lambda: results.append(
        spawn(_late_client, 3, port, timeout=90)))
    runner.start()
    try:
        # the clients are refused until the server takes over the reserved port
        with TCPStore("127.0.0.1", port, is_server=True, timeout=60) as server:
            reserved.close()
            server.set("from-server", b"hi")
            runner.join(100)
            assert server.get("arrived") == b"3"
    finally:
        reserved.close()
        runner.join(100)
    assert results == [[b"hi", b"hi", b"hi"]]


def test_client_thread_started_before_the_server_connects():
    reserved = reserve_port()
    port = reserved.getsockname()[1]
    got = []
    t = threading.Thread(target=lambda: got.append(_late_client(0, 1, port)))
    t.start()
    try:
        with TCPStore("127.0.0.1", port, is_server=True, timeout=30) as server:
            server.set("from-server", b"early bird")
            t.join(40)
    finally:
        reserved.close()
    assert got == [b"early bird"]


def test_a_client_dropped_by_a_closing_server_connects_to_the_next_one_at_that_address():
    closing = socket.create_server(("127.0.0.1", 0))  # accepts, then drops without a word
    port = closing.getsockname()[1]
    got = []
    client = threading.Thread(target=lambda: got.append(_late_client(0, 1, port)))
    client.start()
    try:
        conn, _ = closing.accept()
        conn.close()
        closing.close()
        with TCPStore("127.0.0.1", port, is_server=True, timeout=30) as server:
            server.set("from-server", b"the next one")
            client.join(40)
    finally:
        closing.close()
        client.join(40)
    assert got == [b"the next one"]


# ----------------------------------------------------------------------------- killed clients
def _victim_parked(rank: int, n: int, port: int) -> None:
    with TCPStore("127.0.0.1", port, timeout=60) as c:
        c.set("victim/ready", b"1")
        c.get("victim/never", timeout=60)  # killed while parked here


def test_client_killed_while_parked_does_not_disturb_the_server(store_server):
    outcomes = spawn(_victim_parked, 1, store_server.port, timeout=60, check=False,
                     kill={0: 2.0})
    assert outcomes[0].exitcode == -9
    store_server.set("victim/never", b"now")  # the reply goes nowhere, quietly
    assert store_server.get("victim/never") == b"now"
    assert store_server.add("victim/after", 1) == 1


def _victim_mid_frame(rank: int, n: int, port: int) -> None:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(encode(Op.HELLO, 1, [VERSION, b""])[0])
    sock.recv(1024)
    # half of a 16 MiB set, then nothing: killed with the frame unfinished
    sock.sendall(HEADER.pack(16 << 20, Op.SET, 0, 2) + b"\0" * (8 << 20))
    with TCPStore("127.0.0.1", port, timeout=30) as c:
        c.set("victim/sent-half", b"1")
        c.get("victim/never-set", timeout=60)


def test_client_killed_mid_frame_does_not_disturb_the_server(store_server):
    outcomes = spawn(_victim_mid_frame, 1, store_server.port, timeout=60, check=False,
                     kill={0: 2.0})
    assert outcomes[0].exitcode == -9
    store_server.set("k", b"v")
    with TCPStore("127.0.0.1", store_server.port, timeout=10) as c:
        assert c.get("k") == b"v"


_FD_LIMITED_SERVER = """
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (40, 40))
from gpucoll import TCPStore
s = TCPStore("127.0.0.1", 0, is_server=True, timeout=60)
print(s.port, flush=True)
sys.stdin.read()
s.close()
"""


def test_server_out_of_file_descriptors_serves_waiting_clients_once_others_leave():
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _FD_LIMITED_SERVER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        first = [TCPStore("127.0.0.1", port, timeout=30) for _ in range(25)]
        # beyond the server's descriptors: these wait in the backlog for their hello
        late: list = []
        threads = [threading.Thread(target=lambda: late.append(
            TCPStore("127.0.0.1", port, timeout=60))) for _ in range(20)]
        for t in threads:
            t.start()
        for c in first:
            c.close()
        for t in threads:
            t.join(70)
        assert len(late) == 20
        assert late[0].add("n", 1) == 1
        for c in late:
            c.close()
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
