"""Which small-message exchange the ranks load, said by ``gpucoll info`` and by the first line of
``gpucoll run``: the compiled one, or the Python one and why, with the command that builds the
compiled one where a source tree lacks it (a script saved at a tree's root imports that tree)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from launch_helpers import launching, write_script

import gpucoll
from gpucoll.transport import shm

pytestmark = pytest.mark.timeout(60)

PACKAGE = os.path.dirname(os.path.abspath(gpucoll.__file__))
ROOT = os.path.dirname(PACKAGE)
needs_fast = pytest.mark.skipif(shm._shmfast is None, reason="the compiled exchange was not built")
REPORT = """
    import gpucoll
    from gpucoll.transport import shm
    print("LOADED", gpucoll.__file__, shm._shmfast is not None, flush=True)
"""


@pytest.fixture
def tree(tmp_path):
    """A source tree whose package was never built: this one's files, without the compiled
    exchange."""
    root = tmp_path / "src"
    shutil.copytree(PACKAGE, root / "gpucoll",
                    ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__"))
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), root)
    return root


def _env(**more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "GPUCOLL_NATIVE")}
    return {**env, **more}


def _info(cwd, **env: str) -> str:
    return subprocess.run([sys.executable, "-m", "gpucoll", "info"], cwd=str(cwd),
                          env=_env(**env), capture_output=True, text=True, timeout=50,
                          check=True).stdout


def _run(cwd, script: str, **env: str) -> tuple[list[str], list[str]]:
    """The launcher's own lines and the ranks' LOADED lines of a 2-rank job."""
    with launching(cwd) as start:
        job = start(["-n", "2", script], env=_env(**env))
        assert job.finish(50) == 0, job.text()
    ours = [line for line in job.err().splitlines() if line.startswith("gpucoll run:")]
    return ours, [line for line in job.out().splitlines() if "LOADED" in line]


def test_a_source_tree_without_it_gets_the_python_exchange_and_the_build_command(tree):
    text = _info(tree)
    assert f"shm exchange  in Python (the compiled one is not built in {tree}/gpucoll)" in text
    assert f"build it once with: {sys.executable} -m pip install -e {tree}" in text


@needs_fast
def test_info_says_compiled_where_the_package_has_it(tmp_path):
    text = _info(tmp_path, PYTHONPATH=ROOT)
    assert "shm exchange  compiled" in text.splitlines() and "pip install" not in text


def test_gpucoll_native_0_is_named_as_the_reason_and_asks_for_no_build(tree):
    report = json.loads(subprocess.run(
        [sys.executable, "-m", "gpucoll", "info", "--json"], cwd=str(tree),
        env=_env(GPUCOLL_NATIVE="0"), capture_output=True, text=True, timeout=50,
        check=True).stdout)
    assert report["small_exchange"] == "in Python (GPUCOLL_NATIVE=0)"
    assert report["small_exchange_note"] is None


@needs_fast
def test_a_compiled_module_that_does_not_load_is_not_called_unbuilt(tmp_path):
    code = ("import sys; sys.modules['gpucoll.transport._shmfast'] = None\n"
            "from gpucoll.transport import shm; print(shm.exchange()[0])")
    out = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path),
                         env=_env(PYTHONPATH=ROOT), capture_output=True, text=True,
                         timeout=50, check=True).stdout
    assert out.strip() == f"in Python (the compiled one does not load in {PACKAGE})"


def test_run_names_the_exchange_of_the_tree_a_script_at_its_root_imports(tree):
    script = write_script(tree, REPORT, "tour.py")
    # the launcher itself imports this checkout's package, the ranks the tree's
    ours, loaded = _run(tree.parent, script, PYTHONPATH=ROOT)
    assert ours[0].endswith(f"small-message exchange in Python (the compiled one is not built "
                            f"in {tree}/gpucoll)"), ours
    assert ours[1] == (f"gpucoll run: note: small messages on shared memory take 3-4x longer "
                       f"without the compiled exchange; build it once with: {sys.executable} "
                       f"-m pip install -e {tree}")
    assert sorted(loaded) == [f"[rank {r}] LOADED {tree}/gpucoll/__init__.py False"
                              for r in range(2)]


@needs_fast
def test_run_says_compiled_when_the_ranks_import_a_package_that_has_it(tmp_path):
    script = write_script(tmp_path, REPORT)
    ours, loaded = _run(tmp_path, script, PYTHONPATH=ROOT)
    assert ours[0].endswith(", small-message exchange compiled"), ours
    assert not any("note" in line for line in ours), ours
    assert sorted(loaded) == [f"[rank {r}] LOADED {PACKAGE}/__init__.py True" for r in range(2)]
