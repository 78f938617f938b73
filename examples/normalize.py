"""Global mean/variance normalisation of data sharded unevenly across ranks.

Each rank holds a different number of rows. Two all_reduce calls give the global count and mean,
then the global variance (two passes, numerically stable); each rank normalises its own rows.
Checks: the statistics equal NumPy's on all the data in one place, and the normalised data has
mean 0 and variance 1 globally.

    gpucoll run -n 4 examples/normalize.py [--device]
"""

from __future__ import annotations

import sys

import numpy as np
from _example import finish, parse_args, start, to_host

FEATURES = 5


def shard(rank: int) -> np.ndarray:
    """This rank's rows: a different count, offset and spread per rank and per feature."""
    rng = np.random.default_rng(rank)
    rows = 1000 + 337 * rank
    scale = np.arange(1, FEATURES + 1)
    return rng.normal(loc=3.0 * rank, scale=scale, size=(rows, FEATURES)) + 100.0


def global_moments(comm, xp, x):
    """(global mean, global variance) per feature, over every rank's rows."""
    sums = xp.concatenate([xp.asarray([x.shape[0]], dtype=x.dtype), x.sum(axis=0)])
    comm.all_reduce(sums)
    count, mean = sums[0], sums[1:] / sums[0]
    sq = ((x - mean) ** 2).sum(axis=0)
    comm.all_reduce(sq)
    return mean, sq / count


def main() -> int:
    args = parse_args(__doc__)
    comm, xp = start(args.device)
    x = xp.asarray(shard(comm.rank))
    mean, var = global_moments(comm, xp, x)
    z = (x - mean) / xp.sqrt(var)
    z_mean, z_var = global_moments(comm, xp, z)

    everything = np.concatenate([shard(r) for r in range(comm.size)])
    want_mean, want_var = everything.mean(axis=0), everything.var(axis=0)
    err_mean = float(np.abs(to_host(mean) - want_mean).max())
    err_var = float(np.abs(to_host(var) / want_var - 1).max())
    print(f"{x.shape[0]} rows here; global mean {np.round(to_host(mean), 3)}, "
          f"variance {np.round(to_host(var), 3)}", flush=True)
    ok = (err_mean < 1e-9 and err_var < 1e-9 and float(np.abs(to_host(z_mean)).max()) < 1e-9
          and float(np.abs(to_host(z_var) - 1).max()) < 1e-9)
    detail = (f"{len(everything)} rows on {comm.size} ranks: mean and variance match NumPy on "
              f"all rows (errors {err_mean:.1e}, {err_var:.1e}); normalised mean "
              f"{float(np.abs(to_host(z_mean)).max()):.1e}, variance "
              f"{float(to_host(z_var).mean()):.6f}")
    return finish(comm, xp, "normalize", ok, detail)


if __name__ == "__main__":
    sys.exit(main())
