"""Host (NumPy) arrays on the NCCL backend: copied to device memory, worked on there, copied back.

NCCL moves device memory only, yet ``backend="auto"`` picks NCCL on a GPU machine, where a
program may well pass NumPy arrays (a loss, a metric, or all its data when it does not use the
GPU). So that the whole API works there as it does on the host ring (and as torch's default
"cpu:gloo,cuda:nccl" does), an op of the backend decorated with ``host_arrays(written)`` takes
host buffers too: each goes through pinned memory into a device buffer on the call's stream, the
op runs on the device buffers, and the buffers it writes (the parameters named in ``written``)
are copied back, on the stream after it, into the pinned buffer they came through (one pinned
buffer per host array). The host copies out of pinned memory
into the caller's arrays once that device work is done, within the call's deadline:

- a collective returns with its host arrays written, also when started with ``async_op=True``
  (its Work is then complete): the communicator's own host-side steps after a backend call
  (unpacking a fused buffer, writing back a strided array's stand-in) read those arrays at once.
  NCCL runs one communicator's calls in the order they were issued, so such a collective also
  waits for this rank's earlier sends and receives: one whose peer posts its side only after
  its own collective holds both back until their deadlines (docs/gpus.md, "One communicator,
  one queue");
- ``batch_p2p`` (every ``isend``/``irecv``) returns at once, so that sends and receives posted
  on both sides before either is waited for never wait on each other; its Works write the
  received arrays when found complete (``wait``, ``synchronize``, ``is_completed``), and writing
  one call's arrays writes every earlier call's first, so that work completes in issue order.

A failed call leaves the caller's host arrays as they were. Device buffers pass straight
through, at the cost of one look at each argument.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from gpucoll.arrays import ArrayRef
from gpucoll.work import Work


class HostCopies:
    """The host arrays one call writes, their pinned copies (filled on the device after the
    call), and the Work that says when those copies are done."""

    def __init__(self, pairs: list[tuple[ArrayRef, np.ndarray]], work: Work,
                 queue: list[HostCopies], lock: threading.Lock):
        self.pairs, self.work, self._queue, self._lock = pairs, work, queue, lock
        self.done = False

    def finish(self, timeout: float | None = None) -> bool:
        """Wait for the device work (at most ``timeout``; None: the call's deadline), then
        write the host arrays, every earlier call's first; False if still running."""
        with self._lock:
            return self._write(timeout)

    def ready(self) -> bool:
        """True once written back; writes back when the device is done. Never blocks: while
        another thread is writing back, it is not yet complete."""
        if self.done or not self.work.is_completed() or not self._lock.acquire(blocking=False):
            return self.done
        try:
            return self._write(0.0)
        finally:
            self._lock.release()

    def _write(self, timeout: float | None) -> bool:
        while self._queue and not self.done:
            first = self._queue[0]
            if not first.work._wait(timeout):
                return False
            for ref, pinned in first.pairs:
                np.copyto(ref.host.view(np.uint8), pinned)
            first.done = True
            self._queue.pop(0)
        return True


class HostWork(Work):
    """The Work of an asynchronous call on host arrays: complete once they are written."""

    def __init__(self, copies: HostCopies):
        self._copies = copies

    def is_completed(self) -> bool:
        return self._copies.ready()

    def _wait(self, timeout: float | None) -> bool:
        return self._copies.finish(timeout)


def host_arrays(*written: str) -> Callable[[Callable], Callable]:
    """Let an ``NcclBackend`` op take host buffers (see the module docstring); ``written``
    names the parameters the op writes."""

    def decorate(method: Callable) -> Callable:
        signature = inspect.signature(method)

        @functools.wraps(method)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not (_any_host(args) or kwargs and _any_host(kwargs.values())):
                return method(self, *args, **kwargs)
            return _staged(self, method, signature.bind(self, *args, **kwargs), written)

        return call

    return decorate


def _any_host(values: Any) -> bool:
    """Whether a host buffer is among ``values``, or in a list or tuple of them (a plain loop:
    this runs on every call, also on device arrays)."""
    for value in values:
        kind = value.__class__
        if kind is ArrayRef:
            if value.kind != "device":
                return True
        elif (kind is list or kind is tuple) and _any_host(value):
            return True
    return False


def _staged(backend: Any, method: Callable, bound: inspect.BoundArguments,
            written: tuple[str, ...]) -> Any:
    """Run ``method`` on device copies of the host buffers in ``bound``; see the module
    docstring for when the results reach the host."""
    rt, args = backend._rt, bound.arguments
    with rt.using_device(backend.device):
        s = rt.stream_handle(args.get("stream"))
        backend.refuse_capture(method.__name__, s)  # before anything is allocated or queued
        backs: list[tuple[ArrayRef, ArrayRef, np.ndarray]] = []
        keep: list[Any] = []

        def swap(value: Any, writes: bool) -> Any:
            if isinstance(value, ArrayRef):
                return value if value.kind == "device" else _to_device(rt, value, writes, s,
                                                                       backs, keep)
            if isinstance(value, tuple):  # batch_p2p's (is_send, ref, peer): a send only reads
                sends = len(value) == 3 and isinstance(value[0], bool) and value[0]
                return tuple(swap(v, writes and not sends) for v in value)
            if isinstance(value, list):
                return [swap(v, writes) for v in value]
            return value

        for name, value in list(args.items()):
            args[name] = swap(value, name in written)
        if "stream" in args:
            args["stream"] = s
        result = method(*bound.args, **bound.kwargs)
        op = backend._last
        for _, device, pinned in backs:
            if device.nbytes:
                rt.memcpy_async(pinned.ctypes.data, device.ptr, device.nbytes, s)
        backend._end(op.opname, s, op.deadline, op.timeout, (keep, backs))
    copies = HostCopies([(ref, pinned) for ref, _, pinned in backs],
                        backend._event_work(backend._last), backend._host_queue,
                        backend._host_lock)
    with backend._host_lock:
        backend._host_queue.append(copies)
    if isinstance(result, list):  # batch_p2p: one Work per operation, all done together
        return [HostWork(copies) for _ in result]
    copies.finish()
    return result


def _to_device(rt: Any, ref: ArrayRef, writes: bool, s: int,
               backs: list[tuple[ArrayRef, ArrayRef, np.ndarray]], keep: list[Any]) -> ArrayRef:
    """A device copy of host buffer ``ref``, queued on stream ``s`` through pinned memory."""
    pinned = rt.alloc_pinned(ref.nbytes)
    memory = rt.alloc_device(ref.nbytes, s)
    device = ArrayRef(memory, "device", memory.ptr, ref.shape, ref.dtype, ref.count, ref.nbytes,
                      device=rt.current_device())
    if ref.nbytes:
        np.copyto(pinned, ref.host.view(np.uint8))
        rt.memcpy_async(device.ptr, pinned.ctypes.data, ref.nbytes, s)
    keep.append(pinned)
    if writes:  # the copy back reuses the pinned buffer: it is queued after the copy in
        backs.append((ref, device, pinned))  # and the op on the same stream
    return device
