"""A garbled variable is an error naming it before a rank waits for anyone: each case starts rank
0 of 2 with a long deadline and no rank 1, so an unchecked variable would show as a wait."""

from __future__ import annotations

import time

import pytest

import gpucoll

BAD = [
    ("GPUCOLL_TIMEOUT", "soon", "GPUCOLL_TIMEOUT='soon'"),
    ("GPUCOLL_TIMEOUT", "-5", "GPUCOLL_TIMEOUT must be a positive"),
    ("GPUCOLL_NATIVE", "maybe", "GPUCOLL_NATIVE='maybe'"),
    ("GPUCOLL_SHM_RING_BYTES", "2MB", "GPUCOLL_SHM_RING_BYTES='2MB'"),
    ("GPUCOLL_SHM_RING_BYTES", "16", "GPUCOLL_SHM_RING_BYTES='16'"),
    ("GPUCOLL_TRANSPORT", "infiniband", "GPUCOLL_TRANSPORT='infiniband'"),
    ("GPUCOLL_LINK_TIMEOUT", "15s", "GPUCOLL_LINK_TIMEOUT='15s'"),
    ("GPUCOLL_LINK_TIMEOUT", "1", "GPUCOLL_LINK_TIMEOUT='1'.*from 3 to 86400"),
]


@pytest.mark.parametrize("var, value, words", BAD, ids=[f"{v}={x}" for v, x, _ in BAD])
def test_a_garbled_variable_fails_init_at_once_naming_it(monkeypatch, store_addr, var, value,
                                                          words):
    monkeypatch.setenv(var, value)
    start = time.monotonic()
    with pytest.raises(ValueError, match=words):
        gpucoll.init("ring", rank=0, world_size=2, store=store_addr,
                     timeout=None if var == "GPUCOLL_TIMEOUT" else 60)
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("env, words", [
    ({"GPUCOLL_WORLD_SIZE": "1000000000"}, "GPUCOLL_WORLD_SIZE=1000000000 is more ranks"),
    ({"GPUCOLL_WORLD_SIZE": "2", "GPUCOLL_STORE": "http://h:1"}, "GPUCOLL_STORE: .*'http://h:1'"),
], ids=["a-billion-ranks", "an-http-store"])
def test_a_launcher_environment_that_cannot_be_right_fails_init_at_once(monkeypatch, env, words):
    monkeypatch.setenv("GPUCOLL_RANK", "0")
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    start = time.monotonic()
    with pytest.raises(gpucoll.RendezvousError, match=words):
        gpucoll.init("ring", timeout=60)
    assert time.monotonic() - start < 5


def test_a_world_size_argument_beyond_the_limit_is_refused_before_the_store_is_asked():
    from gpucoll.rendezvous import MAX_WORLD_SIZE

    with pytest.raises(ValueError, match=f"world_size={MAX_WORLD_SIZE + 1} is more ranks"):
        gpucoll.init("ring", rank=0, world_size=MAX_WORLD_SIZE + 1, store="tcp://127.0.0.1:9")
