"""The NCCL backend, driven through nccl4py (NVIDIA's NCCL binding).

Modules:

- ``backend``: ``NcclBackend``, the collectives on device arrays (out-of-place, uneven, coalesced
  and batched calls included), and its start-up through the store: device choice, arrival, the
  unique id; the watchdog thread and the event-backed ``Work``; and whether ``backend="auto"``
  picks NCCL, and why (``agree``);
- ``hostarrays``: host (NumPy) arrays on the backend, staged through device memory, and the
  Work that writes them back;
- ``driver``: one non-blocking NCCL communicator, polled so that no call blocks past its
  deadline, aborted once on a failure; NCCL's datatype and op codes for gpucoll's dtypes and ops.

Nothing here imports CuPy or nccl4py at import time.
"""

from __future__ import annotations

from gpucoll.backends.nccl.backend import NcclBackend

__all__ = ["NcclBackend"]
