"""The two test tiers. Plain ``python -m pytest`` runs the fast tier: every behaviour once, on 2
ranks over shared memory where ranks are needed. ``python -m pytest -m slow`` runs the rest of
the grid (other transports, world sizes, the Python exchange), the docs, the examples and the
comparisons with torch and Open MPI. ``grid`` keeps one point of a parameter grid in the fast
tier and marks the others slow.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest

SLOW = pytest.mark.slow


def grid(values: Iterable[Any], fast: Any, *, rows: bool = False) -> list:
    """``values`` for ``parametrize``, each not equal to ``fast`` (or not in it, given a list)
    marked slow. With ``rows``, each value is a tuple of several argument names' values."""
    keep = fast if isinstance(fast, list) else [fast]
    out = []
    for value in values:
        if value in keep:
            out.append(value)
        elif rows:
            out.append(pytest.param(*value, marks=SLOW))
        else:
            out.append(pytest.param(value, marks=SLOW))
    return out
