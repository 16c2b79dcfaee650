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

The same groups carry the shared-memory all-reduce (shm.py, hierarchical.py): ``shared`` is the
communicator of the ranks that can map one another's memory. ``MINIPAR_RANKS_PER_NODE=k`` cuts
each real node into "nodes" of k consecutive ranks, so one machine can play a cluster (the
tests of the hierarchical all-reduce do; the ranks still share memory, they just do not use it
across the cut).
"""
import os
import weakref
from collections import namedtuple

from mpi4py import MPI

from minipar.comm import watch

Local = namedtuple("Local", "rank size nodes")


def ranks_per_node():
    """k from ``MINIPAR_RANKS_PER_NODE`` (pretend nodes of k ranks), or None: the real nodes."""
    value = os.environ.get("MINIPAR_RANKS_PER_NODE", "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"MINIPAR_RANKS_PER_NODE must be a positive integer, got {value!r}")
    return int(value)


def shared(mpi_comm):
    """The mpi4py communicator of the ranks of ``mpi_comm`` on this rank's node, in the order of
    their ranks in ``mpi_comm`` (collective; the caller frees it). With MINIPAR_RANKS_PER_NODE=k
    a node's ranks are cut into groups of k."""
    with watch.blocking("split by node", watch.world_ranks(mpi_comm)):
        node = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=mpi_comm.Get_rank())
        k = ranks_per_node()
        if k is None:
            return node
        try:
            return node.Split(node.Get_rank() // k, key=node.Get_rank())
        finally:
            node.Free()


def local(mpi_comm=None):
    """``Local(rank, size, nodes)``: this rank's place among the ranks of its node, their
    number, and the number of nodes ``mpi_comm`` (default MPI.COMM_WORLD) spans."""
    mpi_comm = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
    node = shared(mpi_comm)
    try:
        rank, size = node.Get_rank(), node.Get_size()
    finally:
        node.Free()
    with watch.blocking("count of nodes", watch.world_ranks(mpi_comm)):
        nodes = mpi_comm.allreduce(int(rank == 0), op=MPI.SUM)
    return Local(rank, size, nodes)


_spans = weakref.WeakKeyDictionary()  # Communicator -> the number of nodes its ranks span


def span(comm):
    """How many nodes the ranks of Communicator ``comm`` span (collective on first call, then
    remembered): what ``auto`` asks before it weighs the shared-memory all-reduces."""
    if comm not in _spans:
        _spans[comm] = local(comm.mpi).nodes
    return _spans[comm]
