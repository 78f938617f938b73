"""The guard on every public call of a communicator: refused in a forked child, and while
another thread is inside a call of the same communicator; a failure that ends the group dumps
the flight recorder (``gpucoll.dumps``).

It lives apart from ``communicator`` so that the modules adding calls to the Communicator
(``uneven``, ``objects``, ``batch``, ``fused``, ``groups``) can guard theirs the same way.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from gpucoll.errors import GpucollError


def entry(method: Callable) -> Callable:
    """A public call: refused in a forked child, and while another thread is inside a call.
    (A public method that hands off to a guarded ``_name`` is named ``name`` in messages.)"""
    name = method.__name__.lstrip("_")

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self._forked:
            raise self._in_child(name)
        if not self._entry.acquire(blocking=False):
            raise self._concurrent(name)
        self._inside = name
        try:
            return method(self, *args, **kwargs)
        except GpucollError as exc:
            self._flight.failed(exc)  # the flight recorder dumps on the group's first failure
            raise
        finally:
            self._entry.release()

    return call
