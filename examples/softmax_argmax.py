"""Distributed softmax and argmax over logits split by columns (a vocabulary sharded across
ranks, as in a tensor-parallel output layer).

softmax: all_reduce(max) of the row maxima, then all_reduce(sum) of the exponentials.
argmax: each rank's best (value, global column); an all_gather of those pairs picks the winner
and the rank that owns it (ties go to the lowest column, like numpy.argmax).
Checks both against NumPy on the whole logits matrix.

    gpucoll run -n 4 examples/softmax_argmax.py [--device]
"""

from __future__ import annotations

import sys

import numpy as np
from _example import finish, parse_args, start, to_host

ROWS, COLS_PER_RANK = 6, 250


def logits(world: int) -> np.ndarray:
    """The whole matrix (every rank can make it; each keeps only its columns)."""
    return np.random.default_rng(7).normal(scale=4.0, size=(ROWS, world * COLS_PER_RANK))


def softmax(comm, xp, part):
    row_max = part.max(axis=1)
    comm.all_reduce(row_max, op="max")
    e = xp.exp(part - row_max[:, None])
    total = e.sum(axis=1)
    comm.all_reduce(total, op="sum")
    return e / total[:, None]


def argmax(comm, xp, part, offset: int):
    """(value, global column, owning rank) of each row's maximum."""
    local = part.argmax(axis=1)
    pairs = xp.stack([part[xp.arange(part.shape[0]), local], (local + offset).astype(part.dtype)])
    everyone = to_host(comm.all_gather(pairs))  # (size, 2, rows)
    values, columns = everyone[:, 0], everyone[:, 1]
    # the highest value; among equal values the lowest column (that of the lowest rank)
    owner = np.argmax(values, axis=0)
    rows = np.arange(values.shape[1])
    return values[owner, rows], columns[owner, rows].astype(np.int64), owner


def main() -> int:
    args = parse_args(__doc__)
    comm, xp = start(args.device)
    full = logits(comm.size)
    mine = slice(comm.rank * COLS_PER_RANK, (comm.rank + 1) * COLS_PER_RANK)
    part = xp.asarray(full[:, mine])

    probs = to_host(softmax(comm, xp, part))
    value, column, owner = argmax(comm, xp, part, comm.rank * COLS_PER_RANK)

    e = np.exp(full - full.max(axis=1, keepdims=True))
    want = (e / e.sum(axis=1, keepdims=True))[:, mine]
    err = float(np.abs(probs - want).max())
    want_col = full.argmax(axis=1)
    argmax_ok = (np.array_equal(column, want_col) and np.array_equal(value, full.max(axis=1))
                 and np.array_equal(owner, want_col // COLS_PER_RANK))
    if comm.rank == 0:
        for i in range(ROWS):
            print(f"row {i}: max {value[i]:.4f} at column {column[i]} on rank {owner[i]}; "
                  f"p = {e[i, column[i]] / e[i].sum():.4f}", flush=True)
    ok = err < 1e-12 and argmax_ok
    detail = (f"softmax over {full.shape[1]} columns on {comm.size} ranks matches NumPy "
              f"(max error {err:.1e}); argmax value, column and owner match: {argmax_ok}")
    return finish(comm, xp, "softmax_argmax", ok, detail)


if __name__ == "__main__":
    sys.exit(main())
