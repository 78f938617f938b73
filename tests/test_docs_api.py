"""Every Python example of docs/api.md runs as written, on 3 ranks of the host ring.

Each block runs in a namespace holding ``comm`` (this rank's communicator), ``np`` and
``gpucoll``; the opening block, which joins a group from a launcher's environment, is left out.
"""

from __future__ import annotations

import pathlib
import re

import pytest
from multiproc import spawn

pytestmark = pytest.mark.timeout(180)

API = pathlib.Path(__file__).resolve().parent.parent / "docs" / "api.md"


def blocks() -> list[str]:
    found = re.findall(r"```python\n(.*?)```", API.read_text(), re.S)
    return [b for b in found if "gpucoll.init(" not in b]


def _run(rank: int, n: int, addr: str) -> list[str]:
    import numpy as np

    import gpucoll

    failures = []
    with gpucoll.init("ring", rank=rank, world_size=n, store=addr, timeout=60) as comm:
        for i, code in enumerate(blocks()):
            try:
                exec(compile(code, f"docs/api.md block {i}", "exec"),
                     {"comm": comm, "np": np, "gpucoll": gpucoll})
            except Exception as exc:  # noqa: BLE001 - reported to the test
                failures.append(f"block {i}: {type(exc).__name__}: {exc}\n{code}")
                break  # the ranks may be out of step now
    return failures


def test_the_api_page_has_examples():
    assert len(blocks()) >= 7


def test_every_example_of_the_api_page_runs_on_3_ranks(store_addr):
    failures = [f for rank_failures in spawn(_run, 3, store_addr, timeout=150)
                for f in rank_failures]
    assert not failures, "\n".join(failures)
