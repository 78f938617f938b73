"""The layering of docs/code.md, checked on the imports of every module of the package.

Data flows down, never back up::

    cli (the gpucoll command, selftest, bench, doctor)  >  launch  >  communicator  >  backends
      >  transport  >  store (with rendezvous, the store's bootstrap)  >  leaf utilities

A module may import its own layer and the layers below it. Leaf utilities (errors, ops, arrays,
work, cuda, progress) import only each other. Topology stands apart: it imports nothing of the
collective layers, and only the layers that run collectives (backends and up) may ask it for a
ring order.
Every ``import`` counts, those inside functions too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
import functools
import pathlib
import re

import pytest

import gpucoll

PACKAGE = pathlib.Path(gpucoll.__file__).resolve().parent
ROOT = PACKAGE.parent

# module or package -> layer; the longest matching name decides ("gpucoll" itself: the root only)
LAYER_OF = {
    "gpucoll.__main__": "cli",
    "gpucoll.selftest": "cli",
    "gpucoll.bench": "cli",
    "gpucoll.doctor": "cli",
    "gpucoll.launch": "launch",
    "gpucoll": "communicator",  # the package root re-exports the public API
    "gpucoll.communicator": "communicator",
    "gpucoll.default": "communicator",
    "gpucoll.validation": "communicator",
    "gpucoll.dumps": "communicator",
    "gpucoll.uneven": "communicator",
    "gpucoll.objects": "communicator",
    "gpucoll.messages": "communicator",
    "gpucoll.batch": "communicator",
    "gpucoll.distributed": "communicator",
    "gpucoll.backends": "backends",
    "gpucoll.transport": "transport",
    "gpucoll.store": "store",
    "gpucoll.rendezvous": "store",
    "gpucoll.init_methods": "store",
    "gpucoll.errors": "leaf",
    "gpucoll.progress": "leaf",
    "gpucoll.ops": "leaf",
    "gpucoll.arrays": "leaf",
    "gpucoll.work": "leaf",
    "gpucoll.cuda": "leaf",
    "gpucoll.topology": "topology",
}
ORDER = ["leaf", "store", "transport", "backends", "communicator", "launch", "cli"]
ARRAY_LIBRARIES = {"numpy", "cupy", "cupyx", "ml_dtypes", "torch"}


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> str:
    """The layer of ``module``, or "unassigned" for a module of no layer yet."""
    owners = [m for m in LAYER_OF if module == m or (m != "gpucoll" and module.startswith(m + "."))]
    return LAYER_OF[max(owners, key=len)] if owners else "unassigned"


def _is_module(name: str) -> bool:
    rel = pathlib.Path(*name.split("."))
    return (ROOT / rel).with_suffix(".py").is_file() or (ROOT / rel / "__init__.py").is_file()


def _from_target(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")[: len(module.split(".")) - node.level + is_package]
    return ".".join(base + ([node.module] if node.module else []))


def imported_by(path: pathlib.Path) -> set[str]:
    """Every module ``path`` imports anywhere in its body (``from pkg import mod`` names mod)."""
    module, found = module_name(path), set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = _from_target(node, module, path.name == "__init__.py")
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if _is_module(sub) else target)
    return found


@functools.cache
def graph() -> dict[str, set[str]]:
    return {module_name(p): imported_by(p) for p in sorted(PACKAGE.rglob("*.py"))}


def internal_edges(importers: str | None = None) -> list[tuple[str, str]]:
    """(importer, imported) pairs inside the package, optionally from one layer only."""
    return [(a, b) for a, deps in graph().items() for b in sorted(deps)
            if b.split(".")[0] == "gpucoll" and (importers is None or layer(a) == importers)]


def test_the_import_scan_sees_imports_inside_functions():
    assert "gpucoll.store" in graph()["gpucoll.rendezvous"]  # only imported in connect_store


def test_every_module_belongs_to_a_layer():
    assert [m for m in graph() if layer(m) == "unassigned"] == []


def test_no_module_imports_a_layer_above_its_own():
    collective = [(a, b) for a, b in internal_edges() if "topology" not in (layer(a), layer(b))]
    upward = [f"{a} ({layer(a)}) imports {b} ({layer(b)})" for a, b in collective
              if ORDER.index(layer(b)) > ORDER.index(layer(a))]
    assert upward == []


@pytest.mark.parametrize("lower", ["leaf", "store", "transport", "backends"])
def test_lower_layers_never_import_the_communicator(lower):
    assert [(a, b) for a, b in internal_edges(lower) if layer(b) == "communicator"] == []


def test_leaf_utilities_import_only_each_other():
    assert [(a, b) for a, b in internal_edges("leaf") if layer(b) != "leaf"] == []


def test_the_store_imports_only_itself_errors_and_the_wait_notices():
    assert [(a, b) for a, b in internal_edges("store")
            if layer(b) != "store" and b not in ("gpucoll.errors", "gpucoll.progress")] == []


def test_the_store_knows_nothing_of_arrays():
    arrays = [(m, d) for m, deps in graph().items() if layer(m) == "store"
              for d in deps if d.split(".")[0] in ARRAY_LIBRARIES or d.startswith("gpucoll.arrays")]
    assert arrays == []


def test_topology_imports_nothing_of_the_collective_layers():
    assert [(a, b) for a, b in internal_edges("topology")
            if layer(b) != "topology" and b not in ("gpucoll.errors",)] == []


def test_only_layers_that_run_collectives_use_topology():
    allowed = ORDER[ORDER.index("backends"):] + ["topology"]
    assert [(a, b) for a, b in internal_edges() if layer(b) == "topology"
            and layer(a) not in allowed] == []


def test_public_names_come_from_the_communicator_layer_or_below():
    above = {name: mod for name, mod in gpucoll._EXPORTS.items()
             if ORDER.index(layer(mod)) > ORDER.index("communicator")}
    assert above == {}


def test_examples_use_only_the_public_package():
    deep = {(p.name, d) for p in sorted((ROOT / "examples").glob("*.py"))
            for d in imported_by(p) if d.startswith("gpucoll.")}
    assert deep == set()


@pytest.mark.parametrize("package", ["launch", "store", "topology", "bench", "backends",
                                     "backends.nccl", "transport"])
def test_each_package_names_its_modules_in_its_docstring(package):
    """A package's file list reads as its table of contents: the docstring of its __init__
    says what each of its modules holds."""
    import importlib

    doc = importlib.import_module(f"gpucoll.{package}").__doc__
    modules = {p.stem for p in PACKAGE.joinpath(*package.split(".")).glob("*.py")
               if not p.stem.startswith("__")}
    named = set(re.findall(r"``(\w+)``", doc.split("Modules:", 1)[1]))
    assert modules - named == set()


def code_md_modules() -> tuple[set[str], str]:
    """The files docs/code.md's module tree names (paths under gpucoll/), and its first line."""
    text = (ROOT / "docs" / "code.md").read_text().split("## Modules", 1)[1]
    tree = text.split("```text\n", 1)[1].split("```", 1)[0].splitlines()
    found, folders = set(), []
    for line in tree[1:]:
        entry = re.match(r"^( +)([\w.]+(?:\.py|\.c|/))(?:\s|$)", line)
        if not entry:
            continue  # a description carried over to the next line
        depth = len(entry.group(1)) // 2 - 1
        del folders[depth:]
        if entry.group(2).endswith("/"):  # a package: its line stands for its __init__.py
            folders.append(entry.group(2))
            found.add("".join(folders) + "__init__.py")
        else:
            found.add("".join(folders) + entry.group(2))
    return found, tree[0]


def test_docs_code_md_names_every_module_and_no_other():
    """docs/code.md is the map of the code: one line for each module, none for a module gone."""
    on_disk = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*")
               if p.suffix in (".py", ".c") and "__pycache__" not in p.parts}
    named, header = code_md_modules()
    assert (sorted(on_disk - named), sorted(named - on_disk)) == ([], [])
    python = len([m for m in on_disk if m.endswith(".py")])
    assert f"{python} Python modules" in header
