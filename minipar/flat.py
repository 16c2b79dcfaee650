"""The flat layout: parameters laid end to end in one vector, as optimizers and data parallelism
lay them (one pass, or one collective, over all of them instead of one per parameter).

Parameter i of a list occupies [o_i, o_i + n_i) of the vector, o_i = n_0 + ... + n_{i-1}.

    flat = flatten_parameters(params)          # every p.data is now a view of flat
    grads = flatten_grads(params, xp.empty_like(flat))
    for p, g in zip(params, views(grads, params)):
        p.grad = g                             # each gradient a view of the vector
"""
from . import backend


def offsets(params):
    """Start of each parameter in a flat vector of ``params`` laid end to end, and the total."""
    starts, total = [], 0
    for p in params:
        starts.append(total)
        total += p.size
    return starts, total


def padded_numel(n, parts):
    """``n`` rounded up to a multiple of ``parts``: the length of a flat vector that ZeRO cuts
    into ``parts`` equal chunks (the zeros at its end are the padding)."""
    return -(-n // parts) * parts


def views(vector, params):
    """``vector`` cut into arrays of the params' shapes, in the flat layout (views, no copy);
    ``params`` may be Parameters or arrays."""
    return [vector[o:o + p.size].reshape(p.shape) for p, o in zip(params, offsets(params)[0])]


def flatten_parameters(params, size=None):
    """One contiguous vector holding the params' values end to end (zero-padded to ``size``);
    every ``p.data`` becomes a view of it, so writing the vector writes the parameters."""
    n = offsets(params)[1]
    flat = backend.get_array_module(params[0].data).zeros(n if size is None else size,
                                                          params[0].dtype)
    for p, view in zip(params, views(flat, params)):
        view[...] = p.data
        p.data = view
    return flat


def flatten_grads(params, out):
    """Copy the params' gradients end to end into ``out`` (zeros for a missing gradient)."""
    for p, view in zip(params, views(out, params)):
        view[...] = 0 if p.grad is None else p.grad
    return out
