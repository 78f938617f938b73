"""Data-parallel training over whole epochs, the way training scripts do it: the gradients
live in one fused buffer (a ``gpucoll.Bucket``) and are summed with one ``all_reduce_many``
per step; the last batch of each epoch does not divide evenly among the ranks, so the
per-sample losses are collected with ``all_gather_v``; rank 0 decides each epoch's shuffle and
learning rate and shares them, and the final checkpoint, with ``broadcast_object``.

Checks: the loss falls, the parameters are bit-identical on every rank and equal to the
checkpoint rank 0 broadcast, and they match (to rounding) one process trained on whole batches.

    gpucoll run -n 4 examples/train_epochs.py [--epochs 6] [--device]
"""

from __future__ import annotations

import hashlib
import sys

import numpy as np
from _example import finish, parse_args, start, to_host

import gpucoll

IN, HIDDEN, OUT = 8, 32, 1
SAMPLES, BATCH = 998, 120  # 8 full batches and a last one of 38 rows per epoch
SHAPES = [(IN, HIDDEN), (HIDDEN,), (HIDDEN, OUT), (OUT,)]


def extra(parser) -> None:
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--lr", type=float, default=0.2)


def dataset():
    """The whole data set, the same on every rank: a smooth target function of 8 inputs."""
    rng = np.random.default_rng(1234)
    x = rng.normal(size=(SAMPLES, IN))
    w = rng.normal(size=(IN, OUT)) / np.sqrt(IN)
    return x, np.sin(x @ w) + 0.1 * (x[:, :1] ** 2)


def init_params(xp) -> list:
    rng = np.random.default_rng(100)
    return [xp.asarray(rng.normal(size=s) / np.sqrt(s[0]) if len(s) == 2 else np.zeros(s))
            for s in SHAPES]


def losses_and_grad_sums(xp, params, x, y):
    """Per-sample squared errors of a tanh MLP, and the gradients summed over the samples."""
    w1, b1, w2, b2 = params
    h = xp.tanh(x @ w1 + b1)
    err = h @ w2 + b2 - y
    d_out = 2 * err
    d_h = (d_out @ w2.T) * (1 - h * h)
    return (err * err).ravel(), [x.T @ d_h, d_h.sum(0), h.T @ d_out, d_out.sum(0)]


def main() -> int:
    args = parse_args(__doc__, extra)
    comm, xp = start(args.device)
    r, n = comm.rank, comm.size
    xs, ys = dataset()
    params = init_params(xp)
    reference = init_params(xp)  # one process, whole batches, same order of samples
    grads = gpucoll.Bucket(SHAPES, np.float64, kind="device" if args.device else "host")
    epoch_losses, split = [], None

    for epoch in range(args.epochs):
        # rank 0 decides the epoch's shuffle and learning rate (as if read from a checkpoint)
        plan = {"epoch": epoch, "seed": 1000 + epoch, "lr": args.lr * 0.9 ** epoch}
        plan = comm.broadcast_object(plan if r == 0 else None)
        order = np.random.default_rng(plan["seed"]).permutation(SAMPLES)
        seen = []
        for start_row in range(0, SAMPLES, BATCH):
            batch = order[start_row:start_row + BATCH]
            mine = np.array_split(batch, n)[r]  # the last batch: 10, 10, 9, 9 rows
            losses, sums = losses_and_grad_sums(xp, params, xp.asarray(xs[mine]),
                                                xp.asarray(ys[mine]))
            for g, s in zip(grads, sums, strict=True):
                g[...] = s
            comm.all_reduce_many(grads)  # every gradient, summed over ranks, in one transfer
            every = comm.all_gather_v(losses, tiled=True)  # each sample's loss, from all ranks
            for p, g in zip(params, grads, strict=True):
                p -= plan["lr"] * g / every.size
            seen.append(to_host(every))
            if len(batch) < BATCH:
                split = [len(part) for part in np.array_split(batch, n)]

            _, ref_sums = losses_and_grad_sums(xp, reference, xp.asarray(xs[batch]),
                                               xp.asarray(ys[batch]))
            for p, g in zip(reference, ref_sums, strict=True):
                p -= plan["lr"] * g / len(batch)
        epoch_losses.append(float(np.concatenate(seen).mean()))
        if r == 0:
            print(f"epoch {epoch}  lr {plan['lr']:.3f}  loss {epoch_losses[-1]:.5f}", flush=True)

    # rank 0's checkpoint, shared with everyone: its parameters travel out of band
    mine = [to_host(p) for p in params]
    checkpoint = comm.broadcast_object({"epoch": args.epochs, "params": mine,
                                        "losses": epoch_losses} if r == 0 else None)
    matches = all(np.array_equal(a, b) for a, b in zip(checkpoint["params"], mine, strict=True))
    digests = comm.all_gather_object(hashlib.sha256(b"".join(p.tobytes() for p in mine))
                                     .hexdigest())
    identical = len(set(digests)) == 1
    gap = max(float(np.abs(a - to_host(b)).max()) for a, b in zip(mine, reference, strict=True))
    ok = (epoch_losses[-1] < 0.5 * epoch_losses[0] and identical and matches and gap < 1e-9
          and checkpoint["losses"] == epoch_losses)
    detail = (f"loss {epoch_losses[0]:.4f} -> {epoch_losses[-1]:.4f} over {args.epochs} epochs, "
              f"last batch of each split {'/'.join(map(str, split))} rows; parameters "
              f"bit-identical on {n} ranks: {identical}; rank 0's checkpoint matches every rank: "
              f"{matches}; max difference from one process on whole batches: {gap:.1e}")
    return finish(comm, xp, "train_epochs", ok, detail)


if __name__ == "__main__":
    sys.exit(main())
