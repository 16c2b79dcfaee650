"""The torch.distributed-shaped facade of minipar (the parallel layer).

    import minipar.distributed as dist                 # was: import torch.distributed as dist
    dist.init_process_group(backend="mpi")             # under mpiexec -n N
    dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)      # in place, as in torch
    p.grad /= dist.get_world_size()

process_group.py: init_process_group, new_group, ReduceOp, the all-reduce algorithm;
collectives.py: all_reduce, broadcast, all_gather, send/recv, ... in place; checkpoint.py: save
on N ranks, load on M (``dcp.save(state, checkpoint_id=...)``, docs/checkpoints.md); sharded.py:
the slices of the serial tensors a rank holds; state.py: ``AppState``, a model and its optimizer
under the serial names; tree.py: a state dict as (path, leaf) items; flat_state.py and
hybrid_state.py: the trainers' checkpoint adapters.
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
