"""Megatron's conjugate operators: how tensors enter and leave the tensor-parallel region.

The names are those of Megatron's ``tensor_parallel/mappings.py``. Each operator's backward is
its conjugate's forward (why: docs/tensor_parallel.md):

    operator                              forward              backward
    copy_to_tensor_region (f)             identity             all-reduce
    reduce_from_tensor_region (g)         all-reduce           identity
    scatter_to_tensor_region              keep my features     all-gather features
    gather_from_tensor_region             all-gather features  keep my features
  sequence parallelism (Korthikanti et al. 2022), along T of (B, T, C):
    scatter_to_sequence_region            keep my T slice      all-gather T
    gather_from_sequence_region           all-gather T         reduce-scatter T
    reduce_scatter_to_sequence_region     reduce-scatter T     all-gather T
"""
from ... import backend
from ...amp.autocast_mode import to_lower_precision
from ...autograd import as_tensor, make_result
from ...recording import Recorder
from .shard import divide, split_specs

SEQ = 1  # the sequence axis of (B, T, C) activations


# ----------------------------------------------------------------------------------------------
# The collectives, logged for accounting
# ----------------------------------------------------------------------------------------------

# Every collective below is also written to the active CollectiveLogs, so a lesson or a test can
# count what a layer moved (report.py tabulates it).
class CollectiveLog(Recorder):
    """Context: records every collective the operators below run, as dicts with ``op``,
    ``where`` (the module's name), ``direction`` (forward/backward), ``bytes`` (the whole tensor:
    an all-reduce's input, an all-gather's output, a reduce-scatter's input) and ``sent`` (this
    rank's bytes on the wire, from the group's counters)."""


def _logged(op, group, note, nbytes, run):
    before = group.counters.bytes_sent
    out = run()
    CollectiveLog.record({"op": op, "where": note[0], "direction": note[1], "bytes": int(nbytes),
                          "sent": group.counters.bytes_sent - before})
    return out


def _contiguous(a):
    return backend.get_array_module(a).ascontiguousarray(a)


def _identity(a, group, axis, note):
    return a


def _all_reduce(a, group, axis, note, op="sum"):
    return _logged("all_reduce", group, note, a.nbytes, lambda: group.all_reduce(a, op=op))


def _keep_mine(a, group, axis, note):
    n = divide(a.shape[axis], group.size, "sequence length" if axis == SEQ else "feature size")
    index = [slice(None)] * a.ndim
    index[axis] = slice(group.rank * n, (group.rank + 1) * n)
    return _contiguous(a[tuple(index)])


def _all_gather(a, group, axis, note):
    xp = backend.get_array_module(a)
    parts = _logged("all_gather", group, note, a.nbytes * group.size,
                    lambda: group.all_gather(_contiguous(a)))
    return xp.concatenate(list(parts), axis=axis)


def _reduce_scatter(a, group, axis, note):
    xp = backend.get_array_module(a)
    n = divide(a.shape[axis], group.size, "sequence length")
    front = _contiguous(xp.moveaxis(a, axis, 0))
    mine = _logged("reduce_scatter", group, note, a.nbytes, lambda: group.reduce_scatter(front))
    return _contiguous(xp.moveaxis(mine.reshape(n, *front.shape[1:]), 0, axis))


def _into_product(x):
    # The ways into a parallel linear (f, scatter, the all-gather of T) feed a matrix product:
    # under autocast the input is cast to the 16-bit dtype here, where the product would cast it
    # (the same rounding point), so that the collective moves 16-bit messages, half the bytes
    # (f's backward all-reduce gets the 16-bit dX, not the float32 one the cast's backward makes)
    return to_lower_precision(as_tensor(x))


def _mapping(op, x, group, where, forward, backward, axis):
    # Each operator is differentiable and runs its collectives on the group it is given.
    x = as_tensor(x)
    out = forward(x.data, group, axis, (where, "forward"))
    return make_result(out, (x,), lambda g: (backward(g, group, axis, (where, "backward")),), op)


# ----------------------------------------------------------------------------------------------
# The conjugate operators (Megatron's names)
# ----------------------------------------------------------------------------------------------

def copy_to_tensor_region(x, group, where="f"):
    """f: identity forward, all-reduce backward (conjugate: g). Before a column-parallel linear:
    every rank's slice of the layer contributes to dX."""
    x = _into_product(x)
    ### BEGIN SOLUTION megatron-f-g
    return _mapping("f", x, group, where, _identity, _all_reduce, -1)
    ### END SOLUTION


def reduce_from_tensor_region(x, group, where="g"):
    """g: all-reduce forward, identity backward (conjugate: f). After a row-parallel linear."""
    ### BEGIN SOLUTION megatron-f-g
    return _mapping("g", x, group, where, _all_reduce, _identity, -1)
    ### END SOLUTION


def scatter_to_tensor_region(x, group, where="scatter"):
    """Keep this rank's slice of the last axis; backward all-gathers it (conjugate: gather).
    Before a row-parallel linear."""
    x = _into_product(x)
    return _mapping("scatter", x, group, where, _keep_mine, _all_gather, -1)


def gather_from_tensor_region(x, group, where="gather"):
    """All-gather the last axis; backward keeps this rank's slice (conjugate: scatter)."""
    return _mapping("gather", x, group, where, _all_gather, _keep_mine, -1)


def scatter_to_sequence_region(x, group, where="scatter_seq"):
    """Keep this rank's slice of T; backward all-gathers T (conjugate: gather_from_sequence)."""
    return _mapping("scatter_seq", x, group, where, _keep_mine, _all_gather, SEQ)


def gather_from_sequence_region(x, group, where="gather_seq"):
    """All-gather T, backward reduce-scatter T (conjugate: reduce_scatter_to_sequence). Takes the
    place of f before a column-parallel linear under sequence parallelism."""
    x = _into_product(x)
    return _mapping("gather_seq", x, group, where, _all_gather, _reduce_scatter, SEQ)


def reduce_scatter_to_sequence_region(x, group, where="reduce_scatter_seq"):
    """Reduce-scatter T, backward all-gather T (conjugate: gather_from_sequence). Takes the place
    of g after a row-parallel linear under sequence parallelism."""
    return _mapping("reduce_scatter_seq", x, group, where, _reduce_scatter, _all_gather, SEQ)


# ----------------------------------------------------------------------------------------------
# Sequence parallelism's other sum: the replicated parameters' gradients
# ----------------------------------------------------------------------------------------------

def allreduce_replicated_grads(module, group):
    """Sum the gradients of the replicated parameters over ``group``. Under sequence parallelism
    each rank's LayerNorms, biases and position table saw only its own tokens."""
    split = split_specs(module)
    for name, p in module.named_parameters():
        if name not in split and p.grad is not None:
            p.grad = _all_reduce(p.grad, group, -1, ("grads", "backward"))
