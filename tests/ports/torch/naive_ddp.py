"""A naive data-parallel training loop: rank 0's initial parameters broadcast to every rank,
each rank's gradients on its shard of the batch all-reduced and averaged, and the result
compared with training the same model on the whole batch in one process."""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def batch():
    g = torch.Generator().manual_seed(42)
    return torch.randn(32, 10, generator=g), torch.randn(32, 5, generator=g)


def train(model, inputs, labels, steps, sync=None):
    loss_fn = nn.MSELoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), labels)
        loss.backward()
        if sync is not None:
            sync(model)
        optimizer.step()
        losses.append(loss.item())
    return losses


def allreduce_gradients(model):
    world = dist.get_world_size()
    for param in model.parameters():
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
        param.grad /= world


def run(rank, size):
    torch.manual_seed(rank)  # every rank starts from parameters of its own...
    model = ToyModel()
    for param in model.parameters():  # ...until rank 0's are broadcast
        dist.broadcast(param.data, src=0)
    inputs, labels = batch()
    losses = train(model, inputs[rank::size], labels[rank::size], 8, allreduce_gradients)
    print('Rank ', rank, ' losses ', losses)
    print('Rank ', rank, ' parameters ', [p.sum().item() for p in model.parameters()])
    if rank == 0:
        torch.manual_seed(0)
        alone = ToyModel()
        train(alone, inputs, labels, 8)
        diff = max((a - b).abs().max().item()
                   for a, b in zip(model.parameters(), alone.parameters(), strict=True))
        print('Rank ', rank, ' single-process difference ', diff, ' close ', diff < 1e-6)


def init_process(rank, size, port, fn, backend='gloo'):
    """ Initialize the distributed environment. """
    os.environ['MASTER_ADDR'] = '127.0.0.1'
    os.environ['MASTER_PORT'] = port
    dist.init_process_group(backend, rank=rank, world_size=size)
    fn(rank, size)


def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return str(s.getsockname()[1])


if __name__ == "__main__":
    world_size = 2
    processes = []
    mp.set_start_method("spawn")
    port = free_port()
    for rank in range(world_size):
        p = mp.Process(target=init_process, args=(rank, world_size, port, run))
        p.start()
        processes.append(p)

    for p in processes:
        p.join()
