"""gpucoll: GPU-aware collective communication for Python.

Semantic versioning applies to the names in ``__all__`` only. Submodules load on first use, so
``import gpucoll`` stays cheap and never touches CUDA.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "GpucollError": "gpucoll.errors",
    "CollectiveTimeout": "gpucoll.errors",
    "CollectiveMismatch": "gpucoll.errors",
    "PeerFailure": "gpucoll.errors",
    "StoreError": "gpucoll.errors",
    "StoreTimeout": "gpucoll.errors",
    "FrameError": "gpucoll.errors",
    "RendezvousError": "gpucoll.errors",
    "LaunchError": "gpucoll.errors",
    "TopologyParseError": "gpucoll.errors",
    "TopologyUnavailable": "gpucoll.errors",
    "BackendUnavailable": "gpucoll.errors",
    "NcclFailure": "gpucoll.errors",
    "UsageError": "gpucoll.errors",
    "ReduceOp": "gpucoll.ops",
    "TCPStore": "gpucoll.store",
    "PrefixStore": "gpucoll.store",
    "Communicator": "gpucoll.communicator",
    "Work": "gpucoll.work",
    "init": "gpucoll.default",
    "is_initialized": "gpucoll.default",
    "get_default": "gpucoll.default",
    "get_rank": "gpucoll.default",
    "get_world_size": "gpucoll.default",
    "all_reduce": "gpucoll.default",
    "broadcast": "gpucoll.default",
    "reduce": "gpucoll.default",
    "all_gather": "gpucoll.default",
    "gather": "gpucoll.default",
    "scatter": "gpucoll.default",
    "reduce_scatter": "gpucoll.default",
    "all_to_all": "gpucoll.default",
    "send": "gpucoll.default",
    "recv": "gpucoll.default",
    "barrier": "gpucoll.default",
    "split": "gpucoll.default",
    "close": "gpucoll.default",
    "isend": "gpucoll.default",
    "irecv": "gpucoll.default",
    "batch": "gpucoll.default",
    "batch_isend_irecv": "gpucoll.default",
    "P2POp": "gpucoll.batch",
    "all_gather_v": "gpucoll.default",
    "gather_v": "gpucoll.default",
    "scatter_v": "gpucoll.default",
    "all_to_all_v": "gpucoll.default",
    "reduce_scatter_v": "gpucoll.default",
    "all_reduce_many": "gpucoll.default",
    "Bucket": "gpucoll.batch",
    "broadcast_object": "gpucoll.default",
    "all_gather_object": "gpucoll.default",
    "gather_object": "gpucoll.default",
    "scatter_object": "gpucoll.default",
    "send_object": "gpucoll.default",
    "recv_object": "gpucoll.default",
    "isend_object": "gpucoll.default",
    "irecv_object": "gpucoll.default",
    "all_reduce_object": "gpucoll.default",
    "reduce_object": "gpucoll.default",
    "ANY_SOURCE": "gpucoll.messages",
    "ANY_TAG": "gpucoll.messages",
    "Status": "gpucoll.messages",
    "new_group": "gpucoll.default",
    "monitored_barrier": "gpucoll.default",
}

__all__ = sorted(_EXPORTS) + ["__version__"]

# submodules the docs name as ``gpucoll.X``: loaded on first attribute access, like the names
_SUBMODULES = frozenset({"distributed", "rendezvous", "store", "topology"})


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"gpucoll.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'gpucoll' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
