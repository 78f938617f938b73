"""mpi4py tutorial, "Collective Communication": Python objects (bcast, scatter, gather), and
the lowercase allreduce."""

import gpucoll

comm = gpucoll.init()
# size = comm.Get_size(); rank = comm.Get_rank()
size, rank = comm.size, comm.rank

# Broadcasting a Python dictionary
if rank == 0:
    data = {"key1": [7, 2.72, 2 + 3j], "key2": ("abc", "xyz")}
else:
    data = None
# data = comm.bcast(data, root=0)
data = comm.broadcast_object(data, root=0)
assert data == {"key1": [7, 2.72, 2 + 3j], "key2": ("abc", "xyz")}

# Scattering Python objects
if rank == 0:
    data = [(i + 1) ** 2 for i in range(size)]
else:
    data = None
# data = comm.scatter(data, root=0)
data = comm.scatter_object(data, root=0)
assert data == (rank + 1) ** 2

# Gathering Python objects
data = (rank + 1) ** 2
# data = comm.gather(data, root=0)
data = comm.gather_object(data, root=0)
if rank == 0:
    for i in range(size):
        assert data[i] == (i + 1) ** 2
else:
    assert data is None

# total = comm.allreduce(rank, op=MPI.SUM); biggest = comm.allreduce(rank, op=MPI.MAX)
total = comm.all_reduce_object(rank, op="sum")
biggest = comm.all_reduce_object(rank, op=gpucoll.ReduceOp.MAX)
assert total == size * (size - 1) // 2 and biggest == size - 1
# names = comm.allreduce([rank], op=MPI.SUM): list + list, folded in rank order
assert comm.all_reduce_object([rank]) == list(range(size))

print(f"rank {rank}: ok collectives_objects total={total}")
comm.close()
