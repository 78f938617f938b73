"""Large values: received without copies, sent with scatter-gather, read back intact."""

from __future__ import annotations

import select
import socket
import struct
import threading

import pytest

from gpucoll import StoreError, StoreTimeout, TCPStore
from gpucoll.store.protocol import (
    BIG_ARG,
    HEADER,
    MAX_IOV,
    Frame,
    FrameReader,
    Op,
    ReplyReader,
    Status,
    decode_args,
    encode,
    encode_payload,
    unsent,
)


def pattern(n: int, seed: int = 0) -> bytes:
    """``n`` bytes that differ from position to position (a misplaced chunk shows)."""
    return (bytes(range(seed % 251, 251)) + bytes(range(seed % 251))) * (n // 251) + \
        bytes(n % 251)


def frame_bytes(code: int, rid: int, args: list[bytes]) -> bytes:
    return b"".join(encode(code, rid, args))


def no_deadline() -> None:
    """A ``tick`` that always allows another receive."""


# ----------------------------------------------------------------------------- end to end
def test_64_mib_value_round_trips_intact(store_server):
    value = pattern(64 << 20, seed=7)
    with TCPStore("127.0.0.1", store_server.port, timeout=60) as c:
        c.set("big", value)
        assert c.get("big") == value


def test_multi_get_of_large_and_small_values_returns_each_in_order(store_server):
    values = [pattern(1 << 20, 1), b"tiny", b"", pattern(300 << 10, 2), pattern(BIG_ARG, 3)]
    keys = [f"k{i}" for i in range(len(values))]
    store_server.multi_set(keys, values)
    assert store_server.multi_get(keys) == values


def test_multi_set_and_multi_get_of_more_large_values_than_one_sendmsg_takes(store_server):
    n = MAX_IOV + 8
    keys = [f"k{i}" for i in range(n)]
    values = [pattern(BIG_ARG, i) for i in range(n)]
    store_server.multi_set(keys, values)
    got = store_server.multi_get(keys)
    assert len(got) == n and got == values


def test_waiters_on_large_values_each_get_the_whole_reply(store_server):
    keys = ["a", "b"]
    values = [pattern(2 << 20, 4), pattern(1 << 20, 5)]
    results: list = [None] * 4

    def waiter(i: int) -> None:
        with TCPStore("127.0.0.1", store_server.port, timeout=30) as c:
            results[i] = c.multi_get(keys, timeout=30)

    threads = [threading.Thread(target=waiter, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    store_server.multi_set(keys, values)
    for t in threads:
        t.join(60)
    assert results == [values] * 4


def test_compare_set_compares_a_large_stored_value_by_content(store_server):
    old, new = pattern(1 << 20, 1), pattern(1 << 20, 2)
    store_server.set("k", old)
    assert store_server.compare_set("k", bytearray(old), new) == new
    assert store_server.compare_set("k", old, b"x") == new
    assert store_server.get("k") == new


def test_add_to_a_key_holding_a_large_value_is_refused_and_the_client_goes_on(store_server):
    store_server.set("k", pattern(1 << 20))
    with pytest.raises(StoreError, match="does not hold an integer"):
        store_server.add("k", 1)
    assert store_server.add("n", 2) == 2


def test_large_value_overwritten_while_a_reader_receives_it_arrives_whole(store_server):
    first = pattern(8 << 20, 1)
    store_server.set("k", first)
    with TCPStore("127.0.0.1", store_server.port, timeout=30) as c:
        got: list = []
        t = threading.Thread(target=lambda: got.append(c.get("k")))
        t.start()
        store_server.set("k", pattern(8 << 20, 2))
        t.join(60)
    assert got[0] in (first, pattern(8 << 20, 2))


# ----------------------------------------------------------------------------- encoding
def test_large_reply_payload_keeps_large_values_as_buffers_of_their_own():
    big = pattern(1 << 20)
    args = [b"a", big, b"b", b"c", big]
    argc, size, bufs = encode_payload(args)
    assert (argc, size) == (5, 4 * 5 + sum(map(len, args)))
    assert [b is big for b in bufs] == [False, True, False, True]
    assert b"".join(bufs) == struct.pack("<5I", *map(len, args)) + b"".join(args)


def test_small_reply_payload_is_one_buffer():
    argc, size, bufs = encode_payload([b"x", b"yz"])
    assert (argc, size, bufs) == (2, 11, [struct.pack("<2I", 1, 2) + b"xyz"])


def test_large_frame_in_a_bytearray_decodes_large_arguments_as_views():
    big = pattern(BIG_ARG)
    payload = bytearray(b"".join(encode(Op.SET, 1, [b"key", big]))[HEADER.size:])
    args = decode_args(Frame(Op.SET, 1, 2, payload), views=True)
    assert type(args[0]) is bytes and type(args[1]) is memoryview
    assert args == [b"key", big]
    assert [type(a) for a in decode_args(Frame(Op.SET, 1, 2, payload))] == [bytes, bytes]


# ----------------------------------------------------------------------------- server reader
def test_server_reader_reassembles_a_large_frame_sent_in_pieces():
    a, b = socket.socketpair()
    with a, b:
        a.settimeout(10)
        b.setblocking(False)
        big = pattern(3 << 20, 9)
        data = frame_bytes(Op.SET, 0, [b"key", big]) + frame_bytes(Op.NUM_KEYS, 2, [])
        feeder = threading.Thread(target=lambda: [a.sendall(data[i:i + 700_001])
                                                  for i in range(0, len(data), 700_001)])
        feeder.start()
        reader = FrameReader(8 << 20)
        frames: list[Frame] = []
        while len(frames) < 2 and select.select([b], [], [], 10)[0]:
            try:
                got = reader.read_from(b)
            except BlockingIOError:
                continue
            assert got is not None
            frames += got
        feeder.join(10)
        assert [(f.code, f.rid) for f in frames] == [(Op.SET, 0), (Op.NUM_KEYS, 2)]
        assert decode_args(frames[0]) == [b"key", big]


# ----------------------------------------------------------------------------- client reader
def test_reply_reader_reads_a_large_reply_fed_in_pieces():
    a, b = socket.socketpair()
    with a, b:
        values = [pattern(2 << 20, 1), b"s", pattern(BIG_ARG + 1, 2)]
        data = frame_bytes(Status.OK, 3, values) + frame_bytes(Status.OK, 4, [b"next"])

        def feed() -> None:
            a.settimeout(10)
            for start in range(0, len(data), 100_003):
                a.sendall(data[start:start + 100_003])

        t = threading.Thread(target=feed)
        t.start()
        reader = ReplyReader(b)
        assert reader.read_frame(no_deadline) == (Status.OK, 3, values)
        assert reader.read_frame(no_deadline) == (Status.OK, 4, [b"next"])
        assert not reader.torn
        t.join(10)


def test_reply_reader_returns_none_when_the_stream_ends_mid_frame():
    a, b = socket.socketpair()
    with b:
        with a:
            a.sendall(HEADER.pack(4 + (8 << 20), Status.OK, 1, 1) + struct.pack("<I", 8 << 20)
                      + b"x" * 1000)
        reader = ReplyReader(b)
        assert reader.read_frame(no_deadline) is None


def test_reply_reader_marks_the_stream_torn_when_the_deadline_passes_mid_frame():
    a, b = socket.socketpair()
    with a, b:
        b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 50_000))
        a.sendall(HEADER.pack(4 + (1 << 20), Status.OK, 1, 1) + struct.pack("<I", 1 << 20))

        def expired() -> None:
            raise StoreTimeout("deadline")

        reader = ReplyReader(b)
        with pytest.raises(StoreTimeout):
            reader.read_frame(expired)
        assert reader.torn


def test_reply_reader_refuses_a_large_frame_whose_lengths_do_not_add_up():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(HEADER.pack(1 << 20, Status.OK, 1, 1) + struct.pack("<I", 5))
        reader = ReplyReader(b)
        with pytest.raises(ValueError, match="add up"):
            reader.read_frame(no_deadline)


def test_unsent_is_what_a_partial_send_left_in_order_without_empty_buffers():
    rest = unsent([b"abc", b"", b"defg", b"", b"hi"], 5)
    assert [bytes(v) for v in rest] == [b"fg", b"hi"]
    assert unsent([b"abc", b"de"], 5) == []
