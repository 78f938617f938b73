"""The out-of-place forms of all_reduce, reduce and broadcast (``out=``), as NCCL has them.

``x`` is only read (on ranks where it is read at all) and the result lands in ``out``, an array
of ``x``'s shape and dtype that shares no memory with it. The in-place calls hand off here when
they are given ``out``, so their own path stays as it was.
"""

from __future__ import annotations

from typing import Any

from gpucoll.validation import Call


class OutOfPlaceCalls:
    """The ``out=`` forms for ``Communicator`` (a mixin: it uses the communicator's argument
    checks, sequence numbers and backend)."""

    def _all_reduce_out(self, c: Call, x: Any, out: Any, op: Any, async_op: bool,
                        timeout: float | None, stream: Any) -> Any:
        ref = c.array(x, "x")
        rop = c.op(op, ref.dtype)
        t = c.timeout(timeout, self.timeout)
        res = c.output(out, ref, tuple(ref.shape), (ref,))
        seq = self._signature(c, t, ref, op=rop)
        b = self._backend
        return self._issue(c, seq, lambda: b.all_reduce_out(ref, res, rop, timeout=t,
                                                             stream=stream),
                           res.array, async_op, stream)

    def _reduce_out(self, c: Call, x: Any, out: Any, root: Any, op: Any, async_op: bool,
                    timeout: float | None, stream: Any) -> Any:
        root = c.rank_arg(root, "root")
        ref = c.array(x, "x")
        rop = c.op(op, ref.dtype)
        t = c.timeout(timeout, self.timeout)
        res = None if out is None else c.output(out, ref, tuple(ref.shape), (ref,))
        if res is None and self.rank == root:
            raise c.fail(ValueError, "out is None on the root; root receives the result there")
        seq = self._signature(c, t, ref, op=rop, root=root)
        b = self._backend
        return self._issue(c, seq, lambda: b.reduce_out(
            ref, res if self.rank == root else None, root, rop, timeout=t, stream=stream),
            None if res is None else res.array, async_op, stream)

    def _broadcast_out(self, c: Call, x: Any, out: Any, root: Any, async_op: bool,
                       timeout: float | None, stream: Any) -> Any:
        root = c.rank_arg(root, "root")
        t = c.timeout(timeout, self.timeout)
        if self.rank == root:
            if x is None:
                raise c.fail(TypeError, f"x is None on the root; root {root} broadcasts its x")
            ref = c.array(x, "x")
            res = c.output(out, ref, tuple(ref.shape), (ref,))
        else:  # x is not read here: out alone says what arrives
            ref = None
            res = c.array(out, "out", writable=True, copy=False)
        seq = self._signature(c, t, res, root=root)
        b = self._backend
        return self._issue(c, seq, lambda: b.broadcast_out(ref, res, root, timeout=t,
                                                            stream=stream),
                           res.array, async_op, stream)
