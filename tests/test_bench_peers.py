"""The peers' adapters run the same cases as gpucoll's and pass the same correctness pass."""

from __future__ import annotations

import importlib.util

import pytest
from multiproc import spawn

from gpucoll.bench import libraries
from gpucoll.bench.engine import Case, Engine, HostMemory
from gpucoll.bench.options import parse_args

pytestmark = pytest.mark.slow  # gloo and Open MPI beside gpucoll

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                 reason="torch is not installed")

CASES = [Case("all_reduce", 4096, "float", "sum", -1), Case("all_reduce", 64, "int32", "max", -1),
         Case("all_gather", 4096, "float", "none", -1),
         Case("reduce_scatter", 4096, "float", "sum", -1),
         Case("broadcast", 4096, "float", "none", 1), Case("reduce", 4096, "float", "sum", 1),
         Case("all_to_all", 4096, "float", "none", -1), Case("sendrecv", 4096, "float", "none", -1)]


def _gloo_rank(rank, n, store_file):
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(n))
    lib = libraries.GlooLibrary(30.0, init_method=f"file://{store_file}")
    engine = Engine(lib, HostMemory(), parse_args(["-n", "2", "-w", "1"]))
    try:
        return [engine.run(c) for c in CASES]
    finally:
        lib.close()


@needs_torch
@pytest.mark.slow
def test_gloo_runs_every_operation_correctly_on_two_ranks(tmp_path):
    results = spawn(_gloo_rank, 2, str(tmp_path / "gloo-store"), timeout=90)[0]
    for case, r in zip(CASES, results, strict=True):
        measured = [m for m in (r.out_of_place, r.in_place) if m is not None]
        assert measured, case
        assert all(m.wrong == 0 for m in measured), (case, r)
    # torch.distributed's all_reduce has no out-of-place form: shown as not measured
    assert results[0].out_of_place is None and results[0].in_place.wrong == 0


def test_a_missing_peer_says_why():
    assert libraries.peer_available("nccl-tests") == "unknown peer 'nccl-tests'"


def test_mpi_needs_mpirun(monkeypatch):
    monkeypatch.setattr(libraries.shutil, "which", lambda name: None)
    reason = libraries.peer_available("mpi")
    assert reason in ("mpirun is not on PATH", "mpi4py is not installed")


def test_versions_name_a_module_run_from_a_source_tree_by_its_own_version(monkeypatch):
    from importlib import metadata

    import gpucoll

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    got = libraries.versions("gpucoll", "no_such_module_here")
    assert got["gpucoll"] == gpucoll.__version__ and "no_such_module_here" not in got


def test_gloo_runs_torch_nccl_on_device_memory_only_where_every_local_rank_has_a_gpu(
        monkeypatch):
    import sys
    import types

    from gpucoll.bench import cli

    torch = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: True,
                                                             device_count=lambda: 1))
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setattr(cli, "device_available", lambda: True)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    auto = parse_args(["all_reduce"])
    monkeypatch.setenv("WORLD_SIZE", "2")  # two ranks would share the one GPU
    assert not cli.wants_device(auto)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # one rank on each of two hosts
    assert cli.wants_device(auto)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert cli.wants_device(parse_args(["all_reduce", "--memory", "device"]))
    assert not cli.wants_device(parse_args(["all_reduce", "--memory", "host"]))
