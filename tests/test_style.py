"""Project-wide rules: lint-clean code, a CLI that lists its commands, a cheap import."""

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is not installed")
def test_ruff_finds_nothing():
    paths = [p for p in ("gpucoll", "tests", "benchmarks", "examples") if (ROOT / p).exists()]
    proc = subprocess.run(["ruff", "check", "--quiet", *paths], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_cli_lists_every_command():
    from gpucoll.__main__ import COMMANDS, usage

    text = usage()
    assert all(name in text for name in COMMANDS)


def test_import_gpucoll_touches_no_cuda_library():
    code = (
        "import sys, gpucoll; gpucoll.ReduceOp; gpucoll.GpucollError; gpucoll.NcclFailure; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('cupy', 'torch', 'nccl') "
        "or m.startswith('cuda.')))"  # cuda-bindings' .pth file imports the bare namespace
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_documented_submodules_load_on_first_attribute_access():
    code = "import gpucoll; print(gpucoll.rendezvous.from_env.__name__, gpucoll.store.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["from_env", "gpucoll.store"]
