"""The torch.distributed-shaped facade of minipar (the parallel layer).

    import minipar.distributed as dist                 # was: import torch.distributed as dist
    dist.init_process_group(backend="mpi")             # under mpiexec -n N
    dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)      # in place, as in torch
    p.grad /= dist.get_world_size()

process_group.py: init_process_group, get_rank, get_world_size, new_group, ReduceOp, the
all-reduce algorithm (``all_reduce_algorithm=`` or ``MINIPAR_ALLREDUCE``); collectives.py:
all_reduce, broadcast, reduce, all_gather, reduce_scatter, send/recv/isend/irecv, barrier, each
overwriting the Tensor's data or the array it is given.

    from minipar.distributed import checkpoint as dcp
    dcp.save({"app": dcp.AppState(model, optimizer)}, checkpoint_id="ckpt/step-10")
    dcp.load(state, checkpoint_id="ckpt/step-10")          # fills ``state`` in place

``checkpoint``: save on N ranks, load on M (resharding); ``sharded.ShardedTensor``: how a wrapper
describes the slices of the serial tensors its rank holds; ``state.AppState``: a model and its
optimizer under the serial names; ``tree``: a state dict as (path, leaf) items and back.
"""
from . import checkpoint  # noqa: F401
from .sharded import ShardedTensor  # noqa: F401
from .state import AppState  # noqa: F401
from .collectives import (Work, all_gather, all_gather_into_tensor, all_reduce,  # noqa: F401
                          barrier, broadcast, irecv, isend, recv, reduce, reduce_scatter,
                          reduce_scatter_tensor, send)
from .process_group import (ProcessGroup, ReduceOp, destroy_process_group,  # noqa: F401
                            get_all_reduce_algorithm, get_backend, get_global_rank,
                            get_group_rank, get_process_group_ranks, get_rank, get_world_size,
                            group, init_process_group, is_available, is_initialized,
                            is_mpi_available, new_group)
