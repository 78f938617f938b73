"""What one client can make the store server hold: a hostile or stuck client costs the server a
bounded amount of memory, and every other client goes on being served.

The server runs as a ``gpucoll store`` process of the test's own, so its memory can be read.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading

import pytest
from store_wire import (
    closed_by_server,
    hello,
    raw_connect,
    read_frame,
    rss_bytes,
    standalone_store,
)

from gpucoll import TCPStore
from gpucoll.store import StoreLimits
from gpucoll.store.protocol import HEADER, Op, Status, decode_args, encode, pack_timeout

MiB = 1 << 20


def serves(port: int, token: str | None = None) -> bool:
    """A well-behaved client still gets its answers."""
    with TCPStore("127.0.0.1", port, timeout=30, token=token) as c:
        c.set("still", b"served")
        return c.add("count", 1) >= 1 and c.get("still") == b"served"


def get_request(rid: int, key: bytes) -> bytes:
    return encode(Op.GET, rid, [pack_timeout(60.0), key])[0]


# ----------------------------------------------------------------------------- before the hello
@pytest.mark.parametrize("length", [64 << 10, 0xFFFFFFF0])
def test_a_huge_length_before_the_hello_is_refused_without_allocating(length):
    with standalone_store("--token", "tok") as (proc, port, _):
        before = rss_bytes(proc.pid)
        socks = [raw_connect(port) for _ in range(300)]
        for sock in socks:
            sock.sendall(HEADER.pack(length, Op.HELLO, 1, 2))
        for sock in socks:
            reply = read_frame(sock)
            assert reply.code == Status.ERROR and b"exceeds the limit of 4096" in \
                decode_args(reply)[0]
            assert closed_by_server(sock)
        grown = rss_bytes(proc.pid) - before
        for sock in socks:
            sock.close()
        assert grown < 8 * MiB, f"300 headers grew the server by {grown / MiB:.1f} MiB"
        assert serves(port, token="tok")


def test_a_token_too_long_for_the_hello_limit_is_refused_when_the_server_starts():
    with pytest.raises(ValueError, match="token of 5000 bytes does not fit"):
        TCPStore("127.0.0.1", 0, is_server=True, token="x" * 5000)


def test_a_longer_hello_limit_admits_a_longer_token():
    with TCPStore("127.0.0.1", 0, is_server=True, token="x" * 5000, timeout=10,
                  limits=StoreLimits(hello_bytes=8192)) as s:
        assert s.add("n", 1) == 1


# ----------------------------------------------------------------------------- after the hello
def test_headers_of_large_frames_alone_do_not_make_the_server_allocate():
    with standalone_store() as (proc, port, _):
        before = rss_bytes(proc.pid)
        socks = [raw_connect(port) for _ in range(24)]
        for sock in socks:
            assert hello(sock).code == Status.OK
            sock.sendall(HEADER.pack(32 * MiB - 64, Op.SET, 0, 2))  # and then nothing
        assert serves(port)  # the server has read every header by the time it answers
        grown = rss_bytes(proc.pid) - before
        assert grown < 96 * MiB, f"24 headers of 32 MiB frames grew the server by " \
                                 f"{grown / MiB:.0f} MiB"
        for sock in socks:
            sock.close()
        assert serves(port)


def test_a_client_that_never_reads_its_replies_is_throttled_at_bounded_memory():
    with standalone_store("--max-buffered-bytes", str(4 * MiB)) as (proc, port, _):
        with TCPStore("127.0.0.1", port, timeout=30) as writer:
            writer.set("blob", b"b" * (200 << 10))  # each reply a copy of 200 KiB
            writer.add("count", 0)
            before = rss_bytes(proc.pid)
            slow = raw_connect(port)
            assert hello(slow).code == Status.OK
            slow.settimeout(3.0)
            batch = b"".join(get_request(rid, b"blob") for rid in range(1, 1001))
            sent, throttled, grown = 0, False, 0
            while not throttled and grown < 512 * MiB:  # unbounded would be gigabytes
                try:
                    slow.sendall(batch)
                    sent += 1000
                except TimeoutError:
                    throttled = True
                grown = rss_bytes(proc.pid) - before
            # others are served while the slow client is held back
            assert writer.add("count", 1) == 1 and writer.get("blob") == b"b" * (200 << 10)
            assert throttled, f"{sent} requests sent without being held back; server grew " \
                              f"{grown / MiB:.0f} MiB"
            assert grown < 64 * MiB, f"server grew by {grown / MiB:.0f} MiB"
            slow.close()
            assert serves(port)


def test_a_slow_reader_that_catches_up_gets_every_reply_in_order():
    with TCPStore("127.0.0.1", 0, is_server=True, timeout=30,
                  limits=StoreLimits(buffered_bytes=1 << 16)) as s:
        s.set("v", b"x" * 10000)
        sock = raw_connect(s.port)
        assert hello(sock).code == Status.OK
        n = 400  # 4 MB of replies past a 64 KiB limit: paused and resumed many times
        sender = threading.Thread(target=lambda: sock.sendall(
            b"".join(get_request(rid, b"v") for rid in range(2, n + 2))))
        sender.start()
        rids = []
        for _ in range(n):
            reply = read_frame(sock)
            assert reply.code == Status.OK and decode_args(reply) == [b"x" * 10000]
            rids.append(reply.rid)
        sender.join(30)
        sock.close()
        assert rids == list(range(2, n + 2))


def test_replies_to_many_parked_requests_share_their_payload():
    with standalone_store() as (proc, port, _):
        sock = raw_connect(port)
        assert hello(sock).code == Status.OK
        sock.sendall(b"".join(get_request(rid, b"later") for rid in range(2, 2002)))
        with TCPStore("127.0.0.1", port, timeout=30) as c:
            c.add("sync", 1)
            before = rss_bytes(proc.pid)
            c.set("later", b"v" * (100 << 10))  # 2000 waiters, none of them reading
            assert c.get("later") == b"v" * (100 << 10)
            grown = rss_bytes(proc.pid) - before
        sock.close()
        assert grown < 64 * MiB, f"2000 replies of 100 KiB grew the server by " \
                                 f"{grown / MiB:.0f} MiB"


def test_parked_requests_past_the_limit_are_refused_naming_it():
    with TCPStore("127.0.0.1", 0, is_server=True, timeout=30,
                  limits=StoreLimits(waiting=100)) as s:
        sock = raw_connect(s.port)
        assert hello(sock).code == Status.OK
        sock.sendall(b"".join(get_request(rid, f"never/{rid}".encode())
                              for rid in range(2, 152)))
        refused = [read_frame(sock) for _ in range(50)]
        assert [f.rid for f in refused] == list(range(102, 152))
        assert all(f.code == Status.ERROR and b"already wait" in decode_args(f)[0]
                   for f in refused)
        s.set("never/2", b"now")  # the first hundred still wait and are answered
        reply = read_frame(sock)
        assert (reply.code, reply.rid, decode_args(reply)) == (Status.OK, 2, [b"now"])
        sock.close()


# ----------------------------------------------------------------------------- configuration
@pytest.mark.parametrize("field, value", [("hello_bytes", 10), ("buffered_bytes", 100),
                                          ("waiting", 0), ("waiting", 1.5),
                                          ("hello_timeout", 0), ("hello_timeout", True)])
def test_limits_out_of_range_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"StoreLimits: {field} must be"):
        StoreLimits(**{field: value})


def test_limits_belong_to_the_server():
    with pytest.raises(ValueError, match="is_server=True"):
        TCPStore("127.0.0.1", 1, limits=StoreLimits())


def test_store_command_refuses_a_bad_limit():
    proc = subprocess.run([sys.executable, "-m", "gpucoll", "store", "--port", "0",
                           "--max-waiting", "0"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "waiting must be an int >= 1" in proc.stderr


def test_limits_can_be_set_on_the_store_command():
    with standalone_store("--max-hello-bytes", "128") as (_, port, _):
        sock = raw_connect(port)
        sock.sendall(HEADER.pack(200, Op.HELLO, 1, 2))
        assert b"exceeds the limit of 128" in decode_args(read_frame(sock))[0]
        sock.close()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as ok:
            assert hello(ok).code == Status.OK
