"""Every torch.distributed call that docs/torch.md marks exact, once, on two ranks and values
whose every bit counts; each rank prints what it got."""

import os
import socket
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def values(rank, n, dtype=torch.float32):
    g = torch.Generator().manual_seed(10 + rank)
    if dtype.is_floating_point or dtype.is_complex:
        return (torch.randn(n, generator=g, dtype=torch.float64) * 1e3).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    return torch.randint(-1000, 1000, (n,), generator=g).to(dtype)


def run(rank, size):
    out = []

    def say(name, value):
        out.append(f"Rank {rank} {name} {value!r}")

    ops = {'SUM': dist.ReduceOp.SUM, 'PRODUCT': dist.ReduceOp.PRODUCT,
           'MIN': dist.ReduceOp.MIN, 'MAX': dist.ReduceOp.MAX, 'AVG': dist.ReduceOp.AVG}
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                  torch.int32, torch.uint8):
        for name, op in ops.items():
            if name == 'AVG' and not dtype.is_floating_point:
                continue
            t = values(rank, 5, dtype)
            dist.all_reduce(t, op=op)
            say(f"all_reduce {name} {dtype}", t.tolist())
    for name in ('BAND', 'BOR', 'BXOR'):
        for dtype in (torch.int64, torch.uint8, torch.bool):
            t = values(rank, 5, dtype)
            dist.all_reduce(t, op=getattr(dist.ReduceOp, name))
            say(f"all_reduce {name} {dtype}", t.tolist())
    t = values(rank, 3, torch.complex64)
    dist.all_reduce(t)
    say("all_reduce complex64", t.tolist())
    t = values(rank, 6).reshape(2, 3).t()
    dist.all_reduce(t)
    say("all_reduce non-contiguous", t.tolist())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        t = values(rank, 4)
        dist.all_reduce(t, op=dist.reduce_op.MAX)
        say("all_reduce reduce_op.MAX", t.tolist())
    t = values(rank, 4)
    work = dist.all_reduce(t, async_op=True)
    say("async all_reduce", (work.wait(), work.is_completed(), t.tolist()))

    p = torch.nn.Parameter(values(rank, 4))
    dist.broadcast(p, src=1)
    say("broadcast a parameter", p.tolist())
    t = values(rank, 4, torch.float64)
    dist.broadcast(t, src=0)
    say("broadcast", t.tolist())
    t = values(rank, 4)
    dist.reduce(t, dst=1, op=dist.ReduceOp.SUM)
    if rank == 1:  # elsewhere torch leaves the tensor unspecified (gloo overwrites part of it)
        say("reduce", t.tolist())

    got = [torch.zeros(3) for _ in range(size)]
    dist.all_gather(got, values(rank, 3))
    say("all_gather", [g.tolist() for g in got])
    got = [torch.zeros(3) for _ in range(size)]
    dist.all_gather(got, values(rank, 3), async_op=True).wait()
    say("async all_gather", [g.tolist() for g in got])
    o = torch.zeros(2 * size)
    dist.all_gather_single(o, values(rank, 2))
    say("all_gather_single", o.tolist())
    o = torch.zeros(2)
    dist.reduce_scatter_single(o, values(rank, 2 * size))
    say("reduce_scatter_single", o.tolist())
    o = torch.zeros(2)
    dist.reduce_scatter(o, [values(rank, 2, torch.float64).float() + j for j in range(size)],
                        op=dist.ReduceOp.MAX)
    say("reduce_scatter MAX", o.tolist())
    o = torch.zeros(4)
    dist.all_to_all_single(o, values(rank, 4))
    say("all_to_all_single", o.tolist())
    o = torch.zeros(3 if rank == 0 else 5)
    dist.all_to_all_single(o, values(rank, 4), output_split_sizes=[1, 2] if rank == 0 else [3, 2],
                           input_split_sizes=[1, 3] if rank == 0 else [2, 2])
    say("all_to_all_single with splits", o.tolist())
    outs = [torch.zeros(2) for _ in range(size)]
    dist.all_to_all(outs, [values(rank, 2) + j for j in range(size)])
    say("all_to_all", [x.tolist() for x in outs])
    gl = [torch.zeros(2) for _ in range(size)] if rank == 1 else None
    dist.gather(values(rank, 2), gl, dst=1)
    say("gather", gl and [x.tolist() for x in gl])
    t = torch.zeros(2)
    dist.scatter(t, [values(9, 2) + j for j in range(size)] if rank == 0 else None, src=0)
    say("scatter", t.tolist())

    t = values(rank, 3)
    if rank == 0:
        dist.send(t, dst=1)
        say("recv returned", None)
    else:
        say("recv returned", dist.recv(t, src=0))
    say("send/recv", t.tolist())
    t = values(rank, 3, torch.float64)
    req = dist.isend(t, dst=1) if rank == 0 else dist.irecv(t, src=0)
    say("isend/irecv", (req.wait(), t.tolist()))
    t = torch.zeros(2)
    ops = [dist.P2POp(dist.isend, values(rank, 2), 1 - rank), dist.P2POp(dist.irecv, t, 1 - rank)]
    say("batch_isend_irecv", ([w.wait() for w in dist.batch_isend_irecv(ops)], t.tolist()))

    say("barrier", dist.barrier())
    say("monitored_barrier", dist.monitored_barrier())

    objs = [None] * size
    dist.all_gather_object(objs, {"rank": rank, "name": f"r{rank}"})
    say("all_gather_object", objs)
    objs = [rank, "x"] if rank == 1 else [None, None]
    dist.broadcast_object_list(objs, src=1)
    say("broadcast_object_list", objs)
    objs = [None] * size if rank == 0 else None
    dist.gather_object((rank, 1.5), objs, dst=0)
    say("gather_object", objs)
    objs = [None]
    dist.scatter_object_list(objs, [{"to": j} for j in range(size)] if rank == 0 else None,
                             src=0)
    say("scatter_object_list", objs)
    objs = [None, None]
    if rank == 0:
        dist.send_object_list([{"a": 1}, [2, 3]], dst=1)
    else:
        say("recv_object_list returned", dist.recv_object_list(objs, src=0))
    say("send_object_list/recv_object_list", objs)

    say("world", (dist.is_initialized(), dist.get_rank(), dist.get_world_size(),
                  dist.get_backend()))
    pair = dist.new_group([1, 0])
    say("new_group", (dist.get_rank(pair), dist.get_world_size(pair),
                      dist.get_process_group_ranks(pair), dist.get_group_rank(pair, 1),
                      dist.get_global_rank(pair, 0)))
    t = values(rank, 2)
    dist.broadcast(t, group=pair, group_src=1)
    say("broadcast group_src", t.tolist())
    alone = dist.new_group([0])
    t = values(rank, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        say("all_reduce on a group of one", (dist.all_reduce(t, group=alone), t.tolist()))
    say("get_rank/get_world_size of a group", (dist.get_rank(alone),
                                                dist.get_world_size(alone)))
    say("group.WORLD", (dist.get_rank(dist.group.WORLD), dist.GroupMember.WORLD is
                        dist.group.WORLD))
    print("\n".join(out))
    dist.destroy_process_group()
    say("destroy_process_group ended the group", not dist.is_initialized())
    print(out[-1])


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
