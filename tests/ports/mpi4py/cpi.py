"""mpi4py tutorial, "Compute Pi": rank 0 broadcasts N, every rank sums its share of the
midpoint rule for the integral of 4/(1+x^2) over [0, 1], and a reduce adds them on rank 0.
(The tutorial starts these workers with MPI.COMM_SELF.Spawn; here `gpucoll run` starts them.)"""

import math
import time

import numpy

import gpucoll

comm = gpucoll.init()
# size = comm.Get_size(); rank = comm.Get_rank()
size, rank = comm.size, comm.rank
# t0 = MPI.Wtime()
t0 = time.perf_counter()

N = numpy.array(100 if rank == 0 else 0, dtype="i")
# comm.Bcast([N, MPI.INT], root=0)
comm.broadcast(N, root=0)
h = 1.0 / N
s = 0.0
for i in range(rank, N, size):
    x = h * (i + 0.5)
    s += 4.0 / (1.0 + x**2)
PI = numpy.array(s * h, dtype="d")
# comm.Reduce([PI, MPI.DOUBLE], None, op=MPI.SUM, root=0)   (on rank 0: a receive buffer)
comm.reduce(PI, root=0, op="sum")

# pi = comm.allreduce(s * h, op=MPI.SUM): the same sum, as a Python float on every rank
pi = comm.all_reduce_object(s * h)
assert abs(pi - math.pi) < 1e-4
if rank == 0:
    assert abs(PI - math.pi) < 1e-4
print(f"rank {rank}: ok cpi {pi:.6f} in {time.perf_counter() - t0:.3f} s")
comm.close()
