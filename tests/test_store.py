"""TCPStore operations, one behaviour each, against a server of the test's own."""

from __future__ import annotations

import threading

import pytest

from gpucoll import StoreError, StoreTimeout, TCPStore
from gpucoll.store import parse_address


@pytest.fixture
def client(store_server):
    c = TCPStore("127.0.0.1", store_server.port, timeout=30.0)
    yield c
    c.close()


def test_port_zero_reports_the_chosen_port(store_server):
    assert 0 < store_server.port < 65536


def test_set_then_get_returns_the_bytes(store_server):
    store_server.set("k", b"\x00\xffvalue")
    assert store_server.get("k") == b"\x00\xffvalue"


def test_str_values_are_stored_as_utf8(store_server):
    store_server.set("k", "häh")
    assert store_server.get("k") == "häh".encode()


def test_empty_value_is_a_value(store_server):
    store_server.set("k", b"")
    assert store_server.get("k", timeout=1) == b""
    assert store_server.check(["k"])


def test_set_from_one_client_is_seen_by_another(store_server, client):
    client.set("shared", b"x")
    assert store_server.get("shared") == b"x"


def test_set_overwrites(store_server):
    store_server.set("k", b"1")
    store_server.set("k", b"2")
    assert store_server.get("k") == b"2"


def test_get_blocks_until_another_client_sets_the_key(store_server, client):
    got = []
    t = threading.Thread(target=lambda: got.append(client.get("later", timeout=20)))
    t.start()
    store_server.set("later", b"v")
    t.join(30)
    assert got == [b"v"]


def test_get_of_a_missing_key_times_out_naming_the_key(store_server):
    with pytest.raises(StoreTimeout, match=r"never-set.*after 0\.\d+ s"):
        store_server.get("never-set", timeout=0.2)


def test_store_timeout_is_a_timeout_error(store_server):
    with pytest.raises(TimeoutError):
        store_server.get("never-set", timeout=0.05)


def test_default_timeout_of_the_store_applies(store_server):
    short = TCPStore("127.0.0.1", store_server.port, timeout=0.3)
    try:
        with pytest.raises(StoreTimeout, match="timeout 0.3 s"):
            short.get("never-set")
    finally:
        short.close()


def test_add_counts_from_zero(store_server):
    assert store_server.add("n", 5) == 5
    assert store_server.add("n", -2) == 3
    assert store_server.get("n") == b"3"


def test_add_on_a_non_integer_value_is_refused(store_server):
    store_server.set("text", b"abc")
    with pytest.raises(StoreError, match="does not hold an integer"):
        store_server.add("text", 1)
    assert store_server.get("text") == b"abc"  # and the connection still works


def test_add_rejects_a_non_int_amount_before_sending(store_server):
    with pytest.raises(TypeError, match="amount"):
        store_server.add("n", 1.5)


def test_add_is_atomic_across_threads(store_server):
    clients = [TCPStore("127.0.0.1", store_server.port, timeout=30) for _ in range(8)]
    threads = [threading.Thread(target=lambda c=c: [c.add("ctr", 1) for _ in range(200)])
               for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for c in clients:
        c.close()
    assert store_server.add("ctr", 0) == 1600


def test_compare_set_on_a_missing_key_with_empty_expected_sets_it(store_server):
    assert store_server.compare_set("cas", b"", b"first") == b"first"
    assert store_server.get("cas") == b"first"


def test_compare_set_on_a_missing_key_with_expected_returns_expected(store_server):
    assert store_server.compare_set("cas", b"old", b"new") == b"old"
    assert not store_server.check(["cas"])


def test_compare_set_swaps_when_the_value_matches(store_server):
    store_server.set("cas", b"a")
    assert store_server.compare_set("cas", b"a", b"b") == b"b"
    assert store_server.get("cas") == b"b"


def test_compare_set_keeps_and_returns_a_value_that_differs(store_server):
    store_server.set("cas", b"a")
    assert store_server.compare_set("cas", b"x", b"b") == b"a"
    assert store_server.get("cas") == b"a"


def test_compare_set_wakes_a_waiting_get(store_server, client):
    got = []
    t = threading.Thread(target=lambda: got.append(client.get("cas", timeout=20)))
    t.start()
    store_server.compare_set("cas", b"", b"won")
    t.join(30)
    assert got == [b"won"]


def test_wait_returns_once_all_keys_exist(store_server, client):
    done = threading.Event()

    def waiter():
        client.wait(["a", "b", "c"], timeout=20)
        done.set()

    t = threading.Thread(target=waiter)
    t.start()
    store_server.set("a", b"1")
    store_server.set("c", b"1")
    assert not done.is_set()  # "b" is still missing
    store_server.set("b", b"1")
    t.join(30)
    assert done.is_set()


def test_wait_timeout_names_only_the_missing_keys(store_server):
    store_server.set("here", b"1")
    with pytest.raises(StoreTimeout) as info:
        store_server.wait(["here", "gone1", "gone2"], timeout=0.2)
    assert "gone1" in str(info.value) and "gone2" in str(info.value)
    assert "'here'" not in str(info.value)


def test_wait_on_no_keys_returns_at_once(store_server):
    store_server.wait([], timeout=0)


def test_keys_must_be_a_list_not_a_string(store_server):
    with pytest.raises(TypeError, match="list of str"):
        store_server.wait("abc")


def test_check_is_true_only_when_every_key_exists(store_server):
    store_server.set("a", b"1")
    assert store_server.check(["a"])
    assert not store_server.check(["a", "b"])


def test_delete_key_reports_whether_it_existed(store_server):
    store_server.set("d", b"1")
    assert store_server.delete_key("d") is True
    assert store_server.delete_key("d") is False
    assert not store_server.check(["d"])


def test_peek_returns_the_values_there_now_and_none_for_the_rest(store_server):
    store_server.multi_set(["p/a", "p/empty"], [b"1", b""])
    assert store_server.peek(["p/a", "p/missing", "p/empty"]) == [b"1", None, b""]


def test_peek_never_waits(store_server):
    assert store_server.peek(["never/1", "never/2"]) == [None, None]
    assert store_server.peek([]) == []


def test_peek_returns_large_values_whole(store_server):
    big = bytes(range(256)) * 4096
    store_server.set("p/big", big)
    assert store_server.peek(["p/none", "p/big"]) == [None, big]


def test_peek_needs_a_list_of_keys(store_server):
    with pytest.raises(TypeError, match="peek: keys must be a list"):
        store_server.peek("p/a")


def test_delete_prefix_deletes_only_the_keys_under_it_and_counts_them(store_server):
    store_server.multi_set(["job1/a", "job1/b/c", "job10/a", "other"], [b"1"] * 4)
    assert store_server.delete_prefix("job1/") == 2
    assert store_server.peek(["job1/a", "job1/b/c", "job10/a", "other"]) == \
        [None, None, b"1", b"1"]
    assert store_server.delete_prefix("job1/") == 0


def test_delete_prefix_refuses_the_empty_prefix(store_server):
    store_server.set("k", b"v")
    with pytest.raises(ValueError, match="every key"):
        store_server.delete_prefix("")
    assert store_server.check(["k"])


def test_num_keys_counts_every_key(store_server):
    before = store_server.num_keys()
    store_server.set("n1", b"1")
    store_server.add("n2", 1)
    assert store_server.num_keys() == before + 2


def test_multi_set_then_multi_get_in_order(store_server):
    store_server.multi_set(["x", "y", "z"], [b"1", "2", b"3"])
    assert store_server.multi_get(["z", "x", "y"]) == [b"3", b"1", b"2"]


def test_multi_get_waits_for_missing_keys(store_server, client):
    got = []
    t = threading.Thread(target=lambda: got.append(client.multi_get(["p", "q"], timeout=20)))
    t.start()
    store_server.set("q", b"Q")
    store_server.set("p", b"P")
    t.join(30)
    assert got == [[b"P", b"Q"]]


def test_multi_get_times_out_naming_the_missing_key(store_server):
    store_server.set("p", b"P")
    with pytest.raises(StoreTimeout, match="'q'"):
        store_server.multi_get(["p", "q"], timeout=0.1)


def test_multi_set_needs_as_many_values_as_keys(store_server):
    with pytest.raises(ValueError, match="2 keys"):
        store_server.multi_set(["a", "b"], [b"1"])


def test_values_of_64_mib_round_trip(store_server, client):
    big = bytes(range(256)) * (1 << 18)
    client.set("big", big)
    assert store_server.get("big") == big


def test_value_over_the_limit_is_refused_before_sending():
    with TCPStore("127.0.0.1", 0, is_server=True, timeout=10, max_value_bytes=1024) as s:
        with pytest.raises(ValueError, match="exceeds the store's limit of 1024"):
            s.set("k", bytes(1025))
        s.set("k", bytes(1024))
        assert len(s.get("k")) == 1024


def test_multi_set_larger_than_one_frame_is_refused_before_sending():
    with TCPStore("127.0.0.1", 0, is_server=True, timeout=10, max_value_bytes=1 << 20) as s:
        with pytest.raises(ValueError, match="multi_set.*split it"):
            s.multi_set(["a", "b"], [bytes(1 << 20), bytes(1 << 20)])
        s.multi_set(["a"], [bytes(1 << 20)])
        assert len(s.get("a")) == 1 << 20


def test_non_str_key_is_a_type_error(store_server):
    with pytest.raises(TypeError, match="keys are str"):
        store_server.set(b"k", b"v")


def test_non_bytes_value_is_a_type_error(store_server):
    with pytest.raises(TypeError, match="bytes or str"):
        store_server.set("k", 5)


def test_negative_timeout_is_a_value_error(store_server):
    with pytest.raises(ValueError, match="timeout"):
        store_server.get("k", timeout=-1)


def test_client_needs_a_real_port():
    with pytest.raises(ValueError, match="port=0"):
        TCPStore("127.0.0.1", 0)


def test_calls_after_close_raise_store_error(store_server):
    c = TCPStore("127.0.0.1", store_server.port, timeout=5)
    c.close()
    c.close()  # idempotent
    with pytest.raises(StoreError, match="closed"):
        c.get("k")


def test_context_manager_closes_the_server():
    with TCPStore("127.0.0.1", 0, is_server=True, timeout=5) as s:
        port = s.port
    with pytest.raises(StoreTimeout, match=f"127.0.0.1:{port}"):
        TCPStore("127.0.0.1", port, timeout=0.3)


@pytest.mark.filterwarnings("ignore:gpucoll store on .* has no token")
def test_server_on_the_wildcard_address_is_its_own_client():
    with TCPStore("0.0.0.0", 0, is_server=True, timeout=5) as s:
        s.set("k", b"v")
        assert s.get("k") == b"v"


def test_parse_address_reads_tcp_urls():
    assert parse_address("tcp://node1:29500") == ("node1", 29500)
    assert parse_address("[::1]:7") == ("::1", 7)
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        parse_address("node1")


def test_waiters_on_the_same_keys_time_out_independently(store_server, client):
    got = []
    t = threading.Thread(target=lambda: got.append(client.multi_get(["s1", "s2"], timeout=20)))
    t.start()
    with pytest.raises(StoreTimeout, match="'s2'"):
        store_server.wait(["s1", "s2"], timeout=0.1)
    store_server.multi_set(["s1", "s2"], [b"1", b"2"])
    t.join(30)
    assert got == [[b"1", b"2"]]


def test_wait_after_a_timed_out_wait_on_the_same_keys_still_completes(store_server, client):
    with pytest.raises(StoreTimeout):
        store_server.wait(["again"], timeout=0.05)
    done = []
    t = threading.Thread(target=lambda: done.append(client.wait(["again"], timeout=20)))
    t.start()
    store_server.set("again", b"1")
    t.join(30)
    assert done == [None]


def test_get_and_wait_of_the_same_key_each_get_their_own_reply(store_server, client):
    got = []
    t1 = threading.Thread(target=lambda: got.append(("get", client.get("both", timeout=20))))
    t2 = threading.Thread(target=lambda: got.append(("wait", client.wait(["both"], timeout=20))))
    t1.start()
    t2.start()
    store_server.set("both", b"B")
    t1.join(30)
    t2.join(30)
    assert sorted(got) == [("get", b"B"), ("wait", None)]


def test_multi_get_never_returns_a_key_deleted_before_it_completes(store_server):
    store_server.set("d1", b"1")
    store_server.delete_key("d1")
    with pytest.raises(StoreTimeout, match="'d1'"):
        store_server.multi_get(["d1"], timeout=0.1)


def test_bytes_in_a_key_list_is_a_type_error(store_server):
    with pytest.raises(TypeError, match="bytes b'k'"):
        store_server.check(["a", b"k"])


def _has_ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback here")
def test_store_on_ipv6_loopback():
    with TCPStore("::1", 0, is_server=True, timeout=10) as s:
        with TCPStore("::1", s.port, timeout=10) as c:
            c.set("k", b"v6")
            assert s.get("k") == b"v6"


def test_multi_get_of_values_larger_together_than_the_value_limit():
    with TCPStore("127.0.0.1", 0, is_server=True, timeout=20, max_value_bytes=1 << 20) as s:
        s.set("a", bytes(1 << 20))
        s.set("b", b"\x01" * (1 << 20))
        a, b = s.multi_get(["a", "b"])
        assert (len(a), len(b), b[:1]) == (1 << 20, 1 << 20, b"\x01")


def test_compare_set_of_two_values_at_the_limit():
    with TCPStore("127.0.0.1", 0, is_server=True, timeout=20, max_value_bytes=1 << 20) as s:
        old, new = bytes(1 << 20), b"\x01" * (1 << 20)
        s.set("k", old)
        assert s.compare_set("k", old, new) == new


def test_sets_sent_just_before_close_are_applied(store_server):
    for i in range(20):
        c = TCPStore("127.0.0.1", store_server.port, timeout=10)
        c.set(f"last-words/{i}", b"x" * 1000)
        c.close()
    assert store_server.check([f"last-words/{i}" for i in range(20)])


def test_answered_waits_do_not_pile_up_behind_a_long_one(store_server):
    """A wait that never ends (say, for an abort key) must not keep every later answered
    wait's bookkeeping alive in the server."""
    import socket

    from gpucoll.store.protocol import HEADER, VERSION, Op, encode, pack_timeout

    server = store_server._server
    sock = socket.create_connection(("127.0.0.1", store_server.port), timeout=30)
    sock.sendall(encode(Op.HELLO, 1, [VERSION, b""])[0])
    sock.recv(1024)
    sock.sendall(encode(Op.WAIT, 2, [pack_timeout(600), b"abort"])[0])
    for rnd in range(3):
        keys = [f"r{rnd}/{i}".encode() for i in range(5000)]
        sock.sendall(b"".join(encode(Op.GET, 10 + i, [pack_timeout(600), k])[0]
                              for i, k in enumerate(keys)))
        store_server.multi_set([k.decode() for k in keys], [b"1"] * len(keys))
        got = 0
        buf = b""
        while got < len(keys):  # read every reply: all gets answered
            buf += sock.recv(1 << 16)
            while len(buf) >= HEADER.size and len(buf) >= HEADER.size + HEADER.unpack_from(
                    buf)[0]:
                buf = buf[HEADER.size + HEADER.unpack_from(buf)[0]:]
                got += 1
    sock.close()
    assert len(server._timers) < 10000  # 15000 answered entries would be there otherwise


def test_timed_out_waits_leave_nothing_parked(store_server):
    server = store_server._server
    for i in range(20):
        with pytest.raises(StoreTimeout):
            store_server.wait([f"never/{i}"], timeout=0.01)
    assert not any(k.startswith(b"never/") for k in server._parked)
    assert not server._watches
