"""Which ranks share this machine: the node-local rank and size, and how many nodes there are.

    local = node.local(comm.mpi)     # Local(rank=1, size=4, nodes=2): rank 1 of the 4 on my node

Why. A node's GPUs are numbered 0, 1, ... on that node, so a rank picks its GPU by its place
among the ranks of its own node, not by its world rank (world rank 5 of 8 on two nodes of 4 is
the second rank of the second node: GPU 1). The world rank cannot tell which ranks share a
node: mpiexec may place ranks in blocks or round robin, Slurm by its own distribution, and a
hostfile may give nodes different slot counts. Launcher variables (OMPI_COMM_WORLD_LOCAL_RANK,
MPI_LOCALRANKID, SLURM_LOCALID) say it, but each launcher its own way. MPI itself knows:
``MPI_Comm_split_type(COMM_TYPE_SHARED)`` splits a communicator into groups of ranks that can
share memory, i.e. one group per node, with any MPI and any launcher. A rank's rank in its group
is its local rank; counting the groups' rank 0s gives the number of nodes.

Collective: every rank of ``mpi_comm`` calls it (comm.world() does, once, and hands the local
rank to backend.select_gpu: backend imports nothing of minipar, so it is told, not asked).
"""
from collections import namedtuple

from mpi4py import MPI

Local = namedtuple("Local", "rank size nodes")


def local(mpi_comm=None):
    """``Local(rank, size, nodes)``: this rank's place among the ranks of its node, their
    number, and the number of nodes ``mpi_comm`` (default MPI.COMM_WORLD) spans."""
    mpi_comm = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
    shared = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=mpi_comm.Get_rank())
    try:
        rank, size = shared.Get_rank(), shared.Get_size()
    finally:
        shared.Free()
    nodes = mpi_comm.allreduce(int(rank == 0), op=MPI.SUM)
    return Local(rank, size, nodes)
