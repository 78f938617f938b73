"""``gpucoll store`` serves a standalone store that ranks reach over TCP."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gpucoll import StoreError, TCPStore
from gpucoll.store import parse_address


@pytest.fixture
def standalone():
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpucoll", "store", "--host", "127.0.0.1", "--port", "0",
         "--token", "tok"], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        yield proc, line
    finally:
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def test_standalone_store_prints_its_address_and_serves(standalone):
    proc, line = standalone
    assert line.startswith("gpucoll store: serving tcp://127.0.0.1:")
    host, port = parse_address(line.split()[3])
    with TCPStore(host, port, timeout=20, token="tok") as c:
        c.set("k", b"v")
        assert c.get("k") == b"v"


def test_standalone_store_requires_its_token(standalone):
    _, line = standalone
    host, port = parse_address(line.split()[3])
    with pytest.raises(StoreError, match="token"):
        TCPStore(host, port, timeout=20, token="wrong")


def test_standalone_store_exits_cleanly_on_sigterm(standalone):
    proc, line = standalone
    assert "serving" in line
    proc.terminate()
    assert proc.wait(timeout=20) == 0
