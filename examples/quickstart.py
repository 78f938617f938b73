"""Every collective once, with each rank's values before and after.

    gpucoll run -n 4 examples/quickstart.py            # NumPy arrays, host ring
    gpucoll run -n 4 examples/quickstart.py --device   # CuPy arrays, NCCL
"""

from __future__ import annotations

import sys

import numpy as np
from _example import finish, parse_args, start, to_host


def show(comm, op: str, before, after) -> None:
    """One line per rank; the barrier keeps each collective's lines together."""
    print(f"{op:<22} before {fmt(before):<32} after {fmt(after)}", flush=True)
    comm.barrier()


def fmt(a) -> str:
    return "-" if a is None else str(to_host(a).tolist())


def main() -> int:
    args = parse_args(__doc__)
    comm, xp = start(args.device)
    wrong = []

    def expect(op: str, got, want) -> None:
        if not np.array_equal(to_host(got), np.asarray(want)):
            wrong.append(f"{op}: got {fmt(got)}, want {np.asarray(want).tolist()}")

    reductions(comm, xp, expect)
    gathers_and_scatters(comm, xp, expect)
    point_to_point_and_async(comm, xp, expect)
    calls = 11 if comm.size > 1 else 10  # one rank has no peer for send/recv
    ranks = f"{comm.size} rank{'s' if comm.size > 1 else ''}"
    done = f"{calls} collectives on {ranks} gave the expected values"
    return finish(comm, xp, "quickstart", not wrong, "; ".join(wrong) or done)


def reductions(comm, xp, expect) -> None:
    r, n = comm.rank, comm.size
    x = xp.full(2, r + 1, dtype=xp.float32)
    before = x.copy()
    comm.all_reduce(x, op="sum")
    show(comm, "all_reduce(sum)", before, x)
    expect("all_reduce", x, np.full(2, n * (n + 1) / 2))

    x = xp.full(2, r + 1, dtype=xp.int64)
    before = x.copy()
    comm.all_reduce(x, op="max")
    show(comm, "all_reduce(max)", before, x)
    expect("all_reduce max", x, [n, n])

    x = xp.arange(3, dtype=xp.float64) + 10 * r
    before = x.copy()
    comm.broadcast(x, root=0)
    show(comm, "broadcast(root=0)", before, x)
    expect("broadcast", x, np.arange(3))

    x = xp.full(2, r + 1, dtype=xp.float32)
    before = x.copy()
    comm.reduce(x, root=0, op="sum")
    show(comm, "reduce(root=0)", before, x if r == 0 else None)
    if r == 0:
        expect("reduce", x, np.full(2, n * (n + 1) / 2))


def gathers_and_scatters(comm, xp, expect) -> None:
    r, n = comm.rank, comm.size
    x = xp.asarray([r, r * r], dtype=xp.int32)
    got = comm.all_gather(x)
    show(comm, "all_gather", x, got)
    expect("all_gather", got, [[i, i * i] for i in range(n)])

    got = comm.gather(x, root=0)
    show(comm, "gather(root=0)", x, got)
    if r == 0:
        expect("gather", got, [[i, i * i] for i in range(n)])

    src = xp.arange(n * 2, dtype=xp.float32).reshape(n, 2) if r == 0 else None
    got = comm.scatter(src, root=0)
    show(comm, "scatter(root=0)", src, got)
    expect("scatter", got, [2 * r, 2 * r + 1])

    x = xp.ones((n, 2), dtype=xp.float32) * (r + 1)
    got = comm.reduce_scatter(x, op="sum")
    show(comm, "reduce_scatter(sum)", x, got)
    expect("reduce_scatter", got, np.full(2, n * (n + 1) / 2))

    x = xp.asarray([[10 * r + j] for j in range(n)], dtype=xp.int64)
    got = comm.all_to_all(x)
    show(comm, "all_to_all", x, got)
    expect("all_to_all", got, [[10 * j + r] for j in range(n)])


def point_to_point_and_async(comm, xp, expect) -> None:
    r, n = comm.rank, comm.size
    if n > 1:  # one rank has no peer: a send to itself is an error
        # point to point around a ring: send right, receive from the left (overlapped)
        x = xp.full(1, r, dtype=xp.int32)
        got = xp.empty_like(x)
        work = comm.send(x, (r + 1) % n, async_op=True)
        comm.recv(got, (r - 1) % n)
        work.wait()
        show(comm, "send right / recv left", x, got)
        expect("send/recv", got, [(r - 1) % n])

    x = xp.full(2, float(r), dtype=xp.float64)
    work = comm.all_reduce(x, op="avg", async_op=True)
    work.wait()
    show(comm, "all_reduce(avg, async)", xp.full(2, float(r)), x)
    expect("all_reduce avg", x, np.full(2, (n - 1) / 2))


if __name__ == "__main__":
    sys.exit(main())
