"""A missing optional package gives one line naming the extra of gpucoll to install, never a
traceback. Absence is simulated in a subprocess (``sys.modules[name] = None`` makes every import
of it fail)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import gpucoll
from gpucoll.errors import GpucollError, MissingPackage, install_hint, require

TOPOLOGY = os.path.join(os.path.dirname(__file__), "data", "topology")


def gpucoll_without(module: str, *argv: str, cwd=None) -> subprocess.CompletedProcess:
    """``gpucoll ARGV...`` in a subprocess where ``module`` cannot be imported."""
    code = (f"import sys; sys.modules[{module!r}] = None\n"
            "from gpucoll.__main__ import main\n"
            f"sys.exit(main({list(argv)!r}))\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=cwd)


def one_line_error(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_topo_png_without_matplotlib_names_the_topo_extra(tmp_path):
    saved = os.path.join(TOPOLOGY, sorted(os.listdir(TOPOLOGY))[0])
    done = gpucoll_without("matplotlib", "topo", "--from", saved, "--png",
                           str(tmp_path / "t.png"))
    assert one_line_error(done) == ('gpucoll topo: error: topo --png needs matplotlib, which is '
                                    'not installed: pip install "gpucoll[topo]"')
    assert not (tmp_path / "t.png").exists()


def test_bench_all_datatypes_without_ml_dtypes_names_the_cuda12_extra():
    done = gpucoll_without("ml_dtypes", "bench", "-d", "all", "-b", "8", "-e", "8")
    assert one_line_error(done) == ('gpucoll bench: error: datatype bfloat16 needs ml_dtypes, '
                                    'which is not installed: pip install "gpucoll[cuda12]"')


def test_bench_plot_without_matplotlib_is_one_line(tmp_path):
    done = gpucoll_without("matplotlib", "bench", "-b", "8", "-e", "8", "--plot",
                           str(tmp_path / "p.png"))
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip() == ('gpucoll bench: error: --plot needs matplotlib, which is not '
                                   'installed: pip install "gpucoll[topo]"')


def test_require_returns_the_module_when_it_is_there():
    assert require("os", "anything") is os


def test_the_error_is_an_import_error_and_a_gpucoll_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingPackage) as info:
        require("matplotlib", "drawing")
    assert isinstance(info.value, ImportError) and isinstance(info.value, GpucollError)
    assert str(info.value) == ('drawing needs matplotlib, which is not installed: '
                               'pip install "gpucoll[topo]"')


@pytest.mark.parametrize(("module", "hint"), [
    ("pynvml", 'pip install "gpucoll[topo]"'),
    ("cupy", 'pip install "gpucoll[cuda12]"'),
    ("torch", "pip install torch"),
    ("mpi4py.MPI", "pip install mpi4py"),
])
def test_each_optional_package_has_its_install_command(module, hint):
    assert install_hint(module) == hint


def test_the_extras_named_exist_in_the_project():
    import re

    root = os.path.dirname(os.path.dirname(os.path.abspath(gpucoll.__file__)))
    with open(os.path.join(root, "pyproject.toml")) as f:
        text = f.read()
    from gpucoll.errors import PACKAGES

    for package, extra in PACKAGES.values():
        if extra is not None:
            block = re.search(rf"^{extra} = \[(.*?)\]", text, re.S | re.M)
            assert block and f'"{package}' in block.group(1), (extra, package)
