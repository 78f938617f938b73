"""One SPMD job: rank 0 broadcasts the parameters, scatters the work, and gathers the results.

The work is evaluating a polynomial (the parameters) at many points; rank 0 checks the gathered
results against doing all the work itself.

    gpucoll run -n 4 examples/spmd.py [--points-per-rank 10000] [--device]
"""

from __future__ import annotations

import sys

import numpy as np
from _example import finish, parse_args, start, to_host

DEGREE = 6


def extra(parser) -> None:
    parser.add_argument("--points-per-rank", type=int, default=10_000)


def evaluate(xp, coeffs, x):
    """Horner's rule: the work each rank does on its share of the points."""
    y = xp.zeros_like(x)
    for c in coeffs:
        y = y * x + c
    return y


def main() -> int:
    args = parse_args(__doc__, extra)
    comm, xp = start(args.device)
    k = args.points_per_rank

    # 1. parameters: made on rank 0, sent to all
    coeffs = xp.zeros(DEGREE + 1)
    if comm.rank == 0:
        coeffs[...] = xp.asarray(np.random.default_rng(0).normal(size=DEGREE + 1))
    comm.broadcast(coeffs, root=0)

    # 2. work: rank 0 holds every point; each rank gets k of them
    points = xp.linspace(-1.0, 1.0, comm.size * k) if comm.rank == 0 else None
    mine = comm.scatter(points, root=0, tiled=True)

    # 3. results: each rank's k values, gathered in rank order on rank 0
    results = comm.gather(evaluate(xp, coeffs, mine), root=0, tiled=True)
    print(f"evaluated {mine.size} points in [{float(mine[0]):+.4f}, {float(mine[-1]):+.4f}]",
          flush=True)

    ok, detail = True, f"{comm.size} ranks x {k} points"
    if comm.rank == 0:
        want = np.polyval(to_host(coeffs), to_host(points))
        gap = float(np.abs(to_host(results) - want).max())
        ok = results.shape == (comm.size * k,) and gap < 1e-12
        detail += f": gathered results equal rank 0's own evaluation (max difference {gap:.1e})"
    return finish(comm, xp, "spmd", ok, detail)


if __name__ == "__main__":
    sys.exit(main())
