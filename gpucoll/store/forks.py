"""What a forked child (a data loader, say) does with the sockets it inherited: it closes its
copies at once, telling nobody, so that the parent's death still ends them (its peers and its
store's clients notice at once, its wills fire) and the child cannot use them by mistake.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

_LIVE: weakref.WeakSet = weakref.WeakSet()  # what this process registered, while it lives


def drop_when_forked(obj: Any) -> None:
    """Have ``obj.drop_inherited()`` called in every child forked from this process after now,
    for as long as ``obj`` lives here."""
    _LIVE.add(obj)


def _drop_inherited() -> None:
    for obj in list(_LIVE):
        obj.drop_inherited()


os.register_at_fork(after_in_child=_drop_inherited)
