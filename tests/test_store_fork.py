"""Stores across fork() and the death of the process hosting the store.

A forked child (a data loader, say) must not keep its parent's store connections or server
sockets open: the parent's death has to end them, firing its wills and failing the clients of
its server at once. The child cannot use what it inherited and is told so.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import threading
import time

import pytest

from gpucoll import StoreError, StoreTimeout, TCPStore


def until(condition, timeout: float = 20.0) -> None:
    """Wait for ``condition()`` to hold (a state another thread or process reaches)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def in_child(fn) -> bytes:
    """Run ``fn()`` (returning up to 1000 bytes) in a forked child; its result, or b"hang"."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the test runner
        try:
            out = fn()
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            out = f"{type(exc).__name__}: {exc}".encode()
        os.write(w, out[:1000])
        os._exit(0)
    os.close(w)
    try:
        ready, _, _ = select.select([r], [], [], 30)
        return os.read(r, 1000) if ready else b"hang"
    finally:
        os.close(r)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, ChildProcessError):
        os.kill(pid, signal.SIGKILL)


# ----------------------------------------------------------------------------- the child's side
def _use(store: TCPStore) -> bytes:
    try:
        store.add("n", 1)
    except StoreError as exc:
        store.close()  # closing what it inherited is silent
        return str(exc).encode()
    return b"the inherited store answered"


def test_a_forked_child_cannot_use_the_parents_store_and_is_told_why(store_server):
    with TCPStore("127.0.0.1", store_server.port, timeout=30) as store:
        said = in_child(lambda: _use(store))
        assert b"inherited across fork()" in said and b"TCPStore of its own" in said
        assert b"add('n')" in said
        assert store.add("n", 1) == 1  # the parent's connection is untouched


def test_a_forked_child_is_told_at_once_even_while_a_parent_thread_was_waiting(store_server):
    with TCPStore("127.0.0.1", store_server.port, timeout=30) as store:
        got = []
        waiter = threading.Thread(target=lambda: got.append(store.get("later", timeout=30)))
        waiter.start()
        until(lambda: store._conn._reading)  # the thread is inside the call, holding the reader
        said = in_child(lambda: _use(store))
        store_server.set("later", b"v")
        waiter.join(40)
        assert b"inherited across fork()" in said
        assert got == [b"v"]


def test_a_child_of_the_hosting_process_cannot_use_the_server_either():
    with TCPStore("127.0.0.1", 0, is_server=True, timeout=30) as host:
        said = in_child(lambda: _use(host))
        assert b"inherited across fork()" in said
        assert host.add("n", 1) == 1


_CHILD_EXITS_NORMALLY = """
import os, sys, threading
from gpucoll import StoreError, TCPStore
host = TCPStore("127.0.0.1", 0, is_server=True, timeout=30)
client = TCPStore("127.0.0.1", host.port, timeout=30)
threading.Thread(target=lambda: client.get("never", timeout=30), daemon=True).start()
while not client._conn._reading:
    pass
pid = os.fork()
if pid == 0:
    try:
        client.add("n", 1)
    except StoreError:
        sys.exit(0)  # a normal interpreter exit, with everything inherited still around
    sys.exit(3)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status), flush=True)
os._exit(0)
"""


def test_a_forked_child_exits_normally_while_a_parent_thread_was_reading():
    out = subprocess.run([sys.executable, "-c", _CHILD_EXITS_NORMALLY], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0", out.stderr
    assert "Fatal Python error" not in out.stderr


# ----------------------------------------------------------------------------- the parent's death
_WILL_THEN_FORK_THEN_DIE = """
import os, signal, sys, time
from gpucoll import TCPStore
store = TCPStore("127.0.0.1", int(sys.argv[1]), timeout=30)
store.set_will("gone/parent", b"died")
child = os.fork()
if child == 0:
    time.sleep(120)  # a data loader outliving its parent
    os._exit(0)
store.set("child", str(child))
store.add("sync", 1)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_the_parents_wills_fire_when_it_dies_while_its_forked_child_lives(store_server):
    proc = subprocess.Popen([sys.executable, "-c", _WILL_THEN_FORK_THEN_DIE,
                             str(store_server.port)])
    child = None
    try:
        child = int(store_server.get("child", timeout=60))
        assert proc.wait(timeout=60) == -signal.SIGKILL
        os.kill(child, 0)  # the child still lives
        assert store_server.get("gone/parent", timeout=20) == b"died"
    finally:
        kill(proc.pid)
        proc.wait()
        if child is not None:
            kill(child)


_HOST = """
import os, sys, time
from gpucoll import TCPStore
store = TCPStore("127.0.0.1", 0, is_server=True, timeout=60)
print(store.port, flush=True)
child = 0
if sys.stdin.readline().strip() == "fork":  # once the clients are connected and waiting
    child = os.fork()
    if child == 0:
        time.sleep(120)  # a data loader outliving its parent
        os._exit(0)
print(child, flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("forked", ["alone", "fork"])
def test_clients_waiting_in_the_store_fail_at_once_when_its_host_dies(forked):
    proc = subprocess.Popen([sys.executable, "-c", _HOST], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    child = 0
    try:
        port = int(proc.stdout.readline())
        client = TCPStore("127.0.0.1", port, timeout=120)
        errors: list[BaseException] = []

        def call(fn):
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - collected for the test
                errors.append(exc)

        calls = [lambda: client.get("never", timeout=120),
                 lambda: client.wait(["never/a", "never/b"], timeout=120)]
        threads = [threading.Thread(target=call, args=(fn,)) for fn in calls]
        for t in threads:
            t.start()
        until(lambda: len(client._conn._pending) == 2)
        proc.stdin.write(forked + "\n")
        proc.stdin.flush()
        child = int(proc.stdout.readline())
        start = time.monotonic()
        proc.kill()
        for t in threads:
            t.join(60)
        elapsed = time.monotonic() - start
        assert len(errors) == 2, errors
        for exc in errors:
            assert isinstance(exc, StoreError) and not isinstance(exc, StoreTimeout), exc
            assert f"lost the connection to the store at 127.0.0.1:{port}" in str(exc)
        assert elapsed < 30, f"the waiting calls took {elapsed:.1f} s to fail (timeout 120 s)"
        with pytest.raises(StoreError, match="lost the connection"):
            client.add("n", 1)
        client.close()
    finally:
        kill(proc.pid)
        proc.wait()
        if child:
            kill(child)
