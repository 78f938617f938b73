"""Data-parallel training of a small MLP: each rank takes a slice of every batch, gradients are
averaged with one all_reduce, and every rank applies the same update.

Checks: the loss falls, the parameters are bit-identical on every rank, and they equal (to
rounding) those of one process trained on the union of the ranks' slices.

    gpucoll run -n 4 examples/train_mlp.py [--steps 60] [--device]
"""

from __future__ import annotations

import sys

import numpy as np
from _example import finish, parse_args, start, to_host

IN, HIDDEN, OUT = 8, 32, 1
PER_RANK = 16  # rows of each batch per rank


def extra(parser) -> None:
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=0.1)


def dataset(world: int, steps: int):
    """The whole job's data, the same on every rank: batches of a smooth target function."""
    rng = np.random.default_rng(1234)
    x = rng.normal(size=(steps, world * PER_RANK, IN))
    w = rng.normal(size=(IN, OUT)) / np.sqrt(IN)
    return x, np.sin(x @ w) + 0.1 * (x[..., :1] ** 2)


def init_params(xp, seed: int) -> list:
    rng = np.random.default_rng(seed)
    shapes = [(IN, HIDDEN), (HIDDEN,), (HIDDEN, OUT), (OUT,)]
    return [xp.asarray(rng.normal(size=s) / np.sqrt(s[0]) if len(s) == 2 else np.zeros(s))
            for s in shapes]


def loss_and_grads(xp, params, x, y):
    """Mean squared error of a tanh MLP, and its gradient by hand (no autograd needed)."""
    w1, b1, w2, b2 = params
    h = xp.tanh(x @ w1 + b1)
    err = h @ w2 + b2 - y
    n = x.shape[0]
    d_out = 2 * err / n
    d_h = (d_out @ w2.T) * (1 - h * h)
    grads = [x.T @ d_h, d_h.sum(0), h.T @ d_out, d_out.sum(0)]
    return float((err * err).mean()), grads


def sgd(params, grads, lr: float) -> None:
    for p, g in zip(params, grads, strict=True):
        p -= lr * g


def flat(xp, arrays):
    return xp.concatenate([a.ravel() for a in arrays])


def unflat(vec, like) -> list:
    out, at = [], 0
    for a in like:
        out.append(vec[at:at + a.size].reshape(a.shape))
        at += a.size
    return out


def main() -> int:
    args = parse_args(__doc__, extra)
    comm, xp = start(args.device)
    r, n = comm.rank, comm.size
    xs, ys = dataset(n, args.steps)

    # every rank starts from rank 0's parameters
    params = init_params(xp, seed=100 + r)
    for p in params:
        comm.broadcast(p, root=0)
    reference = init_params(xp, seed=100)  # the single-process run on whole batches

    losses = []
    for step in range(args.steps):
        mine = slice(r * PER_RANK, (r + 1) * PER_RANK)
        x, y = xp.asarray(xs[step, mine]), xp.asarray(ys[step, mine])
        loss, grads = loss_and_grads(xp, params, x, y)
        packed = flat(xp, grads + [xp.asarray([loss])])
        comm.all_reduce(packed, op="avg")  # one call for every gradient and the loss
        sgd(params, unflat(packed, grads), args.lr)
        losses.append(float(to_host(packed[-1:])[0]))

        _, ref_grads = loss_and_grads(xp, reference, xp.asarray(xs[step]), xp.asarray(ys[step]))
        sgd(reference, ref_grads, args.lr)
        if r == 0 and step % 10 == 0:
            print(f"step {step:3d}  loss {losses[-1]:.5f}", flush=True)

    mine = flat(xp, params)
    everyone = to_host(comm.all_gather(mine))
    identical = all(np.array_equal(everyone[0], everyone[i]) for i in range(n))
    gap = float(np.abs(to_host(mine) - to_host(flat(xp, reference))).max())
    first, last = np.mean(losses[:5]), np.mean(losses[-5:])
    ok = last < 0.5 * first and identical and gap < 1e-9
    detail = (f"loss {first:.4f} -> {last:.4f} over {args.steps} steps; parameters identical on "
              f"{n} ranks: {identical}; max difference from one process on the whole batches: "
              f"{gap:.1e}")
    return finish(comm, xp, "train_mlp", ok, detail)


if __name__ == "__main__":
    sys.exit(main())
