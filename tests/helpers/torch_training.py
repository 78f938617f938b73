"""A data-parallel torch training script, written against torch.distributed's functional API.

    gpucoll run -n 2 tests/helpers/torch_training.py torch   OUT.pt   # torch.distributed, gloo
    gpucoll run -n 2 tests/helpers/torch_training.py gpucoll OUT.pt   # gpucoll.distributed

The two runs differ only in the module imported as ``dist``. Rank 0 saves the final parameters
of a model trained with SGD and of one trained with Adam (and the losses it saw) to OUT.pt;
the tests compare the two files bit for bit.
"""

from __future__ import annotations

import importlib
import sys

import torch

dist = importlib.import_module("torch.distributed" if sys.argv[1] == "torch"
                               else "gpucoll.distributed")


def mlp(rank: int) -> torch.nn.Module:
    torch.manual_seed(100 + rank)  # each rank starts elsewhere: the broadcast must fix that
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    return model


def average_gradients(model: torch.nn.Module, size: int) -> None:
    works = [dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, async_op=True)
             for p in model.parameters()]
    for w in works:
        w.wait()
    for p in model.parameters():
        p.grad /= size


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def main() -> None:
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    config = [{"lr": 0.05, "steps": 20}] if rank == 0 else [None]
    dist.broadcast_object_list(config, src=0)
    models = {"sgd": mlp(rank), "adam": mlp(rank)}
    opts = {"sgd": torch.optim.SGD(models["sgd"].parameters(), lr=config[0]["lr"], momentum=0.9),
            "adam": torch.optim.Adam(models["adam"].parameters(), lr=config[0]["lr"] / 10)}
    data = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(config[0]["steps"]):
        x = torch.randn(size * 4, 8, generator=data)
        y = torch.randint(0, 3, (size * 4,), generator=data)
        mine = slice(rank * 4, rank * 4 + 4)  # this rank's share of the batch
        for name, model in models.items():
            loss = torch.nn.functional.cross_entropy(model(x[mine]), y[mine])
            opts[name].zero_grad()
            loss.backward()
            average_gradients(model, size)
            opts[name].step()
            total = loss.detach().reshape(1).clone()
            dist.reduce(total, dst=0)
            every = torch.zeros(size)
            dist.all_gather_into_tensor(every, loss.detach().reshape(1))
            losses.append((name, total.item(), every.tolist()))
    result = {"losses": losses}
    for name, model in models.items():
        mine = flat(model)
        gathered = [torch.zeros_like(mine) for _ in range(size)]
        dist.all_gather(gathered, mine)
        assert all(torch.equal(g, mine) for g in gathered), "ranks ended with different params"
        result[name] = mine
    if rank == 0:
        torch.save(result, sys.argv[2])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
