"""Communication: point-to-point messages (communicator.py), collectives written by hand over
them (collectives.py), and the alpha-beta-gamma cost model that predicts their time (cost.py).

    from minipar import comm
    world = comm.world()
    y = world.all_reduce(x, op="sum", algorithm="ring")
"""
from minipar.comm.collectives import ALGORITHMS, OPS, chunk_bounds
from minipar.comm.communicator import CommError, Communicator, Request, cuda_aware, world

__all__ = ["ALGORITHMS", "OPS", "CommError", "Communicator", "Request", "chunk_bounds",
           "cuda_aware", "world"]
