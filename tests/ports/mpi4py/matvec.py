"""mpi4py tutorial, "Parallel matrix-vector product": each rank holds m rows of A and m
entries of x; an Allgather assembles x everywhere."""

import numpy

import gpucoll


def matvec(comm, A, x):
    m = A.shape[0]  # local rows
    # p = comm.Get_size()
    p = comm.size
    xg = numpy.zeros(m * p, dtype="d")
    # comm.Allgather([x, MPI.DOUBLE], [xg, MPI.DOUBLE])
    comm.all_gather(x, tiled=True, out=xg)
    y = numpy.dot(A, xg)
    return y


comm = gpucoll.init()
m, n = 3, 3 * comm.size
rows = numpy.arange(comm.rank * m, (comm.rank + 1) * m)
A = numpy.add.outer(rows, numpy.arange(n)).astype("d")  # A[i, j] = i + j, this rank's rows
x = numpy.arange(comm.rank * m, (comm.rank + 1) * m, dtype="d")  # x[j] = j, this rank's part
y = matvec(comm, A, x)
full = numpy.add.outer(numpy.arange(n), numpy.arange(n)) @ numpy.arange(n, dtype="d")
assert numpy.array_equal(y, full[rows])
print(f"rank {comm.rank}: ok matvec {y.tolist()}")
comm.close()
