"""mpi4py tutorial, "Collective Communication": NumPy arrays (Bcast, Scatter, Gather,
Allgather, Allreduce)."""

import numpy as np

import gpucoll

comm = gpucoll.init()
size, rank = comm.size, comm.rank

# Broadcasting a NumPy array
if rank == 0:
    data = np.arange(100, dtype="i")
else:
    data = np.empty(100, dtype="i")
# comm.Bcast(data, root=0)
comm.broadcast(data, root=0)
for i in range(100):
    assert data[i] == i

# Scattering NumPy arrays
sendbuf = None
if rank == 0:
    sendbuf = np.empty([size, 100], dtype="i")
    sendbuf.T[:, :] = range(size)
recvbuf = np.empty(100, dtype="i")
# comm.Scatter(sendbuf, recvbuf, root=0)
comm.scatter(sendbuf, root=0, out=recvbuf)
assert np.allclose(recvbuf, rank)

# Gathering NumPy arrays
sendbuf = np.zeros(100, dtype="i") + rank
recvbuf = None
if rank == 0:
    recvbuf = np.empty([size, 100], dtype="i")
# comm.Gather(sendbuf, recvbuf, root=0)
comm.gather(sendbuf, root=0, out=recvbuf)
if rank == 0:
    for i in range(size):
        assert np.allclose(recvbuf[i, :], i)

# comm.Allgather(sendbuf, recvbuf)
recvbuf = np.empty([size, 100], dtype="i")
comm.all_gather(sendbuf, out=recvbuf)
assert all(np.allclose(recvbuf[i], i) for i in range(size))

# comm.Allreduce(sendbuf, recvbuf, op=MPI.SUM)
recvbuf = np.empty(100, dtype="i")
comm.all_reduce(sendbuf, op="sum", out=recvbuf)
assert np.all(recvbuf == size * (size - 1) // 2)
# comm.Allreduce(MPI.IN_PLACE, sendbuf, op=MPI.MAX)
comm.all_reduce(sendbuf, op="max")
assert np.all(sendbuf == size - 1)

print(f"rank {rank}: ok collectives_arrays sum={recvbuf[0]}")
comm.close()
