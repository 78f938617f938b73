"""Optional packages: which extra of gpucoll installs each, and the one error a missing one gives.

``require("matplotlib", "topo --png")`` imports and returns the module, or raises
``MissingPackage`` whose message is the whole story in one line: what needs it and the command
that installs it (``pip install "gpucoll[topo]"``). The ``gpucoll`` command prints that line
instead of a traceback.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from gpucoll.errors import MissingPackage

# module imported -> (package on PyPI, extra of gpucoll that installs it; None: no extra does)
PACKAGES = {
    "matplotlib": ("matplotlib", "topo"),
    "pynvml": ("nvidia-ml-py", "topo"),
    "ml_dtypes": ("ml_dtypes", "cuda12"),
    "cupy": ("cupy-cuda12x", "cuda12"),
    "torch": ("torch", None),
    "mpi4py": ("mpi4py", None),
}


def install_hint(module: str) -> str:
    """The command that installs ``module``: gpucoll's extra where one has it."""
    package, extra = PACKAGES.get(module.split(".")[0], (module.split(".")[0], None))
    return f'pip install "gpucoll[{extra}]"' if extra else f"pip install {package}"


def missing(module: str, purpose: str) -> MissingPackage:
    """The error for ``purpose`` (e.g. ``topo --png``) when ``module`` cannot be imported."""
    package = PACKAGES.get(module.split(".")[0], (module,))[0]
    return MissingPackage(f"{purpose} needs {package}, which is not installed: "
                          f"{install_hint(module)}")


def require(module: str, purpose: str) -> ModuleType:
    """``module`` imported, or MissingPackage naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise missing(module, purpose) from None
