"""PrefixStore: namespaces inside one store."""

from __future__ import annotations

import threading

import pytest

from gpucoll import PrefixStore, StoreTimeout


def test_keys_land_under_the_prefix(store_server):
    PrefixStore("job1", store_server).set("k", b"v")
    assert store_server.get("job1/k") == b"v"
    assert not store_server.check(["k"])


def test_two_namespaces_do_not_collide(store_server):
    a, b = PrefixStore("a", store_server), PrefixStore("b", store_server)
    a.set("k", b"from a")
    b.set("k", b"from b")
    assert (a.get("k"), b.get("k")) == (b"from a", b"from b")


def test_nested_prefixes_join_with_slashes(store_server):
    inner = PrefixStore("sub", PrefixStore("outer", store_server))
    inner.set("k", b"v")
    assert store_server.get("outer/sub/k") == b"v"


def test_add_and_compare_set_are_namespaced(store_server):
    p = PrefixStore("ns", store_server)
    assert p.add("n", 2) == 2
    assert p.compare_set("c", b"", b"x") == b"x"
    assert store_server.multi_get(["ns/n", "ns/c"]) == [b"2", b"x"]


def test_wait_check_and_delete_are_namespaced(store_server):
    p = PrefixStore("ns", store_server)
    store_server.set("ns/w", b"1")
    p.wait(["w"], timeout=5)
    assert p.check(["w"]) and not p.check(["other"])
    assert p.delete_key("w") and not store_server.check(["ns/w"])


def test_multi_set_and_multi_get_are_namespaced(store_server):
    p = PrefixStore("ns", store_server)
    p.multi_set(["x", "y"], [b"1", b"2"])
    assert p.multi_get(["y", "x"]) == [b"2", b"1"]
    assert store_server.get("ns/x") == b"1"


def test_get_blocks_and_times_out_with_the_full_key(store_server):
    with pytest.raises(StoreTimeout, match="ns/missing"):
        PrefixStore("ns", store_server).get("missing", timeout=0.1)


def test_wait_blocks_until_set_through_another_namespace_object(store_server):
    done = []
    p = PrefixStore("ns", store_server)
    t = threading.Thread(target=lambda: done.append(p.wait(["late"], timeout=20)))
    t.start()
    PrefixStore("ns", store_server).set("late", b"1")
    t.join(30)
    assert done == [None]


def test_peek_is_namespaced(store_server):
    store_server.multi_set(["ns/a", "a"], [b"inside", b"outside"])
    assert PrefixStore("ns", store_server).peek(["a", "b"]) == [b"inside", None]


def test_delete_prefix_deletes_within_the_namespace_only(store_server):
    store_server.multi_set(["ns/x/1", "ns/x/2", "ns/y", "nsx", "x/1"], [b"v"] * 5)
    space = PrefixStore("ns", store_server)
    assert space.delete_prefix("x/") == 2
    assert space.delete_prefix("") == 1
    assert store_server.peek(["nsx", "x/1"]) == [b"v", b"v"]


def test_nested_delete_prefix_keeps_to_the_inner_namespace(store_server):
    store_server.multi_set(["a/b/1", "a/c/1"], [b"v", b"v"])
    assert PrefixStore("b", PrefixStore("a", store_server)).delete_prefix("") == 1
    assert store_server.check(["a/c/1"])


def test_num_keys_counts_the_whole_store(store_server):
    store_server.set("outside", b"1")
    p = PrefixStore("ns", store_server)
    p.set("inside", b"1")
    assert p.num_keys() == store_server.num_keys()


def test_close_leaves_the_underlying_store_open(store_server):
    with PrefixStore("ns", store_server) as p:
        p.set("k", b"v")
    assert store_server.get("ns/k") == b"v"


def test_empty_prefix_is_refused(store_server):
    with pytest.raises(ValueError, match="prefix"):
        PrefixStore("", store_server)


def test_non_str_key_is_a_type_error(store_server):
    with pytest.raises(TypeError, match="keys are str"):
        PrefixStore("ns", store_server).get(3)


def test_single_string_as_key_list_is_a_type_error(store_server):
    with pytest.raises(TypeError, match="list of str"):
        PrefixStore("ns", store_server).wait("abc")
