"""What each benchmarked operation moves, and its bandwidths as nccl-tests defines them.

nccl-tests (doc/PERFORMANCE.md) reports ``algbw = S / t`` and ``busbw = algbw * factor(n)``,
where the factor turns the rate into what each rank's link carried, so numbers stay comparable
across rank counts. ``S`` is the reported size: the whole buffer for all_reduce, broadcast,
reduce and sendrecv; the total of all ranks' slots for all_gather (output) and reduce_scatter
(input); the whole per-rank send buffer for all_to_all. GB are 1e9 bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One benchmarked operation: its names, what it reduces and roots, and its bus factor."""

    name: str
    binary: str  # the nccl-tests program measuring the same thing
    reduces: bool  # takes a reduction operator (the redop column)
    rooted: bool  # takes a root rank (the root column)
    slotted: bool  # the buffer is split into one slot per rank (count rounds to n)
    factor: Callable[[int], float]

    def counts(self, nbytes: int, itemsize: int, nranks: int) -> tuple[int, int]:
        """Elements of (send buffer, receive buffer) per rank for a requested size in bytes.

        Like nccl-tests, a size that does not divide evenly is rounded down: to whole
        elements, and for slotted operations to a whole number of elements per rank.
        """
        count = nbytes // itemsize
        if not self.slotted:
            return count, count
        slot = count // nranks
        if self.name == "all_gather":
            return slot, slot * nranks
        if self.name == "reduce_scatter":
            return slot * nranks, slot
        return slot * nranks, slot * nranks  # all_to_all

    def size_bytes(self, nbytes: int, itemsize: int, nranks: int) -> int:
        """The ``size`` column: the larger of the send and receive buffers, in bytes."""
        send, recv = self.counts(nbytes, itemsize, nranks)
        return max(send, recv) * itemsize


def _ring(n: int) -> float:
    return 2.0 * (n - 1) / n


def _share(n: int) -> float:
    return (n - 1) / n


def _one(n: int) -> float:
    return 1.0


OPS: dict[str, OpSpec] = {
    spec.name: spec
    for spec in (
        OpSpec("all_reduce", "all_reduce_perf", True, False, False, _ring),
        OpSpec("all_gather", "all_gather_perf", False, False, True, _share),
        OpSpec("reduce_scatter", "reduce_scatter_perf", True, False, True, _share),
        OpSpec("broadcast", "broadcast_perf", False, True, False, _one),
        OpSpec("reduce", "reduce_perf", True, True, False, _one),
        OpSpec("all_to_all", "alltoall_perf", False, False, True, _share),
        OpSpec("sendrecv", "sendrecv_perf", False, False, False, _one),
    )
}


def bus_factor(op: str, nranks: int) -> float:
    """busbw / algbw for ``op`` on ``nranks`` ranks (nccl-tests' correction factor)."""
    if nranks < 1:
        raise ValueError(f"nranks={nranks} must be at least 1")
    return OPS[op].factor(nranks)


def bandwidths(op: str, size_bytes: int, seconds: float, nranks: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s for ``size_bytes`` (the size column) moved in ``seconds``."""
    if seconds <= 0:
        return 0.0, 0.0
    algbw = size_bytes / seconds / 1e9
    return algbw, algbw * bus_factor(op, nranks)
