"""``gpucoll store`` serves a standalone store that ranks reach over TCP."""

from __future__ import annotations

import pytest
from store_wire import standalone_store

from gpucoll import StoreError, TCPStore


@pytest.fixture
def standalone():
    with standalone_store("--token", "tok") as store:
        yield store


def test_standalone_store_prints_its_address_and_serves(standalone):
    assert standalone.banner.startswith("gpucoll store: serving tcp://127.0.0.1:")
    with TCPStore("127.0.0.1", standalone.port, timeout=20, token="tok") as c:
        c.set("k", b"v")
        assert c.get("k") == b"v"


def test_standalone_store_requires_its_token(standalone):
    with pytest.raises(StoreError, match="token"):
        TCPStore("127.0.0.1", standalone.port, timeout=20, token="wrong")


def test_standalone_store_exits_cleanly_on_sigterm(standalone):
    standalone.proc.terminate()
    assert standalone.proc.wait(timeout=20) == 0
