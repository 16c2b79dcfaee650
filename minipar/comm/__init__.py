"""Communication: point-to-point messages and collectives written by hand over them.

    from minipar import comm
    world = comm.world()
    y = world.all_reduce(x, op="sum", algorithm="ring")

    communicator.py   the Communicator: send/recv, counters, and every collective's entry point
    registry.py       the algorithms by name, each with its cost formula
    allreduce.py      sequential, parallel, ring, recursive halving and doubling
    shm.py            the all-reduce over the node's shared memory (an MPI-3 window)
    hierarchical.py   shm inside each node, point-to-point across the node leaders
    param_server.py   the parameter server as an all-reduce, one server and sharded
    trees.py          broadcast and reduce over binomial trees
    exchange.py       reduce-scatter, all-gather, all-to-all, gather, scatter
    patterns.py       the ring and recursive halving/doubling steps they share, MPICH's fold
    mpi.py            MPI's own collectives: the reference
    nonblocking.py    iall_reduce (overlapping gradient buckets with backward), iall_gather and
                      ireduce_scatter (ZeRO-3 gathering the next layer while this one computes)
    cost.py, fit.py   the alpha-beta-gamma model; measuring its constants on this machine
    node.py           the node-local rank (MPI_COMM_TYPE_SHARED): which GPU a rank uses,
                      and how many nodes a communicator spans
    buffers.py, staging.py, errors.py, watch.py   arrays, GPU staging, errors, who waits on whom
"""
from minipar.comm.buffers import chunk_bounds
from minipar.comm.communicator import Communicator, Counters, Request, world
from minipar.comm.errors import CommError
from minipar.comm.registry import ALGORITHMS, OPS
from minipar.comm.staging import cuda_aware
from minipar.comm.watch import waiting_on

__all__ = ["ALGORITHMS", "OPS", "CommError", "Communicator", "Counters", "Request",
           "chunk_bounds", "cuda_aware", "waiting_on", "world"]
