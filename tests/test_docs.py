"""Every command and code block of README.md and docs/*.md runs, so the docs cannot drift.

Each fenced block names its language: ``python`` and ``bash`` blocks run, ``console`` blocks run
their ``$ `` lines (the other lines are the output they printed, not compared), ``text`` blocks
are output or diagrams and never run. HTML comments right before a block say how it runs:

- ``<!-- not run: REASON -->``: never run here, for the reason given (it needs a GPU, Docker,
  several hosts, the network, or many minutes);
- ``<!-- gpu -->``: run only where CUDA exists (the ``gpu`` marker skips it elsewhere);
- ``<!-- ranks: N -->``: a Python script run on N ranks by ``gpucoll run -n N``;
- ``<!-- file: NAME -->``: the content of the file NAME, which later blocks of the page use;
- ``<!-- timeout: S -->``: seconds the block may take (default 120).

A Python block without ``ranks`` runs as ``python block.py``. Every block that runs is whole,
as a reader would copy it: a Python block that uses a communicator ``comm`` makes it itself.
Every block runs in a fresh directory holding the repository's ``examples``, ``benchmarks``,
``tests`` and ``docker`` (linked, read only by convention), empty ``docs`` and ``results``
folders, the page's files, and ``train.py``, ``mypackage.train`` and ``buggy.py``, the stand-ins
for "your script" that the launcher's page names.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import shlex
import signal
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every code block of the docs

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGUAGES = {"python", "bash", "console", "text"}
KEYS = {"not run", "gpu", "ranks", "file", "timeout"}
LINKED = ("examples", "benchmarks", "tests", "docker")

# "your script" of the launcher's page: any arguments, one all_reduce, a line from rank 0
TRAIN = """\
import sys

import numpy as np

import gpucoll

with gpucoll.init() as comm:
    x = np.ones(4) * comm.rank
    comm.all_reduce(x)
    if comm.rank == 0:
        print(f"train.py {' '.join(sys.argv[1:])}: {comm.size} ranks, sum {x[0]:.0f}")
"""
# the failing job of the launcher's page: rank 2 raises on line 7, before an all_reduce
BUGGY = """\
import numpy as np

import gpucoll

with gpucoll.init() as comm:
    if comm.rank == 2:
        raise ValueError("bad batch on rank 2")
    comm.all_reduce(np.ones(4))
"""


@dataclasses.dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    marks: dict[str, str]

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.lang != "text" and "not run" not in self.marks


def parse(page: Path) -> list[Block]:
    """The fenced blocks of ``page``, with the markers in the comments just before each."""
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = re.match(r"^(```+)(\S*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith(fence.group(1)))
        marks, k = {}, i - 1
        while k >= 0 and (m := re.match(r"^<!--\s*(.*?)\s*-->$", lines[k].strip())):
            key, _, value = m.group(1).partition(":")
            marks[key.strip()] = value.strip()
            k -= 1
        found.append(Block(page, i + 1, fence.group(2), "\n".join(lines[i + 1:end]) + "\n",
                           marks))
        i = end + 1
    return found


BLOCKS = [b for page in PAGES for b in parse(page)]


def console_script(block: Block) -> str:
    """A bash script of a console block's ``$`` commands. A command followed by ``$ echo $?``
    must exit with the status printed after it, every other command with 0."""
    commands: list[list[str]] = []  # [command, printed output...]
    for line in block.code.splitlines():
        if line.startswith("$ "):
            commands.append([line[2:]])
        elif commands and commands[-1][0].endswith("\\") and len(commands[-1]) == 1:
            commands[-1][0] += "\n" + line
        elif commands:
            commands[-1].append(line)
    script = []
    for n, (command, *_) in enumerate(commands):
        if command.strip() == "echo $?":
            continue
        expected = 0
        if n + 1 < len(commands) and commands[n + 1][0].strip() == "echo $?":
            expected = int(commands[n + 1][1])
        script += [command, f"s=$?; if [ $s -ne {expected} ]; then echo \"docs: exit status "
                   f"$s, expected {expected}:\" {shlex.quote(command)} >&2; exit 1; fi"]
    return "\n".join(script) + "\n"


def workdir(block: Block, path: Path) -> Path:
    """A fresh directory laid out as the docs assume, with the page's files in it."""
    for name in LINKED:
        (path / name).symlink_to(ROOT / name)
    (path / "docs").mkdir()
    (path / "results").mkdir()
    (path / "train.py").write_text(TRAIN)
    (path / "buggy.py").write_text(BUGGY)
    (path / "mypackage").mkdir()
    (path / "mypackage" / "__init__.py").write_text("")
    (path / "mypackage" / "train.py").write_text(TRAIN)
    for other in BLOCKS:
        if other.page == block.page and "file" in other.marks:
            (path / other.marks["file"]).write_text(other.code)
    return path


def run_shell(script: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """``script`` under bash in its own session, killed with everything it started at the
    deadline; the venv's ``python`` and ``gpucoll`` come first on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCOLL_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    proc = subprocess.Popen(["bash", "-c", script], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"still running after {timeout} s:\n{script}\n{out}\n{err}")
    return subprocess.CompletedProcess(script, proc.returncode, out, err)


def script_of(block: Block, cwd: Path) -> str:
    """The bash script that runs ``block`` in ``cwd``."""
    if block.lang == "bash":
        return "set -eo pipefail\n" + block.code
    if block.lang == "console":
        return console_script(block)
    if "file" in block.marks:  # a file the page uses: it must at least compile
        return f"python -m py_compile {shlex.quote(block.marks['file'])}\n"
    (cwd / "_block.py").write_text(block.code)
    if "ranks" in block.marks:
        return f"python -m gpucoll run -n {int(block.marks['ranks'])} _block.py\n"
    return "python _block.py\n"


def params():
    for b in BLOCKS:
        if b.runs:
            marks = [pytest.mark.gpu] if "gpu" in b.marks else []
            yield pytest.param(b, id=b.name, marks=marks)


@pytest.mark.timeout(0)  # each block has its own deadline
@pytest.mark.parametrize("block", list(params()))
def test_block_runs(block: Block, tmp_path):
    cwd = workdir(block, tmp_path)
    timeout = float(block.marks.get("timeout", 120))
    done = run_shell(script_of(block, cwd), cwd, timeout)
    assert done.returncode == 0, (
        f"{block.name} exited with status {done.returncode}\n--- block\n{block.code}"
        f"--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}")


def test_the_pages_have_blocks_to_run():
    assert len([b for b in BLOCKS if b.runs]) >= 25


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.name)
def test_every_block_says_how_it_runs(block: Block):
    assert block.lang in LANGUAGES, (
        f"{block.name}: a fence needs one of the languages {sorted(LANGUAGES)}")
    assert set(block.marks) <= KEYS, f"{block.name}: unknown marker {set(block.marks) - KEYS}"
    if "not run" in block.marks:
        assert len(block.marks["not run"]) >= 10, f"{block.name}: say why it is not run"
        assert block.lang != "text", f"{block.name}: text blocks never run anyway"
    if block.lang == "text":
        assert not block.code.startswith("$ "), f"{block.name}: commands belong in console"
    if block.lang == "console":
        assert block.code.startswith("$ "), f"{block.name}: a console block starts with $"
    if "ranks" in block.marks:
        assert block.lang == "python", f"{block.name}: ranks marks Python blocks"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.runs and b.lang == "python"],
                         ids=lambda b: b.name)
def test_a_python_block_that_uses_comm_makes_it(block: Block):
    """A reader copies a block whole: a ``comm`` it never makes is a NameError for them."""
    uses = re.search(r"\bcomm\.", block.code)
    makes = re.search(r"^\s*(comm\s*=|with .* as comm\b)", block.code, re.M)
    assert not uses or makes, f"{block.name}: uses comm without making it (gpucoll.init())"


@pytest.mark.parametrize("block", [b for b in BLOCKS if "file" in b.marks],
                         ids=lambda b: b.name)
def test_every_file_block_is_used_by_a_later_block(block: Block):
    later = [b for b in BLOCKS if b.page == block.page and b.line > block.line and b.runs
             and "file" not in b.marks]
    assert any(block.marks["file"] in b.code for b in later), (
        f"{block.name}: no later block of the page runs {block.marks['file']}")


def _variables_named_in(package: Path) -> dict[str, str]:
    """Every GPUCOLL_* name that appears as a whole string in the package's code (what it reads
    from, or sets in, the environment), with a module that names it."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and re.fullmatch(r"GPUCOLL_[A-Z0-9_]+", node.value):
                found.setdefault(node.value, str(path.relative_to(ROOT)))
    return found


def _variables_in_the_table() -> set[str]:
    """The variables of api.md's table of environment variables (its first column)."""
    text = (ROOT / "docs" / "api.md").read_text()
    section = text.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    return {name for cell in rows for name in re.findall(r"`(GPUCOLL_[A-Z0-9_]+)`", cell)}


def test_every_environment_variable_the_package_reads_is_in_the_table():
    named, table = _variables_named_in(ROOT / "gpucoll"), _variables_in_the_table()
    assert len(named) >= 20  # the scan finds them (os.environ.get("GPUCOLL_..."), constants)
    missing = {name: where for name, where in named.items() if name not in table}
    assert not missing, f"not in docs/api.md's table of environment variables: {missing}"
    assert table <= set(named), f"in the table, never read: {table - set(named)}"


def test_the_readme_quickstart_runs_as_the_readme_says(tmp_path):
    """The first command: the install steps are not run here (they reach the package
    index); what follows them runs in this environment."""
    first = [b for b in BLOCKS if b.page.name == "README.md" and b.lang == "bash"][0]
    steps = [s.strip() for s in first.code.strip().split("&&")]
    assert steps[:3] == ["python3 -m venv .venv", ". .venv/bin/activate", "pip install ."], steps
    cwd = workdir(first, tmp_path)
    done = run_shell(" && ".join(steps[3:]), cwd, 120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "CHECK quickstart: passed" in done.stdout


def test_the_readme_test_command_is_what_ci_runs():
    second = [b for b in BLOCKS if b.page.name == "README.md" and b.lang == "bash"][1]
    steps = [s.strip() for s in second.code.strip().split("&&")]
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    assert " && ".join(steps[-2:]) == "python -m pytest && python -m pytest -m slow -n 0" == ci[-1]
    assert 'pip install -e ".[test,peers]"' in steps
    assert any(line.endswith('pip install --quiet -e ".[test,peers]"') for line in ci)


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = unicodedata.normalize("NFKC", heading).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return {anchor(h) for h in re.findall(r"^#+\s+(.*?)\s*$", text, re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_to_a_page_of_the_repository_resolves(page: Path):
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, frag = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no {dest.relative_to(ROOT)}")
        elif frag and dest.suffix == ".md" and frag not in anchors(dest):
            broken.append(f"{target}: no heading #{frag} in {dest.relative_to(ROOT)}")
    assert not broken, "\n".join(broken)
