"""Data-parallel training that overlaps communication with the backward pass: a gradient hook
on each parameter starts an async_op=True all_reduce as soon as that gradient is ready, and
every handle is waited for before optimizer.step(). Two hook styles: the parameter's
register_post_accumulate_grad_hook, and register_hook on its gradient accumulator node (as
DDP and Horovod did before that hook existed). Both must match a synchronous all_reduce."""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn


class OverlappingDDP:
    def __init__(self, model, style):
        self.model = model
        self.handles = []
        self.accumulators = []  # the accumulator nodes must outlive the hooks on them
        self.world = dist.get_world_size()
        for param in model.parameters():
            dist.broadcast(param.data, src=0)
            if style == 'post_accumulate':
                param.register_post_accumulate_grad_hook(self._reduce)
            else:
                acc = param.expand_as(param).grad_fn.next_functions[0][0]
                acc.register_hook(self._make_hook(param))
                self.accumulators.append(acc)

    def _make_hook(self, param):
        def hook(*unused):
            self._reduce(param)
        return hook

    def _reduce(self, param):
        self.handles.append(dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, async_op=True))

    def finish(self):
        for handle in self.handles:
            handle.wait()
        self.handles.clear()
        for param in self.model.parameters():
            param.grad /= self.world


def make_model():
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(),
                         nn.Linear(24, 3))


def train(model, rank, size, finish=None, sync=None):
    g = torch.Generator().manual_seed(100 + rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    losses = []
    for _ in range(6):
        inputs, labels = torch.randn(16, 12, generator=g), torch.randn(16, 3, generator=g)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(inputs), labels)
        loss.backward()
        if finish is not None:
            finish()
        if sync is not None:
            sync(model, size)
        optimizer.step()
        losses.append(loss.item())
    return losses


def synchronous(model, size):
    for param in model.parameters():
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
        param.grad /= size


def run(rank, size):
    reference = make_model()
    for param in reference.parameters():
        dist.broadcast(param.data, src=0)
    expected = train(reference, rank, size, sync=synchronous)
    for style in ('post_accumulate', 'accumulator_node'):
        model = make_model()
        ddp = OverlappingDDP(model, style)
        losses = train(model, rank, size, finish=ddp.finish)
        same = all(torch.equal(a, b)
                   for a, b in zip(model.parameters(), reference.parameters(), strict=True))
        print('Rank ', rank, style, ' losses ', losses)
        print('Rank ', rank, style, ' parameters ', [p.sum().item() for p in model.parameters()])
        print('Rank ', rank, style, ' matches synchronous ', same and losses == expected)


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
