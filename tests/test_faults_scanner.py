"""A port scanner or health check beside a starting job: connections to a rank's listeners that
close at once, send garbage or send nothing are dropped while set-up goes on, and the job's
results stay exact. The scanner finds the listeners where the ranks publish them in the store
(their TCP port and abstract Unix socket), so it touches no other process's ports."""

from __future__ import annotations

import json
import socket
import threading
import time

import numpy as np
import pytest
from multiproc import spawn
from test_ring import open_backend, ref
from tiers import grid

from gpucoll import TCPStore
from gpucoll.ops import ReduceOp
from gpucoll.transport.mesh import HELLO

pytestmark = pytest.mark.timeout(120)

GARBAGE = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(range(256))


def _reduce_exactly(rank, n, addr, transport, calls):
    """Set up beside the scanner (the last rank comes a second late, so the others wait in
    set-up meanwhile), then all_reduce exact integers ``calls`` times."""
    if rank == n - 1:
        time.sleep(1.0)
    store, b = open_backend(rank, n, addr, transport, timeout=30)
    try:
        for i in range(calls):
            x = np.full(1000 + 37 * i, rank + i, np.float64)
            b.all_reduce(ref(x), ReduceOp.SUM, timeout=30)
            want = n * i + n * (n - 1) / 2
            assert np.all(x == want), f"call {i}: got {x[:3]}, want {want}"
        return b._mesh.strays
    finally:
        b.close()
        store.close()


class Scanner:
    """Connects to every listener the ranks publish, over and over, until stopped: each
    connection closes at once, sends garbage (or a hello's length of it), or stays silent and
    open (those are closed when the scanner stops)."""

    def __init__(self, store_port: int, n: int):
        self.store_port, self.n = store_port, n
        self.stop = threading.Event()
        self.connections = 0
        self.silent: list[socket.socket] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Scanner:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(30)
        for sock in self.silent:
            sock.close()

    def _targets(self, store: TCPStore) -> list:
        found = []
        for r in range(self.n):
            key = f"ring/ring/addr/{r}"
            if store.check([key]):
                addr = json.loads(store.get(key))
                found += [(socket.AF_INET, ("127.0.0.1", addr["port"])),
                          (socket.AF_UNIX, "\0" + addr["unix"])]
        return found

    def _run(self) -> None:
        with TCPStore("127.0.0.1", self.store_port, timeout=10) as store:
            kind = 0
            while not self.stop.is_set():
                for family, address in self._targets(store):
                    kind += 1
                    sock = socket.socket(family, socket.SOCK_STREAM)
                    sock.settimeout(1)
                    try:
                        sock.connect(address)
                        if kind % 4 == 1:
                            sock.sendall(GARBAGE)
                        elif kind % 4 == 2:
                            sock.sendall(GARBAGE[:HELLO.size])
                        elif kind % 4 == 3 and len(self.silent) < 64:
                            self.silent.append(sock)
                            sock = None
                        self.connections += 1
                    except OSError:
                        pass  # the rank has closed its listeners: set-up is over
                    finally:
                        if sock is not None:
                            sock.close()
                time.sleep(0.002)


def _scanned_job(n, transport, calls=20):
    """Run a job of ``n`` ranks on a store of its own beside a scanner: (the scanner's
    connections, each rank's count of dropped connections)."""
    with TCPStore("127.0.0.1", 0, is_server=True, timeout=30.0) as server, \
            Scanner(server.port, n) as scanner:
        strays = spawn(_reduce_exactly, n, f"tcp://127.0.0.1:{server.port}", transport, calls,
                       timeout=90)
    return scanner.connections, strays


@pytest.mark.parametrize("transport", grid(["shm", "tcp"], "shm"))
def test_a_scanner_hitting_every_listener_during_set_up_does_not_stop_the_job(transport):
    connections, strays = _scanned_job(2, transport)
    assert connections > 0  # the scanner did reach the listeners during set-up
    assert sum(strays) > 0  # and the ranks dropped its connections, counting them


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_six_ranks_start_beside_a_scanner_five_times_in_a_row(transport):
    for attempt in range(5):
        _, strays = _scanned_job(6, transport, calls=5)
        assert sum(strays) > 0, f"attempt {attempt}: the scanner reached no listener"
