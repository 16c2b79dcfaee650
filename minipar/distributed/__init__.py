"""The torch.distributed-shaped facade of minipar (the parallel layer).

    import minipar.distributed as dist                 # was: import torch.distributed as dist
    dist.init_process_group(backend="mpi")             # under mpiexec -n N
    dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)      # in place, as in torch
    p.grad /= dist.get_world_size()

process_group.py: init_process_group, new_group, ReduceOp, the all-reduce algorithm;
collectives.py: all_reduce, broadcast, gather, all_to_all, the object collectives, ... in place,
on minipar Tensors, arrays and torch CPU tensors; p2p.py: send/recv, batch_isend_irecv;
checkpoint.py: save on N ranks, load on M (docs/checkpoints.md); sharded.py: the slices of the
serial tensors a rank holds; state.py: ``AppState``, a model and its optimizer under the serial
names; tree.py: a state dict as (path, leaf) items; flat_state.py and hybrid_state.py: the
trainers' checkpoint adapters; device_mesh.py: init_device_mesh; fsdp.py: fully_shard.
"""
from . import checkpoint  # noqa: F401
from .sharded import ShardedTensor  # noqa: F401
from .state import AppState  # noqa: F401
from .collectives import (Work, all_gather, all_gather_into_tensor,  # noqa: F401
                          all_gather_object, all_reduce, all_to_all, all_to_all_single, barrier,
                          broadcast, broadcast_object_list, gather, gather_object, reduce,
                          reduce_scatter, reduce_scatter_tensor, scatter, scatter_object_list)
from .p2p import P2POp, batch_isend_irecv, irecv, isend, recv, send  # noqa: F401
from .process_group import (ProcessGroup, ReduceOp, destroy_process_group,  # noqa: F401
                            get_all_reduce_algorithm, get_backend, get_global_rank,
                            get_group_rank, get_process_group_ranks, get_rank, get_world_size,
                            group, init_process_group, is_available, is_initialized,
                            is_mpi_available, new_group)
from .device_mesh import DeviceMesh, init_device_mesh  # noqa: F401

FSDP_NAMES = ("fully_shard", "FSDPModule", "MixedPrecisionPolicy")  # in fsdp.py


def __getattr__(name):
    """``dist.fsdp`` and its names, imported on first use: fsdp.py imports minipar.comm, which
    starts MPI, and ``import minipar.distributed`` must not."""
    if name == "fsdp" or name in FSDP_NAMES:
        import importlib
        fsdp = importlib.import_module(".fsdp", __name__)
        return fsdp if name == "fsdp" else getattr(fsdp, name)
    raise AttributeError(f"module 'minipar.distributed' has no attribute {name!r}")
