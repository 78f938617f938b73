"""mpi4py tutorial, "Point-to-Point Communication": NumPy arrays (the fast way!)."""

import numpy

import gpucoll

comm = gpucoll.init()
rank = comm.rank
data = None  # ranks other than 0 and 1 take no part in the tutorial's exchanges

# passing MPI datatypes explicitly
if rank == 0:
    data = numpy.arange(1000, dtype="i")
    # comm.Send([data, MPI.INT], dest=1, tag=77)
    comm.send(data, 1, tag=77)
elif rank == 1:
    data = numpy.empty(1000, dtype="i")
    # comm.Recv([data, MPI.INT], source=0, tag=77)
    comm.recv(data, 0, tag=77)
    assert (data == numpy.arange(1000)).all()

# automatic MPI datatype discovery
if rank == 0:
    data = numpy.arange(100, dtype=numpy.float64)
    # comm.Send(data, dest=1, tag=13)
    comm.send(data, 1, tag=13)
elif rank == 1:
    data = numpy.empty(100, dtype=numpy.float64)
    # comm.Recv(data, source=0, tag=13)
    comm.recv(data, 0, tag=13)
    assert (data == numpy.arange(100)).all()

print(f"rank {rank}: ok p2p_arrays {None if data is None else data[:3].tolist()}")
comm.close()
