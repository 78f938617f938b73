"""Helpers for tests that talk to a store the hard way: raw sockets speaking the wire format, and
a standalone ``gpucoll store`` process whose memory a test can read."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
from typing import NamedTuple

from gpucoll.store import parse_address
from gpucoll.store.protocol import HEADER, VERSION, Frame, Op, encode


def raw_connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def read_frame(sock: socket.socket) -> Frame | None:
    """One whole reply frame from a raw socket, or None if the server closed it."""
    head = _read_exact(sock, HEADER.size)
    if head is None:
        return None
    plen, code, rid, argc = HEADER.unpack(head)
    payload = _read_exact(sock, plen)
    return None if payload is None else Frame(code, rid, argc, payload)


def _read_exact(sock: socket.socket, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        try:
            chunk = sock.recv(n - len(data))
        except ConnectionResetError:
            return None
        if not chunk:
            return None
        data += chunk
    return data


def closed_by_server(sock: socket.socket) -> bool:
    """True once the server has closed this connection (drains anything it sent first)."""
    while True:
        try:
            if not sock.recv(65536):
                return True
        except ConnectionResetError:
            return True


def hello(sock: socket.socket, token: str = "") -> Frame:
    sock.sendall(encode(Op.HELLO, 1, [VERSION, token.encode()])[0])
    return read_frame(sock)


def rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` (Linux /proc)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


class Standalone(NamedTuple):
    proc: subprocess.Popen
    port: int
    banner: str  # the line it printed when it started


@contextlib.contextmanager
def standalone_store(*args: str):
    """A ``gpucoll store`` process on 127.0.0.1 (any free port) with extra CLI ``args``;
    yields a Standalone and stops the process afterwards whatever happened."""
    proc = subprocess.Popen([sys.executable, "-m", "gpucoll", "store", "--host", "127.0.0.1",
                             "--port", "0", *args], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "serving" in line, f"store did not start: {line!r}"
        yield Standalone(proc, parse_address(line.split()[3])[1], line)
    finally:
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
