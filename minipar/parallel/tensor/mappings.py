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
# The accounting: while a CollectiveLog is open, the operators' group records what it runs
# ----------------------------------------------------------------------------------------------

class CollectiveLog(Recorder):
    """Context: records every collective the operators below run, as dicts with ``op``,
    ``where`` (the module's name), ``direction`` (forward/backward), ``bytes`` (the whole tensor:
    an all-reduce's input, an all-gather's output, a reduce-scatter's input) and ``sent`` (this
    rank's bytes on the wire, from the group's counters)."""


class _Recording:
    """The tensor group as the operators see it while a CollectiveLog is open: its
    collectives, each recorded with the place and direction it ran for (report.py tabulates)."""

    def __init__(self, group, where, direction):
        self.group, self.where, self.direction = group, where, direction
        self.rank, self.size = group.rank, group.size

    def all_reduce(self, a, op="sum"):
        return self._record("all_reduce", a.nbytes, lambda: self.group.all_reduce(a, op=op))

    def all_gather(self, a):
        return self._record("all_gather", a.nbytes * self.size, lambda: self.group.all_gather(a))

    def reduce_scatter(self, a):
        return self._record("reduce_scatter", a.nbytes, lambda: self.group.reduce_scatter(a))

    def _record(self, op, nbytes, run):
        before = self.group.counters.bytes_sent
        out = run()
        sent = self.group.counters.bytes_sent - before
        CollectiveLog.record({"op": op, "where": self.where, "direction": self.direction,
                              "bytes": int(nbytes), "sent": sent})
        return out


def logged(group, where, direction):
    """``group`` itself, or while a CollectiveLog is open the stand-in that records."""
    return _Recording(group, where, direction) if CollectiveLog.recording() else group


# ----------------------------------------------------------------------------------------------
# What the operators do to an array along an axis: keep this rank's slice, gather, scatter
# ----------------------------------------------------------------------------------------------

def _contiguous(a):
    return backend.get_array_module(a).ascontiguousarray(a)


def _keep_mine(a, group, axis):
    n = divide(a.shape[axis], group.size, "sequence length" if axis == SEQ else "feature size")
    index = [slice(None)] * a.ndim
    index[axis] = slice(group.rank * n, (group.rank + 1) * n)
    return _contiguous(a[tuple(index)])


def _all_gather(a, group, axis):
    parts = group.all_gather(_contiguous(a))
    return backend.get_array_module(a).concatenate(list(parts), axis=axis)


def _reduce_scatter(a, group, axis):
    xp = backend.get_array_module(a)
    n = divide(a.shape[axis], group.size, "sequence length")
    front = _contiguous(xp.moveaxis(a, axis, 0))
    mine = group.reduce_scatter(front)
    return _contiguous(xp.moveaxis(mine.reshape(n, *front.shape[1:]), 0, axis))


def _into_product(x):
    # The ways into a parallel linear (f, scatter, the all-gather of T) feed a matrix product:
    # under autocast the input is cast to the 16-bit dtype here, where the product would cast it
    # (the same rounding point), so that the collective moves 16-bit messages, half the bytes
    # (f's backward all-reduce gets the 16-bit dX, not the float32 one the cast's backward makes)
    return to_lower_precision(as_tensor(x))


# ----------------------------------------------------------------------------------------------
# The conjugate operators (Megatron's names): each a differentiable op whose forward and
# backward run their collectives on the group it is given
# ----------------------------------------------------------------------------------------------

def copy_to_tensor_region(x, group, where="f"):
    """f: identity forward, all-reduce backward (conjugate: g). Before a column-parallel linear:
    every rank's slice of the layer contributes to dX."""
    x = _into_product(x)
    ### BEGIN SOLUTION megatron-f-g
    return make_result(x.data, (x,),
                       lambda g: (logged(group, where, "backward").all_reduce(g),), "f")
    ### END SOLUTION


def reduce_from_tensor_region(x, group, where="g"):
    """g: all-reduce forward, identity backward (conjugate: f). After a row-parallel linear."""
    x = as_tensor(x)
    ### BEGIN SOLUTION megatron-f-g
    return make_result(logged(group, where, "forward").all_reduce(x.data), (x,),
                       lambda g: (g,), "g")
    ### END SOLUTION


def scatter_to_tensor_region(x, group, where="scatter"):
    """Keep this rank's slice of the last axis; backward all-gathers it (conjugate: gather).
    Before a row-parallel linear."""
    x = _into_product(x)
    return make_result(_keep_mine(x.data, group, -1), (x,),
                       lambda g: (_all_gather(g, logged(group, where, "backward"), -1),),
                       "scatter")


def gather_from_tensor_region(x, group, where="gather"):
    """All-gather the last axis; backward keeps this rank's slice (conjugate: scatter)."""
    x = as_tensor(x)
    return make_result(_all_gather(x.data, logged(group, where, "forward"), -1), (x,),
                       lambda g: (_keep_mine(g, group, -1),), "gather")


def scatter_to_sequence_region(x, group, where="scatter_seq"):
    """Keep this rank's slice of T; backward all-gathers T (conjugate: gather_from_sequence)."""
    x = as_tensor(x)
    return make_result(_keep_mine(x.data, group, SEQ), (x,),
                       lambda g: (_all_gather(g, logged(group, where, "backward"), SEQ),),
                       "scatter_seq")


def gather_from_sequence_region(x, group, where="gather_seq"):
    """All-gather T, backward reduce-scatter T (conjugate: reduce_scatter_to_sequence). Takes the
    place of f before a column-parallel linear under sequence parallelism."""
    x = _into_product(x)
    return make_result(_all_gather(x.data, logged(group, where, "forward"), SEQ), (x,),
                       lambda g: (_reduce_scatter(g, logged(group, where, "backward"), SEQ),),
                       "gather_seq")


def reduce_scatter_to_sequence_region(x, group, where="reduce_scatter_seq"):
    """Reduce-scatter T, backward all-gather T (conjugate: gather_from_sequence). Takes the place
    of g after a row-parallel linear under sequence parallelism."""
    x = as_tensor(x)
    return make_result(_reduce_scatter(x.data, logged(group, where, "forward"), SEQ), (x,),
                       lambda g: (_all_gather(g, logged(group, where, "backward"), SEQ),),
                       "reduce_scatter_seq")


# ----------------------------------------------------------------------------------------------
# Sequence parallelism's other sum: the replicated parameters' gradients
# ----------------------------------------------------------------------------------------------

def allreduce_replicated_grads(module, group):
    """Sum the gradients of the replicated parameters over ``group``. Under sequence parallelism
    each rank's LayerNorms, biases and position table saw only its own tokens."""
    split = split_specs(module)
    for name, p in module.named_parameters():
        if name not in split and p.grad is not None:
            p.grad = logged(group, "grads", "backward").all_reduce(p.grad)
