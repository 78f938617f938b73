"""Carry on after losing a rank: data-parallel training that loses one rank to SIGKILL half way,
shrinks its communicator to the survivors, reloads the last step's state from one of them
(broadcast_object), and finishes on the rest.

Each step's global batch (the same rows however many ranks there are) is split among the ranks
that are left; the gradient is the sum over every row divided by their number, so the training
gives the same result on 4 ranks, on 3, or in one process. Checks: the loss falls, the
parameters are bit-identical on every survivor, and they equal (to rounding) those of one
process trained on the whole batches.

    gpucoll run -n 4 --keep-going examples/shrink.py [--steps 40] [--kill-rank 3] [--device]
"""

from __future__ import annotations

import os
import signal
import sys

import numpy as np
from _example import finish, parse_args, start, to_host

import gpucoll

IN, HIDDEN, OUT = 8, 32, 1
ROWS = 48  # rows of each step's batch: divides among 4, 3, 2 or 1 ranks


def extra(parser) -> None:
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--kill-rank", type=int, default=-1,
                        help="the rank that dies (default: the last one)")
    parser.add_argument("--kill-step", type=int, default=-1,
                        help="the step it dies at, before its gradient is shared (default: "
                        "half way)")


def dataset(steps: int):
    rng = np.random.default_rng(1234)
    x = rng.normal(size=(steps, ROWS, IN))
    w = rng.normal(size=(IN, OUT)) / np.sqrt(IN)
    return x, np.sin(x @ w) + 0.1 * (x[..., :1] ** 2)


def init_params(xp) -> list:
    rng = np.random.default_rng(100)
    shapes = [(IN, HIDDEN), (HIDDEN,), (HIDDEN, OUT), (OUT,)]
    return [xp.asarray(rng.normal(size=s) / np.sqrt(s[0]) if len(s) == 2 else np.zeros(s))
            for s in shapes]


def summed_grads(xp, params, x, y):
    """The squared error summed over the rows of ``x`` and its gradient (summed, not averaged,
    so that shards of any size add up to the whole batch's)."""
    w1, b1, w2, b2 = params
    h = xp.tanh(x @ w1 + b1)
    err = h @ w2 + b2 - y
    d_out = 2 * err
    d_h = (d_out @ w2.T) * (1 - h * h)
    return float((err * err).sum()), [x.T @ d_h, d_h.sum(0), h.T @ d_out, d_out.sum(0)]


def flat(xp, arrays):
    return xp.concatenate([a.ravel() for a in arrays])


def unflat(vec, like) -> list:
    out, at = [], 0
    for a in like:
        out.append(vec[at:at + a.size].reshape(a.shape))
        at += a.size
    return out


def train_step(comm, xp, params, x, y, lr: float) -> float:
    """One step on this rank's share of the batch; the gradients travel in one all_reduce."""
    share = ROWS // comm.size
    mine = slice(comm.rank * share, (comm.rank + 1) * share)
    loss, grads = summed_grads(xp, params, xp.asarray(x[mine]), xp.asarray(y[mine]))
    packed = flat(xp, grads + [xp.asarray([loss])])
    comm.all_reduce(packed)
    packed /= ROWS
    for p, g in zip(params, unflat(packed, grads), strict=True):
        p -= lr * g
    return float(to_host(packed[-1:])[0])


def reload(comm, xp, params, step: int) -> int:
    """After a shrink: the survivors resume from the earliest step any of them completed,
    with the parameters of the first survivor that stands there (sent by broadcast_object)."""
    done = xp.asarray([step], dtype=xp.int64)
    comm.all_reduce(done, op="min")
    resume = int(to_host(done)[0])
    mine = xp.asarray([comm.rank if step == resume else comm.size], dtype=xp.int64)
    comm.all_reduce(mine, op="min")
    src = int(to_host(mine)[0])
    state = comm.broadcast_object({"step": resume, "params": [to_host(p) for p in params]}
                                  if comm.rank == src else None, root=src)
    for p, v in zip(params, state["params"], strict=True):
        p[...] = xp.asarray(v)
    return state["step"]


def main() -> int:
    args = parse_args(__doc__, extra)
    comm, xp = start(args.device)
    victim = args.kill_rank if args.kill_rank >= 0 else comm.size - 1
    if comm.size < 2:
        victim = -1  # one rank alone has nobody to carry on
    kill_at = args.kill_step if args.kill_step >= 0 else args.steps // 2
    xs, ys = dataset(args.steps)
    params = init_params(xp)
    losses, step, started_on = [], 0, comm.size
    while step < args.steps:
        if comm.size == started_on and comm.rank == victim and step == kill_at:
            print(f"rank {comm.rank}: killed at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            losses.append(train_step(comm, xp, params, xs[step], ys[step], args.lr))
            step += 1
        except gpucoll.PeerFailure as exc:
            old = comm
            comm = comm.shrink()
            old.close()
            print(f"rank {comm.rank} of {comm.size} (was rank {old.rank} of {old.size}): lost a "
                  f"rank at step {step} ({type(exc).__name__}); carrying on", flush=True)
            step = reload(comm, xp, params, step)
            del losses[step:]
    if comm.rank == 0:
        print(f"finished {args.steps} steps on {comm.size} of {started_on} ranks", flush=True)

    reference = init_params(xp)  # one process on the whole batches
    for s in range(args.steps):
        _, grads = summed_grads(xp, reference, xp.asarray(xs[s]), xp.asarray(ys[s]))
        for p, g in zip(reference, grads, strict=True):
            p -= args.lr * g / ROWS
    mine = flat(xp, params)
    everyone = to_host(comm.all_gather(mine))
    identical = all(np.array_equal(everyone[0], row) for row in everyone)
    gap = float(np.abs(to_host(mine) - to_host(flat(xp, reference))).max())
    first, last = np.mean(losses[:5]), np.mean(losses[-5:])
    ok = last < 0.5 * first and identical and gap < 1e-9
    detail = (f"{args.steps} steps, the last {args.steps - kill_at} on {comm.size} of "
              f"{started_on} ranks; loss {first:.4f} -> {last:.4f}; parameters identical on the "
              f"survivors: {identical}; max difference from one process: {gap:.1e}")
    return finish(comm, xp, "shrink", ok, detail)


if __name__ == "__main__":
    sys.exit(main())
