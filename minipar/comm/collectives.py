"""Old home of the collectives, kept so existing imports work: see allreduce.py, trees.py,
exchange.py, param_server.py and mpi.py (the algorithms), registry.py (the table)."""
from minipar.comm.allreduce import AUTO_CANDIDATES, all_reduce, choose  # noqa: F401
from minipar.comm.buffers import chunk_bounds, check_same  # noqa: F401
from minipar.comm.exchange import (all_gather, all_to_all, gather, reduce_scatter,  # noqa: F401
                                   scatter)
from minipar.comm.nonblocking import AsyncWorker, Work  # noqa: F401
from minipar.comm.patterns import log2  # noqa: F401
from minipar.comm.registry import ALGORITHMS, OPS, algorithm  # noqa: F401
from minipar.comm.trees import broadcast, reduce  # noqa: F401
