"""Device arrays on a host backend: staged through pinned host memory, chunk by chunk.

``StagedBackend`` wraps a host backend (the ring). Host buffers pass straight through. For
device buffers of element-wise ops (all_reduce, broadcast, reduce, send, recv) the data moves in
chunks through two pinned buffers: while the ring works on chunk i on the host, the copy of
chunk i+1 to the host is already running on the stream, and chunk i-1's result is on its way
back. Ops that rearrange slots (gathers, scatters, all-to-all) stage whole buffers. Every copy
is queued on the call's stream (default: the current stream), so the staged call is ordered
after earlier work on it and later work sees the results.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from gpucoll import cuda
from gpucoll.arrays import ArrayRef, as_ref
from gpucoll.backends.base import Backend
from gpucoll.errors import CollectiveTimeout, GpucollError
from gpucoll.ops import ReduceOp
from gpucoll.work import CompletedWork

CHUNK_BYTES = 4 << 20


class _Pinned:
    """A pinned host buffer plus the event after the last copy that reads it on the device."""

    def __init__(self, rt: Any, nbytes: int):
        self.mem = rt.alloc_pinned(nbytes)
        self.ptr = self.mem.__array_interface__["data"][0] if nbytes else 0
        self.busy: Any = None

    def host_ref(self, dtype: np.dtype, count: int) -> ArrayRef:
        return as_ref(self.mem[: count * dtype.itemsize].view(dtype), "staged")


class StagedBackend(Backend):
    """A host backend that also accepts device arrays (see the module docstring)."""

    host_control = True  # host arrays pass straight through to the ring

    def __init__(self, inner: Backend, *, chunk_bytes: int | None = None):
        self.inner = inner
        self.chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
        self.name, self.rank, self.size = inner.name, inner.rank, inner.size
        self._pair: list[_Pinned] | None = None
        self._local = threading.local()  # the issuing thread's current stream, for async calls
        self.lean = getattr(inner, "lean", None)  # host arrays pass straight through

    @property
    def progress(self):
        return self.inner.progress

    def isend(self, x: ArrayRef, dst: int, *, timeout: float, stream: Any = None):
        if x.kind != "device":
            return self.inner.isend(x, dst, timeout=timeout)
        return super().isend(x, dst, timeout=timeout, stream=stream)

    def irecv(self, x: ArrayRef, src: int, *, timeout: float, stream: Any = None):
        if x.kind != "device":
            return self.inner.irecv(x, src, timeout=timeout)
        return super().irecv(x, src, timeout=timeout, stream=stream)

    def __getattr__(self, attr: str) -> Any:  # ring-specific extras (links, transport, ...)
        if attr == "inner":
            raise AttributeError(attr)
        return getattr(self.inner, attr)

    # ---- element-wise ops: chunked pipeline ----------------------------------------------

    def all_reduce(self, x: ArrayRef, op: ReduceOp, *, timeout: float, stream: Any = None):
        if x.kind != "device":
            return self.inner.all_reduce(x, op, timeout=timeout)
        self._pipeline(x, True, True, timeout, stream,
                       lambda h, t: self.inner.all_reduce(h, op, timeout=t))

    def broadcast(self, x: ArrayRef, root: int, *, timeout: float, stream: Any = None):
        if x.kind != "device":
            return self.inner.broadcast(x, root, timeout=timeout)
        mine = self.rank == root
        self._pipeline(x, mine, not mine, timeout, stream,
                       lambda h, t: self.inner.broadcast(h, root, timeout=t))

    def reduce(self, x: ArrayRef, root: int, op: ReduceOp, *, timeout: float,
               stream: Any = None):
        if x.kind != "device":
            return self.inner.reduce(x, root, op, timeout=timeout)
        self._pipeline(x, True, self.rank == root, timeout, stream,
                       lambda h, t: self.inner.reduce(h, root, op, timeout=t))

    def send(self, x: ArrayRef, dst: int, *, timeout: float, stream: Any = None):
        if x.kind != "device":
            return self.inner.send(x, dst, timeout=timeout)
        self._pipeline(x, True, False, timeout, stream,
                       lambda h, t: self.inner.send(h, dst, timeout=t))

    def recv(self, x: ArrayRef, src: int, *, timeout: float, stream: Any = None):
        if x.kind != "device":
            return self.inner.recv(x, src, timeout=timeout)
        self._pipeline(x, False, True, timeout, stream,
                       lambda h, t: self.inner.recv(h, src, timeout=t))

    def _pipeline(self, x: ArrayRef, down: bool, up: bool, timeout: float, stream: Any,
                  run: Callable[[ArrayRef, float], None]) -> None:
        """Chunk i: device->host copy (queued one chunk ahead), ``run`` on the host, and
        host->device copy of the result, alternating between two pinned buffers."""
        rt, deadline = cuda.runtime(), time.monotonic() + timeout
        s = self._stream(rt, x, stream)
        per = max(1, self.chunk_bytes // x.dtype.itemsize)
        chunks = [(i, min(per, x.count - i)) for i in range(0, x.count, per)] or [(0, 0)]
        pair = self._buffers(rt, min(x.nbytes, per * x.dtype.itemsize))
        ready = [self._down(rt, x, pair[0], chunks[0], s, down, deadline)]
        for k, (start, count) in enumerate(chunks):
            buf = pair[k % 2]
            if k + 1 < len(chunks):  # start copying the next chunk before working on this one
                ready.append(self._down(rt, x, pair[(k + 1) % 2], chunks[k + 1], s, down,
                                        deadline))
            _wait(ready[k], deadline, "device-to-host copy", self.rank)
            run(buf.host_ref(x.dtype, count), deadline - time.monotonic())
            if up and count:
                rt.memcpy_async(x.ptr + start * x.dtype.itemsize, buf.ptr,
                                count * x.dtype.itemsize, s)
                buf.busy = rt.record_event(s)

    def _down(self, rt: Any, x: ArrayRef, buf: _Pinned, chunk: tuple[int, int], s: int,
              down: bool, deadline: float) -> Any:
        _wait(buf.busy, deadline, "host-to-device copy", self.rank)  # buffer free again
        buf.busy = None
        start, count = chunk
        if down and count:
            rt.memcpy_async(buf.ptr, x.ptr + start * x.dtype.itemsize,
                            count * x.dtype.itemsize, s)
        return rt.record_event(s)

    # ---- slot-rearranging ops: whole buffers -------------------------------------------------

    def all_gather(self, x: ArrayRef, out: ArrayRef, *, timeout: float, stream: Any = None):
        self._whole((x, out), (True, False), timeout, stream,
                    lambda h, t: self.inner.all_gather(h[0], h[1], timeout=t))

    def gather(self, x: ArrayRef, out: ArrayRef | None, root: int, *, timeout: float,
               stream: Any = None):
        self._whole((x, out), (True, False), timeout, stream,
                    lambda h, t: self.inner.gather(h[0], h[1], root, timeout=t))

    def scatter(self, x: ArrayRef | None, out: ArrayRef, root: int, *, timeout: float,
                stream: Any = None):
        self._whole((x, out), (True, False), timeout, stream,
                    lambda h, t: self.inner.scatter(h[0], h[1], root, timeout=t))

    def reduce_scatter(self, x: ArrayRef, out: ArrayRef, op: ReduceOp, *, timeout: float,
                       stream: Any = None):
        self._whole((x, out), (True, False), timeout, stream,
                    lambda h, t: self.inner.reduce_scatter(h[0], h[1], op, timeout=t))

    def all_to_all(self, x: ArrayRef, out: ArrayRef, *, timeout: float, stream: Any = None):
        self._whole((x, out), (True, False), timeout, stream,
                    lambda h, t: self.inner.all_to_all(h[0], h[1], timeout=t))

    def _whole(self, refs: tuple, inputs: tuple, timeout: float, stream: Any,
               run: Callable[[list, float], None]) -> None:
        """Copy device inputs to pinned memory, run on the host, copy device outputs back."""
        if all(r is None or r.kind != "device" for r in refs):
            return run(list(refs), timeout)
        rt, deadline = cuda.runtime(), time.monotonic() + timeout
        s = self._stream(rt, next(r for r in refs if r is not None), stream)
        hosts, backs = [], []
        for ref, is_input in zip(refs, inputs, strict=True):
            if ref is None or ref.kind != "device":
                hosts.append(ref)
                continue
            buf = _Pinned(rt, ref.nbytes)
            if is_input and ref.nbytes:
                rt.memcpy_async(buf.ptr, ref.ptr, ref.nbytes, s)
            hosts.append(buf.host_ref(ref.dtype, ref.count))
            if not is_input:
                backs.append((ref, buf))
        _wait(rt.record_event(s), deadline, "device-to-host copy", self.rank)
        run(hosts, deadline - time.monotonic())
        for ref, buf in backs:
            if ref.nbytes:
                rt.memcpy_async(ref.ptr, buf.ptr, ref.nbytes, s)
        if backs:  # the pinned buffers must outlive the copies
            _wait(rt.record_event(s), deadline, "host-to-device copy", self.rank)

    # ---- out of place: a device copy into out, then the in-place pipeline on it ------------

    def all_reduce_out(self, x: ArrayRef, out: ArrayRef, op: ReduceOp, *, timeout: float,
                       stream: Any = None):
        if x.kind != "device" and out.kind != "device":
            return self.inner.all_reduce_out(x, out, op, timeout=timeout)
        self._copy(x, out, stream, timeout)
        self.all_reduce(out, op, timeout=timeout, stream=stream)

    def reduce_out(self, x: ArrayRef, out: ArrayRef | None, root: int, op: ReduceOp, *,
                   timeout: float, stream: Any = None):
        if all(r is None or r.kind != "device" for r in (x, out)):
            return self.inner.reduce_out(x, out, root, op, timeout=timeout)
        if self.rank != root:
            return self.reduce(x, root, op, timeout=timeout, stream=stream)
        self._copy(x, out, stream, timeout)
        self.reduce(out, root, op, timeout=timeout, stream=stream)

    def broadcast_out(self, x: ArrayRef | None, out: ArrayRef, root: int, *, timeout: float,
                      stream: Any = None):
        if all(r is None or r.kind != "device" for r in (x, out)):
            return self.inner.broadcast_out(x, out, root, timeout=timeout)
        if self.rank == root:
            self._copy(x, out, stream, timeout)
        self.broadcast(out, root, timeout=timeout, stream=stream)

    def _copy(self, src: ArrayRef, dst: ArrayRef, stream: Any, timeout: float) -> None:
        """``dst`` := ``src`` (same size; either may be on the device), ordered on the stream."""
        rt = cuda.runtime()
        s = self._stream(rt, src if src.kind == "device" else dst, stream)
        if src.nbytes:
            rt.memcpy_async(dst.ptr, src.ptr, src.nbytes, s)
        _wait(rt.record_event(s), time.monotonic() + timeout, "copy into out", self.rank)

    # ---- uneven sizes and grouped rounds: whole buffers ----------------------------------

    def exchange(self, sends, recvs, layout: int, *, timeout: float, stream: Any = None):
        peers = [p for p, _ in sends] + [p for p, _ in recvs]
        refs = tuple(r for _, r in sends) + tuple(r for _, r in recvs)
        flags = (True,) * len(sends) + (False,) * len(recvs)
        k = len(sends)
        self._whole(refs, flags, timeout, stream, lambda h, t: self.inner.exchange(
            list(zip(peers[:k], h[:k], strict=True)), list(zip(peers[k:], h[k:], strict=True)),
            layout, timeout=t))

    def all_gather_v(self, x: ArrayRef, out: ArrayRef, counts, layout: int, *, timeout: float,
                     stream: Any = None):
        self._whole((x, out), (True, False), timeout, stream,
                    lambda h, t: self.inner.all_gather_v(h[0], h[1], counts, layout, timeout=t))

    def reduce_scatter_v(self, x: ArrayRef, out: ArrayRef, counts, op: ReduceOp, layout: int,
                         *, timeout: float, stream: Any = None):
        self._whole((x, out), (True, False), timeout, stream,
                    lambda h, t: self.inner.reduce_scatter_v(h[0], h[1], counts, op, layout,
                                                             timeout=t))

    def all_reduce_coalesced(self, xs, op: ReduceOp, *, timeout: float, stream: Any = None):
        if all(x.kind != "device" for x in xs):
            return self.inner.all_reduce_coalesced(xs, op, timeout=timeout)
        super().all_reduce_coalesced(xs, op, timeout=timeout, stream=stream)

    def batch_p2p(self, ops, *, timeout: float, stream: Any = None):
        """Host buffers go to the ring as they are. With device buffers the whole batch is
        staged: sends copied down, every message posted together, receives copied back up;
        it has completed when this returns."""
        if all(x.kind != "device" for _, x, _ in ops):
            return self.inner.batch_p2p(ops, timeout=timeout)
        refs = tuple(x for _, x, _ in ops)
        flags = tuple(sending for sending, _, _ in ops)

        def run(hosts: list, t: float) -> None:
            staged = [(sending, h, peer) for (sending, _, peer), h in zip(ops, hosts, strict=True)]
            for work in self.inner.batch_p2p(staged, timeout=t):
                work.wait()

        self._whole(refs, flags, timeout, stream, run)
        return [CompletedWork() for _ in ops]

    # ---- streams and pinned buffers ------------------------------------------------------

    def _stream(self, rt: Any, ref: ArrayRef, stream: Any) -> int:
        if stream is None:
            stream = getattr(self._local, "stream", None)
        s = rt.stream_handle(stream)
        if ref.stream is not None and ref.stream != s:
            rt.wait_event(s, rt.record_event(ref.stream))
        return s

    def _buffers(self, rt: Any, nbytes: int) -> list[_Pinned]:
        if self._pair is None or self._pair[0].mem.nbytes < nbytes:
            self._pair = [_Pinned(rt, nbytes), _Pinned(rt, nbytes)]
        return self._pair

    # ---- the rest delegates --------------------------------------------------------------

    def barrier(self, *, timeout: float) -> None:
        self.inner.barrier(timeout=timeout)

    def run_async(self, call: Callable[[], None], *, stream: Any = None):
        """Run on the inner backend's worker, with this thread's current stream as default
        (CUDA's current stream is per thread)."""
        issuer = stream if stream is not None else _current_stream()

        def staged() -> None:
            self._local.stream = issuer
            try:
                call()
            finally:
                self._local.stream = None

        return self.inner.run_async(staged, stream=stream)

    def run_sync(self, call: Callable[[], None]) -> None:
        self.inner.run_sync(call)

    def split(self, store: Any, rank: int | None, size: int, color: int | None, key: int,
              *, timeout: float) -> Backend | None:
        sub = self.inner.split(store, rank, size, color, key, timeout=timeout)
        return None if sub is None else StagedBackend(sub, chunk_bytes=self.chunk_bytes)

    def shrink(self, store: Any, members: list[int], *, timeout: float,
               liveness: Any = None) -> Backend:
        return StagedBackend(self.inner.shrink(store, members, timeout=timeout,
                                               liveness=liveness), chunk_bytes=self.chunk_bytes)

    def abort(self, reason: str | GpucollError) -> None:
        self.inner.abort(reason)

    def close(self) -> None:
        self.inner.close()


def _current_stream() -> int | None:
    """This thread's current stream, or None where no device array can exist (CuPy's runtime
    with CuPy never imported, or no CUDA at all) - host-only calls must not load CuPy."""
    rt = cuda.runtime()
    if isinstance(rt, cuda.CupyRuntime) and "cupy" not in sys.modules:
        return None
    try:
        return rt.current_stream()
    except Exception:  # noqa: BLE001 - no usable CUDA: host-only calls need no stream
        return None


def _wait(event: Any, deadline: float, what: str, rank: int) -> None:
    """Block the host until ``event`` is done, at most until ``deadline``."""
    delay = 0.00002
    while event is not None and not event.done():
        if time.monotonic() > deadline:
            raise CollectiveTimeout(f"staged {what} on rank {rank} did not finish in time")
        time.sleep(delay)
        delay = min(delay * 2, 0.001)
