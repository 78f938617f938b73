"""mpi4py tutorial, "Point-to-Point Communication": Python objects, blocking and non-blocking."""

import gpucoll

# from mpi4py import MPI
# comm = MPI.COMM_WORLD
# rank = comm.Get_rank()
comm = gpucoll.init()
rank = comm.rank
data = None  # ranks other than 0 and 1 take no part in the tutorial's exchanges

# Python objects (pickle under the hood)
if rank == 0:
    data = {"a": 7, "b": 3.14}
    # comm.send(data, dest=1, tag=11)
    comm.send_object(data, 1, tag=11)
elif rank == 1:
    # data = comm.recv(source=0, tag=11)
    data = comm.recv_object(0, tag=11)
    assert data == {"a": 7, "b": 3.14}

# Python objects with non-blocking communication
if rank == 0:
    data = {"a": 7, "b": 3.14}
    # req = comm.isend(data, dest=1, tag=11)
    req = comm.isend_object(data, 1, tag=11)
    req.wait()
elif rank == 1:
    # req = comm.irecv(source=0, tag=11)
    req = comm.irecv_object(0, tag=11)
    data = req.wait()
    assert data == {"a": 7, "b": 3.14}

# receiving from any source, with a status (mpi4py: source=MPI.ANY_SOURCE, status=MPI.Status())
if rank != 0:
    comm.send_object(rank * 10, 0, tag=rank)
else:
    got = []
    for _ in range(comm.size - 1):
        # status = MPI.Status()
        # data = comm.recv(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status)
        status = gpucoll.Status()
        data = comm.recv_object(gpucoll.ANY_SOURCE, tag=gpucoll.ANY_TAG, status=status)
        assert data == status.Get_source() * 10 and status.Get_tag() == status.Get_source()
        got.append(status.Get_source())
    assert sorted(got) == list(range(1, comm.size))

print(f"rank {rank}: ok p2p_objects {data}")
comm.close()
