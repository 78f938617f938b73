"""Shared fixtures: a store per test on a free port, the rule that `gpu` tests need CUDA, and
the rule that `image` tests (container builds, many minutes) run only when asked for by name:
``python -m pytest -m image``."""

from __future__ import annotations

import functools
import os
import pathlib
import sys

import pytest

# The modules tests share (the spawn helper, the emulations, case tables) live in tests/helpers/;
# tests import them by their own names, and so do the ranks they start
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "helpers"))

# Thousands of ranks start in a run: with PYTHONDONTWRITEBYTECODE (set on some machines) each
# would compile the package anew, a third of the fast tier's time. Compiled once, then read.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


@functools.cache
def cuda_available() -> bool:
    """True when CuPy sees at least one CUDA device (never raises)."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if "image" not in (config.option.markexpr or ""):
        later = pytest.mark.skip(reason="builds container images (many minutes): run it with "
                                 "`python -m pytest -m image`")
        for item in items:
            if "image" in item.keywords:
                item.add_marker(later)
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; this machine has none")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not keywords: a folder may be "gpu"
            item.add_marker(skip)


@pytest.fixture
def store_server():
    """A TCPStore server of this test's own on 127.0.0.1, port chosen by the OS."""
    from gpucoll import TCPStore

    server = TCPStore("127.0.0.1", 0, is_server=True, timeout=30.0)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def store_addr(store_server) -> str:
    """The address ``tcp://127.0.0.1:PORT`` of this test's store, for ranks to meet at."""
    return f"tcp://127.0.0.1:{store_server.port}"


@pytest.fixture
def rt(store_addr):
    """The emulated CUDA runtime and NCCL (two devices) in place of the real ones for this test."""
    from nccl_emulation import EmulatedRuntime

    from gpucoll import cuda

    runtime = EmulatedRuntime(store_addr, devices=2, hang_timeout=10)
    with cuda.use_runtime(runtime):
        yield runtime
    runtime.close()
