"""Communication: point-to-point messages and collectives written by hand over them.

    world = comm.world()        # from minipar import comm
    y = world.all_reduce(x, op="sum", algorithm="ring")

    communicator.py   the Communicator: send/recv, counters, every collective's entry point
    allreduce.py      sequential, parallel, ring, recursive halving and doubling (also shm.py,
                      hierarchical.py, param_server.py); trees.py, exchange.py: the others
    mpi.py            MPI's own collectives: the reference
    cost.py, fit.py   the alpha-beta-gamma model; measuring its constants on this machine
    wire.py, watch.py the one door to MPI (buffers, chunks, checks, counters, trace); who
                      waits on whom: a hang or a failing rank ends the job

Every module, and the theory they share: docs/comm.md.
"""
from minipar.comm.buffers import chunk_bounds
from minipar.comm.communicator import Communicator, world
from minipar.comm.wire import Counters, Request
from minipar.comm.errors import CommError
from minipar.comm.registry import ALGORITHMS, OPS
from minipar.comm.staging import cuda_aware
from minipar.comm.watch import waiting_on

__all__ = ["ALGORITHMS", "OPS", "CommError", "Communicator", "Counters", "Request",
           "chunk_bounds", "cuda_aware", "waiting_on", "world"]
