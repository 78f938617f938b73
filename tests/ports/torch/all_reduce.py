"""PyTorch tutorial "Writing Distributed Applications with PyTorch": collective communication,
an all_reduce over a group made with new_group, in the tutorial's template."""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank, size):
    """ Simple collective communication. """
    group = dist.new_group([0, 1])
    tensor = torch.ones(1)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    print('Rank ', rank, ' has data ', tensor[0].item())


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
