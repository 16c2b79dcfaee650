"""The torch.distributed-shaped facade of minipar (the parallel layer).

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
