"""Ring all-reduce written with send/recv, checked against the library's all_reduce.

The array is cut into one chunk per rank. Reduce-scatter: n-1 steps, each rank sends a chunk to
its right neighbour and adds the chunk from its left one, after which rank r owns the full sum
of chunk r+1. All-gather: n-1 more steps pass the finished chunks around the ring. Each step
sends asynchronously and receives at the same time, so no rank waits on a full socket.

    gpucoll run -n 4 examples/ring_allreduce.py [--count 100003] [--device]
"""

from __future__ import annotations

import sys

import numpy as np
from _example import finish, parse_args, start, to_host


def extra(parser) -> None:
    parser.add_argument("--count", type=int, default=100_003, help="elements (any number)")


def exchange(comm, send_buf, recv_buf) -> None:
    """Send to the right neighbour while receiving from the left one."""
    work = comm.send(send_buf, (comm.rank + 1) % comm.size, async_op=True)
    comm.recv(recv_buf, (comm.rank - 1) % comm.size)
    work.wait()


def ring_all_reduce(comm, xp, x):
    """Sum ``x`` (1-D) over every rank, in place, with 2(n-1) neighbour exchanges."""
    n, r = comm.size, comm.rank
    bounds = np.linspace(0, x.size, n + 1).astype(int)
    chunk = lambda i: x[bounds[i % n]:bounds[i % n + 1]]
    # reduce-scatter
    for step in range(n - 1):
        incoming = xp.empty_like(chunk(r - step - 1))
        exchange(comm, chunk(r - step), incoming)
        chunk(r - step - 1)[...] += incoming
    # all-gather: rank r now holds the finished chunk r+1
    for step in range(n - 1):
        exchange(comm, chunk(r - step + 1), chunk(r - step))
    return x


def main() -> int:
    args = parse_args(__doc__, extra)
    comm, xp = start(args.device)
    rng = np.random.default_rng(comm.rank)
    results = []
    for dtype in (np.int64, np.float64):
        data = rng.integers(-1000, 1000, size=args.count).astype(dtype)
        if dtype == np.float64:
            data = data * 0.001 + rng.random(args.count)
        ours = ring_all_reduce(comm, xp, xp.array(data))  # copies: both work in place
        theirs = comm.all_reduce(xp.array(data))
        a, b = to_host(ours), to_host(theirs)
        # integers must match exactly; floats up to the order of the additions
        same = np.array_equal(a, b) if dtype == np.int64 else np.allclose(a, b, rtol=1e-12)
        results.append((np.dtype(dtype).name, same, float(np.abs(a - b).max())))
    if comm.rank == 0:
        for name, same, gap in results:
            print(f"{name:8} {args.count} elements: ring == all_reduce: {same} "
                  f"(max difference {gap:.1e})", flush=True)
    ok = all(same for _, same, _ in results)
    detail = (f"send/recv ring all-reduce of {args.count} elements on {comm.size} ranks equals "
              f"all_reduce for int64 (exactly) and float64")
    return finish(comm, xp, "ring_allreduce", ok, detail)


if __name__ == "__main__":
    sys.exit(main())
