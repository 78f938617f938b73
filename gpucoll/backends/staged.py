"""Device arrays on a host backend: staged through pinned host memory, chunk by chunk.

``StagedBackend`` wraps a host backend (the ring). Host buffers pass straight through. For
device buffers of element-wise ops (all_reduce, broadcast, reduce, send, recv) the data moves in
chunks through two pinned buffers: while the ring works on chunk i on the host, the copy of
chunk i+1 to the host and the copy of chunk i-1's result back are both queued on the stream,
and the host waits only for the copy of the chunk it works on next. Ops that rearrange slots
(gathers, scatters, all-to-all) stage whole buffers. Every copy is queued on the call's stream
(default: the issuing thread's current stream), which first waits for the data's producers, so
the staged call is ordered after them and later work on the stream sees the results; the call
runs with the arrays' device current. Pinned buffers and device arrays stay referenced until
the copies that use them are done (``cuda.hold``), and an asynchronous call's Work is complete
only once its copies back are.
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
from gpucoll.backends import Backend
from gpucoll.errors import CollectiveTimeout, GpucollError, UsageError
from gpucoll.ops import ReduceOp
from gpucoll.work import CompletedWork, DeviceTail, wait_event

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

    def isend(self, x: ArrayRef, dst: int, *, timeout: float, stream: Any = None,
              tag: int = 0):
        if x.kind != "device":
            return self.inner.isend(x, dst, timeout=timeout, tag=tag)
        return super().isend(x, dst, timeout=timeout, stream=stream, tag=tag)

    def irecv(self, x: ArrayRef, src: int, *, timeout: float, stream: Any = None,
              tag: int = 0):
        if x.kind != "device":
            return self.inner.irecv(x, src, timeout=timeout, tag=tag)
        return super().irecv(x, src, timeout=timeout, stream=stream, tag=tag)

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

    def send(self, x: ArrayRef, dst: int, *, timeout: float, stream: Any = None, tag: int = 0):
        if x.kind != "device":
            return self.inner.send(x, dst, timeout=timeout, tag=tag)
        self._pipeline(x, True, False, timeout, stream,
                       lambda h, t: self.inner.send(h, dst, timeout=t, tag=tag))

    def recv(self, x: ArrayRef, src: int, *, timeout: float, stream: Any = None, tag: int = 0):
        if x.kind != "device":
            return self.inner.recv(x, src, timeout=timeout, tag=tag)
        self._pipeline(x, False, True, timeout, stream,
                       lambda h, t: self.inner.recv(h, src, timeout=t, tag=tag))

    def _pipeline(self, x: ArrayRef, down: bool, up: bool, timeout: float, stream: Any,
                  run: Callable[[ArrayRef, float], None]) -> None:
        """Chunk k: device->host copy, ``run`` on the host, host->device copy of the result,
        alternating between two pinned buffers. Every copy is queued on the call's stream, in
        the order copy down k+1, copy up k: the host waits only for the copy down of the chunk
        it works on next, so the ring's work on chunk k overlaps the copy up of chunk k-1 and
        the copy down of chunk k+1."""
        rt, deadline = cuda.runtime(), time.monotonic() + timeout
        item = x.dtype.itemsize
        with rt.using_device(x.device):
            s = self._stream(rt, (x,), stream, "staged")
            per = max(1, self.chunk_bytes // item)
            chunks = [(i, min(per, x.count - i)) for i in range(0, x.count, per)] or [(0, 0)]
            pair = self._buffers(rt, min(x.nbytes, per * item), s)
            last = None
            try:
                ready = [self._down(rt, x, pair[0], chunks[0], s, down)]
                for k, (start, count) in enumerate(chunks):
                    buf = pair[k % 2]
                    if k + 1 < len(chunks):  # queued ahead: runs while the host works on k
                        ready.append(self._down(rt, x, pair[(k + 1) % 2], chunks[k + 1], s,
                                                down))
                    _wait(ready[k], deadline, "device-to-host copy", self.rank)
                    run(buf.host_ref(x.dtype, count), _left(deadline))
                    if up and count:
                        rt.memcpy_async(x.ptr + start * item, buf.ptr, count * item, s)
                last = rt.record_event(s)
            finally:
                if last is None:
                    last = rt.record_event(s)
                for buf in pair:  # the next call's copies into them come after these
                    buf.busy = last
                cuda.hold(last, x)  # the copies up still write into x
            self._finish(last, deadline)

    def _down(self, rt: Any, x: ArrayRef, buf: _Pinned, chunk: tuple[int, int], s: int,
              down: bool) -> Any:
        """Queue the copy of ``chunk`` into ``buf`` (when ``down``); the event after it (the
        host may use ``buf`` once it has completed)."""
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
        """Copy device inputs to pinned memory, run on the host, copy device outputs back; the
        pinned buffers and the device arrays stay referenced until those copies are done."""
        if all(r is None or r.kind != "device" for r in refs):
            return run(list(refs), timeout)
        rt, deadline = cuda.runtime(), time.monotonic() + timeout
        first = next(r for r in refs if r is not None and r.kind == "device")
        with rt.using_device(first.device):
            s = self._stream(rt, refs, stream, "staged")
            hosts, backs, bufs = [], [], []
            last = None
            try:
                for ref, is_input in zip(refs, inputs, strict=True):
                    if ref is None or ref.kind != "device":
                        hosts.append(ref)
                        continue
                    buf = _Pinned(rt, ref.nbytes)
                    bufs.append(buf)
                    if is_input and ref.nbytes:
                        rt.memcpy_async(buf.ptr, ref.ptr, ref.nbytes, s)
                    hosts.append(buf.host_ref(ref.dtype, ref.count))
                    if not is_input:
                        backs.append((ref, buf))
                _wait(rt.record_event(s), deadline, "device-to-host copy", self.rank)
                run(hosts, _left(deadline))
                for ref, buf in backs:
                    if ref.nbytes:
                        rt.memcpy_async(ref.ptr, buf.ptr, ref.nbytes, s)
                last = rt.record_event(s)
            finally:
                cuda.hold(last if last is not None else rt.record_event(s), refs, bufs)
            self._finish(last, deadline)

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
        """``dst`` := ``src`` (same size; either may be on the device), ordered on the stream;
        both stay referenced until the copy is done."""
        rt = cuda.runtime()
        device = src.device if src.kind == "device" else dst.device
        with rt.using_device(device):
            s = self._stream(rt, (src, dst), stream, "copy into out")
            if src.nbytes:
                rt.memcpy_async(dst.ptr, src.ptr, src.nbytes, s)
            done = rt.record_event(s)
            cuda.hold(done, src, dst)
            _wait(done, time.monotonic() + timeout, "copy into out", self.rank)

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

    def batch_p2p(self, ops, *, timeout: float, stream: Any = None, tags=None):
        """Host buffers go to the ring as they are. With device buffers the whole batch is
        staged: sends copied down, every message posted together, receives copied back up;
        it has completed when this returns."""
        if all(x.kind != "device" for _, x, _ in ops):
            return self.inner.batch_p2p(ops, timeout=timeout, tags=tags)
        refs = tuple(x for _, x, _ in ops)
        flags = tuple(sending for sending, _, _ in ops)

        def run(hosts: list, t: float) -> None:
            staged = [(sending, h, peer) for (sending, _, peer), h in zip(ops, hosts, strict=True)]
            for work in self.inner.batch_p2p(staged, timeout=t, tags=tags):
                work.wait()

        self._whole(refs, flags, timeout, stream, run)
        return [CompletedWork() for _ in ops]

    # ---- streams and pinned buffers ------------------------------------------------------

    def _stream(self, rt: Any, refs: tuple, stream: Any, opname: str) -> int:
        """The call's stream (``stream=``, else the issuing thread's current stream), ordered
        after the producers of the data: that current stream and any CAI v3 stream."""
        current = getattr(self._local, "current", None)
        if current is None:
            current = rt.current_stream()
        s = current if stream is None else rt.stream_handle(stream)
        if rt.is_capturing(s):
            raise UsageError(
                f"{opname} on rank {self.rank}: stream {s:#x} is capturing a CUDA graph; the "
                "host ring cannot run inside a graph")
        producers = [] if current == s else [current]
        for ref in refs:
            if ref is not None and ref.stream is not None and ref.stream != s and \
                    ref.stream not in producers:
                producers.append(ref.stream)
        for p in producers:
            rt.wait_event(s, rt.record_event(p))
        return s

    def _buffers(self, rt: Any, nbytes: int, s: int) -> list[_Pinned]:
        """The two pinned chunk buffers, at least ``nbytes`` each, free for stream ``s``: its
        work comes after their last use (that of an earlier call, maybe on another stream)."""
        if self._pair is None or self._pair[0].mem.nbytes < nbytes:
            old = self._pair
            if old is not None and old[0].busy is not None:  # its copies may still run
                cuda.hold(old[0].busy, old)
            self._pair = [_Pinned(rt, nbytes), _Pinned(rt, nbytes)]
        for buf in self._pair:
            if buf.busy is not None:
                rt.wait_event(s, buf.busy)
        return self._pair

    def _finish(self, last: Any, deadline: float) -> None:
        """Tell the Work of an asynchronous call which device work it left queued."""
        tail = getattr(self._local, "tail", None)
        if tail is not None:
            tail.event, tail.deadline = last, deadline

    # ---- the rest delegates --------------------------------------------------------------

    def barrier(self, *, timeout: float) -> None:
        self.inner.barrier(timeout=timeout)

    def run_async(self, call: Callable[[], None], *, stream: Any = None):
        """Run on the inner backend's worker with the issuing thread's current stream (CUDA's
        current stream is per thread); the Work completes once the copies back are done."""
        current = _current_stream()
        tail = DeviceTail()

        def staged() -> None:
            self._local.current, self._local.tail = current, tail
            try:
                call()
            finally:
                self._local.current = self._local.tail = None

        work = self.inner.run_async(staged, stream=stream)
        work.tail = tail
        return work

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
    """Block the host until ``event`` has completed, at most until ``deadline``."""
    if not wait_event(event, deadline):
        raise CollectiveTimeout(f"staged {what} on rank {rank} did not finish in time")


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.0)
